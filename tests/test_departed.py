"""A run that died stays reported as dead after its series expire: the ingest keeps a departed
rank's end (when it last pushed, how it ended) for ``--ingest.dead-ttl`` after
``--ingest.ttl``, on /metrics (so its alert holds on: the promtool cases in rule_cases.py) and
on the status page; a clean end, or a rank that comes back, is no death.

Each case is an hour of a rank pushed every 5 s then silent or said goodbye, on a fake clock,
through the daemon's own ingest, history and status document."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from exporter.heuristics.rules import DEFAULTS
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore
from exporter.serving.status import StatusView
from exporter.serving.training import TrainingCollector

T = DEFAULTS["thresholds"]
TTL, DEAD_TTL = 600.0, 3600.0


class Node:
    """A daemon's ingest, history and page on one fake clock (unix = monotonic + 1e9)."""

    def __init__(self, dead_ttl: float = DEAD_TTL) -> None:
        self.now = 1000.0
        self.store = IngestStore(ttl=TTL, dead_ttl=dead_ttl, clock=lambda: self.now,
                                 wall_clock=lambda: self.now + 1e9)
        self.history = History(window=300.0, point_seconds=5.0, instance="n1",
                               clock=lambda: self.now)
        self.views = Attribution()
        self.cycle = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TrainingCollector(self.store, lambda: self.views.latest))

    def push(self, rank: str = "0", run_id: str = "a", **over) -> None:
        t = self.now - 1000.0
        self.store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": "r", "rank": rank, "run_id": run_id,
            "steps": int(t * 10), "step_seconds": t, "data_wait_seconds": 0.1 * t,
            "samples": 320 * t, "elapsed_seconds": t, "last_step_timestamp": self.now + 1e9,
            **over}).encode())

    def run(self, seconds: float, ranks: tuple[str, ...] = ("0",), **over) -> None:
        """``seconds`` of the given ranks pushing every 5 s (none: silence)."""
        for _ in range(int(seconds / 5)):
            self.now += 5.0
            for r in ranks:
                self.push(r, **over)
            self.observe()

    def observe(self) -> None:
        self.cycle += 1
        self.history.observe(self.views.update(
            Snapshot(self.cycle, self.now + 1e9, "test", ""), self.store.states(),
            self.store.departed()))

    def page(self) -> dict:
        return StatusView(self.history, T).document()

    def value(self, name: str, rank: str = "0", **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"run": "r", "rank": rank, **labels})


def verdicts(doc: dict) -> dict[str, str]:
    (run,) = doc["runs"]
    return {rank["rank"]: rank["verdict"] for rank in run["ranks"]}


def test_a_killed_run_is_still_said_vanished_long_after_its_series_went():
    node = Node()
    node.run(600)  # ten minutes of steps, then SIGKILL: no goodbye
    node.run(25 * 60, ranks=())  # 25 minutes later: past --ingest.ttl
    assert node.value("gputrain_training_steps_total") is None  # its counters are gone ...
    since = node.now + 1e9 - node.value("gputrain_training_last_push_timestamp_seconds")
    assert since == pytest.approx(25 * 60)  # ... its end is not
    assert node.value("gputrain_training_finished") == 0
    doc = node.page()
    assert verdicts(doc) == {"0": "vanished"}
    assert "25 min ago" in doc["runs"][0]["ranks"][0]["reason"]
    node.run(TTL + DEAD_TTL - 25 * 60 + 5, ranks=())  # dead_ttl after the ttl: forgotten
    assert node.value("gputrain_training_last_push_timestamp_seconds") is None
    assert node.page()["runs"] == []


def test_a_failed_rank_is_said_failed_for_the_dead_ttl_with_its_exception():
    node = Node()
    node.run(300, ranks=("0", "1"))
    node.push("1", goodbye=True, exit_reason="exception", exit_detail="torch.OutOfMemoryError")
    node.run(40 * 60, ranks=())  # rank 0 killed by the scheduler after its peer's failure
    assert node.value("gputrain_training_failed", "1") == 1
    assert node.value("gputrain_training_exit_info", "1", reason="exception",
                      detail="torch.OutOfMemoryError") == 1
    assert verdicts(node.page()) == {"0": "vanished", "1": "failed"}
    assert "torch.OutOfMemoryError" in node.page()["runs"][0]["ranks"][1]["reason"]


def test_a_clean_end_is_never_a_death_after_the_ttl():
    node = Node()
    node.run(300)
    node.push(goodbye=True, exit_reason="completed")
    node.run(30 * 60, ranks=())
    assert node.value("gputrain_training_last_push_timestamp_seconds") is None
    assert node.store.departed() == []
    assert node.page()["runs"] == []


