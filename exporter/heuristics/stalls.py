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


# -- Prometheus' histogram_quantile: one definition, for the rules' evaluator and the daemon --

def outside_quantiles(q: float) -> float | None:
    """A quantile's value for a ``q`` outside [0, 1] (NaN, -Inf, +Inf), else None."""
    if math.isnan(q):
        return math.nan
    if q < 0 or q > 1:
        return math.copysign(math.inf, q)
    return None


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' bucketQuantile over (upper bound, cumulative count) pairs: NaN without a
    +Inf bucket or observations; linear within the bucket the rank falls in; the highest finite
    bound where it falls in +Inf's."""
    out_of_range = outside_quantiles(q)
    if out_of_range is not None:
        return out_of_range
    buckets = sorted(buckets)
    if not buckets or buckets[-1][0] != math.inf:
        return math.nan
    merged: list[list[float]] = []
    for bound, count in buckets:  # one bucket a bound (coalesceBuckets)
        if merged and merged[-1][0] == bound:
            merged[-1][1] += count
        else:
            merged.append([bound, count])
    for i in range(1, len(merged)):  # ensureMonotonic
        merged[i][1] = max(merged[i][1], merged[i - 1][1])
    if len(merged) < 2:
        return math.nan
    observations = merged[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = next((i for i in range(len(merged) - 1) if merged[i][1] >= rank), len(merged) - 1)
    if b == len(merged) - 1:
        return merged[-2][0]
    if b == 0 and merged[0][0] <= 0:
        return merged[0][0]
    start, end, count = 0.0, merged[b][0], merged[b][1]
    if b > 0:
        start = merged[b - 1][0]
        count -= merged[b - 1][1]
        rank -= merged[b - 1][1]
    if not count:  # (never, for monotonic counts and 0 < q <= 1)
        return math.nan
    return start + (end - start) * rank / count


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> \
        float | None:
    """:func:`bucket_quantile` of cumulative ``counts`` (the last one +Inf's) over finite upper
    ``bounds``; None where it is NaN (no observation)."""
    if len(counts) != len(bounds) + 1:
        return None
    value = bucket_quantile(q, [*zip(bounds, counts[:-1], strict=True), (math.inf, counts[-1])])
    return None if math.isnan(value) else value


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
