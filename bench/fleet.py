"""A fleet of gputrain-exporter nodes on one machine, and the real pipeline that watches it.

The pages are the real daemon's: a few **template** daemons (``python -m exporter`` with the
demo backend's 8 GPUs) take pushes from real training clients (``examples/synthetic_client.py``,
8 ranks each): a healthy run, a run with one straggler rank, an input-bound run, a run that
finishes, one that starts late, and an idle node. One **page server** process (``python
bench/fleet.py serve PLAN``) serves N nodes, each on its own port, from those pages: each node
is one template's page with its run's name, its ranks (``rank="3"`` becomes the node's first
rank in its run plus 3) and its GPUs' UUIDs rewritten, and the lines the daemon writes at each
request (its clock, the ages) written at each scrape as the daemon writes them. A template
page is fetched again when the one held is over ``refresh`` seconds old, so the counters grow
as the daemons' do; a node of a multi-node run shows the same figures as its run's other
nodes, its own labels. A node is killed by closing its port (connection refused, as a node
that goes away).

The pipeline (:func:`start_pipeline`): Debian's ``vmagent`` scrapes every node (file_sd) and
remote-writes to ``victoria-metrics``; one ``vmalert`` evaluates the node rules (``rules
--level node``: every recording rule and the one-node alerts) over the raw series and writes
the results back, as a shard would; a second ``vmalert`` evaluates the global rules (``rules
--level global``) over the results, with the flags of ``deploy/scale-out/vmalert.service``;
both notify one real Alertmanager, which posts to a webhook. Optionally a real Prometheus
shard scrapes a slice of the nodes with the node rules and ``deploy/scale-out/prometheus-
shard.yml``'s results-only ``remote_write``, into a sink that counts the bytes (what leaves a
shard), notifying nobody (its alerts would be copies).

Used by ``bench/bench_fleet.py`` (the figures at a given N) and ``tests/test_fleet.py`` (a
few dozen nodes: exactly the planted faults fire, once each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid as uuidlib
import zlib
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "scale-out"

# --------------------------------------------------------------------------------------------
# The templates: what each kind of node runs

# synthetic_client flags of a rank (sleeps stand in for the loader and the GPU step). Steps of
# about 0.1 s keep the clients cheap (each wakes a few times per step) and the rates steady.
# 4e12 FLOPs a sample: a healthy rank's MFU is about 0.65 of the demo H100's bf16 peak (with
# 1e9, every busy rank's MFU reads as low, and GpuTrainLowMFU is right to say so)
FLOPS = ("--flops-per-sample", "4e12")
FAST = ("--batch-size", "16", "--data-wait-ms", "0", "--compute-ms", "100", *FLOPS)
# the straggler computes 2.5x as long as its peers (no data wait: it is not input-bound; the
# global rule's step-time branch names it, as no communication is measured)
SLOW = ("--batch-size", "16", "--data-wait-ms", "0", "--compute-ms", "250", *FLOPS)
# waits for data 3/4 of each step: input-bound at both tiers (>= 0.05 and >= 0.2)
STARVED = ("--batch-size", "16", "--data-wait-ms", "150", "--compute-ms", "50", *FLOPS)
PUSH_INTERVAL = "2"  # seconds between a client's pushes (the client's default is 5)


@dataclass(frozen=True)
class Template:
    """One real daemon and the clients that push to it."""

    name: str
    ranks: tuple[tuple[str, ...], ...] = ()  # each local rank's client flags
    host: bool = True  # the daemon's host collectors (cpu, memory, disk, network)
    load: str | None = None  # --demo.load (None: the GPUs follow their ranks)
    late: bool = False  # its clients start when told (start_late), not with the daemon

    @property
    def run(self) -> str:
        """The run name its clients push (rewritten per node)."""
        return f"tpl-{self.name}"


def templates(finish_steps: int) -> dict[str, Template]:
    return {t.name: t for t in (
        Template("healthy", (FAST,) * 8),
        Template("straggler", (FAST,) * 5 + (SLOW,) + (FAST,) * 2),
        # its verdict is its own: the host collectors would refine it by this machine's load
        # (a busy 2-core machine reads as CPU-bound preprocessing), as tests/test_scaleout.py
        # runs its input-bound cluster-b node
        Template("starved", (STARVED,) * 8, host=False),
        Template("finishing", ((*FAST, "--steps", str(finish_steps)),) * 8),
        Template("starting", (FAST,) * 8, late=True),
        Template("idle", (), load="0"),
    )}


# --------------------------------------------------------------------------------------------
# The plan: which node is which, and what must fire

STRAGGLER_POSITION, STRAGGLER_LOCAL_RANK = 2, 5  # in run-000: its third node, local rank 5
RUN_SIZES = (16, 8, 8, 4, 4, 2, 1, 1)  # the healthy runs' sizes in nodes, cycled
MIN_NODES = 16


@dataclass(frozen=True)
class Node:
    name: str  # its instance label
    template: str
    run: str | None  # the run its ranks belong to
    rank_base: int = 0  # its first rank in the run


@dataclass
class Plan:
    nodes: list[Node]
    dead: str  # the node whose port is closed mid-run
    expected: set[tuple] = field(default_factory=set)  # alert keys (see alert_key)

    @property
    def ranks(self) -> int:
        return sum(8 for n in self.nodes if n.run is not None)


def alert_key(labels: dict[str, str]) -> tuple:
    """What tells two alerts apart: name, tier, run, rank and node (a copy from a second
    ruler adds or changes other labels, e.g. ``alertgroup``)."""
    return (labels.get("alertname"), labels.get("severity"), labels.get("run"),
            labels.get("rank"), labels.get("instance"))


def make_plan(n: int) -> Plan:
    """N nodes: run-000 (8 nodes, its third holding the straggler), one input-bound node
    (run ``starved``), one run that finishes, one that starts late, idle nodes (1 in 20),
    run-001 (4 nodes, its second killed mid-run), the rest healthy runs of RUN_SIZES nodes."""
    if n < MIN_NODES:
        raise ValueError(f"a fleet has at least {MIN_NODES} nodes, not {n}")
    nodes: list[Node] = []

    def add(template: str, run: str | None, base: int = 0) -> Node:
        node = Node(f"node-{len(nodes):04d}", template, run, base)
        nodes.append(node)
        return node

    for i in range(8):
        add("straggler" if i == STRAGGLER_POSITION else "healthy", "run-000", 8 * i)
    starved = add("starved", "starved")
    add("finishing", "finishing")
    add("starting", "starting")
    dead = None
    for i in range(4):
        node = add("healthy", "run-001", 8 * i)
        dead = node if i == 1 else dead
    for _ in range(max(1, n // 20)):
        add("idle", None)
    runs, k = 2, 0
    while len(nodes) < n:
        size = min(RUN_SIZES[k % len(RUN_SIZES)], n - len(nodes))
        k += 1
        for i in range(size):
            add("healthy", f"run-{runs:03d}", 8 * i)
        runs += 1
    assert dead is not None
    straggler = nodes[STRAGGLER_POSITION]
    expected = {("GpuTrainStragglerRank", "warning", "run-000",
                 str(straggler.rank_base + STRAGGLER_LOCAL_RANK), straggler.name),
                ("GpuTrainExporterDown", "critical", None, None, dead.name)}
    for r in range(8):
        for tier in ("info", "warning"):
            expected.add(("GpuTrainInputBound", tier, "starved", str(r), starved.name))
    return Plan(nodes, dead.name, expected)


# --------------------------------------------------------------------------------------------
# The page server (a process of its own: `python bench/fleet.py serve PLAN_FILE`)

_SLOT = re.compile(r'rank="(\d+)"|run="[^"]*"|uuid="(GPU-[0-9a-fA-F-]+)"')
_TIME = "gputrain_exporter_time_seconds"
PLAIN = "text/plain; version=0.0.4; charset=utf-8"


def parse_template(text: str) -> list[Any]:
    """A template page as parts: strings, and slots a node fills in: ("rank", n), ("run",),
    ("uuid", i) for the i-th GPU UUID of the page, ("age", value) for a sample whose value is
    an age at the request (written then: the value plus the time since the fetch), ("now",)
    for the daemon's clock."""
    parts: list[Any] = []
    uuids: dict[str, int] = {}
    buf: list[str] = []

    def flush() -> None:
        if buf:
            parts.append("".join(buf))
            buf.clear()

    for line in text.splitlines(keepends=True):
        if line.startswith("#"):
            buf.append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        head, _, value = line.rstrip("\n").rpartition(" ")
        pos = 0
        for m in _SLOT.finditer(head):
            buf.append(head[pos:m.start()])
            flush()
            if m.group(1) is not None:
                buf.append('rank="')
                flush()
                parts.append(("rank", int(m.group(1))))
                buf.append('"')
            elif m.group(2) is not None:
                buf.append('uuid="')
                flush()
                parts.append(("uuid", uuids.setdefault(m.group(2), len(uuids))))
                buf.append('"')
            else:
                buf.append('run="')
                flush()
                parts.append(("run",))
                buf.append('"')
            pos = m.end()
        buf.append(head[pos:] + " ")
        if name == _TIME:
            flush()
            parts.append(("now",))
        elif name.endswith("_age_seconds"):
            flush()
            parts.append(("age", float(value)))
        else:
            buf.append(value)
        buf.append("\n")
    flush()
    return parts


