"""What ``--ingest.state-file`` costs the sampler's thread, against a scrape in the same run.

    python bench/bench_state_file.py [--ranks 8,64,1024]

An ingest holding N ranks (each pushed as a real client pushes: a 16-bucket histogram, three
phases, its process's figures, one GPU) is written to a state file (``StateFile.save``: the
document, JSON, an fsync'd write and a rename) and read back into a fresh ingest
(``StateFile.load``: every row checked as a push is); the anchor is one render of the same
ranks' ``/metrics`` lines (``TrainingCollector.render``: what a scrape pays). Prints
milliseconds per call (best of five), the file's bytes, and each cost over the anchor's.
The daemon writes the file on the cycle after a rank ends and at most every 30 s otherwise,
and reads it once at start.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.client import DEFAULT_BUCKETS
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.ingest import IngestStore
from exporter.serving.state_file import StateFile
from exporter.serving.training import TrainingCollector


def store_of(ranks: int) -> IngestStore:
    store = IngestStore(max_series=max(1024, ranks), proc="/nonexistent")
    bounds = list(DEFAULT_BUCKETS)
    for r in range(ranks):
        counts = [min(1000, 60 * (i + 1)) for i in range(len(bounds))]
        store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": f"run-{r // 8}", "rank": str(r % 8),
            "run_id": f"id{r}", "steps": 1000, "step_seconds": 500.0,
            "data_wait_seconds": 50.0, "samples": 32000.0, "elapsed_seconds": 520.0,
            "step_buckets": bounds, "step_counts": counts,
            "phases": {"checkpoint": 12.5, "evaluation": 30.0, "dataloader_start": 2.0},
            "process": {"cpu_seconds": 800.0, "resident_memory_bytes": 3e9, "pid": 1000 + r},
            "gpus": [str(r % 8)], "last_step_timestamp": time.time()}).encode())
    return store


def best_ms(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="8,64,1024")
    counts = [int(x) for x in ap.parse_args().ranks.split(",")]
    print(f"python {sys.version.split()[0]}; ms per call, best of 5")
    print(f"{'ranks':>5} {'scrape ms (anchor)':>18} {'save ms':>8} {'load ms':>8} "
          f"{'file KB':>8} {'save/scrape':>11} {'load/scrape':>11}")
    for n in counts:
        store = store_of(n)
        views = Attribution()
        view = views.update(Snapshot(1, time.time(), "bench", ""), store.states(),
                            store.departed())
        collector = TrainingCollector(store, lambda v=view: v)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ingest.json"
            saver = StateFile(str(path), store)
            scrape = best_ms(lambda c=collector: c.render())
            save = best_ms(saver.save)

            def load(p: Path = path, m: int = n) -> None:
                fresh = IngestStore(max_series=max(1024, m), proc="/nonexistent")
                StateFile(str(p), fresh).load()
                assert len(fresh.saved()["ranks"]) == m

            restore = best_ms(load)
            size = path.stat().st_size / 1024
        print(f"{n:>5} {scrape:>18.2f} {save:>8.2f} {restore:>8.2f} {size:>8.0f} "
              f"{save / scrape:>10.1f}x {restore / scrape:>10.1f}x")


if __name__ == "__main__":
    main()
