"""A rank's place, read from the stacks the daemon takes when a run's first steps (or a
phase) pass the hang ceiling, stands until the rank makes a step: where no step comes, the
daemon takes the stacks again each ``hung_min_seconds`` while the run is not hung. Real
torch.distributed (gloo on the CPU), three ranks on one daemon. (Apart from
``test_hang_ceiling.py`` so that the suite's workers run both at once.)
"""

from __future__ import annotations

import pytest
from conftest import NO_HOST, wait_until
from test_hangs import Job, run_of

pytestmark = pytest.mark.torch


def test_a_place_taken_before_the_first_step_is_taken_again_while_no_step_tells(
        daemon_factory, tmp_path):
    """In their first step, ranks 0 and 1 of 'moved-on' wait at a barrier while rank 2
    prepares the data (55 s): past the ceiling the stacks place them in the barrier, at risk
    of its timeout. Then the barrier passes and every rank compiles, in the same first step,
    for minutes: no step ends and no phase comes between, so nothing but new stacks can tell
    that they left the barrier. The daemon takes them again each hung_min_seconds (10 s here;
    the ceiling 20 s) while the run's first steps last: their place becomes their own code,
    and the timeout risk is no longer said."""
    cfg = tmp_path / "thresholds.yml"
    cfg.write_text("thresholds:\n  hung_max_seconds: 20\n  hung_min_seconds: 10\n")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", *NO_HOST,
                       f"--status.rules-config={cfg}")
    job = Job(tmp_path, "moved-on", [d.ingest_url] * 3, "--block", "prepare-in-step",
              "--block-rank", "2", "--block-seconds", "55", "--first-step-seconds", "400")
    try:
        def at_risk() -> dict | None:
            card = run_of(d, "moved-on")
            ranks = {r["rank"]: r for r in card["ranks"]} if card else {}
            return ranks if ranks and all(ranks[r]["verdict"] == "timeout-risk"
                                          for r in ("0", "1")) else None

        wait_until(at_risk, timeout=180, interval=1,
                   what=lambda: f"ranks 0 and 1 at risk ({run_of(d, 'moved-on')})")

        def moved_on() -> dict | None:
            card = run_of(d, "moved-on")
            ranks = {r["rank"]: r for r in card["ranks"]} if card else {}
            return ranks if ranks and all(
                ranks[r]["location"] not in (None, "collective") for r in "012") else None

        ranks = wait_until(moved_on, timeout=240, interval=1,
                           what=lambda: f"the ranks placed in their own code "
                                        f"({run_of(d, 'moved-on')})")
        assert not {r["verdict"] for r in ranks.values()} & {"timeout-risk", "hung"}, ranks
        assert all(r["step_in_progress_seconds"] > 55 for r in ranks.values()), ranks
    finally:
        job.stop()