def node_uuids(node: str, gpus: int = 8) -> list[str]:
    return ["GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{node}.fleet.{i}"))
            for i in range(gpus)]


def render_node(parts: list[Any], node: dict, fetched: float, now: float) -> str:
    out: list[str] = []
    add = out.append
    base, run, uuids = node["rank_base"], node["run"] or "", node["uuids"]
    for p in parts:
        if p.__class__ is str:
            add(p)
            continue
        kind = p[0]
        if kind == "rank":
            add(str(base + p[1]))
        elif kind == "run":
            add(run)
        elif kind == "uuid":
            add(uuids[p[1] % len(uuids)])
        elif kind == "age":
            add(repr(round(p[1] + max(0.0, now - fetched), 3)))
        else:
            add(repr(round(now, 3)))
    return "".join(out)


class PageServer:
    """Serves every node of the plan on its own loopback port, from the template pages."""

    def __init__(self, plan: dict) -> None:
        self.templates: dict[str, str] = plan["templates"]  # name -> daemon URL
        self.refresh: float = plan.get("refresh", 1.0)
        self.nodes = {n["name"]: {**n, "uuids": node_uuids(n["name"])} for n in plan["nodes"]}
        self.cache: dict[str, tuple[float, list[Any]]] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.sites: dict[str, Any] = {}
        self.stats = {"scrapes": 0, "bytes": 0, "gzip_bytes": 0, "render_seconds": 0.0,
                      "fetches": 0, "fetch_errors": 0}
        self.session: Any = None

    async def template(self, name: str) -> tuple[float, list[Any]]:
        lock = self.locks.setdefault(name, asyncio.Lock())
        async with lock:
            held = self.cache.get(name)
            now = time.time()
            if held is None or now - held[0] > self.refresh:
                try:
                    async with self.session.get(self.templates[name] + "/metrics",
                                                headers={"Accept": "text/plain"}) as r:
                        text = await r.text()
                    held = (time.time(), parse_template(text))
                    self.cache[name] = held
                    self.stats["fetches"] += 1
                except Exception:
                    self.stats["fetch_errors"] += 1
                    if held is None:
                        raise
            return held

    def handler(self, name: str):
        from aiohttp import web

        node = self.nodes[name]

        async def metrics(request: web.Request) -> web.Response:
            fetched, parts = await self.template(node["template"])
            t0 = time.perf_counter()
            body = render_node(parts, node, fetched, time.time()).encode()
            headers = {"Content-Type": PLAIN}
            self.stats["bytes"] += len(body)
            if "gzip" in request.headers.get("Accept-Encoding", ""):
                c = zlib.compressobj(1, zlib.DEFLATED, 31)
                body = c.compress(body) + c.flush()
                headers["Content-Encoding"] = "gzip"
            self.stats["gzip_bytes"] += len(body)
            self.stats["render_seconds"] += time.perf_counter() - t0
            self.stats["scrapes"] += 1
            return web.Response(body=body, headers=headers)

        return metrics

    async def main(self, ready_file: Path) -> None:
        import aiohttp
        from aiohttp import web

        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        ports: dict[str, int] = {}
        runners = []
        for name in self.nodes:
            app = web.Application()
            app.router.add_get("/metrics", self.handler(name))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            site = web.SockSite(runner, sock)
            await site.start()
            ports[name] = sock.getsockname()[1]
            self.sites[name] = (runner, site)
            runners.append(runner)

        control = web.Application()

        async def kill(request: web.Request) -> web.Response:
            name = request.match_info["node"]
            runner, _site = self.sites.pop(name)
            await runner.cleanup()  # the port closes: connection refused, as a dead node
            return web.json_response({"killed": name})

        async def stats(request: web.Request) -> web.Response:
            ru = resource.getrusage(resource.RUSAGE_SELF)
            return web.json_response({**self.stats, "cpu_seconds": ru.ru_utime + ru.ru_stime,
                                      "max_rss_bytes": ru.ru_maxrss * 1024})

        control.router.add_post("/kill/{node}", kill)
        control.router.add_get("/stats", stats)
        crunner = web.AppRunner(control, access_log=None)
        await crunner.setup()
        csock = socket.socket()
        csock.bind(("127.0.0.1", 0))
        await web.SockSite(crunner, csock).start()
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"control": csock.getsockname()[1], "ports": ports}))
        tmp.rename(ready_file)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.session.close()


