"""The `gputrain-exporter` command: serve (the default), rules, diagnose, top, profile,
dashboards. (The repository's generated files: scripts/generate.py.)"""

from __future__ import annotations

import argparse
import difflib
import errno
import gc
import ipaddress
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from exporter import __version__
from exporter.config import ConfigError, Settings, add_flags, parse_listen_address, resolve

log = logging.getLogger("exporter")

SUBCOMMANDS = ("serve", "rules", "diagnose", "top", "profile", "dashboards")


def url_of(scheme: str, server: Any) -> str:
    """An address a person can open: the real port, localhost for every-address binds."""
    host, port = server.address[:2]
    if host in ("", "0.0.0.0", "::"):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Parser(argparse.ArgumentParser):
    """The command line: its commands' parsers by name, and serve's (the default command)."""

    serve_parser: argparse.ArgumentParser
    commands: Mapping[str, argparse.ArgumentParser]


def build_parser() -> Parser:
    parser = Parser(
        prog="gputrain-exporter",
        description="Prometheus exporter for GPU training: per-GPU and host metrics, and the "
                    "step and data-wait times that training clients push.")
    parser.add_argument("--version", action="version", version=f"gputrain-exporter {__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the exporter daemon (the default)")
    add_flags(serve)
    parser.serve_parser = serve  # --help shows its flags too
    from exporter.cli import profile, top  # subcommands register flags
    from exporter.heuristics import diagnose, generate, rules

    rules.add_parser(sub)
    diagnose.add_parser(sub)
    top.add_parser(sub)
    profile.add_parser(sub)
    generate.add_parser(sub)
    parser.commands = sub.choices  # name -> its parser
    return parser


def _did_you_mean(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _unknown(parser: Parser, command: str, extra: list[str]) -> str:
    """What is wrong with arguments the command does not take, with the closest it does."""
    sub = parser.commands[command]
    options = [o for a in sub._actions for o in a.option_strings]
    flag = extra[0].split("=", 1)[0]
    if flag.startswith("-"):
        return (f"unknown flag {flag} for {command}" + _did_you_mean(flag, options)
                + f" (gputrain-exporter {command} --help lists them)")
    return f"unexpected argument {extra[0]} for {command}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if args[:1] in (["-h"], ["--help"]):  # the commands, then the daemon's own flags
        parser.print_help()
        print("\nserve, the default command, runs the daemon and takes these flags:\n")
        parser.serve_parser.print_help()
        return 0
    if args and not args[0].startswith("-") and args[0] not in SUBCOMMANDS:
        parser.error(f"unknown command {args[0]}" + _did_you_mean(args[0], SUBCOMMANDS)
                     + f" (commands: {', '.join(SUBCOMMANDS)}; serve is the default)")
    if not args or args[0] not in (*SUBCOMMANDS, "--version"):
        args.insert(0, "serve")
    ns, extra = parser.parse_known_args(args)
    if extra:
        parser.commands[ns.command].error(_unknown(parser, ns.command, extra))
    if ns.command == "serve":
        try:
            settings = resolve(ns)
        except ConfigError as exc:
            parser.exit(2, f"gputrain-exporter: error: {exc}\n")
        return serve(settings)
    return ns.func(ns)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _tls(settings: Settings, part: str) -> tuple[str, str] | None:
    """(cert, key) of ``--<part>.tls-cert-file`` and ``--<part>.tls-key-file``, or None."""
    cert, key = settings[f"{part}.tls-cert-file"], settings[f"{part}.tls-key-file"]
    if bool(cert) != bool(key):
        raise ConfigError(f"--{part}.tls-cert-file and --{part}.tls-key-file go together")
    return (cert, key) if cert else None


def _read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"--ingest.token-file {path}: {exc.strerror}") from None
    if len(token) < 16:
        raise ConfigError(f"--ingest.token-file {path}: the token must be at least 16 "
                          "characters")
    return token


def _thresholds(path: str | None) -> dict[str, float]:
    """The thresholds of a `rules --config` file (the catalogue's defaults without one)."""
    from exporter.heuristics.rules import load_overrides, settings

    try:
        return settings(load_overrides(path))["thresholds"]
    except ValueError as exc:
        raise ConfigError(f"--status.rules-config {exc}") from None


