"""What the daemon's own view costs: /api/v1/status and the status page per request, the
history per sampler cycle and in memory, and whether a viewer slows the scrape, beside the
anchors measured in the same run (a /metrics scrape and /healthz of the same daemon).

    python bench/bench_status.py [--requests 40] [--ranks 0,64] [--in-process]

Requests are spaced more than one sampler interval apart, as a page refreshing every 2 s and
`top` every second are, so each one meets a newer history and the document is built anew (the
worst case: back-to-back requests would be answered from the cache). Ranks push every 5 s
from a separate process (bench_scrape.py's pushers: 15 buckets, 4 phases, one GPU each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_scrape import demo_daemon, payload, pct, scrape  # noqa: E402

from exporter.heuristics.rules import DEFAULTS  # noqa: E402
from exporter.reading.collectors import host_collectors  # noqa: E402
from exporter.reading.gpu_backends import DemoBackend  # noqa: E402
from exporter.reading.sampler import Sampler  # noqa: E402
from exporter.serving.attribution import Attribution  # noqa: E402
from exporter.serving.history import History  # noqa: E402
from exporter.serving.ingest import IngestStore  # noqa: E402
from exporter.serving.status import StatusView  # noqa: E402


def timed_get(session: requests.Session, url: str) -> float:
    t0 = time.perf_counter()
    r = session.get(url, timeout=30)
    r.raise_for_status()
    return time.perf_counter() - t0


def over_http(ranks: int, n: int, spacing: float) -> dict[str, list[float]]:
    """Per kind of request, its latencies against one demo daemon with ``ranks`` pushing;
    the scrape is also timed while a viewer reads the status every 0.25 s."""
    out: dict[str, list[float]] = {k: [] for k in (
        "status", "page", "metrics", "healthz", "metrics_with_viewer")}
    with demo_daemon(ranks, 4, "status") as (_, base):
        s = requests.Session()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every rank is in the history
            doc = s.get(base + "/api/v1/status", timeout=10).json()
            if sum(len(r["ranks"]) for r in doc["runs"]) >= ranks:
                break
            time.sleep(0.5)
        for _ in range(n):
            time.sleep(spacing)
            out["status"].append(timed_get(s, base + "/api/v1/status"))
            out["page"].append(timed_get(s, base + "/"))
            out["healthz"].append(timed_get(s, base + "/healthz"))
            time.sleep(spacing)
            out["metrics"].append(scrape(s, base + "/metrics")[0])
        stop = threading.Event()

        def viewer() -> None:
            v = requests.Session()
            while not stop.wait(0.25):
                v.get(base + "/api/v1/status", timeout=10)

        t = threading.Thread(target=viewer, daemon=True)
        t.start()
        for _ in range(n):
            time.sleep(spacing)
            out["metrics_with_viewer"].append(scrape(s, base + "/metrics")[0])
        stop.set()
        t.join()
    return out


def in_process(ranks: int, cycles: int) -> dict[str, float]:
    """The history's cost per sampler cycle, a document build, and the history's memory once
    its window is full, with ``ranks`` live and pushing every 5 s (in-process, demo GPUs)."""
    now = [time.time()]  # the pushes carry wall-clock timestamps: the clock they are checked by
    sampler = Sampler(DemoBackend(8), host_collectors(), interval=1.0)
    store = IngestStore(max_series=max(ranks, 1), clock=lambda: now[0],
                        wall_clock=lambda: now[0])
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    history = History(300.0)
    views = Attribution()
    view = StatusView(history, DEFAULTS["thresholds"], backend="demo")
    observe, detect = [], [0.0]
    find = history._detect

    def timed_detect(*args) -> None:  # the regime detector's share of observe()
        t0 = time.perf_counter()
        find(*args)
        detect[0] += time.perf_counter() - t0

    history._detect = timed_detect
    detected = []
    for cycle in range(cycles):
        now[0] += 1.0
        for r in range(ranks):
            if (r + cycle) % 5 == 0:  # each rank pushes every 5 s
                store.push(json.dumps(payload(r, 10 * (cycle + 1), 4)).encode())
        snap = replace(sampler.run_once(), timestamp=now[0])
        detect[0] = 0.0
        t0 = time.perf_counter()
        history.observe(views.update(snap, store.states()))
        observe.append(time.perf_counter() - t0)
        detected.append(detect[0])
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    memory = sum(s.size_diff for s in after.compare_to(before, "filename")
                 if s.traceback[0].filename.endswith(("history.py", "training.py", "expr.py")))
    builds = []
    for _ in range(20):
        history.version += 1  # as a new cycle would: the next request builds anew
        t0 = time.perf_counter()
        view.json_bytes()
        builds.append(time.perf_counter() - t0)
    sampler.stop()
    return {"observe_ms": pct(observe[-60:], 0.5) * 1e3,
            "observe_mean_ms": sum(observe[-60:]) / 60 * 1e3,
            "detect_mean_ms": sum(detected[-60:]) / 60 * 1e3,
            "detect_max_ms": max(detected[-60:]) * 1e3,
            "build_ms": pct(builds, 0.5) * 1e3,
            "bytes": len(view.json_bytes()), "memory_mb": memory / 1e6,
            "points": history.size()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--ranks", default="0,64")
    ap.add_argument("--spacing", type=float, default=1.1)
    ap.add_argument("--in-process", action="store_true",
                    help="only the in-process table (the history's costs), no daemon")
    ns = ap.parse_args()
    levels = [int(x) for x in ns.ranks.split(",")]
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, 8 demo GPUs, "
          f"{ns.requests} requests of each kind {ns.spacing} s apart")
    print(f"{'ranks':>5}  {'request':<32} {'median ms':>9} {'p99 ms':>8}  ratio to /metrics")
    for ranks in [] if ns.in_process else levels:
        got = over_http(ranks, ns.requests, ns.spacing)
        anchor = pct(got["metrics"], 0.5)
        for kind, label in (("metrics", "/metrics scrape (anchor)"),
                            ("healthz", "/healthz (anchor)"),
                            ("status", "/api/v1/status (a viewer's)"),
                            ("page", "/ (the page's HTML)"),
                            ("metrics_with_viewer", "/metrics with a viewer at 4/s")):
            v = got[kind]
            print(f"{ranks:>5}  {label:<32} {pct(v, 0.5) * 1e3:>9.2f} "
                  f"{pct(v, 0.99) * 1e3:>8.2f}  {pct(v, 0.5) / anchor:.2f}")
    print()
    print(f"{'ranks':>5}  {'observe/cycle ms':>16} {'build ms':>9} {'JSON bytes':>10} "
          f"{'history MB':>10} {'points':>7}")
    costs = {}
    for ranks in sorted({*levels, 1024}):
        r = costs[ranks] = in_process(ranks, 330)
        print(f"{ranks:>5}  {r['observe_ms']:>16.3f} {r['build_ms']:>9.2f} {r['bytes']:>10} "
              f"{r['memory_mb']:>10.2f} {r['points']:>7}")
    # the regime detector runs inside observe(), on a rank's points as one is added (every
    # 10 s): its mean and worst cost per cycle beside observe()'s mean (the anchor)
    print()
    print(f"{'ranks':>5}  {'observe mean ms':>15} {'detector mean ms':>16} "
          f"{'detector max ms':>15}")
    for ranks, r in costs.items():
        print(f"{ranks:>5}  {r['observe_mean_ms']:>15.3f} {r['detect_mean_ms']:>16.3f} "
              f"{r['detect_max_ms']:>15.3f}")


if __name__ == "__main__":
    main()
