"""Hangs judged at the hang ceiling, end to end: real torch.distributed (gloo on the CPU),
three ranks on one daemon whose ceiling (``hung_max_seconds``) is 40 s through
``--status.rules-config`` (300 by default: the rules are the same, each test a minute long).

Where no pace tells a hang (before and in a first step) or a phase holds the run (a
DataLoader's start), the daemon takes the stacks past the ceiling: ranks that wait for a peer
in a collective make the run hung, with the rank that holds them named; a rank still working
(its own code, a compilation, data being prepared, every rank's DataLoader starting slowly)
keeps the run's allowance. (The cluster of ``test_hangs.py`` holds the two-minute verdict of a
run with a pace; these are apart so that the suite's workers run both at once.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ENV_BIN, NO_HOST, ROOT, Daemon, require_module, sample_value, wait_until
from test_hangs import Job, hang_profiles, run_of

pytestmark = pytest.mark.torch


def ceiling_daemon(daemon_factory, tmp_path: Path) -> Daemon:
    """A daemon whose hang ceiling is 40 s (300 by default: the rule is the same, the test a
    minute long)."""
    cfg = tmp_path / "thresholds.yml"
    cfg.write_text("thresholds:\n  hung_max_seconds: 40\n")
    return daemon_factory("--gpu.backend=demo", "--demo.gpus=1", *NO_HOST,
                          f"--status.rules-config={cfg}")


def first_step_job(daemon_factory, tmp_path: Path, run: str, block: str) -> tuple[Daemon, Job]:
    """A daemon whose hang ceiling is 40 s and a three-rank job on it whose rank 2 does
    ``block`` in its first step."""
    d = ceiling_daemon(daemon_factory, tmp_path)
    return d, Job(tmp_path, run, [d.ingest_url] * 3, "--block", block, "--block-rank", "2")


def assert_hung_past_the_ceiling(d: Daemon, run: str) -> None:
    """``run`` is hung on ``d``'s page, its live ranks 0 and 1 waiting in a collective past the
    40 s ceiling, from the stacks the daemon took of them."""
    def hung() -> dict | None:
        card = run_of(d, run)
        return card if card and card["status"] == "hung" else None

    card = wait_until(hung, timeout=180, interval=1,
                      what=lambda: f"run {run} hung on the page ({run_of(d, run)})")
    ranks = {r["rank"]: r for r in card["ranks"]}
    for r in ("0", "1"):
        assert ranks[r]["verdict"] == "hung", ranks[r]
        assert ranks[r]["location"] == "collective", ranks[r]
        assert ranks[r]["step_in_progress_seconds"] > 40, ranks[r]
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
    hung nor stalled."""
    wait_until(lambda: set(hang_profiles(d, run)) == {"0", "1", "2"}, timeout=180,
               interval=1, what=lambda: f"the stacks of run {run}'s ranks ({run_of(d, run)})")

    card = placed(d, run)
    where = {r["rank"]: r["location"] for r in card["ranks"]}
    assert where["0"] == where["1"] == "collective" != where["2"], where
    assert card["status"] != "hung" and card["hang"] is None, card
    assert not {r["verdict"] for r in card["ranks"]} & {"hung", "stalled"}, card["ranks"]
    assert all(r["step_in_progress_seconds"] > 40 for r in card["ranks"]), card["ranks"]


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
        assert open_s is not None and open_s > 40, open_s
        assert_allowance_kept(d, "before-prepare")
    finally:
        for job in jobs:
            job.stop()


def test_a_dataloader_start_that_never_ends_while_the_peers_wait_is_hung(daemon_factory,
                                                                         tmp_path):
    """After 20 steps every rank of 'loader-hang' starts a new epoch; rank 2's DataLoader
    start never returns (its first read blocks) while ranks 0 and 1 wait for it in their
    epoch's first all-reduce. The start is a phase wrap() declares, not the user: past the
    ceiling the daemon takes the stacks, the peers wait in a collective, and the run is hung
    with rank 2 named, in its data set. The near miss, 'loader-slow': every rank's start
    blocks, none waits for another: the phase holds, no hang."""
    d = ceiling_daemon(daemon_factory, tmp_path)
    jobs = [Job(tmp_path, run, [d.ingest_url] * 3, "--block", "loader-start", "--block-rank",
                who, "--block-after", "20")
            for run, who in (("loader-hang", "2"), ("loader-slow", "-1"))]
    try:
        card = placed(d, "loader-hang", hung=True, timeout=240)
        ranks = {r["rank"]: r for r in card["ranks"]}
        assert all(r["verdict"] == "hung" for r in ranks.values()), ranks
        assert ranks["0"]["location"] == ranks["1"]["location"] == "collective", ranks
        assert ranks["2"]["location"] == "data_loading", ranks["2"]
        assert ranks["2"]["phase_in_progress"]["dataloader_start"] > 40, ranks["2"]
        assert "DataLoader's start" in ranks["2"]["reason"], ranks["2"]
        assert "rank 2" in card["hang"] and "__getitem__" in card["hang"], card["hang"]

        wait_until(lambda: set(hang_profiles(d, "loader-slow")) == {"0", "1", "2"},
                   timeout=120, interval=1,
                   what=lambda: f"the stacks of loader-slow ({run_of(d, 'loader-slow')})")

        card = placed(d, "loader-slow")
        assert {r["location"] for r in card["ranks"]} == {"data_loading"}, card["ranks"]
        assert card["status"] != "hung" and card["hang"] is None, card
        assert "(dataloader_start) in a declared phase past the hang ceiling" in d.log_text()
    finally:
        for job in jobs:
            job.stop()


