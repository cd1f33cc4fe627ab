"""How soon a hang is said, against the rank's step time (10 ms to 60 s steps), beside the
anchor it races: NCCL's watchdog (a 480 s heartbeat, a 600 s collective timeout).

    python bench/bench_hang.py [--steps 0.01,0.1,1,10,60] [--repeats 3]

For each step time a rank pushes to a real demo daemon as a client would: its totals at that
pace, then its step in progress just under the hung limit (the catalogue's, at the default
thresholds), and nothing more. The daemon ages the open step by its own clock; measured is the
time from that push until ``/api/v1/status`` says hung and until the daemon has asked the rank
for its stacks (the capture's instruction in a push answer). The detection latency is the
limit plus that reaction plus one push interval (the client's 5 s) on the daemon's surfaces;
the alert adds a scrape, the liveness recording and an evaluation (the shipped 15 s, 10 s and
15 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import NO_HOST, free_port  # noqa: E402

from exporter.heuristics.catalogue import defaults, hung_limit  # noqa: E402
from exporter.heuristics.readings import RankReport  # noqa: E402
from exporter.protocol import DEFAULT_PUSH_INTERVAL_SECONDS, PUSH_PATH  # noqa: E402

WATCHDOG_HEARTBEAT, WATCHDOG_TIMEOUT = 480.0, 600.0
SCRAPE, LIVENESS, EVALUATION = 15.0, 10.0, 15.0  # the shipped intervals
LEAD = 3.0  # seconds under the limit the last push leaves the open step


def reaction(base: str, ingest: str, step_s: float, n: int) -> tuple[float, float, float]:
    """(limit, seconds to the hung verdict, seconds to the capture's instruction)."""
    run = f"pace-{n}-{step_s:g}".replace(".", "_")
    steps = max(10, int(600 / step_s))
    rep = RankReport("", "", run, "0", typical_step_seconds=step_s)
    limit = hung_limit(rep, defaults())
    body = {"version": 1, "run": run, "rank": "0", "run_id": run, "steps": steps,
            "step_seconds": steps * step_s, "data_wait_seconds": 0.0, "samples": steps * 8.0,
            "capabilities": ["stacks"], "step_open_seconds": limit - LEAD}
    s = requests.Session()
    t0 = time.monotonic()
    s.post(ingest + PUSH_PATH, json=body, timeout=10).raise_for_status()
    hung = instructed = None
    while time.monotonic() - t0 < 60 and (hung is None or instructed is None):
        if hung is None:
            doc = s.get(base + "/api/v1/status", timeout=10).json()
            card = next((r for r in doc["runs"] if r["run"] == run), None)
            if card and card["status"] == "hung":
                hung = time.monotonic() - t0
        if instructed is None and hung is not None:
            answer = s.post(ingest + PUSH_PATH, json={**body, "step_open_seconds": limit},
                            timeout=10).json()
            if any(i.get("type") == "stacks" for i in answer.get("instructions", [])):
                instructed = time.monotonic() - t0
        time.sleep(0.05)
    if hung is None or instructed is None:
        raise SystemExit(f"step {step_s} s: the daemon did not say hung within 60 s")
    return limit, hung - LEAD, instructed - LEAD


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="0.01,0.1,1,10,60")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    port, ingest_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--gpu.backend=demo", "--demo.gpus=1", *NO_HOST,
         f"--web.listen-address=127.0.0.1:{port}",
         f"--ingest.listen-address=127.0.0.1:{ingest_port}"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base, ingest = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ingest_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(base + "/healthz", timeout=1).raise_for_status()
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        rows = []
        for step_s in (float(x) for x in a.steps.split(",")):
            runs = [reaction(base, ingest, step_s, i) for i in range(a.repeats)]
            limit = runs[0][0]
            hung = statistics.median(r[1] for r in runs)
            captured = statistics.median(r[2] for r in runs)
            surfaces = limit + DEFAULT_PUSH_INTERVAL_SECONDS + hung
            alert = limit + DEFAULT_PUSH_INTERVAL_SECONDS + SCRAPE + LIVENESS + EVALUATION
            rows.append({"step_seconds": step_s, "limit_seconds": limit,
                         "daemon_reaction_seconds": round(hung, 2),
                         "capture_asked_seconds": round(captured, 2),
                         "surfaces_seconds": round(surfaces, 1),
                         "alert_worst_seconds": round(alert, 1),
                         "alert_vs_heartbeat": round(alert / WATCHDOG_HEARTBEAT, 2),
                         "alert_vs_timeout": round(alert / WATCHDOG_TIMEOUT, 2)})
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(f"{'step':>8} {'limit':>7} {'reaction':>9} {'capture':>8} {'surfaces':>9} "
          f"{'alert<=':>8} {'/480 s':>7} {'/600 s':>7}")
    for r in rows:
        print(f"{r['step_seconds']:>7g}s {r['limit_seconds']:>6.0f}s "
              f"{r['daemon_reaction_seconds']:>8.2f}s {r['capture_asked_seconds']:>7.2f}s "
              f"{r['surfaces_seconds']:>8.1f}s {r['alert_worst_seconds']:>7.1f}s "
              f"{r['alert_vs_heartbeat']:>7.2f} {r['alert_vs_timeout']:>7.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
