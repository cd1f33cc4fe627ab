"""Hangs, as the daemon sees them: when a run turns hung, dump the stacks of its ranks here.

Each sampler cycle :class:`HangWatch` looks for a live rank whose step in progress has run past
the floor of the hung limit (``hung_min_seconds``); only then does it build the window's
reports and ask the catalogue (:class:`~exporter.heuristics.catalogue.RunHung`) whether the
rank's run is hung. A run that is asks each of its ranks that push here for a py-spy dump
with native frames, once per hang (a hang is the ranks' processes and step counts: a run that
steps again and hangs again is a new one), within the profile board's bounds. So does a run
whose every live rank is still in its first step past the hang ceiling: with no pace yet,
only the stacks tell a wait (a hang) from a compilation; and so does a run whose steps
stopped while a rank's declared phase (a DataLoader's start, an evaluation) passed the
ceiling: only the stacks tell whether the others wait for it, and it for them. Those two are
dumped again each ``hung_min_seconds`` (or the ranks' ceiling, where a short collective
timeout lowers it) while they last: with no step, nothing else tells that
a rank moved on from a barrier to its own work (its last place would stand). The board
classifies each dump (:mod:`exporter.heuristics.location`); :func:`with_locations` puts the
answer on the reports every surface judges.
"""

from __future__ import annotations

import logging
from typing import Any

from exporter.heuristics.catalogue import (
    BY_VERDICT,
    alive,
    ceiling_of,
    first_steps_past_ceiling,
    hang_ceiling,
    phase_past_ceiling,
    phases_past_ceiling,
)
from exporter.heuristics.readings import RankReport, run_key
from exporter.serving.history import History
from exporter.serving.ingest import RankState
from exporter.serving.profiles import ProfileBoard

log = logging.getLogger(__name__)

MAX_REMEMBERED = 256  # hangs already captured, remembered to capture each once


def with_locations(reports: list[RankReport], history: History,
                   board: ProfileBoard | None) -> list[RankReport]:
    """Set each report's location (and the function that says so) from its rank's last hang
    capture, while the rank has made no step since it was asked for."""
    if board is None:
        return reports
    found = board.hang_locations()
    if not found:
        return reports
    states = history.rank_states()
    for rep in reports:
        key = (rep.run, rep.rank)
        where, st = found.get(key), states.get(key)
        if where is not None and st is not None and where.current(st.steps):
            rep.location, rep.location_detail = {where.location: 1.0}, where.function
    return reports


class HangWatch:
    """Captures the stacks of a hung run's ranks on this node, once per hang (and those of a
    run its stacks may prove hung, once each ``hung_min_seconds`` while it may)."""

    def __init__(self, history: History, board: ProfileBoard,
                 thresholds: dict[str, float]) -> None:
        self.history = history
        self.board = board
        self.thresholds = thresholds
        # hang -> when its stacks were taken (the history's clock)
        self._captured: dict[tuple[Any, ...], float] = {}

    def check(self) -> None:
        """One cycle: capture the stacks of each run that turned hung since the last."""
        t = self.thresholds
        floor = t["hung_min_seconds"]
        now = self.history.clock()
        states = self.history.rank_states()

        def looked_at(st: RankState) -> bool:
            # a step past the floor, or a phase past the ceiling (its peers may be gone); a
            # short collective timeout lowers both
            ceiling = hang_ceiling(st.collective_timeout_seconds, t)
            return (st.step_in_progress(now) or 0.0) > min(floor, ceiling) or \
                (st.phase_in_progress(now) or ("", 0.0))[1] > ceiling

        if not any(looked_at(st) for st in states.values()):
            if self._captured:
                self._captured.clear()
            return
        runs: dict[tuple, list[RankReport]] = {}
        for rep in self.history.reports():
            runs.setdefault(run_key(rep), []).append(rep)
        hung = BY_VERDICT["hung"]
        for ranks in runs.values():
            # a run hung, or one whose every rank is still in its first step past the hang
            # ceiling: its stacks tell a wait (then it is hung) from a compilation
            said = bool(hung.holds_run(ranks, t))
            first = not said and first_steps_past_ceiling(ranks, t)
            start = not said and not first and phases_past_ceiling(ranks, t)
            if not (said or first or start):
                continue
            hang: tuple[Any, ...] = tuple(sorted(
                (r.run, r.rank, states[(r.run, r.rank)].run_id, states[(r.run, r.rank)].steps)
                for r in ranks if (r.run, r.rank) in states))
            # a run not (yet) hung is looked at again each hung_min_seconds (or its ceiling,
            # where a short collective timeout lowers it) while it stays so: a rank that
            # waited at a barrier may be compiling now, with no step to tell
            last = self._captured.get(hang)
            again = min(floor, min(ceiling_of(r, t) for r in ranks))
            if last is not None and (said or now - last < max(again, 1.0)):
                continue
            self._captured.pop(hang, None)
            if len(self._captured) >= MAX_REMEMBERED:
                self._captured.pop(next(iter(self._captured)))
            run = ranks[0].run
            # (a frozen rank, silent while its process runs, cannot be asked: it takes the
            # request through its own pushes)
            ids = self.board.capture_hang(run, [r.rank for r in ranks if alive(r, t)])
            self._captured[hang] = now
            if last is not None:
                log.debug("run %s: its stacks taken again (%s)", run, ", ".join(ids))
            elif said:
                log.warning("run %s is hung: its steps stopped far past their pace; captured "
                            "the stacks of %d of its %d rank(s) here (%s)", run, len(ids),
                            len(ranks), ", ".join(ids) or "none could be asked")
            elif first:
                log.warning("run %s has made no first step in %.0f s: capturing the stacks of "
                            "%d of its %d rank(s) here to tell a hang from a compilation (%s)",
                            run, max(r.step_in_progress or 0.0 for r in ranks), len(ids),
                            len(ranks), ", ".join(ids) or "none could be asked")
            else:
                log.warning("run %s: rank(s) %s in a declared phase past the hang ceiling "
                            "while the others' steps stopped: capturing the stacks of %d of "
                            "its %d rank(s) here to tell whether they wait for it (%s)", run,
                            ", ".join(f"{r.rank} ({next(iter(r.phase_in_progress))})"
                                      for r in ranks if phase_past_ceiling(r, t)),
                            len(ids), len(ranks), ", ".join(ids) or "none could be asked")