def test_a_declared_phase_waiting_in_a_collective_its_peers_never_join_is_hung(daemon_factory,
                                                                              tmp_path):
    """After 20 steps rank 2 of 'eval-hang' enters its evaluation phase and calls a barrier
    its peers never join, while ranks 0 and 1 go on into their next all-reduce and wait for
    it. A declared phase holds the others while its rank works; past the ceiling the daemon
    takes the stacks: rank 2 waits in a collective too, nobody works, the run is hung with
    every rank's place. The near miss, 'ckpt-wait': rank 2 writes its checkpoint inside its
    phase for ever (storage that hangs) while the others wait at a barrier: its stacks are in
    its own I/O, the run waits for it, no hang."""
    d = ceiling_daemon(daemon_factory, tmp_path)
    jobs = [Job(tmp_path, run, [d.ingest_url] * 3, "--block", block, "--block-rank", "2",
                "--block-after", "20")
            for run, block in (("eval-hang", "phase-collective"),
                               ("ckpt-wait", "checkpoint-phase"))]
    try:
        card = placed(d, "eval-hang", hung=True, timeout=240)
        ranks = {r["rank"]: r for r in card["ranks"]}
        assert all(r["verdict"] == "hung" for r in ranks.values()), ranks
        assert {r["location"] for r in ranks.values()} == {"collective"}, ranks
        assert ranks["2"]["phase_in_progress"]["evaluation"] > 40, ranks["2"]
        assert "inside its evaluation phase" in ranks["2"]["reason"], ranks["2"]
        assert "every rank waits in a collective" in card["hang"], card["hang"]
        assert sample_value(d.metrics(), "gputrain_training_stack_location",
                            {"run": "eval-hang", "rank": "2", "location": "collective"}) == 1.0

        wait_until(lambda: set(hang_profiles(d, "ckpt-wait")) == {"0", "1", "2"},
                   timeout=120, interval=1,
                   what=lambda: f"the stacks of ckpt-wait ({run_of(d, 'ckpt-wait')})")
        card = placed(d, "ckpt-wait")
        where = {r["rank"]: r["location"] for r in card["ranks"]}
        assert where == {"0": "collective", "1": "collective", "2": "checkpoint_io"}, where
        assert card["status"] != "hung" and card["hang"] is None, card
        assert not {r["verdict"] for r in card["ranks"]} & {"hung", "stalled"}, card["ranks"]
        assert "2 (checkpoint) in a declared phase past the hang ceiling" in d.log_text()
    finally:
        for job in jobs:
            job.stop()


def test_ranks_waiting_inside_their_evaluation_for_a_frozen_peer_are_hung(daemon_factory,
                                                                         tmp_path):
    """After 20 steps every rank of 'eval-freeze' evaluates inside its evaluation phase, an
    all-reduce of its metric each batch, and rank 2 freezes at its 60th batch (SIGSTOP: a
    rank dead or frozen inside the evaluation; gloo fails fast on a dead peer, NCCL waits for
    its watchdog). Ranks 0 and 1 wait for it in their all-reduce, inside their phase: no step
    is open anywhere. Past the ceiling the daemon takes their stacks: they wait in a
    collective for a rank that can join none, and the run is hung. The near miss,
    'eval-sync': the same evaluation with no rank frozen, every rank in its phase past the
    ceiling: no hang (and no stacks taken: nobody is gone, no step waits)."""
    d = ceiling_daemon(daemon_factory, tmp_path)
    jobs = [Job(tmp_path, run, [d.ingest_url] * 3, "--block", "phase-freeze", "--block-rank",
                who, "--block-after", "20")
            for run, who in (("eval-freeze", "2"), ("eval-sync", "99"))]
    try:
        card = placed(d, "eval-freeze", hung=True, timeout=240, unplaced=("2",))
        ranks = {r["rank"]: r for r in card["ranks"]}
        for r in ("0", "1"):
            assert ranks[r]["verdict"] == "hung", ranks[r]
            assert ranks[r]["location"] == "collective", ranks[r]
            assert ranks[r]["phase_in_progress"]["evaluation"] > 40, ranks[r]
            assert "inside its evaluation phase" in ranks[r]["reason"], ranks[r]
        assert ranks["2"]["verdict"] == "stopped", ranks["2"]
        assert "every rank waits in a collective" in card["hang"], card["hang"]

        def evaluating() -> dict | None:  # every rank in its evaluation past the ceiling
            card = run_of(d, "eval-sync")
            return card if card and len(card["ranks"]) == 3 and all(
                r["phase_in_progress"].get("evaluation", 0) > 45 for r in card["ranks"]) else None

        card = wait_until(evaluating, timeout=120, interval=1,
                          what=lambda: f"eval-sync evaluating ({run_of(d, 'eval-sync')})")
        assert card["status"] != "hung" and card["hang"] is None, card
        assert not {r["verdict"] for r in card["ranks"]} & {"hung", "stalled"}, card["ranks"]
        assert not hang_profiles(d, "eval-sync")
    finally:
        for job in jobs:
            job.stop()