def serve_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description="serve a fleet's pages (bench/fleet.py)")
    p.add_argument("plan", type=Path)
    p.add_argument("ready", type=Path, help="written with the ports once every node listens")
    ns = p.parse_args(argv)
    asyncio.run(PageServer(json.loads(ns.plan.read_text())).main(ns.ready))


# --------------------------------------------------------------------------------------------
# Processes


def _conftest():
    """tests/conftest.py's helpers (Daemon, Server, Alertmanager, Webhook, ...)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import conftest

    return conftest


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, resident bytes) of a process now."""
    tick = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / tick
    rss = 0
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return cpu, rss


class Sink:
    """A remote-write receiver that counts what it is sent (the bytes leaving a shard)."""

    def __init__(self, port: int) -> None:
        self.requests = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                sink.requests += 1
                sink.bytes += n
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.shutdown()


PLANTED = ("GpuTrainStragglerRank", "GpuTrainInputBound", "GpuTrainExporterDown")


@dataclass
class Timings:
    """The pipeline's intervals: the test's are seconds, the bench's production's."""

    scrape: str = "15s"
    evaluation: str = "30s"  # the alert groups' (vmalert -evaluationInterval)
    recording: str = "30s"  # the recording group's (thresholds: recording_interval)
    liveness: str = "10s"  # the liveness group's (thresholds: liveness_interval)
    for_: str = "1m"  # the planted alerts' `for` (thresholds: for.<alert>)
    every_for: bool = False  # every alert's `for` that short, not the planted ones' only
    latency_offset: str = "30s"  # VictoriaMetrics' -search.latencyOffset (the shipped value)
    refresh: float = 1.0  # a template page older than this is fetched again
    flush: str = "1s"  # vmagent's and vmalert's remote-write flush interval
    disable_cache: bool = False  # VictoriaMetrics' -search.disableCache (the test's)


