"""Rare long stalls by the time they cost, from the step histogram a client pushes.

A stall in under 1 % of the steps (a DataLoader re-created each epoch, a checkpoint every few
hundred steps) never moves the p99 step time, yet can cost a fifth of the wall time. The
ingest counts, at every push, the seconds the new steps spent in steps over
:data:`SLOW_STEP_FACTOR` times the rank's median step (from the buckets alone),
exported as ``gputrain_training_slow_step_seconds_total``. Cost: one pass over the buckets a
push.
"""

from __future__ import annotations

import math

# "far above the typical step": a step over this many times the rank's median
SLOW_STEP_FACTOR = 5.0


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> \
        float | None:
    """Prometheus' histogram_quantile on cumulative ``counts`` (the last one +Inf's) over
    finite upper ``bounds``: linear within the bucket, the highest finite bound past it."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    for i, c in enumerate(counts):
        if c >= rank:
            if i == len(bounds):
                return bounds[-1] if bounds else None
            lower = bounds[i - 1] if i > 0 else 0.0
            below = counts[i - 1] if i > 0 else 0
            inside = c - below
            if inside <= 0:
                return bounds[i]
            return lower + (bounds[i] - lower) * (rank - below) / inside
    return bounds[-1] if bounds else None


def _slow_line(bounds: tuple[float, ...], before: tuple[float, ...],
               after: tuple[float, ...], factor: float) -> float | None:
    """The step time over which a step is slow: ``factor`` times the median of ``after``
    (None where the histograms do not fit their bounds or hold no step)."""
    if not bounds or len(after) != len(bounds) + 1 or len(before) != len(after):
        return None
    median = histogram_quantile(0.5, bounds, after)
    return factor * median if median else None


def slow_step_seconds(bounds: tuple[float, ...], before: tuple[float, ...],
                      after: tuple[float, ...], seconds: float,
                      factor: float = SLOW_STEP_FACTOR) -> float:
    """Seconds of the steps between two cumulative histograms (``before``, ``after``: the
    counts with the +Inf bucket last; ``seconds`` their step time) that were slower than
    ``factor`` times the median of ``after``. A bucket wholly above that line counts its
    steps at its middle (linear within the bucket, as histogram_quantile reads it), the
    +Inf bucket at its lower bound; where the step time less every other step at its
    bucket's top proves more (a stall past the last bucket), that counts."""
    limit = _slow_line(bounds, before, after, factor)
    if limit is None:
        return 0.0
    slow, others_at_top = 0.0, 0.0
    below = 0.0
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        n, below = (a - b) - below, a - b  # the new steps in bucket i
        if n <= 0:
            continue
        lower = bounds[i - 1] if i > 0 else 0.0
        if lower >= limit:
            slow += n * ((lower + bounds[i]) / 2 if i < len(bounds) else lower)
        else:
            others_at_top += n * (bounds[i] if i < len(bounds) else math.inf)
    return max(slow, seconds - others_at_top, 0.0)


def slow_step_count(bounds: tuple[float, ...], before: tuple[float, ...],
                    after: tuple[float, ...], factor: float = SLOW_STEP_FACTOR) -> float:
    """How many of the steps between two cumulative histograms (as :func:`slow_step_seconds`)
    fell in buckets wholly above ``factor`` times the median of ``after``: with the steps'
    count, the share of steps that are slow, which tells a loader's period (one slow step in
    its N workers) from rare stalls (one in hundreds)."""
    limit = _slow_line(bounds, before, after, factor)
    if limit is None:
        return 0.0
    slow, below = 0.0, 0.0
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        n, below = (a - b) - below, a - b
        if n > 0 and (bounds[i - 1] if i > 0 else 0.0) >= limit:
            slow += n
    return slow