def test_a_rank_that_comes_back_is_alive_not_departed():
    node = Node()
    node.run(300)
    node.run(TTL + 60, ranks=())  # departed ...
    assert [st.rank for st in node.store.departed()] == ["0"]
    node.run(60, run_id="b")  # ... then restarted under the same run and rank
    assert node.store.departed() == []
    assert node.value("gputrain_training_steps_total") is not None
    assert verdicts(node.page())["0"] not in ("vanished", "failed", "stalled")


def test_dead_ttl_zero_forgets_with_the_ttl_and_departed_ranks_are_bounded():
    node = Node(dead_ttl=0.0)
    node.run(60)
    node.run(TTL + 10, ranks=())
    assert node.value("gputrain_training_last_push_timestamp_seconds") is None
    bounded = IngestStore(max_series=3, ttl=10.0, clock=lambda: node.now,
                          wall_clock=lambda: node.now)
    for k in range(6):  # six ranks die one after the other: the three latest are kept
        bounded.push(json.dumps({"version": SCHEMA_VERSION, "run": "r", "rank": str(k),
                                 "run_id": "a", "steps": 1, "step_seconds": 1.0,
                                 "data_wait_seconds": 0.0, "samples": 1}).encode())
        node.now += 11.0
        bounded.states()
    assert sorted(st.rank for st in bounded.departed()) == ["3", "4", "5"]


def test_a_rank_killed_outright_is_not_judged_on_its_steps_once_silent_past_silent_seconds():
    """Rank 1 is killed (SIGKILL: no goodbye) while rank 0 goes on. Its last window of steps,
    its rates falling, says nothing of now: 20 s after its last push it is still judged as
    before (a push, a scrape may be late), past silent_seconds (60 s) it reads paused, "no
    push", on the page as in diagnose (the same judge), never a bottleneck or gpu-bound."""
    node = Node()
    node.run(300, ranks=("0", "1"))
    before = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert before["1"]["verdict"] not in ("paused", "vanished"), before["1"]
    node.run(20, ranks=("0",))
    assert verdicts(node.page())["1"] == before["1"]["verdict"]
    node.run(T["silent_seconds"] + 10 - 20, ranks=("0",))
    ranks = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert ranks["1"]["verdict"] == "paused", ranks["1"]
    assert ranks["1"]["reason"] == ("no push for 70 s while its run's other ranks push: "
                                    "nothing is judged of its steps"), ranks["1"]
    assert ranks["0"]["verdict"] == before["0"]["verdict"]


def test_a_rank_that_finished_first_is_kept_while_its_run_goes_on_then_forgotten_with_it():
    """Uneven inputs: rank 0 runs out of batches and says goodbye while rank 1 goes on (and
    may wait for it in a collective). A clean end is forgotten a minute after its goodbye,
    which is the hang floor: rank 0 would be gone from every surface just when rank 1 is
    called hung, and nothing could name it. It is kept, finished, while a rank of its run still
    runs, then forgotten with the run's last goodbye, as any clean end is."""
    node = Node()
    node.run(300, ranks=("0", "1"))
    node.push("0", goodbye=True, exit_reason="completed")
    node.run(5 * 60, ranks=("1",))
    assert node.value("gputrain_training_finished", "0") == 1
    ranks = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert ranks["0"]["verdict"] == "finished" and ranks["1"]["verdict"] != "finished", ranks
    node.push("1", goodbye=True, exit_reason="completed")
    node.run(55, ranks=())
    assert set(verdicts(node.page()).values()) == {"finished"}
    node.run(10, ranks=())  # a minute after the last goodbye: the run is forgotten whole
    assert node.page()["runs"] == []
    assert node.store.departed() == []
    assert node.value("gputrain_training_finished", "0") is None


def test_a_run_that_failed_is_told_by_its_first_failure_not_the_launchers_sigterm():
    """Rank 1 raises; a few seconds later the launcher (torchrun) ends ranks 0 and 2 by
    SIGTERM. Every rank reads failed, each with its own end, and the run's verdict is told
    by the failure that came first, the cause, not by rank 0's SIGTERM."""
    node = Node()
    node.run(300, ranks=("0", "1", "2"))
    node.push("1", goodbye=True, exit_reason="exception", exit_detail="RuntimeError")
    node.run(5, ranks=())
    for r in ("0", "2"):
        node.push(r, goodbye=True, exit_reason="signal", exit_detail="SIGTERM")
    node.run(10, ranks=())
    (run,) = node.page()["runs"]
    assert {r["rank"]: r["verdict"] for r in run["ranks"]} == {
        "0": "failed", "1": "failed", "2": "failed"}
    failed = run["verdicts"][0]
    assert failed["verdict"] == "failed" and failed["ranks"] == ["0", "1", "2"]
    assert "RuntimeError" in failed["reason"] and "SIGTERM" not in failed["reason"], failed
