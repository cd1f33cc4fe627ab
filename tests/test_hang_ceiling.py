"""Hangs judged at the hang ceiling, end to end: real torch.distributed (gloo on the CPU),
three ranks on one daemon whose ceiling (``hung_max_seconds``) is :data:`CEILING` through
``--status.rules-config`` (300 by default: the rules are the same, each test a minute long).

Where no pace tells a hang (before and in a first step), the daemon takes the stacks past the
ceiling: ranks that wait for a peer in a collective make the run hung, with the rank that
holds them named; a rank still working (its own code, a compilation, data being prepared)
keeps the run's allowance. (The cluster of ``test_hangs.py`` holds the two-minute verdict of a
run with a pace, ``test_hang_phases.py`` the hangs a phase holds; these are apart so that the
suite's workers run them at once.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import NO_HOST, Daemon, sample_value, wait_until
from test_hangs import Job, hang_profiles, run_of

pytestmark = pytest.mark.torch

CEILING = 25  # seconds: the hang ceiling of these tests' daemons (ceiling_daemon)


def ceiling_daemon(daemon_factory, tmp_path: Path) -> Daemon:
    """A daemon whose hang ceiling is :data:`CEILING` (300 by default: the rule is the same,
    the test a minute long)."""
    cfg = tmp_path / "thresholds.yml"
    cfg.write_text(f"thresholds:\n  hung_max_seconds: {CEILING}\n")
    return daemon_factory("--gpu.backend=demo", "--demo.gpus=1", *NO_HOST,
                          f"--status.rules-config={cfg}")


def first_step_job(daemon_factory, tmp_path: Path, run: str, block: str) -> tuple[Daemon, Job]:
    """A daemon whose hang ceiling is :data:`CEILING` and a three-rank job on it whose rank 2 does
    ``block`` in its first step."""
    d = ceiling_daemon(daemon_factory, tmp_path)
    return d, Job(tmp_path, run, [d.ingest_url] * 3, "--block", block, "--block-rank", "2")


def assert_hung_past_the_ceiling(d: Daemon, run: str) -> None:
    """``run`` is hung on ``d``'s page, its live ranks 0 and 1 waiting in a collective past the
    ceiling, from the stacks the daemon took of them."""
    def hung() -> dict | None:
        card = run_of(d, run)
        return card if card and card["status"] == "hung" else None

    card = wait_until(hung, timeout=180, interval=1,
                      what=lambda: f"run {run} hung on the page ({run_of(d, run)})")
    ranks = {r["rank"]: r for r in card["ranks"]}
    for r in ("0", "1"):
        assert ranks[r]["verdict"] == "hung", ranks[r]
        assert ranks[r]["location"] == "collective", ranks[r]
        assert ranks[r]["step_in_progress_seconds"] > CEILING, ranks[r]
    assert "every rank waits in a collective" in card["hang"], card["hang"]
    assert set(hang_profiles(d, run)) == {"0", "1"}
    assert "no first step" in d.log_text()


def placed(d: Daemon, run: str, hung: bool = False, timeout: float = 30,
           more: Callable[[], str] = str, unplaced: tuple[str, ...] = ()) -> dict:
    """``run``'s card on ``d``'s page once every rank's place is back from its capture (but
    the ``unplaced`` ranks': a frozen rank's client takes no stacks) and, with ``hung``, the
    run reads hung; ``more`` adds to the failure's message."""
    def ready() -> dict | None:
        card = run_of(d, run)
        return card if card and all(r["location"] for r in card["ranks"]
                                    if r["rank"] not in unplaced) and \
            (not hung or card["status"] == "hung") else None

    return wait_until(ready, timeout=timeout, interval=1, what=lambda: (
        f"run {run}{' hung' if hung else ''}, every rank placed ({run_of(d, run)}){more()}"))


