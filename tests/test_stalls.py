"""Rare long stalls judged by the time they cost: the daemon's count of seconds in steps far
above the median, from the pushed step histogram, and the verdict on it (the promtool case
and diagnose through a real Prometheus are in rule_cases.py and test_agreement.py)."""

from __future__ import annotations

import json

import pytest

from exporter.heuristics.rules import DEFAULTS
from exporter.heuristics.stalls import slow_step_count, slow_step_seconds
from exporter.heuristics.verdict import judge
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import IngestStore
from exporter.serving.training import _rank_lines

T = DEFAULTS["thresholds"]
BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def cumulative(durations: list[float]) -> tuple[int, ...]:
    """The client's cumulative bucket counts over BOUNDS, +Inf last."""
    return (*(sum(d <= b for d in durations) for b in BOUNDS), len(durations))


def test_a_rare_long_step_is_counted_whole_and_ordinary_ones_not_at_all():
    steps = [0.02] * 999 + [4.0]  # 0.1 % of the steps
    got = slow_step_seconds(BOUNDS, (0,) * (len(BOUNDS) + 1), cumulative(steps), sum(steps))
    # the 4 s step is in the (2.5, 5] bucket, counted at its middle
    assert got == pytest.approx(3.75)
    # steps that vary within 5x the median are never stalls
    ordinary = [0.02] * 900 + [0.045] * 100
    assert slow_step_seconds(BOUNDS, (0,) * (len(BOUNDS) + 1), cumulative(ordinary),
                             sum(ordinary)) == 0.0


def test_a_stall_past_the_last_bucket_counts_from_the_step_time():
    steps = [0.02] * 500 + [60.0]  # over the highest finite bound (10 s)
    got = slow_step_seconds(BOUNDS, (0,) * (len(BOUNDS) + 1), cumulative(steps), sum(steps))
    assert got == pytest.approx(60.0 + 500 * (0.02 - 0.025))


def push(store: IngestStore, steps: list[float], run: str, wall: float) -> None:
    store.push(json.dumps({
        "version": SCHEMA_VERSION, "run": run, "rank": "0", "run_id": "a",
        "steps": len(steps), "step_seconds": sum(steps), "data_wait_seconds": 0.0,
        "samples": 32.0 * len(steps), "elapsed_seconds": wall, "step_buckets": list(BOUNDS),
        "step_counts": list(cumulative(steps)[:-1])}).encode())


@pytest.mark.parametrize("stall, middle, verdict", [(6.0, 7.5, "step-time-stalls"),
                                                    (1.0, 0.75, None)])
def test_the_daemon_judges_stalls_by_the_wall_time_they_cost(stall, middle, verdict):
    """A stall every 1,000 steps of 20 ms (0.1 % of the steps: the p99 stays at 20 ms) costs
    23 % of the wall time at 6 s (29 % read at its bucket's middle) and is a finding; at 1 s
    (4.8 %, 3.6 % read) it is not."""
    now = [1000.0]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    history = History(window=300.0, point_seconds=5.0, instance="n1")
    views = Attribution()
    steps: list[float] = []
    for k in range(120):  # pushes every 5 s, 10 minutes
        t = 5.0 * (k + 1)
        while sum(steps) < t:
            steps.append(stall if len(steps) % 1000 == 999 else 0.02)
        now[0] = 1000.0 + t
        push(store, steps, "r", sum(steps))
        history.observe(views.update(Snapshot(k, now[0], "test", ""), store.states()))
    (rep,) = judge(history.reports(), T)
    assert rep.step_p99_seconds is not None and rep.step_p99_seconds < 0.03
    expected = middle / (stall + 999 * 0.02)
    assert rep.stall_share == pytest.approx(expected, abs=0.03)
    found = [rep.verdict, *(f.name for f in rep.also)]
    if verdict:
        assert "step-time-stalls" in found, rep.reason
        # nothing seen of checkpoints or loader restarts: the advice says what to look at
        assert "heckpoint" not in rep.advice and "profile --stacks" in rep.advice
    else:
        assert "step-time-stalls" not in found
    (state,) = store.states()
    text = "".join(line for _, line in _rank_lines(state))
    assert f"gputrain_training_slow_step_seconds_total{{rank=\"0\",run=\"r\"}} " \
           f"{state.slow_step_seconds!r}" in text
    assert state.slow_step_seconds > 0 if verdict else True


