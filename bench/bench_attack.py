"""The daemon under attack from one host, beside node_exporter under the same attack in the
same run (the anchor): how many scrapes and pushes from another address are answered within
1 s, and the daemon's memory.

    python bench/bench_attack.py [--seconds 60] [--scenarios slowloris,longpoll,memory,...]

- slowloris: 200 connections per port from 127.0.0.2 that send a request's headers one byte a
  second, each re-opened as soon as the daemon closes it; a scrape and a push from 127.0.0.1
  every 0.5 s (as Prometheus and a rank keep their connections alive).
- longpoll: 140 clients from 127.0.0.2 that hold ``GET /api/v1/profile/<id>?wait=5`` in a loop
  on the ingest port, while a rank pushes from 127.0.0.1 every 0.5 s.
- memory: the worst case the limits allow: from 8 addresses at once, every connection a port
  takes holding 16 KiB of unfinished headers or a 1 MiB body less one byte; four webhook calls
  of 1,000 alerts each against 1,024 live runs with 128-character names. Peak RSS (VmHWM).
- addresses: 520 addresses (127.0.1.1 onwards) each hold one slow connection per port, more
  than a port takes, so no address is the heaviest; probes as in slowloris.
- accept: 2,000 scrapes from 127.0.0.2, each with an Accept header of its own, while
  Prometheus' header is scraped every 0.5 s: answered, the oldest page age it saw, RSS.
- tls: TLS on both ports, two threads re-opening TLS handshakes that never finish (a whole or
  half ClientHello, then a close) from 127.0.0.2; HTTPS scrapes probed; RSS idle, peak, after.

Every loop is bounded in time and count, on loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_scrape import free_port, start_node_exporter, wait_ready  # noqa: E402

ATTACKER = "127.0.0.2"
PROBE_TIMEOUT = 1.0


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def push_body(run: str = "probe", rank: str = "0", steps: int = 1) -> dict:
    return {"version": 1, "run": run, "rank": rank, "run_id": "bench", "steps": steps,
            "step_seconds": 0.1 * steps, "data_wait_seconds": 0.0, "samples": 8 * steps,
            "capabilities": ["profile"]}


class Slowloris:
    """``count`` connections to ``port`` from ``source`` that send ``head`` then one byte a
    second; a connection the server closes is re-opened at once. One thread, non-blocking."""

    def __init__(self, port: int, count: int, head: bytes, source: str | list[str] = ATTACKER,
                 trickle: bytes = b"a") -> None:
        self.port, self.count, self.head = port, count, head
        self.sources = [source] if isinstance(source, str) else source  # round robin
        self.trickle = trickle
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Slowloris:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _open(self, sel: selectors.BaseSelector, source: str) -> None:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((source, 0))
            s.connect_ex(("127.0.0.1", self.port))
        except OSError:
            s.close()
            return
        sel.register(s, selectors.EVENT_READ, {"sent": False, "source": source})

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for i in range(self.count):
            self._open(sel, self.sources[i % len(self.sources)])
        next_tick = time.monotonic()
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the server closed it: open another
                    source = key.data["source"]
                    sel.unregister(s)
                    s.close()
                    self.reopened += 1
                    if not self._stop.is_set():
                        self._open(sel, source)
            if time.monotonic() >= next_tick:
                next_tick += 1.0
                for key in list(sel.get_map().values()):
                    s, state = key.fileobj, key.data
                    with contextlib.suppress(OSError):
                        s.send(self.trickle if state["sent"] else self.head)
                        state["sent"] = True
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()


def probe(url: str, seconds: float, method: str = "GET", body: dict | None = None
          ) -> tuple[int, int]:
    """(answered within PROBE_TIMEOUT, tried): one request every 0.5 s on a kept-alive
    session, as Prometheus scrapes and a rank pushes; a failed one opens a new connection."""
    session, ok, tried = requests.Session(), 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        tried += 1
        try:
            data = None
            if body is not None:
                body["steps"] = body.get("steps", 0) + 1
                data = json.dumps(body)
            r = session.request(method, url, data=data, timeout=PROBE_TIMEOUT,
                                headers={"Content-Type": "application/json"})
            if r.status_code == 200 and time.monotonic() - started <= PROBE_TIMEOUT:
                ok += 1
        except requests.RequestException:
            session.close()
            session = requests.Session()
        time.sleep(max(0.0, 0.5 - (time.monotonic() - started)))
    return ok, tried


def start_daemon(*extra: str) -> tuple[subprocess.Popen, int, int]:
    web, ingest = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--gpu.backend=demo", "--demo.gpus=8",
         f"--web.listen-address=127.0.0.1:{web}", f"--ingest.listen-address=127.0.0.1:{ingest}",
         *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{web}/healthz")
    return proc, web, ingest


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def in_parallel(*calls) -> list:
    out: list = [None] * len(calls)

    def run(i, fn, args):
        out[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, fn, args)) for i, (fn, args)
               in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def pct(ok: int, tried: int) -> str:
    return f"{ok:4d}/{tried:<4d} {100 * ok / max(tried, 1):5.1f} %"


HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
PUSH_HEAD = b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nX-Slow: "


def slowloris(seconds: float, per_port: int, source: str | list[str] = ATTACKER,
              label: str = "") -> None:
    proc, web, ingest = start_daemon()
    try:
        idle = rss_mb(proc.pid)
        requests.post(f"http://127.0.0.1:{ingest}/api/v1/push", json=push_body(), timeout=5)
        attackers = [Slowloris(web, per_port, HEAD, source).start(),
                     Slowloris(ingest, per_port, PUSH_HEAD, source).start()]
        time.sleep(3)  # the attack is in place
        (s_ok, s_n), (p_ok, p_n) = in_parallel(
            (probe, (f"http://127.0.0.1:{web}/metrics", seconds)),
            (probe, (f"http://127.0.0.1:{ingest}/api/v1/push", seconds, "POST", push_body())))
        for a in attackers:
            a.stop()
        print(f"gputrain-exporter  {label}scrapes {pct(s_ok, s_n)}  pushes {pct(p_ok, p_n)}  "
              f"re-opened {sum(a.reopened for a in attackers):6d}  RSS idle {idle:.0f} MB, "
              f"peak {rss_mb(proc.pid, 'VmHWM'):.0f} MB", flush=True)
    finally:
        stop(proc)
    ne, url = start_node_exporter()
    try:
        attacker = Slowloris(urlsplit(url).port, per_port, HEAD, source).start()
        time.sleep(3)
        ok, n = probe(url, seconds)
        attacker.stop()
        print(f"node_exporter      {label}scrapes {pct(ok, n)}  (anchor)  re-opened "
              f"{attacker.reopened:6d}  RSS peak {rss_mb(ne.pid, 'VmHWM'):.0f} MB", flush=True)
    finally:
        stop(ne)


def longpoll(seconds: float, clients: int) -> None:
    proc, web, ingest = start_daemon()
    base = f"http://127.0.0.1:{ingest}"
    try:
        requests.post(base + "/api/v1/push", json=push_body(), timeout=5)
        r = requests.post(base + "/api/v1/profile", json={"run": "probe", "steps": 1},
                          timeout=5)
        pid = r.json()["id"]
        stop_polls = threading.Event()
        answered = [0]

        def poll() -> None:
            s = requests.Session()
            s.mount("http://", _SourceAdapter(ATTACKER))
            while not stop_polls.is_set():
                with contextlib.suppress(requests.RequestException):
                    s.get(f"{base}/api/v1/profile/{pid}?wait=5", timeout=10)
                    answered[0] += 1

        polls = [threading.Thread(target=poll, daemon=True) for _ in range(clients)]
        for t in polls:
            t.start()
        time.sleep(3)
        (p_ok, p_n), (s_ok, s_n) = in_parallel(
            (probe, (base + "/api/v1/push", seconds, "POST", push_body())),
            (probe, (f"http://127.0.0.1:{web}/metrics", seconds)))
        stop_polls.set()
        for t in polls:
            t.join(timeout=20)
        print(f"gputrain-exporter  {clients} long-polls: pushes {pct(p_ok, p_n)}  scrapes "
              f"{pct(s_ok, s_n)}  long-polls answered {answered[0]}", flush=True)
    finally:
        stop(proc)


class _SourceAdapter(requests.adapters.HTTPAdapter):
    """Connections from a given source address (the attacker's)."""

    def __init__(self, source: str) -> None:
        self._source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self._source, 0)
        return super().init_poolmanager(*args, **kwargs)


