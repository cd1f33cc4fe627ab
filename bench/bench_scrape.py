"""Scrape latency as Prometheus sees it, at 0, 64, 256 and 1,024 ranks pushing, beside the
anchors measured in the same run: prometheus_client's own ``generate_latest`` on the same
series (what a scrape cost when it rendered), and node_exporter scraped on the same host.

    python bench/bench_scrape.py [--scrapes 60] [--ranks 0,64,256,1024]
    python bench/bench_scrape.py --nvml-only   # the NVML backend's sampler cycles only

Each scrape is spaced more than one sampler interval after the last, as Prometheus' 15-60 s
scrapes are, so every scrape meets a new snapshot (back-to-back scrapes would hide the
render in a cache). Ranks push every 5 s from a separate process, like training processes.
Needs Debian's prometheus-node-exporter (scripts/test.sh installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
import threadcpu  # noqa: E402

from exporter.reading.collectors import host_collectors  # noqa: E402
from exporter.reading.gpu_backends import DemoBackend  # noqa: E402
from exporter.reading.sampler import Sampler  # noqa: E402

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PHASES = ("dataloader_start", "evaluation", "checkpoint", "callbacks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str) -> None:
    for _ in range(200):
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def payload(rank: int, steps: int, phases: int) -> dict:
    """A rank as the client pushes it: 15 buckets, its phases, process figures, one GPU."""
    bounds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
              30.0, 60.0]
    names = [*PHASES, *(f"hook_{i}" for i in range(phases - len(PHASES)))][:phases]
    return {"version": 1, "run": "llama3-8b-pretrain", "rank": str(rank), "run_id": "bench",
            "steps": steps, "step_seconds": 0.4 * steps, "data_wait_seconds": 0.05 * steps,
            "samples": 32.0 * steps, "step_buckets": bounds,
            "step_counts": [0] * 7 + [steps] * 8, "phases": {n: 0.01 * steps for n in names},
            "last_step_timestamp": time.time(),
            "process": {"cpu_seconds": 0.5 * steps, "resident_memory_bytes": 6.2e9,
                        "read_bytes": 1e6 * steps, "pid": 100000 + rank},
            "gpus": [str(rank % 8)]}


def pushers(url: str, ranks: int, phases: int, interval: float, stop_file: str) -> None:
    """Run in a child process: every rank pushes every ``interval`` seconds, spread evenly."""
    if ranks == 0:
        return
    workers = min(16, ranks)

    def work(w: int) -> None:
        session = requests.Session()
        mine = list(range(w, ranks, workers))
        step = 0
        while not os.path.exists(stop_file):
            step += 10
            for r in mine:
                started = time.monotonic()
                with contextlib.suppress(requests.RequestException):
                    session.post(url, json=payload(r, step, phases), timeout=5)
                time.sleep(max(0.0, interval / len(mine) - (time.monotonic() - started)))

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    while not os.path.exists(stop_file):
        time.sleep(0.2)


def scrape(session: requests.Session, url: str) -> tuple[float, int, int, int]:
    """One scrape as Prometheus makes it: (seconds, gzipped bytes, bytes, series)."""
    t0 = time.perf_counter()
    r = session.get(url, headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"},
                    timeout=30, stream=True)
    raw = r.raw.read(decode_content=False)
    took = time.perf_counter() - t0
    body = gzip.decompress(raw) if r.headers.get("Content-Encoding") == "gzip" else raw
    series = sum(1 for ln in body.splitlines() if ln and not ln.startswith(b"#"))
    return took, len(raw), len(body), series


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def render_anchor(ranks: int, phases: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds to render the same page in-process: through prometheus_client's
    generate_latest (the old scrape path), and the page thread's build (a push since the
    last build, so the pushed rank's lines are written anew)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest

    from exporter.serving.exposition import Exposition
    from exporter.serving.ingest import IngestStore

    sampler = Sampler(DemoBackend(8), host_collectors(), interval=1.0)
    sampler.run_once()
    store = IngestStore(max_series=max(ranks, 1))
    for r in range(ranks):
        store.push(json.dumps(payload(r, 10, phases)).encode())
    app = Exposition(sampler, store)
    registry = CollectorRegistry(auto_describe=False)
    for c in app.collectors:  # the same collectors, training included
        registry.register(c)
    registry.register(app.training)
    old, new = [], []
    app.render(PROMETHEUS_ACCEPT, gzip_ok=True)
    for i in range(repeats):
        sampler.run_once()
        t0 = time.perf_counter()
        generate_latest(registry)
        old.append(time.perf_counter() - t0)
        if ranks:
            store.push(json.dumps(payload(i % ranks, 20 + i, phases)).encode())
        t0 = time.perf_counter()
        app.render(PROMETHEUS_ACCEPT, gzip_ok=True)
        new.append(time.perf_counter() - t0)
    sampler.stop()
    return old, new


def daemon_tag(tag: str, ranks: int) -> str:
    return f"{tag}-{os.getpid()}-{ranks}"


def cpu_file(tag: str) -> str:
    """Where a daemon started by :func:`demo_daemon` writes its CPU by part (threadcpu.py)."""
    return f"/tmp/bench-cpu-{tag}.json"


@contextlib.contextmanager
def demo_daemon(ranks: int, phases: int = 4, tag: str = "scrape"):
    """A demo daemon (8 GPUs) with ``ranks`` pushing every 5 s from a separate process;
    yields (the daemon's process, its web address). Stops both on exit. The daemon writes its
    CPU by part to ``cpu_file(daemon_tag(tag, ranks))``."""
    gp, ip = free_port(), free_port()
    stop_file = f"/tmp/bench-{tag}-stop-{os.getpid()}-{ranks}"
    daemon = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "threadcpu.py"), cpu_file(daemon_tag(tag, ranks)),
         "--gpu.backend=demo",
         f"--web.listen-address=127.0.0.1:{gp}", f"--ingest.listen-address=127.0.0.1:{ip}",
         f"--ingest.max-series={max(ranks, 1)}"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    push = None
    try:
        base = f"http://127.0.0.1:{gp}"
        wait_ready(base + "/healthz")
        push = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--push",
             f"http://127.0.0.1:{ip}/api/v1/push", str(ranks), str(phases), stop_file],
            cwd=ROOT)
        yield daemon, base
    finally:
        Path(stop_file).touch()
        if push is not None:
            push.wait(timeout=30)
        Path(stop_file).unlink(missing_ok=True)
        daemon.terminate()
        daemon.wait()


def measure(ranks: int, phases: int, scrapes: int, spacing: float) -> dict:
    with demo_daemon(ranks, phases) as (_, base):
        url = base + "/metrics"
        session = requests.Session()
        want = 0 if ranks == 0 else ranks
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every rank has pushed once
            text = session.get(url, timeout=10).text
            held = [ln for ln in text.splitlines() if ln.startswith("gputrain_ingest_series ")]
            if held and float(held[0].split()[1]) >= want:
                break
            time.sleep(0.5)
        parts = cpu_file(daemon_tag("scrape", ranks))
        cpu0, wall0 = threadcpu.read(parts), time.monotonic()
        rows = []
        for _ in range(scrapes):
            time.sleep(spacing)
            rows.append(scrape(session, url))
        time.sleep(0.3)  # the file is rewritten every 0.2 s
        cpu1, wall = threadcpu.read(parts), time.monotonic() - wall0 - 0.3
    times = [r[0] for r in rows]
    share = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu1}
    return {"p50": pct(times, 0.5), "p99": pct(times, 0.99), "gz": rows[-1][1],
            "bytes": rows[-1][2], "series": rows[-1][3], "cpu": share["total"],
            "serving": share["serving"], "page": share["page"],
            "gc_full": cpu1["gc_full"] - cpu0["gc_full"], "gc_max": cpu1["gc_max_seconds"]}


def start_node_exporter() -> tuple[subprocess.Popen, str]:
    """Debian's node_exporter, the anchor, on a free port: its process and /metrics URL, once
    it answers."""
    binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if not binary:
        raise SystemExit("install prometheus-node-exporter (Debian) for the anchor")
    port = free_port()
    proc = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_ready(url)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def node_exporter_row(scrapes: int, spacing: float) -> dict:
    proc, url = start_node_exporter()
    try:
        s = requests.Session()
        rows = []
        for _ in range(scrapes):
            time.sleep(spacing)
            rows.append(scrape(s, url))
    finally:
        proc.terminate()
        proc.wait()
    times = [r[0] for r in rows]
    return {"p50": pct(times, 0.5), "p99": pct(times, 0.99), "gz": rows[-1][1],
            "bytes": rows[-1][2], "series": rows[-1][3]}


def sampler_cpu_per_cycle(cycles: int) -> tuple[float, float]:
    sampler = Sampler(DemoBackend(8), host_collectors(), interval=1.0)
    sampler.run_once()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(cycles):
        sampler.run_once()
    cpu = (time.process_time() - cpu0) / cycles
    wall = (time.perf_counter() - wall0) / cycles
    sampler.stop()
    return cpu * 1e3, wall * 1e3


def nvml_cycle_ms(cycles: int, health: bool) -> float:
    """CPU ms per sampler cycle through the real NVML backend on 8 scripted H100s (the real
    nvidia-ml-py binding over the test suite's fake driver, so no GPU is needed): with NVLink,
    ECC and row remapping answered
    (``health``), or all three NOT_SUPPORTED and so asked once, as before they existed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_nvml import FakeDriver, FakeGpu

    from exporter.reading.gpu_backends import NvmlBackend
    from exporter.reading.nvml import Nvml

    extra = ({"nvlink_present": 18, "remapped_rows": (0, 0, 0, 0)} if health else
             {"nvlink_present": 0, "ecc_volatile": None, "remapped_rows": None})
    gpus = [FakeGpu(f"GPU-{i}", util_rate=50, gpm={"sm_util": 50.0, "tensor_util": 10.0},
                    **extra) for i in range(8)]
    sampler = Sampler(NvmlBackend(Nvml(FakeDriver(gpus).binding)), None, interval=1.0,
                      collectors={"gpu"})
    for _ in range(3):
        sampler.run_once()
    cpu0 = time.process_time()
    for _ in range(cycles):
        sampler.run_once()
    sampler.stop()
    return (time.process_time() - cpu0) / cycles * 1e3


def nvml_process_cycle_ms(cycles: int, per_process: bool) -> float:
    """CPU ms per sampler cycle through the real NVML backend on 8 scripted H100s (GPM, NVLink,
    memory health answered) with 16 compute processes each, every process with a new
    utilisation sample each cycle: with per-process utilisation read, or the anchor, the same
    GPUs on a driver without either per-process call (asked once, as before they were read)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_nvml import FakeDriver, FakeGpu

    from exporter.reading.gpu_backends import NvmlBackend
    from exporter.reading.nvml import Nvml

    gpus = [FakeGpu(f"GPU-{i}", util_rate=50, gpm={"sm_util": 50.0, "tensor_util": 10.0},
                    nvlink_present=18, remapped_rows=(0, 0, 0, 0),
                    processes=[(100_000 + 16 * i + p, 2**30) for p in range(16)])
            for i in range(8)]
    missing = () if per_process else ("nvmlDeviceGetProcessesUtilizationInfo",
                                      "nvmlDeviceGetProcessUtilization")
    sampler = Sampler(NvmlBackend(Nvml(FakeDriver(gpus, missing=missing).binding)), None,
                      interval=1.0, collectors={"gpu"})

    def new_samples(n: int) -> None:  # the driver's samples of the last period (us)
        for g in gpus:
            g.process_samples = [(1_000_000 * (n + 1) + k, pid, 40, 20)
                                 for k, (pid, _) in enumerate(g.processes)]

    for n in range(3):
        new_samples(n)
        sampler.run_once()
    cpu = 0.0
    for n in range(3, 3 + cycles):
        new_samples(n)
        t0 = time.process_time()
        sampler.run_once()
        cpu += time.process_time() - t0
    sampler.stop()
    return cpu / cycles * 1e3


def print_nvml_process_cycles(cycles: int, repeats: int = 3) -> None:
    """The two, alternately ``repeats`` times; the medians and their ratio."""
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for per_process in (False, True):
            runs[per_process].append(nvml_process_cycle_ms(cycles, per_process))
    without, with_ = (sorted(runs[k])[len(runs[k]) // 2] for k in (False, True))
    print(f"sampler cycle through the NVML backend, 8 scripted H100s x 16 processes: "
          f"{with_:.2f} ms CPU with per-process utilisation, {without:.2f} ms without it "
          f"(anchor); ratio {with_ / without:.2f} (medians of {repeats} runs of {cycles} "
          f"cycles each: {', '.join(f'{v:.2f}' for v in runs[True])} with, "
          f"{', '.join(f'{v:.2f}' for v in runs[False])} without)")


def main() -> None:
    if sys.argv[1:2] == ["--push"]:
        url, ranks, phases, stop_file = sys.argv[2:6]
        pushers(url, int(ranks), int(phases), 5.0, stop_file)
        return
    p = argparse.ArgumentParser()
    p.add_argument("--scrapes", type=int, default=60)
    p.add_argument("--spacing", type=float, default=1.05,
                   help="seconds between scrapes: more than the 1 s sampler interval")
    p.add_argument("--ranks", default="0,64,256,1024")
    p.add_argument("--phases", type=int, default=4, help="phases per rank (16 at most)")
    p.add_argument("--renders", type=int, default=20)
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--http-only", action="store_true",
                   help="only the scrapes over HTTP, not the in-process render and sampler")
    p.add_argument("--nvml-only", action="store_true",
                   help="only the NVML backend's sampler cycles (no daemon, no scrape)")
    args = p.parse_args()
    if args.nvml_only:
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
        before, after = nvml_cycle_ms(args.cycles, False), nvml_cycle_ms(args.cycles, True)
        print(f"sampler cycle through the NVML backend, 8 scripted H100s: {after:.2f} ms CPU "
              f"with NVLink, ECC and remapping answered, {before:.2f} ms without them")
        print_nvml_process_cycles(args.cycles)
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, 8 demo GPUs + host, "
          f"{args.scrapes} scrapes {args.spacing} s apart (OpenMetrics + gzip, Prometheus' "
          f"headers), ranks push every 5 s with {args.phases} phases each")
    print(f"{'target':30} {'p50 ms':>8} {'p99 ms':>8} {'series':>7} {'bytes':>10} "
          f"{'gzip':>9} {'CPU %':>6} {'HTTP %':>6} {'page %':>6} {'full GCs':>8} "
          f"{'GC max ms':>9}")
    rows = {}
    for n in (int(x) for x in args.ranks.split(",")):
        r = rows[n] = measure(n, args.phases, args.scrapes, args.spacing)
        print(f"{'gputrain, ' + str(n) + ' ranks':30} {r['p50'] * 1e3:8.2f} "
              f"{r['p99'] * 1e3:8.2f} {r['series']:7d} {r['bytes']:10d} {r['gz']:9d} "
              f"{r['cpu'] * 100:6.1f} {r['serving'] * 100:6.1f} {r['page'] * 100:6.1f} "
              f"{r['gc_full']:8.0f} {r['gc_max'] * 1e3:9.1f}", flush=True)
    ne = node_exporter_row(args.scrapes, args.spacing)
    print(f"{'node_exporter (anchor)':30} {ne['p50'] * 1e3:8.2f} {ne['p99'] * 1e3:8.2f} "
          f"{ne['series']:7d} {ne['bytes']:10d} {ne['gz']:9d}")
    base = rows.get(0)
    if base:
        for n, r in rows.items():
            if n:
                print(f"p99 at {n} ranks / p99 at 0 ranks: {r['p99'] / base['p99']:.2f}")
    for n, r in rows.items():
        print(f"p50 at {n} ranks / node_exporter's p50: {r['p50'] / ne['p50']:.2f}")
    if args.http_only:
        return
    print("\nin-process render of the same page (ms), the anchor being prometheus_client's "
          "generate_latest:")
    print(f"{'ranks':>6} {'generate_latest p50':>20} {'p99':>8} {'page build p50':>15} "
          f"{'p99':>8} {'ratio':>6}")
    for n in rows:
        old, new = render_anchor(n, args.phases, args.renders)
        print(f"{n:6d} {pct(old, .5) * 1e3:20.2f} {pct(old, .99) * 1e3:8.2f} "
              f"{pct(new, .5) * 1e3:15.2f} {pct(new, .99) * 1e3:8.2f} "
              f"{pct(new, .5) / pct(old, .5):6.2f}", flush=True)
    cpu_ms, wall_ms = sampler_cpu_per_cycle(args.cycles)
    print(f"\nsampler cycle (8 demo GPUs + host, in-process): {cpu_ms:.2f} ms CPU, "
          f"{wall_ms:.2f} ms wall")
    before, after = nvml_cycle_ms(args.cycles, False), nvml_cycle_ms(args.cycles, True)
    print(f"sampler cycle through the NVML backend, 8 scripted H100s: {after:.2f} ms CPU with "
          f"NVLink, ECC and remapping answered, {before:.2f} ms without them (anchor); "
          f"ratio {after / before:.2f}")
    print_nvml_process_cycles(args.cycles)


if __name__ == "__main__":
    main()
