"""A cost that recurs for minutes at a time (a checkpoint to slow storage, an evaluation, a
DataLoader's start each epoch) is judged by its share of the wall time over the periodic window
(an hour), through the minutes each occurrence stops the steps, on the daemon's own surfaces
(the promtool cases are in rule_cases.py: the same runs, the same verdicts)."""

from __future__ import annotations

import json

import pytest
from test_departed import Node

from exporter.protocol import SCHEMA_VERSION


def run_with(node: Node, phase: str, every: int, lasts: int, minutes: int = 75) -> None:
    """A rank pushing every 5 s for ``minutes``, in ``phase`` (outside the steps, declared
    as open while it lasts) ``lasts`` minutes every ``every`` from minute 10, stepping 0.5 s
    steps with little data wait otherwise."""
    steps = step_s = wait = in_phase = 0.0
    for k in range(minutes * 12):
        minute = k // 12
        busy = minute >= 10 and (minute - 10) % every < lasts
        node.now += 5.0
        if busy:
            in_phase += 5.0
        else:
            steps, step_s, wait = steps + 10, step_s + 5.0, wait + 0.25
        node.store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": "r", "rank": "0", "run_id": "a",
            "steps": int(steps), "step_seconds": step_s, "data_wait_seconds": wait,
            "samples": 32 * steps, "elapsed_seconds": 5.0 * (k + 1),
            "last_step_timestamp": node.now + 1e9, "phases": {phase: in_phase},
            **({"open_phase": phase, "open_phase_seconds": 5.0, "step_open_seconds": 0.0}
               if busy else {})}).encode())
        node.observe()


@pytest.mark.parametrize("phase, every, lasts, verdict, reason", [
    ("checkpoint", 30, 8, "step-time-stalls", "checkpoint saves take"),
    ("evaluation", 15, 5, "step-time-stalls", "evaluations take"),
    ("dataloader_start", 10, 1, "loader-restarts", "DataLoader start-up takes"),
])
def test_a_recurring_cost_over_its_share_is_said_whether_or_not_it_runs_now(phase, every,
                                                                           lasts, verdict,
                                                                           reason):
    node = Node()
    run_with(node, phase, every, lasts)
    (run,) = node.page()["runs"]
    (rank,) = run["ranks"]
    found = [rank["verdict"]] + [f["verdict"] for f in rank["also"]]
    assert verdict in found, rank
    said = rank["reason"] if rank["verdict"] == verdict else \
        next(f["reason"] for f in rank["also"] if f["verdict"] == verdict)
    assert reason in said and "over 1h" in said


@pytest.mark.parametrize("phase, every, lasts", [
    ("checkpoint", 30, 1),  # a minute every half hour: 3 %
    ("evaluation", 30, 2),  # two minutes every half hour: 7 %
])
def test_a_cheap_recurring_cost_is_no_finding(phase, every, lasts):
    node = Node()
    run_with(node, phase, every, lasts)
    (run,) = node.page()["runs"]
    (rank,) = run["ranks"]
    found = {rank["verdict"]} | {f["verdict"] for f in rank["also"]}
    assert not {"step-time-stalls", "loader-restarts"} & found, rank
    assert rank["status"] != "stopped"  # judged as it runs
