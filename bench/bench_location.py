"""What saying where a hung rank is costs the daemon per py-spy dump, beside the anchor in the
same run: ``json.loads`` of the same dump (what the daemon pays anyway to read the push that
carries it).

    python bench/bench_location.py [--n 2000]

Per capture: ``classify_dump`` of the dump as the daemon holds it (the client's parse, as the
tests read the fixtures), cold (the per-frame match cache emptied first: a dump of code never
seen) and warm (the same functions seen before: the other ranks of the run), then
``culprit_line`` over the run's ranks. The captures are the recorded fixtures
(tests/data/stacks/, real py-spy dumps) and a synthetic worst case: 32 threads of 30 frames,
the main thread last, every frame a distinct function of the program's own that no rule
matches (each is tried against every row), judged in a run of 64 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_signals import per_call  # noqa: E402  microseconds per call, best of three

from exporter.client.stacks import parse_dump  # noqa: E402
from exporter.heuristics import location  # noqa: E402

STACKS = ROOT / "tests" / "data" / "stacks"


Run = list[tuple[str, str, location.Location]]


def fixtures() -> list[tuple[str, str, list[dict], Run]]:
    """(name, rank, processes as held, the run's other ranks) per recorded capture."""
    held = {}
    for path in sorted(STACKS.glob("*.json")):
        doc = json.loads(path.read_text())
        held[path.stem] = parse_dump({int(p): raw for p, raw in doc["dumps"].items()},
                                     doc["main_pid"])
    out = []
    for name, processes in held.items():
        scenario, rank, mode = name.rsplit("-", 2)
        peers = [(r.removeprefix("rank"), "node", location.classify_dump(held[n]))
                 for n in held for r in [n.rsplit("-", 2)[1]]
                 if n.startswith(scenario + "-") and n.endswith(mode) and n != name]
        out.append((name, rank.removeprefix("rank"), processes, peers))
    return out


def synthetic() -> tuple[str, str, list[dict], Run]:
    threads = [{"name": "MainThread" if t == 31 else f"Thread-{t}", "tid": t, "active": False,
                "gil": False, "role": "main", "where": 0,
                "frames": [{"function": f"Step{t}.stage_{i}", "file": f"app/part{i}.py",
                            "line": 10 + i} for i in range(30)]} for t in range(32)]
    peers = [(str(r), f"node{r // 8}", location.Location("collective", "all_reduce",
                                                         collective="all_reduce"))
             for r in range(1, 64)]
    return "synthetic 32 threads x 30 frames", "0", [{"pid": 1, "role": "main",
                                                        "threads": threads}], peers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    n = ap.parse_args().n
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}; "
          f"microseconds per capture, best of three runs of {n}")
    print(f"{'capture':36} {'frames':>6} {'json.loads':>10} {'cold':>8} {'warm':>8} "
          f"{'line':>7} {'cold+line':>10} {'x anchor':>9}")
    for name, rank, processes, peers in [*fixtures(), synthetic()]:
        text = json.dumps(processes)
        anchor = per_call(lambda text=text: json.loads(text), n)
        found = location.classify_dump(processes)

        def cold(processes=processes) -> None:
            location._frame.cache_clear()
            location.classify_dump(processes)

        cold_us = per_call(cold, n)
        warm_us = per_call(lambda processes=processes: location.classify_dump(processes), n)
        ranks = [(rank, "node", found), *peers]
        line_us = per_call(lambda ranks=ranks: location.culprit_line(ranks), n)
        frames = max(len(t["frames"]) for p in processes for t in p["threads"])
        print(f"{name:36} {frames:6} {anchor:10.1f} {cold_us:8.1f} {warm_us:8.1f} "
              f"{line_us:7.1f} {cold_us + line_us:10.1f} {(cold_us + line_us) / anchor:8.2f}x")


if __name__ == "__main__":
    main()