def thresholds(t: Timings) -> dict:
    """The thresholds file: the planted alerts' `for` shortened so that they fire within the
    run (as tests/test_scaleout.py does), every other alert's as shipped; with
    ``every_for``, every alert's `for` shortened (what else a fleet would raise)."""
    from exporter.heuristics.catalogue import CATALOGUE

    names = {e.alert for e in CATALOGUE} if t.every_for else set(PLANTED)
    return {"recording_interval": t.recording, "liveness_interval": t.liveness,
            "for": {name: t.for_ for name in sorted(names)}}


def rule_files(tmp: Path, t: Timings) -> dict[str, Path]:
    """`gputrain-exporter rules --level node|global --config thresholds.yml`, as a user runs
    it (the CLI, in a subprocess)."""
    import yaml

    cfg = tmp / "thresholds.yml"
    cfg.write_text(yaml.safe_dump(thresholds(t)))
    out = {}
    for level in ("node", "global"):
        text = subprocess.run([sys.executable, "-m", "exporter", "rules", "--level", level,
                               "--config", str(cfg)], cwd=ROOT, check=True,
                              capture_output=True, text=True, timeout=120).stdout
        out[level] = tmp / f"gputrain.{level}.rules.yml"
        out[level].write_text(text)
    out["thresholds"] = cfg
    return out