def test_a_validation_nobody_declared_is_an_evaluation_the_others_wait_for(daemon_factory,
                                                                         tmp_path):
    """A hand-written loop: after 2,000 steps rank 2 validates for 75 s (``model.eval()``,
    forward passes, no phase declared) while ranks 0 and 1 wait for it at a barrier. The
    client watches the model (``watch_communication``) and pushes rank 2 as in an evaluation
    from the first push that sees it in ``eval()``: past the hang limit the others read
    waiting, never hung, and the run steps again once rank 2 is back in ``train()``. (Without
    the model watched, or with a rank stuck in its own code in ``train()``, the run is hung:
    test_hangs.py.)"""
    d = ceiling_daemon(daemon_factory, tmp_path)
    job = Job(tmp_path, "val-own", [d.ingest_url] * 3, "--block", "eval-undeclared",
              "--block-rank", "2", "--block-after", "2000", "--block-seconds", "75")

    def validating() -> dict | None:
        card = run_of(d, "val-own")
        ranks = {r["rank"]: r for r in card["ranks"]} if card else {}
        return card if ranks.get("2", {}).get("phase_in_progress", {}).get(
            "evaluation", 0) > 55 else None

    try:
        card = wait_until(validating, timeout=180, interval=1,
                          what=lambda: f"rank 2 of val-own validating ({run_of(d, 'val-own')})")
        ranks = {r["rank"]: r for r in card["ranks"]}
        assert card["status"] != "hung" and card["hang"] is None, card
        for r in ("0", "1"):
            assert ranks[r]["verdict"] == "waiting", ranks[r]
            assert ranks[r]["step_in_progress_seconds"] > 40, ranks[r]  # past the limit
            assert "rank 2's evaluation" in ranks[r]["reason"], ranks[r]
        steps = sample_value(d.metrics(), "gputrain_training_steps_total",
                             {"run": "val-own", "rank": "0"})
        wait_until(lambda: (sample_value(d.metrics(), "gputrain_training_steps_total",
                                         {"run": "val-own", "rank": "0"}) or 0) > (steps or 0),
                   timeout=120, interval=1, what="val-own stepping again after the validation")
    finally:
        job.stop()


def test_a_lightning_ranks_epoch_start_that_never_ends_is_hung_with_it_named(daemon_factory,
                                                                           tmp_path):
    """Lightning's DDP strategy over two gloo ranks, with its callback: at the second epoch
    rank 1's DataLoader never starts (its first read blocks) while rank 0 waits in that
    epoch's first all-reduce. The callback pushes rank 1 as in its DataLoader's start (its
    hooks cannot tell that from the fetch), so past the ceiling the daemon takes the stacks
    and names the run hung, rank 1 in its data set."""
    require_module("lightning")
    d = ceiling_daemon(daemon_factory, tmp_path)
    log = open(tmp_path / "lightning.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "ddp_frameworks.py"), "lightning", d.ingest_url,
         "hang"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
             "PATH": f"{ENV_BIN}:/usr/bin:/bin"})
    try:
        card = placed(d, "pl-hang", hung=True, timeout=240, more=lambda: (
            f"; its log: {(tmp_path / 'lightning.log').read_text()[-2000:]}"))
        ranks = {r["rank"]: r for r in card["ranks"]}
        assert ranks["0"]["verdict"] == ranks["1"]["verdict"] == "hung", ranks
        assert ranks["0"]["location"] == "collective", ranks["0"]
        assert ranks["1"]["location"] == "data_loading", ranks["1"]
        assert ranks["1"]["phase_in_progress"]["dataloader_start"] > 40, ranks["1"]
        assert "rank 1" in card["hang"] and "__getitem__" in card["hang"], card["hang"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
