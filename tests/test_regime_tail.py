"""Every window follows the regime, the tail as well as the mean: after a change of pace the
step-time percentiles and the stall share are the new regime's alone, on the daemon's page as in
the rules (``promql.quantile_selected``; its promtool case is in rule_cases.py). Tried as a new
user would: a loop that waited 80 % for data for 150 s, then fixed."""

from __future__ import annotations

import json

import pytest
from test_departed import Node

from exporter.protocol import SCHEMA_VERSION

BOUNDS = [0.25, 1.0, 2.5, 10.0]


class Loop:
    """A rank's client: its cumulative totals and step histogram, pushed every 5 s."""

    def __init__(self, node: Node) -> None:
        self.node, self.t = node, 0.0
        self.steps, self.step_s, self.wait, self.counts = 0, 0.0, 0.0, [0] * len(BOUNDS)

    def run(self, seconds: float, step: float, wait: float = 0.0, stall: float = 0.0,
            every: float = 0.0) -> None:
        """``seconds`` of steps of ``step`` seconds, ``wait`` of each waiting for data, and a
        step of ``stall`` seconds every ``every`` seconds where given."""
        for _ in range(int(seconds / 5)):
            self.node.now += 5.0
            self.t += 5.0
            took = 0.0
            if stall and self.t % every < 5.0:
                self._step(stall, 0.0)
                took = stall
            while took + step <= 5.0 + 1e-9:
                self._step(step, wait)
                took += step
            self.node.store.push(json.dumps({
                "version": SCHEMA_VERSION, "run": "r", "rank": "0", "run_id": "a",
                "steps": self.steps, "step_seconds": self.step_s,
                "data_wait_seconds": self.wait, "samples": 32 * self.steps,
                "elapsed_seconds": self.t, "last_step_timestamp": self.node.now + 1e9,
                "step_buckets": BOUNDS, "step_counts": self.counts}).encode())
            self.node.observe()

    def _step(self, seconds: float, wait: float) -> None:
        self.steps += 1
        self.step_s += seconds
        self.wait += wait * seconds
        for i, bound in enumerate(BOUNDS):
            if seconds <= bound:
                self.counts[i] += 1


def rank(node: Node) -> dict:
    (run,) = node.page()["runs"]
    (r,) = run["ranks"]
    return r


@pytest.mark.parametrize("before", [
    {"step": 2.0, "wait": 0.8},  # input-bound: 80 % data wait, then fixed
    {"step": 2.0},  # slow steps, then a faster model
])
def test_a_fixed_loop_is_not_judged_on_its_old_regimes_tail(before):
    node = Node()
    loop = Loop(node)
    loop.run(150, **before)
    loop.run(120, step=0.2)  # fixed: 120 s of 0.2 s steps without data wait
    r = rank(node)
    found = {r["verdict"]} | {f["verdict"] for f in r["also"]}
    assert r["regime_changed_seconds"] is not None, r  # the change of pace was seen
    assert "step-time-stalls" not in found, r
    assert r["step_p99_seconds"] is not None and r["step_p99_seconds"] <= 0.25, r


@pytest.mark.parametrize("changed", [True, False])
def test_stalls_of_the_current_regime_are_still_said(changed):
    node = Node()
    loop = Loop(node)
    if changed:
        loop.run(150, step=2.0, wait=0.8)
    # a 5 s stall every 30 s among 0.2 s steps: a sixth of the wall time
    loop.run(240 if changed else 390, step=0.2, stall=5.0, every=30.0)
    r = rank(node)
    found = {r["verdict"]} | {f["verdict"] for f in r["also"]}
    assert "step-time-stalls" in found, r
