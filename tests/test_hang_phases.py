"""Hangs a declared phase holds, end to end: real torch.distributed (gloo on the CPU), three
ranks on one daemon whose ceiling (``hung_max_seconds``) is ``CEILING`` (``ceiling_daemon``).

A phase stops a rank's clock and its peers wait for it; past the ceiling the daemon takes the
stacks, and where nobody works the run is hung: a DataLoader's start its peers wait for (also
a framework's epoch start), a phase whose own rank waits in a collective its peers never join,
ranks waiting inside their evaluation for a peer that froze there. A phase whose rank works (a
checkpoint's write, every rank's slow start, an evaluation that syncs its metrics, a validation
nobody declared that the client sees in ``model.eval()``) holds its run. (Apart from
``test_hang_ceiling.py`` so that the suite's workers run both at once.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import ENV_BIN, ROOT, require_module, sample_value, wait_until
from test_hang_ceiling import CEILING, ceiling_daemon, placed
from test_hangs import Job, hang_profiles, run_of

pytestmark = pytest.mark.torch


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
        assert ranks["2"]["phase_in_progress"]["dataloader_start"] > CEILING, ranks["2"]
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
        assert ranks["2"]["phase_in_progress"]["evaluation"] > CEILING, ranks["2"]
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
        # the save holds its peers at the barrier: their collective's timeout draws near
        verdicts = {r["rank"]: r["verdict"] for r in card["ranks"]}
        assert verdicts["0"] == verdicts["1"] == "timeout-risk" != verdicts["2"], verdicts
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
            assert ranks[r]["phase_in_progress"]["evaluation"] > CEILING, ranks[r]
            assert "inside its evaluation phase" in ranks[r]["reason"], ranks[r]
        assert ranks["2"]["verdict"] == "stopped", ranks["2"]
        assert "every rank waits in a collective" in card["hang"], card["hang"]

        def evaluating() -> dict | None:  # every rank in its evaluation past the ceiling
            card = run_of(d, "eval-sync")
            return card if card and len(card["ranks"]) == 3 and all(
                r["phase_in_progress"].get("evaluation", 0) > CEILING + 5
                for r in card["ranks"]) else None

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
    """A hand-written loop: after 2,000 steps rank 2 validates for 80 s (``model.eval()``,
    forward passes, no phase declared) while ranks 0 and 1 wait for it at a barrier. The
    client watches the model (``watch_communication``) and pushes rank 2 as in an evaluation
    from the first push that sees it in ``eval()``: past the hang limit the others read
    waiting (at risk of their barrier's timeout once past the ceiling), never hung, and the
    run steps again once rank 2 is back in ``train()``. (Without
    the model watched, or with a rank stuck in its own code in ``train()``, the run is hung:
    test_hangs.py.)"""
    d = ceiling_daemon(daemon_factory, tmp_path)
    job = Job(tmp_path, "val-own", [d.ingest_url] * 3, "--block", "eval-undeclared",
              "--block-rank", "2", "--block-after", "2000", "--block-seconds", "80")

    def validating() -> dict | None:
        card = run_of(d, "val-own")
        ranks = {r["rank"]: r for r in card["ranks"]} if card else {}
        return card if ranks.get("2", {}).get("phase_in_progress", {}).get(
            "evaluation", 0) > 62 else None  # past the limit and the floor

    try:
        card = wait_until(validating, timeout=180, interval=1,
                          what=lambda: f"rank 2 of val-own validating ({run_of(d, 'val-own')})")
        ranks = {r["rank"]: r for r in card["ranks"]}
        assert card["status"] != "hung" and card["hang"] is None, card
        for r in ("0", "1"):
            # waiting for rank 2's evaluation; once the stacks taken past the ceiling
            # place them in the barrier, at risk of its timeout, rank 2 named either way
            assert ranks[r]["verdict"] in ("waiting", "timeout-risk"), ranks[r]
            assert ranks[r]["step_in_progress_seconds"] > CEILING, ranks[r]  # past the limit
            assert "rank 2" in ranks[r]["reason"], ranks[r]
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
        assert ranks["1"]["phase_in_progress"]["dataloader_start"] > CEILING, ranks["1"]
        assert "rank 1" in card["hang"] and "__getitem__" in card["hang"], card["hang"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