@dataclass
class Fleet:
    """Everything started, for the bench and the test to read and stop."""

    plan: Plan
    tmp: Path
    timings: Timings
    started: list = field(default_factory=list)
    daemons: dict = field(default_factory=dict)  # template name -> conftest.Daemon
    late: list = field(default_factory=list)  # (template, daemon) whose clients start late
    clients: list = field(default_factory=list)
    pages: subprocess.Popen | None = None
    control: str = ""
    ports: dict = field(default_factory=dict)
    vm: Any = None
    vmagent: Any = None
    node_ruler: Any = None
    global_ruler: Any = None
    am: Any = None
    hook: Any = None
    shard: Any = None
    sink: Sink | None = None
    shard_nodes: list = field(default_factory=list)
    rules: dict = field(default_factory=dict)

    def stop(self) -> None:
        _conftest().stop_all(self.started)

    def kill(self, node: str) -> None:
        import requests

        requests.post(f"{self.control}/kill/{node}", timeout=10).raise_for_status()

    def start_late(self) -> None:
        """The clients of the template that starts late: a run begins."""
        for template, daemon in self.late:
            self._clients(template, daemon)
        self.late.clear()

    def _clients(self, template: Template, daemon: Any) -> None:
        c = _conftest()
        for rank, flags in enumerate(template.ranks):
            proc = c.synthetic_client(template.run, daemon.ingest_url, *flags,
                                      "--push-interval", PUSH_INTERVAL, rank=rank, gpu=rank)
            self.clients.append(proc)
            self.started.append(proc)

    def page_stats(self) -> dict:
        import requests

        return requests.get(f"{self.control}/stats", timeout=10).json()

    def processes(self) -> dict[str, list[int]]:
        """The pids of each part, for CPU and memory."""
        out = {"victoria-metrics": [self.vm.proc.pid], "vmagent": [self.vmagent.proc.pid],
               "vmalert-node": [self.node_ruler.proc.pid],
               "vmalert-global": [self.global_ruler.proc.pid],
               "alertmanager": [self.am.proc.pid],
               "page server": [self.pages.pid] if self.pages else [],
               "template daemons": [d.proc.pid for d in self.daemons.values()],
               "training clients": [p.pid for p in self.clients if p.poll() is None]}
        if self.shard is not None:
            out["prometheus shard"] = [self.shard.proc.pid]
        return out


def _flags_of_unit() -> list[str]:
    unit = (DEPLOY / "vmalert.service").read_text().replace("\\\n", " ")
    return shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))[1:]