def memory(seconds: float) -> None:
    proc, web, ingest = start_daemon("--ingest.max-series=1024")
    try:
        idle = rss_mb(proc.pid)
        base = f"http://127.0.0.1:{ingest}"
        s = requests.Session()
        for i in range(1024):
            s.post(base + "/api/v1/push", json=push_body(f"r{i:04d}" + "x" * 123), timeout=10)
        alerts = {"alerts": [{"status": "firing", "labels": {
            "alertname": "GpuTrainInputBound", "run": f"gone-{i}", "rank": "0"}}
            for i in range(1000)]}
        hooks = [threading.Thread(target=lambda: requests.post(
            base + "/api/v1/alerts", json=alerts, timeout=60)) for _ in range(4)]
        for t in hooks:
            t.start()
        for t in hooks:
            t.join()
        after_hooks = rss_mb(proc.pid, "VmHWM")
        padding = b"X-Pad: " + b"a" * 16000 + b"\r\n"
        body_head = (b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n"
                     + b"{" * (1048576 - 1))
        held = []
        for n in range(2, 10):
            held.append(Slowloris(web, 2000 // 8, HEAD + padding, f"127.0.0.{n}").start())
            held.append(Slowloris(ingest, 2000 // 8, body_head, f"127.0.0.{n}", b"").start())
        time.sleep(seconds)
        try:
            ok = requests.get(f"http://127.0.0.1:{web}/metrics", timeout=5).status_code
        except requests.RequestException as exc:
            ok = type(exc).__name__
        for a in held:
            a.stop()
        print(f"gputrain-exporter  RSS idle {idle:.0f} MB, after 4 webhook calls "
              f"{after_hooks:.0f} MB, peak under held connections "
              f"{rss_mb(proc.pid, 'VmHWM'):.0f} MB; a scrape meanwhile: {ok}", flush=True)
    finally:
        stop(proc)


def sources(count: int) -> list[str]:
    """``count`` loopback addresses other than the probes' (127.0.0.1): 127.0.1.1 onwards."""
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(count)]


def addresses(seconds: float, count: int) -> None:
    """Fairness against many addresses: ``count`` addresses each hold one slow connection per
    port (re-opened when closed), more than a port takes; probes from 127.0.0.1."""
    slowloris(seconds, count, sources(count), f"{count} addresses: ")


PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,"
                     "application/openmetrics-text;version=0.0.1;q=0.4,"
                     "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


def _accept_storm(url: str, count: int) -> int:
    """``count`` scrapes from the attacker, each with an Accept header of its own; returns
    how many were answered 200."""
    s = requests.Session()
    s.mount("http://", _SourceAdapter(ATTACKER))
    ok = 0
    for i in range(count):
        with contextlib.suppress(requests.RequestException):
            ok += s.get(url, timeout=30, headers={
                "Accept": f"application/openmetrics-text; version=1.0.{i + 1}; q=0.{i % 9 + 1}"
                if i % 2 else f"text/plain; version={i}.0.4; escaping=values"}).ok
    return ok


def _prometheus_page_age(url: str, seconds: float) -> tuple[int, int, float]:
    """Scrapes with Prometheus' Accept header every 0.5 s: (answered, tried, the oldest
    page age seen, s: how long Prometheus' view can freeze)."""
    ok, tried, oldest = 0, 0, 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        tried += 1
        with contextlib.suppress(requests.RequestException):
            r = requests.get(url, timeout=PROBE_TIMEOUT, headers={"Accept": PROMETHEUS_ACCEPT})
            ok += r.ok and time.monotonic() - started <= PROBE_TIMEOUT
            for line in r.text.splitlines():
                if line.startswith("gputrain_exporter_page_age_seconds "):
                    oldest = max(oldest, float(line.split()[1]))
        time.sleep(max(0.0, 0.5 - (time.monotonic() - started)))
    return ok, tried, oldest


def accept(seconds: float, count: int) -> None:
    """The Accept-variant run: ``count`` scrapes with distinct Accept headers from the
    attacker while Prometheus' header is probed; memory before and after."""
    proc, web, _ingest = start_daemon()
    url = f"http://127.0.0.1:{web}/metrics"
    try:
        idle = rss_mb(proc.pid)
        started = time.monotonic()
        (stormed,), (ok, n, oldest) = in_parallel(
            (lambda: (_accept_storm(url, count),), ()),
            (_prometheus_page_age, (url, seconds)))
        took = time.monotonic() - started
        print(f"gputrain-exporter  {count} Accept variants ({stormed} answered): Prometheus' "
              f"scrapes {pct(ok, n)}, oldest page age {oldest:.1f} s; RSS {idle:.0f} -> "
              f"{rss_mb(proc.pid):.0f} MB (peak {rss_mb(proc.pid, 'VmHWM'):.0f}) in "
              f"{took:.0f} s", flush=True)
    finally:
        stop(proc)
    ne, url = start_node_exporter()
    try:
        idle = rss_mb(ne.pid)
        (stormed,), (ok, n, _) = in_parallel((lambda: (_accept_storm(url, count),), ()),
                                             (_prometheus_page_age, (url, seconds)))
        print(f"node_exporter      {count} Accept variants ({stormed} answered): Prometheus' "
              f"scrapes {pct(ok, n)} (anchor); RSS {idle:.0f} -> {rss_mb(ne.pid):.0f} MB "
              f"(peak {rss_mb(ne.pid, 'VmHWM'):.0f})", flush=True)
    finally:
        stop(ne)


def _client_hello() -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    obj = ctx.wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO())
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _handshake_churn(ports: list[int], stop_at: threading.Event,
                     sources: list[str] | None = None) -> int:
    """Re-open TLS handshakes that never finish (a whole or half ClientHello, then a close)
    from the attacker (or from each of ``sources`` in turn) until ``stop_at``; returns how
    many."""
    hello, n = _client_hello(), 0
    sources = sources or [ATTACKER]
    while not stop_at.is_set():
        for port in ports:
            with contextlib.suppress(OSError), socket.socket() as s:
                s.bind((sources[n % len(sources)], 0))
                s.connect(("127.0.0.1", port))
                s.sendall(hello if n % 2 else hello[:len(hello) // 2])
            n += 1
    return n


def _https_probe(url: str, seconds: float, cert: str) -> tuple[int, int]:
    ok, tried = 0, 0
    session = requests.Session()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        tried += 1
        try:
            r = session.get(url, timeout=PROBE_TIMEOUT, verify=cert)
            ok += r.ok and time.monotonic() - started <= PROBE_TIMEOUT
        except requests.RequestException:
            session.close()
            session = requests.Session()
        time.sleep(max(0.0, 0.5 - (time.monotonic() - started)))
    return ok, tried


def tls(seconds: float, addresses: int = 0) -> None:
    """The TLS-handshake run: TLS on both ports, two attacker threads re-opening handshakes
    that never finish (from one address, or from ``addresses`` of them: past the per-address
    cap, every one starts a handshake), HTTPS scrapes probed; RSS at start, peak and after."""
    sources = [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(addresses)] or None
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cert, key = f"{tmp}/cert.pem", f"{tmp}/key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                        "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", key, "-out", cert], check=True, capture_output=True)
        tls_flags = [f"--{p}.tls-{k}-file={f}" for p in ("web", "ingest")
                     for k, f in (("cert", cert), ("key", key))]
        web, ingest = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "--gpu.backend=demo", "--demo.gpus=8",
             f"--web.listen-address=127.0.0.1:{web}",
             f"--ingest.listen-address=127.0.0.1:{ingest}", *tls_flags],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"https://127.0.0.1:{web}/metrics"
        try:
            _wait_https(url, cert)
            print(f"gputrain-exporter  "
                  f"{_tls_round(proc.pid, [web, ingest], url, cert, seconds, sources)}",
                  flush=True)
        finally:
            stop(proc)
        config = f"{tmp}/web.yml"
        with open(config, "w") as fh:
            fh.write(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
        port = free_port()
        binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        ne = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}",
                               f"--web.config.file={config}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"https://127.0.0.1:{port}/metrics"
        try:
            _wait_https(url, cert)
            print(f"node_exporter      {_tls_round(ne.pid, [port], url, cert, seconds, sources)} "
                  "(anchor, one port)", flush=True)
        finally:
            stop(ne)


def _wait_https(url: str, cert: str) -> None:
    for _ in range(100):
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, verify=cert, timeout=1).ok:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer")


def _tls_round(pid: int, ports: list[int], url: str, cert: str, seconds: float,
               sources: list[str] | None = None) -> str:
    idle = rss_mb(pid)
    stop_at = threading.Event()
    counts: list[int] = []
    churners = [threading.Thread(
        target=lambda: counts.append(_handshake_churn(ports, stop_at, sources)))
        for _ in range(2)]
    for t in churners:
        t.start()
    ok, n = _https_probe(url, seconds, cert)
    stop_at.set()
    for t in churners:
        t.join()
    peak = rss_mb(pid, "VmHWM")
    time.sleep(3)
    after = rss_mb(pid)
    time.sleep(27)
    return (f"{sum(counts)} dead handshakes: HTTPS scrapes {pct(ok, n)}; RSS idle {idle:.0f} "
            f"MB, peak {peak:.0f} MB, 3 s after {after:.0f} MB, 30 s after {rss_mb(pid):.0f} MB")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--per-port", type=int, default=200)
    p.add_argument("--longpolls", type=int, default=140)
    p.add_argument("--addresses", type=int, default=520)
    p.add_argument("--accepts", type=int, default=2000)
    p.add_argument("--scenarios", default="slowloris,longpoll,memory,addresses,accept,tls")
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; attacker {ATTACKER}, "
          f"probes from 127.0.0.1 every 0.5 s for {args.seconds:.0f} s, answered = 200 "
          f"within {PROBE_TIMEOUT:.0f} s")
    for name in args.scenarios.split(","):
        print(f"-- {name}", flush=True)
        if name == "slowloris":
            slowloris(args.seconds, args.per_port)
        elif name == "longpoll":
            longpoll(args.seconds, args.longpolls)
        elif name == "memory":
            memory(min(args.seconds, 20.0))
        elif name == "addresses":
            addresses(args.seconds, args.addresses)
        elif name == "accept":
            accept(args.seconds, args.accepts)
        elif name == "tls":
            tls(args.seconds)
        elif name == "tls-addresses":
            tls(args.seconds, args.addresses)


if __name__ == "__main__":
    main()
