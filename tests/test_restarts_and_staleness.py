"""A crash loop and frozen readings, on the daemon's own view (/api/v1/status, the page, `top`):
what the alerts GpuTrainRunRestarting and GpuTrainCollectorStale say (their promtool cases and
diagnose through a real Prometheus are in rule_cases.py and test_agreement.py), with a near
miss each."""

from __future__ import annotations

import json

import pytest
from fake_nvml import FakeDriver, FakeGpu

from exporter.cli.top import frame
from exporter.heuristics.rules import DEFAULTS
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.gpu_backends import NvmlBackend
from exporter.reading.nvml import Nvml
from exporter.reading.sampler import Sampler
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore
from exporter.serving.status import StatusView

T = DEFAULTS["thresholds"]


class Node:
    """A sampler over a fake GPU, an ingest, a history and the status view, on one clock that
    is also the wall clock the view ages the collectors against."""

    def __init__(self, clock) -> None:
        self.clock = clock
        driver = FakeDriver([FakeGpu("GPU-a", util_rate=40)], clock=clock)
        self.sampler = Sampler(NvmlBackend(Nvml(driver.binding), clock=clock), None,
                               interval=1.0, collectors={"gpu"}, clock=clock, wall_clock=clock)
        self.store = IngestStore(clock=clock, wall_clock=clock)
        self.history = History(window=60.0, point_seconds=5.0, instance="n1", interval=1.0)
        self.views = Attribution()
        self.view = StatusView(self.history, T, lambda: None, "nvml", wall_clock=clock)
        self.totals = {"steps": 0, "step_seconds": 0.0, "data_wait_seconds": 0.0,
                       "samples": 0.0, "elapsed_seconds": 0.0}

    def second(self, run_id: str = "a", cycle: bool = True) -> None:
        """One second of a rank waiting half of each step for data (input-bound), pushed;
        and a sampler cycle unless the sampler is stuck."""
        t = self.totals
        t["steps"] += 10
        t["step_seconds"] += 1.0
        t["data_wait_seconds"] += 0.5
        t["samples"] += 320
        t["elapsed_seconds"] += 1.0
        self.store.push(json.dumps({"version": SCHEMA_VERSION, "run": "r", "rank": "0",
                                    "run_id": run_id, "gpus": ["0"], **t}).encode())
        if cycle:
            self.sampler.run_once()
            self.history.observe(self.views.update(self.sampler.snapshot, self.store.states()))
        self.clock.advance(1.0)

    def restart(self) -> None:
        """The rank's process is replaced: its totals start again from zero."""
        self.totals = {k: 0 for k in self.totals}

    def rank(self) -> dict:
        (run,) = self.view.document()["runs"]
        (rank,) = run["ranks"]
        return rank


def screen(doc: dict) -> str:
    """``top``'s screen of a status document, as text."""
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(frame(doc))
    return console.export_text()


def _live(node: Node, seconds: int, run_id: str = "a") -> None:
    for _ in range(seconds):
        node.second(run_id)


def test_a_rank_replaced_again_and_again_is_restarting_and_nothing_else(clock):
    node = Node(clock)
    for i in range(4):  # a new process every 30 s, each input-bound while it lives
        node.restart()
        _live(node, 30, run_id=f"p{i}")
    rank = node.rank()
    assert rank["verdict"] == "restarting", rank["reason"]
    assert "replaced 3 times" in rank["reason"]
    assert rank["also"] == []  # rates across a restart are no bottleneck
    assert rank["advice"].startswith("Read the first failure")
    assert "restarting" in screen(node.view.document())


def test_one_restart_inside_the_window_is_not_judged_and_one_before_it_is(clock):
    node = Node(clock)
    _live(node, 40, run_id="a")
    node.restart()
    _live(node, 30, run_id="b")  # the 60 s window straddles the restart
    rank = node.rank()
    assert (rank["verdict"], rank["status"]) == ("restarted", "ok"), rank["reason"]
    assert rank["also"] == []
    _live(node, 60, run_id="b")  # the window holds one process again: judged on it
    rank = node.rank()
    assert rank["verdict"] == "input-bound", rank["reason"]


def test_a_stuck_sampler_makes_every_surface_say_stale_and_judge_nothing(clock):
    node = Node(clock)
    _live(node, 60)
    assert node.rank()["verdict"] == "input-bound"
    for _ in range(3):  # the sampler hangs: pushes still come, no cycle ends
        node.second(cycle=False)
    assert node.rank()["verdict"] == "input-bound"  # 3 intervals late: not yet stale
    for _ in range(7):
        node.second(cycle=False)
    doc = node.view.document()
    rank = node.rank()
    assert rank["verdict"] == "stale" and rank["status"] == "fault", rank["reason"]
    assert "the gpu collector" in rank["reason"] and "stale" in rank["reason"]
    assert rank["also"] == []  # nothing judged on frozen readings
    assert [f["verdict"] for f in doc["faults"]] == ["stale"]
    assert "stale" in screen(doc)
    # the cached document moves on with the clock, though the history does not
    assert json.loads(node.view.json_bytes())["runs"][0]["ranks"][0]["verdict"] == "stale"
    node.second()  # the sampler recovers: judged again
    assert node.rank()["verdict"] == "input-bound"


@pytest.mark.parametrize("interval, late, stale", [(1.0, 10.0, True), (30.0, 60.0, False)])
def test_staleness_counts_in_sampler_intervals(clock, interval, late, stale):
    """Ten seconds late is stale at a 1 s interval; a minute late is not at 30 s."""
    node = Node(clock)
    node.history.interval = interval
    _live(node, 5)
    clock.advance(late)
    ages = node.history.collector_ages(clock())
    assert ages["gpu"] == pytest.approx((late + 1) / interval)
    assert (node.rank()["verdict"] == "stale") is stale