def start_pipeline(tmp: Path, plan: Plan, t: Timings, finish_steps: int,
                   shard_nodes: int = 0, vmalert_queue: int | None = None) -> Fleet:
    """Start the templates, the page server and the pipeline; returns once vmagent has
    scraped every node once. ``shard_nodes``: a Prometheus shard over that many nodes too.
    ``vmalert_queue``: the node vmalert's -remoteWrite.maxQueueSize (None: its default)."""
    import requests
    import yaml

    c = _conftest()
    fleet = Fleet(plan, tmp, t)
    try:
        _start(fleet, c, requests, yaml, finish_steps, shard_nodes, vmalert_queue)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def parallel(*calls: Any) -> list[Any]:
    """Run each call in a thread of its own; their results, or the first exception."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def one(i: int, call: Any) -> None:
        try:
            results[i] = call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, call)) for i, call in enumerate(calls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def _start(fleet: Fleet, c: Any, requests: Any, yaml: Any, finish_steps: int,
           shard_nodes: int, vmalert_queue: int | None) -> None:
    """Everything that does not wait on another starts at once (a 2-core machine spends most
    of a start waiting on imports and fsyncs)."""
    tmp, plan, t = fleet.tmp, fleet.plan, fleet.timings

    def started(server: Any) -> Any:
        fleet.started.append(server)  # before it is up: stopped if its start fails
        return server.start()

    # the templates: real daemons, real clients
    used = {n.template for n in plan.nodes}
    chosen = {name: tpl for name, tpl in templates(finish_steps).items() if name in used}
    for name, template in chosen.items():
        args = ["--gpu.backend=demo", "--demo.gpus=8"]
        if template.load is not None:
            args.append(f"--demo.load={template.load}")
        if not template.host:
            args += list(c.NO_HOST)
        fleet.daemons[name] = c.Daemon(*args)

    # VictoriaMetrics, with the shipped ARGS (data path, latency offset and address replaced)
    vm_bin = c.require_binary("victoria-metrics", package="victoria-metrics")
    text = (DEPLOY / "victoria-metrics.default").read_text()
    args = shlex.split(re.search(r'^ARGS="(.*)"$', text, re.M).group(1))
    changed = {"-storageDataPath": str(tmp / "vm-data"),
               "-search.latencyOffset": t.latency_offset}
    args = [f"{a.split('=')[0]}={changed[a.split('=')[0]]}" if a.split("=")[0] in changed
            else a for a in args]
    port = c.free_port()
    args.append(f"-httpListenAddr=127.0.0.1:{port}")
    if t.disable_cache:
        args.append("-search.disableCache")
    (tmp / "vm").mkdir()
    fleet.vm = c.Server([vm_bin, *args], tmp / "vm", f"http://127.0.0.1:{port}", "/health")

    fleet.hook = c.Webhook()
    am_config = tmp / "alertmanager.yml"
    am_config.write_text(yaml.safe_dump({
        # every alert its own group: a copy from a second ruler is a second notification
        "route": {"receiver": "hook", "group_by": ["..."], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "hook", "webhook_configs": [{"url": fleet.hook.url}]}]}))
    fleet.am = c.Alertmanager(tmp, am_config)

    # the page server
    plan_file, ready = tmp / "plan.json", tmp / "pages.json"
    plan_file.write_text(json.dumps({
        "refresh": t.refresh,
        "templates": {name: d.url for name, d in fleet.daemons.items()},
        "nodes": [asdict(n) for n in plan.nodes]}))

    def pages() -> None:
        log = open(tmp / "pages.log", "w")  # noqa: SIM115 - the process holds it
        fleet.pages = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                        "serve", str(plan_file), str(ready)], cwd=ROOT,
                                       stdout=log, stderr=subprocess.STDOUT)
        fleet.started.append(fleet.pages)
        c.wait_until(lambda: ready.exists() or fleet.pages.poll() is not None, timeout=120,
                     what="the page server to listen")
        assert fleet.pages.poll() is None, (tmp / "pages.log").read_text()[-2000:]
        served = json.loads(ready.read_text())
        fleet.control = f"http://127.0.0.1:{served['control']}"
        fleet.ports = served["ports"]

    def rules() -> None:
        fleet.rules = rule_files(tmp, t)

    parallel(rules, pages, lambda: started(fleet.vm), lambda: started(fleet.am),
             *(lambda d=d: started(d) for d in fleet.daemons.values()))
    for name, template in chosen.items():
        if template.late:
            fleet.late.append((template, fleet.daemons[name]))
        else:
            fleet._clients(template, fleet.daemons[name])

    # vmagent: every node, at the scrape interval, remote-written to VictoriaMetrics
    targets = tmp / "targets.yml"
    targets.write_text(yaml.safe_dump(
        [{"targets": [f"127.0.0.1:{fleet.ports[n.name]}"], "labels": {"instance": n.name}}
         for n in plan.nodes]))
    scrape = tmp / "vmagent.yml"
    scrape.write_text(yaml.safe_dump({
        "global": {"scrape_interval": t.scrape},
        "scrape_configs": [{"job_name": "gputrain",
                            "file_sd_configs": [{"files": [str(targets)]}]}]}))
    vmagent_bin = c.require_binary("vmagent", package="victoria-metrics")
    port = c.free_port()
    (tmp / "vmagent").mkdir()
    fleet.vmagent = c.Server(
        [vmagent_bin, f"-promscrape.config={scrape}", f"-remoteWrite.url={fleet.vm.url}"
         "/api/v1/write", f"-remoteWrite.tmpDataPath={tmp / 'vmagent' / 'queue'}",
         f"-remoteWrite.flushInterval={t.flush}", f"-httpListenAddr=127.0.0.1:{port}",
         "-promscrape.suppressScrapeErrors"],
        tmp / "vmagent", f"http://127.0.0.1:{port}", "/health")

    # the rulers: the shipped unit's flags, URLs, rule file and interval replaced
    def ruler(level: str, extra: list[str]) -> Any:
        vmalert_bin = c.require_binary("vmalert", package="victoria-metrics")
        port = c.free_port()
        vm = fleet.vm.url
        changed = {"-rule": str(fleet.rules[level]), "-datasource.url": vm,
                   "-remoteWrite.url": vm, "-remoteRead.url": vm,
                   "-notifier.url": fleet.am.url, "-evaluationInterval": t.evaluation,
                   "-httpListenAddr": f"127.0.0.1:{port}"}
        flags = _flags_of_unit()
        args = [f"{a.split('=', 1)[0]}={changed[a.split('=', 1)[0]]}" for a in flags]
        d = tmp / f"vmalert-{level}"
        d.mkdir()
        return c.Server([vmalert_bin, *args, f"-remoteWrite.flushInterval={t.flush}",
                         *extra], d, f"http://127.0.0.1:{port}", "/health")

    queue = [f"-remoteWrite.maxQueueSize={vmalert_queue}"] if vmalert_queue else []
    fleet.node_ruler = ruler("node", queue)
    fleet.global_ruler = ruler("global", [])
    servers = [fleet.vmagent, fleet.node_ruler, fleet.global_ruler]

    if shard_nodes:
        fleet.shard_nodes = [n.name for n in plan.nodes if n.name != plan.dead][:shard_nodes]
        fleet.sink = Sink(c.free_port())
        fleet.started.append(fleet.sink)
        d = tmp / "shard"
        (d / "targets").mkdir(parents=True)
        (d / "targets" / "gputrain-nodes.yml").write_text(yaml.safe_dump(
            [{"targets": [f"127.0.0.1:{fleet.ports[name]}"], "labels": {"instance": name}}
             for name in fleet.shard_nodes]))
        cfg = yaml.safe_load((DEPLOY / "prometheus-shard.yml").read_text())
        cfg["global"].update(scrape_interval=t.scrape, evaluation_interval=t.evaluation)
        cfg["rule_files"] = [str(fleet.rules["node"])]
        del cfg["alerting"]  # its alerts would be copies of the node vmalert's
        (job,) = cfg["scrape_configs"]
        job["file_sd_configs"][0]["files"] = [str(d / "targets" / "gputrain-*.yml")]
        (remote,) = cfg["remote_write"]
        remote["url"] = f"{fleet.sink.url}/api/v1/write"
        (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        fleet.shard = c.Prometheus(d, [], config_file=d / "prometheus.yml")
        servers.append(fleet.shard)
    parallel(*(lambda s=s: started(s) for s in servers))

    def scraped_all() -> bool:
        up = query(fleet.vm.url, 'count(up{job="gputrain"} == 1)')
        return bool(up) and int(float(up[0]["value"][1])) == len(plan.nodes)

    c.wait_until(scraped_all, timeout=300, interval=0.5,
                 what=f"VictoriaMetrics to hold every node's up (of {len(plan.nodes)})")


# --------------------------------------------------------------------------------------------
# Reading the pipeline


def query(url: str, expr: str, timeout: float = 120) -> list[dict]:
    import requests

    body = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=timeout).json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def scalar(url: str, expr: str) -> float:
    rows = query(url, expr)
    return float(rows[0]["value"][1]) if rows else 0.0


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)", re.M)


def metrics(url: str) -> dict[str, float]:
    """A server's own /metrics, as {'name{labels}': value}."""
    import requests

    text = requests.get(url + "/metrics", timeout=30).text
    return {m[1] + (m[2] or ""): float(m[3]) for m in _SAMPLE.finditer(text)
            if m[3] not in ("NaN",)}


