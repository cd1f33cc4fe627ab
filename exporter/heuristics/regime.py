"""A change of regime in a rank's own series: after a fix, judge the new regime on its own.

A rank's readings are ratios over the rate window (5 m). After a fix (the data wait halves) that
window averages the old regime with the new one for minutes. The daemon's history looks for a
change point in each rank's points (a point every 10 s, the rate window's worth, so the cost is
bounded by what the history keeps anyway): the last :data:`RECENT_SECONDS` are compared with the
rest of the current regime, interval by interval, by their medians (robust: one slow step, a
rare stall or a checkpoint moves one interval, never the median). A change is when the step
time and the throughput move together beyond :data:`CHANGE` (the one pace seen twice, so
jitter in one does not count), or when the data wait's share of the step moves by
:data:`WAIT_SHIFT` while the step time moves the same way by :data:`CHANGE` / 2. Each side
needs :data:`MIN_STEPS` steps and :data:`MIN_INTERVALS` intervals.

Where the change began is the first recent interval from which every interval lies nearer the
new median than the old. The daemon exports it as
``gputrain_training_regime_start_timestamp_seconds{run,rank}``; once the regime is
:data:`REGIME` old (so a window of that length holds it alone) and while it is younger than the
rate window, every surface reads the rank over the last :data:`REGIME` instead of the rate
window: the recording rules (so the alerts and ``diagnose``) select the short-window reading
with :func:`exporter.heuristics.promql.regime_selected`, the daemon's history the same span
(:meth:`exporter.serving.history.History.reports`), by the one condition :func:`short_window`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median
from typing import NamedTuple

from exporter.heuristics.readings import WINDOWS, window_seconds

REGIME = WINDOWS["regime"]  # the window a young regime is read over, as PromQL writes it
REGIME_SECONDS = window_seconds("regime")
# the recent part the detector compares with the rest of the regime: as long as the window
# the new regime is then read over, so that a change found is one that window can show
RECENT_SECONDS = REGIME_SECONDS
# Relative move of the median step time and throughput that is a new regime. A fix worth
# acting on moves the pace by far more (halving the data wait of an input-bound run moves it
# by 30-80 %); the medians of 10 s intervals of a steady run move by a few per cent even with
# step times jittering by +-50 % (tests/test_regime.py), so 25 % leaves a wide margin on both
# sides.
CHANGE = 0.25
# Absolute move of the data wait's share of the step time (0-1) that, with the step time
# moving the same way by half of CHANGE, is a new regime too: the input pipeline fixed while
# the step also got slower elsewhere. 0.10 is twice the input-bound threshold's 0.05 step.
WAIT_SHIFT = 0.10
MIN_STEPS = 20  # steps on each side of a change: fewer are no evidence of a pace
MIN_INTERVALS = 3  # intervals (points apart) on each side: a median of fewer is one reading


class Interval(NamedTuple):
    """One span between two of a rank's points: its end (unix seconds), its length, and what
    the rank's counters grew by in it."""

    end: float
    seconds: float
    steps: float
    step_seconds: float
    wait: float
    samples: float

    @property
    def pace(self) -> tuple[float, float, float]:
        """(mean step time s, data wait share of the step time 0-1, samples per step-second)."""
        return (self.step_seconds / self.steps, self.wait / self.step_seconds,
                self.samples / self.step_seconds)


def change_point(intervals: Sequence[Interval], now: float,
                 recent: float = RECENT_SECONDS) -> float | None:
    """Where a new regime began (unix seconds: an interval's start), or None where the last
    ``recent`` seconds before ``now`` pace as the intervals before them (see the module
    docstring). ``intervals`` are the current regime's, oldest first."""
    stepping = [x for x in intervals if x.steps > 0 and x.step_seconds > 0]
    new = [x for x in stepping if x.end > now - recent]
    old = [x for x in stepping if x.end <= now - recent]
    if len(new) < MIN_INTERVALS or len(old) < MIN_INTERVALS:
        return None
    if sum(x.steps for x in new) < MIN_STEPS or sum(x.steps for x in old) < MIN_STEPS:
        return None
    if old[-1].end - (old[0].end - old[0].seconds) < recent:
        return None  # the rest of the regime must be as long as the recent part
    a = [median(v) for v in zip(*(x.pace for x in old), strict=True)]
    b = [median(v) for v in zip(*(x.pace for x in new), strict=True)]
    step, rate = _relative(a[0], b[0]), _relative(a[2], b[2])
    together = abs(step) >= CHANGE and abs(rate) >= CHANGE and step * rate < 0
    waited = abs(b[1] - a[1]) >= WAIT_SHIFT and abs(step) >= CHANGE / 2 and \
        (b[1] - a[1]) * step > 0
    if not (together or waited):
        return None
    # the first recent interval from which all are nearer the new pace (step time, on a log
    # scale: halving and doubling are the same distance)
    start = new[0].end - new[0].seconds
    for x in new:
        if _nearer_old(x, a[0], b[0]):
            start = x.end
    return start if start < now else None


def moved(old: Sequence[float], new: Sequence[float]) -> bool:
    """Whether two spans' mean paces differ by half a change or more (each span as what the
    rank's counters grew by: steps, step seconds, data wait seconds, samples): a steady rank's
    do not, so the daemon asks :func:`change_point` (medians, far dearer) only where they
    do. A regime change moves the medians and the means alike (an outlier moves only the
    mean: the medians then say no)."""
    if min(old[0], old[1], new[0], new[1]) <= 0:
        return False
    step = _relative(old[1] / old[0], new[1] / new[0])
    rate = _relative(old[3] / old[1], new[3] / new[1])
    wait = new[2] / new[1] - old[2] / old[1]
    return abs(step) >= CHANGE / 2 or abs(rate) >= CHANGE / 2 or abs(wait) >= WAIT_SHIFT / 2


def short_window(age: float | None, window: float) -> bool:
    """Whether a rank whose regime began ``age`` seconds ago is read over the last
    :data:`REGIME` instead of the rate window ``window`` (seconds): the regime fills it, and
    is younger than the rate window. The recording rules' selector writes the same."""
    return age is not None and REGIME_SECONDS <= age < window


def changed_text(age: float) -> str:
    """What a verdict's reason adds for a rank whose regime began ``age`` seconds ago (inside
    the rate window): when, and over what it is judged."""
    since = f"its pace changed {age:.0f} s ago"
    if age >= REGIME_SECONDS:
        return f"{since}: judged over the last {REGIME} alone"
    return f"{since}: judged over the whole window until the new pace fills {REGIME}"


def _relative(a: float, b: float) -> float:
    return (b - a) / a if a else 0.0


def _nearer_old(x: Interval, old: float, new: float) -> bool:
    step = math.log(x.pace[0])
    return abs(step - math.log(old)) < abs(step - math.log(new))