def _observe(history: Any, view: Any, status: Any, hangs: Any = None) -> None:
    """Note a cycle's view (its snapshot, the live ranks, who holds which GPU) in the status
    history, then look for a run that turned hung (its stacks are taken at once)."""
    try:
        history.observe(view)
    except Exception:  # the sampler must outlive a bug here
        log.exception("recording the status history failed")
    status.changed()
    if hangs is not None:
        try:
            hangs.check()
        except Exception:  # likewise: a bug here must not stop the sampler's cycle
            log.exception("looking for hung runs failed")


def _hangup(signum: int, frame: Any) -> None:
    """SIGHUP (a closed terminal, a reload by habit) is ignored, and said so: the flags and
    the config file are read at start only, and a restart loses what the daemon holds
    (docs/flags.md, "Signals and restarts")."""
    log.warning("SIGHUP ignored: the flags and the config file are read at start only; "
                "restart the daemon to apply a change (docs/flags.md, \"Signals and "
                "restarts\", says what a restart loses)")


def serve(settings: Settings, stop: threading.Event | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT (or ``stop`` is set); returns the exit code."""
    from exporter.heuristics.catalogue import PROFILED_ALERTS, STACK_ALERTS
    from exporter.reading.collectors import host_collectors
    from exporter.reading.gpu_backends import DemoBackend, NvmlBackend
    from exporter.reading.peak_flops import PeakTable
    from exporter.reading.sampler import Sampler
    from exporter.serving.attribution import Attribution, Owners
    from exporter.serving.connections import raise_descriptor_limit
    from exporter.serving.exposition import Exposition
    from exporter.serving.hangs import HangWatch
    from exporter.serving.history import History
    from exporter.serving.ingest import IngestStore
    from exporter.serving.routes import IngestSite, Site, WebSite
    from exporter.serving.server import (
        GC_YOUNG_THRESHOLD,
        GIL_SWITCH_SECONDS,
        make_server,
        serve_in_thread,
    )
    from exporter.serving.state_file import CONFIG_ERRORS, StateFile
    from exporter.serving.status import StatusView

    setup_logging(settings["log.level"])
    try:
        web_host, web_port = parse_listen_address(settings["web.listen-address"])
        tls = _tls(settings, "web")
        ingest_tls = _tls(settings, "ingest")
        store, state_file = None, None
        if "training" in settings.collectors:
            ingest_host, ingest_port = parse_listen_address(settings["ingest.listen-address"])
            token_file = settings["ingest.token-file"]
            token = _read_token(token_file) if token_file else None
            if token is None and not _is_loopback(ingest_host):
                raise ConfigError(
                    f"--ingest.listen-address {settings['ingest.listen-address']} is not a "
                    "loopback address: set --ingest.token-file so that only your training "
                    "jobs can push")
            store = IngestStore(settings["ingest.max-series"], settings["ingest.ttl"], token,
                                alert_interval=settings["profile.alert-interval"],
                                profiled_alerts=PROFILED_ALERTS, stack_alerts=STACK_ALERTS,
                                rank_interval=settings["profile.rank-interval"],
                                dead_ttl=settings["ingest.dead-ttl"])
            if settings["ingest.state-file"]:
                state_file = StateFile(settings["ingest.state-file"], store)
                state_file.load()
                try:  # at once: a path that cannot be written is said now, not at the crash
                    state_file.save()
                except OSError as exc:
                    if exc.errno not in CONFIG_ERRORS:  # a full disk: the daemon still serves
                        log.warning("cannot write --ingest.state-file %s: %s",
                                    settings["ingest.state-file"], exc.strerror or exc)
                    else:
                        raise ConfigError(f"cannot write --ingest.state-file "
                                          f"{settings['ingest.state-file']}: "
                                          f"{exc.strerror or exc}") from exc
        thresholds = _thresholds(settings["status.rules-config"])
    except ConfigError as exc:
        log.error("%s", exc)
        return 2

    backend: DemoBackend | NvmlBackend
    if settings["gpu.backend"] == "demo":
        backend = DemoBackend(settings["demo.gpus"], settings["demo.load"],
                              memory_fault=settings["demo.memory-fault"],
                              foreign_load=settings["demo.foreign-load"])
    else:
        backend = NvmlBackend()
    host = host_collectors(settings.collectors, settings.values)
    # before anything listens: a SIGTERM right after /healthz answers must stop us cleanly
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        signal.signal(signal.SIGHUP, _hangup)
    sampler = Sampler(backend, host, settings["sampler.interval"], settings.collectors)
    peaks = PeakTable(settings["gpu.peak-flops"])
    # who holds which GPU, joined once per cycle: /metrics and the history read the same view
    views = Attribution(Owners(read=backend.host_process) if isinstance(backend, DemoBackend)
                        else None, snapshot=sampler.snapshot)
    views.follow(sampler, store)
    if isinstance(backend, DemoBackend) and store is not None:
        # the laptop tour: training on the CPU uses a demo GPU, as the last cycle saw it
        backend.follow(lambda: views.latest.states)
    history = History(settings["status.window"], peaks=peaks, instance=socket.gethostname(),
                      interval=settings["sampler.interval"],
                      clock=store.now if store is not None else time.monotonic,
                      collectors=host)
    status = StatusView(history, thresholds, lambda: sampler.gpu_error, backend.name,
                        lambda: sampler.snapshot.driver_version,
                        store.profiles if store is not None else None,
                        guarded=store is not None and token is not None,
                        wall_clock=time.time)
    if store is not None:  # a profile asked for or finished: a viewer sees it at once
        store.profiles.listeners.append(status.changed)
    hangs = HangWatch(history, store.profiles, thresholds) if store is not None else None
    views.listeners.append(lambda view: _observe(history, view, status, hangs))
    if state_file is not None:
        views.listeners.append(lambda view: state_file.cycle())
    sampler.start()
    status.start()
    app = Exposition(sampler, store, peaks=peaks, status=status, views=views,
                     regimes=history.regime_starts)
    app.start()
    raise_descriptor_limit()  # the connection caps are sized from it
    # a scrape waits for the GIL behind the page and sampler threads at most this long
    # (Python's default, 5 ms, made the scrape p99 at 1,024 ranks 4.9x that at none)
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    # a full garbage collection holds the GIL for tens of ms at 1,024 ranks: a tenth as often
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    servers = []
    listen: list[tuple[str, str, int, type[Site], tuple[Any, ...], tuple[str, str] | None]] = [
        ("web", web_host, web_port, WebSite, (app,), tls)]
    if store is not None:
        listen.append(("ingest", ingest_host, ingest_port, IngestSite,
                       (store, app.healthy), ingest_tls))
    for part, host_, port, handler, serves, tls_ in listen:
        flag = f"{part}.listen-address"
        try:
            servers.append(make_server(host_, port, handler, *serves, tls=tls_))
        except ssl.SSLError as exc:
            cert, key = tls_ or ("", "")  # (only a TLS port raises it)
            log.error("--%s.tls-cert-file %s / --%s.tls-key-file %s: not a usable certificate "
                      "and key (%s)", part, cert, part, key, exc.reason or exc)
        except OSError as exc:
            if tls_ is not None and exc.errno in (errno.ENOENT, errno.EACCES, errno.EISDIR):
                log.error("cannot read --%s.tls-cert-file %s or --%s.tls-key-file %s: %s",
                          part, tls_[0], part, tls_[1], exc.strerror)
            else:
                log.error("cannot listen on --%s %s: %s", flag, settings[flag],
                          exc.strerror or exc)
        else:
            continue
        for srv in servers:
            srv.close_socket()
        app.stop()
        status.stop()
        sampler.stop()
        return 1
    for srv in servers:
        serve_in_thread(srv, f"gputrain-http-{srv.name}")
    scheme = "https" if tls else "http"
    log.info("gputrain-exporter %s serving %s/metrics (%s backend)", __version__,
             url_of(scheme, servers[0]), backend.name)
    if store is not None:
        log.info("ingest for training clients on %s/api/v1/push%s",
                 url_of("https" if ingest_tls else "http", servers[1]),
                 " (token required)" if token else "")
    stop.wait()
    log.info("shutting down")
    # both ports at once: each stops accepting, then answers what it holds within its grace
    draining = [threading.Thread(target=srv.shutdown, name=f"gputrain-stop-{srv.name}")
                for srv in servers]
    for t in draining:
        t.start()
    for t in draining:
        t.join()
    for srv in servers:
        srv.close_socket()
    app.stop()
    status.stop()
    sampler.stop()
    if state_file is not None:  # what the last pushes said, for the next start
        try:
            state_file.save()
        except OSError as exc:
            log.warning("cannot write --ingest.state-file %s at shutdown: %s", state_file.path,
                        exc)
    return 0