def total(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a family's samples whose labels include ``labels``."""
    out = 0.0
    for key, v in values.items():
        if key.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{val}"' in key for k, val in labels.items()):
            out += v
    return out


def received(hook: Any) -> dict[tuple, list[dict]]:
    """Every firing alert the webhook was sent, by alert_key: the distinct label sets."""
    out: dict[tuple, list[dict]] = {}
    for a in list(hook.alerts):
        if a.get("status") != "firing":
            continue
        lab = a["labels"]
        copies = out.setdefault(alert_key(lab), [])
        if lab not in copies:
            copies.append(lab)
    return out


def verdict(got: dict[tuple, list[dict]], expected: set[tuple]) -> dict[str, list]:
    """Planted against fired: missing, unexpected, and keys received with two label sets (a
    copy from a second ruler)."""
    return {"missing": sorted(expected - set(got), key=str),
            "unexpected": sorted(set(got) - expected, key=str),
            "duplicated": sorted((k for k, v in got.items() if len(v) > 1), key=str)}


def evaluated_since(url: str, t: float) -> bool:
    """Every rule of a vmalert was evaluated at ``t`` (Unix seconds) or later."""
    import requests

    groups = requests.get(url + "/api/v1/rules", timeout=30).json()["data"]["groups"]
    stamps = [r.get("lastEvaluation") for g in groups for r in g["rules"]]
    return bool(stamps) and all(s and _epoch(s) >= t for s in stamps)


def _epoch(stamp: str) -> float:
    from datetime import datetime

    m = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    if not m:
        return 0.0
    zone = "+00:00" if m[3] == "Z" else m[3]
    return datetime.fromisoformat(m[1] + zone).timestamp() + float(m[2] or 0)


def settle(fleet: Fleet, after: float, timeout: float = 300) -> None:
    """Wait until both rulers have evaluated every rule ``after`` seconds from now, and
    Alertmanager has delivered every alert it holds (the end of a window in which a copy or an
    unplanned alert would have arrived: events, not a sleep)."""
    import requests

    c = _conftest()
    until = time.time() + after
    for ruler in (fleet.node_ruler, fleet.global_ruler):
        c.wait_until(lambda ruler=ruler: evaluated_since(ruler.url, until), timeout=timeout,
                     interval=0.5, what=f"an evaluation of every rule on {ruler.url}")

    def delivered() -> bool:
        held = requests.get(fleet.am.url + "/api/v2/alerts", timeout=10).json()
        got = received(fleet.hook)
        return all(alert_key(a["labels"]) in got for a in held)

    c.wait_until(delivered, timeout=120, what="Alertmanager to deliver every alert it holds")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve_main(sys.argv[2:])
    else:
        raise SystemExit("usage: python bench/fleet.py serve PLAN_FILE READY_FILE "
                         "(bench/bench_fleet.py runs the fleet)")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
