"""A change of regime in a rank's own series: found after a fix or a slowdown, never in noise.

The detector (exporter.heuristics.regime) reads the 10 s intervals the daemon's history keeps.
Here the intervals are built from simulated steps (seeded), as a training loop makes them: a
fix halves the data wait, a slowdown doubles the step; the near misses are a steady run with
step times jittering +-50 %, one slow step, a rare stall, a small drift, and a run with too few
steps to tell.
"""

from __future__ import annotations

import random

import pytest

from exporter.heuristics.regime import (
    CHANGE,
    MIN_STEPS,
    REGIME_SECONDS,
    Interval,
    change_point,
    short_window,
)

POINT = 10.0  # seconds between the history's points


def run(paces: list[tuple[float, float, float]], seconds: float, seed: int = 1,
        jitter: float = 0.1, extra: dict[int, float] | None = None) -> list[Interval]:
    """Intervals of ``POINT`` s over ``seconds`` of a loop whose step (compute s, wait s) is
    ``paces[i]`` from its start time ``paces[i][0]`` on; each step's parts vary by
    +-``jitter``; ``extra`` adds seconds to the step with that number (a stall)."""
    rnd = random.Random(seed)
    t, n, out = 0.0, 0, []
    edge, acc = POINT, [0, 0.0, 0.0, 0]
    while t < seconds:
        _, compute, wait = [p for p in paces if p[0] <= t][-1]
        c = compute * (1 + rnd.uniform(-jitter, jitter))
        w = wait * (1 + rnd.uniform(-jitter, jitter))
        step = c + w + (extra or {}).get(n, 0.0)
        t += step
        n += 1
        acc = [acc[0] + 1, acc[1] + step, acc[2] + w, acc[3] + 32]
        while t >= edge:  # the step counts in the interval it ends in
            out.append(Interval(edge, POINT, *acc))
            acc, edge = [0, 0.0, 0.0, 0], edge + POINT
    return out


def watched(iv: list[Interval]) -> list[float | None]:
    """What the detector says at each point, as the daemon asks it every 10 s."""
    return [change_point(iv[:k], iv[k - 1].end) for k in range(1, len(iv) + 1)]


def first_found(iv: list[Interval]) -> tuple[float, float]:
    """When the detector first finds a change (unix seconds), and where it places it."""
    found = watched(iv)
    k = next(k for k, x in enumerate(found) if x is not None)
    return iv[k].end, found[k]


def test_a_fix_that_halves_the_step_is_found_where_it_happened():
    # input-bound: 40 ms waiting + 10 ms computing; the loader fixed at 200 s (wait 2 ms)
    when, where = first_found(run([(0, 0.010, 0.040), (200, 0.010, 0.002)], 300))
    # found inside the recent window after the fix, and placed at the fix (one interval)
    assert when - 200 <= REGIME_SECONDS
    assert where == pytest.approx(200, abs=POINT)


def test_a_slowdown_is_a_change_too():
    when, where = first_found(run([(0, 0.020, 0.002), (150, 0.040, 0.002)], 240))
    assert when - 150 <= REGIME_SECONDS
    assert where == pytest.approx(150, abs=POINT)


def test_a_wait_share_that_moves_with_the_step_is_a_change():
    # the wait drops from 30 % to 5 % of the step, the step by 17 %: under CHANGE alone,
    # but the data wait moved with it
    _, where = first_found(run([(0, 0.035, 0.015), (150, 0.0395, 0.0021)], 240))
    assert where == pytest.approx(150, abs=POINT)


@pytest.mark.parametrize("name,paces,extra,jitter", [
    ("steady with step times jittering +-50 %", [(0, 0.02, 0.02)], None, 0.5),
    ("one slow step of 5 s", [(0, 0.02, 0.02)], {4000: 5.0}, 0.1),
    ("a rare stall: 3 s every 2000 steps", [(0, 0.02, 0.02)],
     {n: 3.0 for n in range(500, 10000, 2000)}, 0.1),
    ("a drift of 10 %", [(0, 0.02, 0.02), (150, 0.022, 0.022)], None, 0.1),
])
def test_noise_is_no_change(name, paces, extra, jitter):
    iv = run(paces, 300, jitter=jitter, extra=extra)
    # at every point of the run: the near misses never restart the window
    assert watched(iv) == [None] * len(iv), name


def test_too_few_steps_are_no_evidence():
    # 6 s steps, then 3.5 s: 17 a minute, under MIN_STEPS in the recent window
    iv = run([(0, 4.0, 2.0), (150, 3.0, 0.5)], 300)
    recent = sum(x.steps for x in iv if x.end > iv[-1].end - REGIME_SECONDS)
    assert recent < MIN_STEPS
    assert watched(iv) == [None] * len(iv)


def test_the_rest_of_the_regime_must_be_as_long_as_the_recent_part():
    # a run (or a regime) younger than twice the recent window: nothing to compare with
    iv = run([(0, 0.01, 0.04), (70, 0.01, 0.0)], 110)
    assert change_point(iv, iv[-1].end) is None


def test_the_threshold_is_a_real_margin():
    assert 0.1 < CHANGE < 0.5  # between the noise above and the fixes worth naming


def test_a_young_regime_is_read_over_the_regime_window_only_while_it_fills_it():
    assert not short_window(None, 300)
    assert not short_window(REGIME_SECONDS - 1, 300)  # not yet a window of its own
    assert short_window(REGIME_SECONDS, 300)
    assert short_window(299, 300)
    assert not short_window(300, 300)  # the rate window holds the new regime alone