def test_slow_steps_are_counted_beside_their_seconds():
    """One step in four at 2 s among 0.02 s steps: a quarter of the steps are slow."""
    steps = [2.0 if i % 4 == 3 else 0.02 for i in range(400)]
    assert slow_step_count(BOUNDS, (0,) * (len(BOUNDS) + 1), cumulative(steps)) == 100
    assert slow_step_count(BOUNDS, (0,) * (len(BOUNDS) + 1), cumulative([0.02] * 400)) == 0


def periodic(every: int, workers: int | None, wait: bool, phases: dict | None = None):
    """Ten minutes of a rank whose every ``every``-th step takes 0.5 s (its other steps
    0.02 s), that slow step's time data wait where ``wait``, with a DataLoader of ``workers``
    stated by the client (None: not stated), judged by the daemon."""
    now = [1000.0]
    store = IngestStore(clock=lambda: now[0], wall_clock=lambda: now[0])
    history = History(window=300.0, point_seconds=5.0, instance="n1")
    views = Attribution()
    steps: list[float] = []
    waited = 0.0
    for k in range(120):
        t = 5.0 * (k + 1)
        while sum(steps) < t:
            slow = len(steps) % every == every - 1
            steps.append(0.5 if slow else 0.02)
            waited += 0.48 if slow and wait else 0.001
        now[0] = 1000.0 + t
        body = {"version": SCHEMA_VERSION, "run": "r", "rank": "0", "run_id": "a",
                "steps": len(steps), "step_seconds": sum(steps), "data_wait_seconds": waited,
                "samples": 32.0 * len(steps), "elapsed_seconds": sum(steps),
                "step_buckets": list(BOUNDS), "step_counts": list(cumulative(steps)[:-1]),
                "phases": {p: v * t for p, v in (phases or {}).items()}}
        if workers is not None:
            body["loader_workers"] = workers
        store.push(json.dumps(body).encode())
        history.observe(views.update(Snapshot(k, now[0], "test", ""), store.states()))
    (rep,) = judge(history.reports(), T)
    return rep, [rep.verdict, *(f.name for f in rep.also)]


def stall_finding(rep):
    """The step-time-stalls verdict or finding of a judged rank (its advice)."""
    return rep if rep.verdict == "step-time-stalls" else \
        next(f for f in rep.also if f.name == "step-time-stalls")


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_a_loaders_period_is_the_loader_not_a_stall(workers):
    """N workers deliver batches in groups of N: one step in N waits for its batch (0.5 s),
    the rest take 0.02 s. p99 is 25x the median, yet it is input-bound, said to be the
    loader's period, with the loader's advice, and no stall."""
    rep, found = periodic(workers, workers, wait=True)
    assert rep.verdict == "input-bound", (rep.verdict, rep.reason)
    assert f"the loader's {workers} workers deliver their batches together" in rep.reason
    assert "step-time-stalls" not in found, found
    assert "prefetch_factor" in rep.advice and "persistent_workers" in rep.advice


@pytest.mark.parametrize("every, workers, wait", [
    (4, None, True),  # the client states no loader: nothing tells a period from a stall
    (4, 4, False),  # one slow step in 4 that is no data wait (a sync every 4 steps)
    (40, 4, True),  # one in 40 with 4 workers: not the loader's period
])
def test_slow_steps_that_are_not_the_loaders_period_are_stalls(every, workers, wait):
    rep, found = periodic(every, workers, wait)
    assert "step-time-stalls" in found, (found, rep.reason)
    assert "heckpoint" not in stall_finding(rep).advice  # none was seen


def test_stall_advice_names_checkpoints_where_the_rank_saves_them():
    rep, _ = periodic(40, None, wait=False, phases={"checkpoint": 0.02})
    assert stall_finding(rep).advice.startswith("Checkpoint asynchronously"), rep.reason