def assert_allowance_kept(d: Daemon, run: str) -> None:
    """Past the ceiling ``d`` took the stacks of ``run``'s three ranks: 0 and 1 wait in a
    collective, rank 2 works (not waiting): the run keeps the first step's allowance, neither
    hung nor stalled; ranks 0 and 1 are at risk of their collective's timeout."""
    wait_until(lambda: set(hang_profiles(d, run)) == {"0", "1", "2"}, timeout=180,
               interval=1, what=lambda: f"the stacks of run {run}'s ranks ({run_of(d, run)})")

    card = placed(d, run)
    where = {r["rank"]: r["location"] for r in card["ranks"]}
    assert where["0"] == where["1"] == "collective" != where["2"], where
    assert card["status"] != "hung" and card["hang"] is None, card
    assert not {r["verdict"] for r in card["ranks"]} & {"hung", "stalled"}, card["ranks"]
    assert all(r["step_in_progress_seconds"] > CEILING for r in card["ranks"]), card["ranks"]
    # ... but the waiting ranks' collective will time out first (NCCL's watchdog), and the
    # page says so, naming the rank they wait for
    ranks = {r["rank"]: r for r in card["ranks"]}
    for r in ("0", "1"):
        assert ranks[r]["verdict"] == "timeout-risk", ranks[r]
        assert "rank 2" in ranks[r]["reason"] and "timeout" in ranks[r]["reason"], ranks[r]
    assert ranks["2"]["verdict"] != "timeout-risk", ranks["2"]


def test_a_frozen_peer_before_the_first_step_is_named_hung_past_the_ceiling(daemon_factory,
                                                                            tmp_path):
    """Rank 2 of three freezes (SIGSTOP) before its first step; ranks 0 and 1 wait in their
    first step's all-reduce. No step has set a pace, and a first step may compile for many
    minutes (the 30-minute allowance), so once the first steps pass the hang ceiling the
    daemon takes the live ranks' stacks: both wait in a collective, so the run is hung at the
    ceiling, not after 30 minutes."""
    d, job = first_step_job(daemon_factory, tmp_path, "first-freeze", "freeze")
    try:
        assert_hung_past_the_ceiling(d, "first-freeze")
    finally:
        job.stop()


def test_near_miss_a_first_step_in_its_own_code_is_no_hang_at_the_ceiling(daemon_factory,
                                                                          tmp_path):
    """Rank 2 of three spends its first step in its own code (as a first step that compiles
    does) while ranks 0 and 1 wait in the all-reduce: past the ceiling the daemon takes the
    stacks, finds rank 2 working, and the run keeps the first step's allowance: not hung."""
    d, job = first_step_job(daemon_factory, tmp_path, "first-slow", "slow-start")
    try:
        assert_allowance_kept(d, "first-slow")
    finally:
        job.stop()


def test_a_peer_frozen_before_the_first_batch_is_hung_and_one_preparing_data_is_not(
        daemon_factory, tmp_path):
    """Before their first batch, ranks 0 and 1 wait at a barrier for rank 2 (as a script's
    ranks wait for one to prepare the data): in 'before-freeze' rank 2 froze there (SIGSTOP),
    in 'before-prepare' it is still preparing, in its own code. No rank has begun a step, yet
    none has made one since its process started: past the ceiling the daemon takes the
    stacks; 'before-freeze' is hung on the page and on /metrics' reading of it (its live ranks
    wait in a collective), 'before-prepare' keeps the first step's allowance."""
    d = ceiling_daemon(daemon_factory, tmp_path)
    jobs = [Job(tmp_path, run, [d.ingest_url] * 3, "--block", block, "--block-rank", "2")
            for run, block in (("before-freeze", "freeze-before"), ("before-prepare", "prepare"))]
    try:
        assert_hung_past_the_ceiling(d, "before-freeze")
        # what the rules read: the first step in progress, since the process started
        open_s = sample_value(d.metrics(), "gputrain_training_step_in_progress_seconds",
                              {"run": "before-freeze", "rank": "0"})
        assert open_s is not None and open_s > CEILING, open_s
        assert_allowance_kept(d, "before-prepare")
    finally:
        for job in jobs:
            job.stop()

