"""Scrape latency of the exporter (8 demo GPUs + host) and the sampler's CPU per cycle, with
node_exporter scraped on the same host in the same run as the anchor.

    python bench/bench_scrape.py [--scrapes 300]

Needs Debian's prometheus-node-exporter (scripts/test.sh installs it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from exporter.collectors import host_collectors  # noqa: E402
from exporter.gpu_backends import DemoBackend  # noqa: E402
from exporter.sampler import Sampler  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str) -> None:
    for _ in range(100):
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def scrape_stats(url: str, n: int, session: requests.Session) -> dict:
    headers = {"Accept-Encoding": "gzip", "Accept": "text/plain;version=0.0.4"}
    times, size, series = [], 0, 0
    for _ in range(n):
        t0 = time.perf_counter()
        r = session.get(url, headers=headers, timeout=10)
        times.append(time.perf_counter() - t0)
        size = len(r.content)
        series = sum(1 for ln in r.text.splitlines() if ln and not ln.startswith("#"))
    times.sort()
    return {"median_ms": statistics.median(times) * 1e3,
            "p99_ms": times[int(len(times) * 0.99) - 1] * 1e3, "series": series, "bytes": size}


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scrapes", type=int, default=300)
    p.add_argument("--cycles", type=int, default=200)
    args = p.parse_args()
    node_exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if not node_exporter:
        raise SystemExit("install prometheus-node-exporter (Debian) for the anchor")
    gp, np_ = free_port(), free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "exporter", "--gpu.backend=demo",
                          f"--web.listen-address=127.0.0.1:{gp}",
                          f"--ingest.listen-address=127.0.0.1:{free_port()}"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([node_exporter, f"--web.listen-address=127.0.0.1:{np_}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    try:
        ours, anchor = f"http://127.0.0.1:{gp}/metrics", f"http://127.0.0.1:{np_}/metrics"
        wait_ready(ours)
        wait_ready(anchor)
        time.sleep(2)
        s = requests.Session()
        rows = {"gputrain-exporter (8 demo GPUs + host)": [], "node_exporter (anchor)": []}
        for _ in range(3):  # interleaved rounds
            rows["gputrain-exporter (8 demo GPUs + host)"].append(
                scrape_stats(ours, args.scrapes // 3, s))
            rows["node_exporter (anchor)"].append(scrape_stats(anchor, args.scrapes // 3, s))
        idle_cpu0 = _proc_cpu(procs[0].pid)
        time.sleep(10)
        idle_cpu = (_proc_cpu(procs[0].pid) - idle_cpu0) / 10
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    cpu_ms, wall_ms = sampler_cpu_per_cycle(args.cycles)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.scrapes} scrapes "
          "each (gzip, like Prometheus), interleaved")
    print(f"{'target':42} {'median ms':>10} {'p99 ms':>8} {'series':>7} {'bytes':>9}")
    med = {}
    for name, stats in rows.items():
        m = statistics.median(x["median_ms"] for x in stats)
        p99 = max(x["p99_ms"] for x in stats)
        med[name] = m
        print(f"{name:42} {m:10.2f} {p99:8.2f} {stats[-1]['series']:7d} "
              f"{stats[-1]['bytes']:9d}")
    a, b = med.values()
    print(f"scrape median ratio gputrain/node_exporter: {a / b:.2f}")
    print(f"sampler cycle (8 demo GPUs + host, in-process): {cpu_ms:.2f} ms CPU, "
          f"{wall_ms:.2f} ms wall")
    print(f"exporter process CPU while idle at 1 s interval: {idle_cpu * 100:.2f} % of one core")


def _proc_cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


if __name__ == "__main__":
    main()
