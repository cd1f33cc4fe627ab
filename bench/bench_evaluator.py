"""What evaluating the rules' PromQL in the daemon would cost (issue 48: one definition, two
evaluators), beside what the daemon's history costs today, in the same run.

    python bench/bench_evaluator.py [--ranks 0,64] [--repeats 5]

A real demo daemon (8 GPUs) with ``ranks`` pushing every 5 s (bench_scrape.py's pushers) is
scraped twice, 10 s apart; its page becomes five minutes of points every 10 s (each counter
grows by what it grew in those 10 s, each gauge stays), in an evaluator store
(exporter/heuristics/evaluator.py) as Prometheus would hold them. Then, timed:

- ``diagnose.collect`` over the evaluator: every query diagnose sends, recording rules written
  inline, at the last point (what a status build would cost asking diagnose's questions);
- the recording rules evaluated once, each in order, their results appended (what evaluating
  them each cycle, as Prometheus does, would cost) and ``collect`` reading them back;
- the anchors: a status document built from the history as the daemon does today
  (bench_status.py's in-process build) and a /metrics scrape of the same daemon.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_scrape import demo_daemon, pct  # noqa: E402
from bench_status import in_process  # noqa: E402

from exporter.heuristics import diagnose  # noqa: E402
from exporter.heuristics.evaluator import Engine, Labels, Store, labels_of  # noqa: E402
from exporter.heuristics.rules import groups, identity, settings  # noqa: E402

POINT_MS, POINTS = 10_000, 31  # five minutes of points, as the rate window holds
COUNTER = ("_total", "_sum", "_count", "_bucket")


def page_samples(text: str) -> dict[Labels, float]:
    """A scrape's samples as Prometheus stores them (job and instance added)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[labels_of({**s.labels, "__name__": s.name, "job": "gputrain",
                           "instance": "node-1:9400"})] = float(s.value)
    out[labels_of({"__name__": "up", "job": "gputrain", "instance": "node-1:9400"})] = 1.0
    return out


def history_store(first: dict[Labels, float], second: dict[Labels, float],
                  end_ms: int) -> Store:
    """POINTS points ending at ``end_ms``: counters grow by their growth between the scrapes
    at each point, gauges hold the second scrape's value."""
    store = Store(retention_ms=10 ** 12)
    for k in range(POINTS):
        t = end_ms - (POINTS - 1 - k) * POINT_MS
        samples = []
        for labels, value in second.items():
            name = dict(labels)["__name__"]
            if name.endswith(COUNTER) and labels in first:
                grew = max(0.0, value - first[labels])
                value = value - (POINTS - 1 - k) * grew
            samples.append((labels, value))
        store.append_all(t, samples)
    return store


def timed(fn, repeats: int) -> float:
    """The median of ``repeats`` runs of ``fn``, in ms."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return pct(runs, 0.5) * 1e3


def measure(ranks: int, repeats: int) -> dict[str, float]:
    cfg = settings()
    ids = identity(cfg)
    with demo_daemon(ranks, tag="evaluator") as (_, base):
        session = requests.Session()
        deadline = time.time() + 60
        while ranks and time.time() < deadline:  # every pusher has pushed once
            text = session.get(base + "/metrics?fresh=1", timeout=10).text
            if text.count("gputrain_training_steps_total{") >= ranks:
                break
            time.sleep(1)
        scrape_ms = timed(lambda: session.get(base + "/metrics", timeout=10).text, 20)
        first = page_samples(session.get(base + "/metrics?fresh=1", timeout=10).text)
        time.sleep(POINT_MS / 1000)
        second = page_samples(session.get(base + "/metrics?fresh=1", timeout=10).text)
    end = int(time.time() * 1000)
    store = history_store(first, second, end)
    reports: list = []

    def inline() -> None:
        reports[:] = diagnose.collect(Engine(store, end), cfg["selector"], "5m", None, ids)[0]

    inline_ms = timed(inline, repeats)
    rules = [r for g in groups() if g["name"] == "gputrain.recording" for r in g["rules"]]

    def record() -> None:
        engine = Engine(store, end)
        for rule in rules:
            samples = [(labels_of({**labels, "__name__": rule["record"]}), v)
                       for labels, v in engine.query(rule["expr"])]
            for labels, v in samples:
                store.append(labels, end, v)

    record_ms = timed(record, 1)  # appends: a second pass at the same time adds nothing
    return {"series": len(second), "rules": len(rules), "ranks_read": len(reports),
            "scrape_ms": scrape_ms, "inline_ms": inline_ms, "record_ms": record_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="0,64")
    ap.add_argument("--repeats", type=int, default=5)
    ns = ap.parse_args()
    print(f"python {platform.python_version()}, 8 demo GPUs, {POINTS} points 10 s apart")
    print(f"{'ranks':>5} {'series':>6} {'/metrics ms':>11} {'history build ms':>16} "
          f"{'diagnose over evaluator ms':>26} {'recording rules once ms':>23} "
          f"{'ratio to build':>14}")
    for ranks in (int(x) for x in ns.ranks.split(",")):
        row = measure(ranks, ns.repeats)
        build = in_process(ranks, 330)["build_ms"]
        assert row["ranks_read"] == ranks, row
        print(f"{ranks:>5} {row['series']:>6} {row['scrape_ms']:>11.2f} {build:>16.2f} "
              f"{row['inline_ms']:>26.1f} {row['record_ms']:>23.1f} "
              f"{row['inline_ms'] / build:>13.0f}x", flush=True)


if __name__ == "__main__":
    main()
