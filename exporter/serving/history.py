"""The daemon's short memory of its node and ranks, read as diagnose reads Prometheus.

Every sampler cycle (in the sampler's thread, never on a request) the daemon notes what a window
needs: each GPU's integrated counters and running sums of its gauges, the node's counters, each
live rank's pushed totals. A point is kept every ``point_seconds`` for ``window`` seconds (and
a rank's process-tree memory and the node's available memory once a minute for an hour, for
the leak rule), so memory is bounded by the GPUs and the ingest's live ranks
(``--ingest.max-series``), however many ranks come and go.

:meth:`History.reports` turns the window into :class:`~exporter.heuristics.verdict.RankReport`
readings by the recording rules' own definitions (the same ratios of counters, over this window
instead of 5m), and :func:`exporter.heuristics.verdict.judge` gives the verdicts: the code
``diagnose`` runs.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from exporter.heuristics import regime
from exporter.heuristics.expr import Aggregate, Gauge, Lookup, Point, Series, compiled
from exporter.heuristics.promql import THROTTLE_REASONS
from exporter.heuristics.readings import (
    DISK_READ,
    DISK_WRITTEN,
    LEAK_SPANS,
    PHASE_SECONDS,
    RECEIVED,
    REFINED,
    REGIME_GPU,
    SAMPLES,
    SENT,
    STEP_SECONDS,
    STEPS,
    WAIT,
    WALL,
    GpuReading,
    RankReport,
    duration_seconds,
    of_scope,
    rank_order,
    window_seconds,
    with_open_step,
)
from exporter.heuristics.regime import (
    MIN_INTERVALS,
    REGIME_SECONDS,
    Interval,
    change_point,
    moved,
    short_window,
)
from exporter.protocol import OUTSIDE_STEP_PHASES
from exporter.reading.collectors import HostCollector, host_collectors, host_samples
from exporter.reading.host_processes import read_state
from exporter.reading.peak_flops import PeakTable
from exporter.reading.sampler import GpuState, Snapshot
from exporter.serving.attribution import NodeView, resolve_gpus
from exporter.serving.ingest import RankState, allowance_shares
from exporter.serving.training import ALLOWANCE, DEPARTED, FAMILIES, READERS

WINDOW_SECONDS = window_seconds("rate")  # the recording rules' ratios
POINT_SECONDS = 10.0  # a ratio over the window is exact to its end; its start may be this late
SLOW_POINT_SECONDS = 60.0  # a rank's memory and a GPU's error counts: a point a minute
RSS_SECONDS = window_seconds("leak")  # the leak rule's longer range
LEAK_MIN_SECONDS = window_seconds("leak_recent")  # its shorter: judged once this much is seen
FAULT_SECONDS = window_seconds("fault")  # new Xid and ECC errors count this long
RECENT_SECONDS = window_seconds("recent")  # a vanished run's GPUs: idle this long
HOLD_SECONDS = window_seconds("hold")  # a refinement's hysteresis (see REFINED)
RESTART_SECONDS = window_seconds("restart")  # a rank's restarts count this long
PERIODIC_SECONDS = window_seconds("periodic")  # a recurring cost's share: over this long
MAX_RESTARTS_KEPT = 64  # a crash loop's restarts in the hour, at most, that are counted


class _GpuPoint(NamedTuple):
    t: float  # unix seconds
    sampled: float  # seconds the sampler watched the GPU
    busy: float | None
    rx: float | None  # PCIe bytes received
    tx: float | None
    throttle: float  # seconds throttled (THROTTLE_REASONS)
    sm: float  # running sums of the gauges, and how many readings they hold
    sm_n: int
    tensor: float
    tensor_n: int
    power: float
    power_n: int
    # seconds its processes kept it busy: each live rank's, and no rank's (None where the
    # driver gives no per-process samples)
    ranks_busy: dict[tuple[str, str], float]
    unattributed: float | None
    link: float | None  # bytes/s of the PCIe link as trained at this cycle
    # who is on it at this cycle: the ranks whose processes are, and whether a process no
    # rank owns is (a share counts only while its processes are on the GPU)
    here: frozenset = frozenset()
    stranger_here: bool = False
    memory: float | None = None  # of its memory, the share used at this cycle
    sm_clock: float | None = None  # hertz of its SM clock at this cycle


@dataclass
class _GpuTrack:
    state: GpuState
    sums: list[float] = field(default_factory=lambda: [0.0, 0, 0.0, 0, 0.0, 0])
    last_sample: object = None
    points: deque = field(default_factory=deque)
    previous: _GpuPoint | None = None  # one cycle ago
    current: _GpuPoint | None = None
    # (t, Xid errors, uncorrectable ECC errors) a minute apart, over the fault window
    errors: deque = field(default_factory=lambda: deque(
        maxlen=int(FAULT_SECONDS / SLOW_POINT_SECONDS) + 2))


@dataclass
class _RankTrack:
    state: RankState
    # by counter: what its resets took off it (each value it fell from), as rate() adds back
    offsets: list = field(default_factory=lambda: [None] * len(_KEPT))
    # the state's own samples of _KEPT, as its page shows them, and the state they are of
    kept: tuple = ()
    kept_of: RankState | None = None
    # a counter its process no longer pushes since a restart, by position in _KEPT: the value
    # the last process left it at, to which it is compared when it comes back
    pending: dict[int, float] = field(default_factory=dict)
    bucket_offsets: tuple[int, ...] = ()
    epoch: int = 0
    points: deque = field(default_factory=deque)
    rss: deque = field(default_factory=deque)  # (t, bytes), a point a minute
    # (t, wall seconds, seconds in each phase outside the steps), a point a minute over the
    # periodic window: a recurring cost's share of the wall time
    outside: deque = field(default_factory=lambda: deque(
        maxlen=int(PERIODIC_SECONDS / SLOW_POINT_SECONDS) + 2))
    measure: str | None = None  # what ``rss`` holds: "pss", or "rss" where PSS is unreadable
    # when its process was replaced (a new run_id under the same run and rank)
    restarts: deque = field(default_factory=lambda: deque(maxlen=MAX_RESTARTS_KEPT))
    # unix seconds: where its current regime began (a change of pace found in its points),
    # and from where its points are compared (its current process's first push)
    regime_start: float | None = None
    regime_floor: float = 0.0


# a rank's readings the history evaluates from their trees (exporter.heuristics.expr): over
# the window (from its oldest point to now), and as they are now
WINDOWED = tuple(r for r in of_scope("rank") if r.tree is not None and r.window is not None)
INSTANT = tuple(r for r in of_scope("rank") if r.tree is not None and r.window is None
                and not isinstance(r.tree, Gauge))  # a gauge as it is: read_gauges
# the counters a rank's points keep: those the trees rate, and the history's own reads (its
# wall time and phases, and the regime detector's growths)
_KEPT: tuple[str, ...] = tuple(sorted(
    frozenset().union(*(r.tree.names() for r in WINDOWED if r.tree))
    | {WALL.name, PHASE_SECONDS.name, STEPS.name, STEP_SECONDS.name, WAIT.name, SAMPLES.name}))
_KEPT_INDEX = {name: i for i, name in enumerate(_KEPT)}
_KEPT_READERS = tuple(READERS[name] for name in _KEPT)
# where a point keeps the regime detector's four growths, and its wall time
_GROWTH = tuple(_KEPT_INDEX[x.name] for x in (STEPS, STEP_SECONDS, WAIT, SAMPLES))
_WALL_AT = _KEPT_INDEX[WALL.name]
# a node's readings, as trees: over the window and as they are now; and the byte rates the page
# shows of its disks and interfaces over the last cycle
NODE_WINDOWED = tuple(r for r in of_scope("node") if r.tree is not None and r.window)
NODE_INSTANT = tuple(r for r in of_scope("node") if r.tree is not None and r.window is None)
_BYTE_RATES = {
    "disk_read_bytes_per_second": Aggregate("sum", Series(DISK_READ, "device")),
    "disk_written_bytes_per_second": Aggregate("sum", Series(DISK_WRITTEN, "device")),
    "network_received_bytes_per_second": Aggregate("sum", RECEIVED),
    "network_transmitted_bytes_per_second": Aggregate("sum", SENT),
}
_HOST_KEPT: tuple[str, ...] = tuple(sorted(frozenset().union(
    *(r.tree.names() for r in NODE_WINDOWED if r.tree),
    *(x.names() for x in _BYTE_RATES.values()))))
_HOST_INDEX = {name: i for i, name in enumerate(_HOST_KEPT)}
_NODE_WINDOWED = compiled([*(r.tree for r in NODE_WINDOWED if r.tree), *_BYTE_RATES.values()],
                          _HOST_INDEX)
_NODE_INSTANT = compiled([r.tree for r in NODE_INSTANT if r.tree], _HOST_INDEX)
# the readings' fragments the daemon adds otherwise: a step in progress weighs in afterwards
# (readings.with_open_step)
_NO_OPEN_STEP = {"open_part": 0.0, "open_count": 0.0}
# the trees compiled (exporter.heuristics.expr.compiled): the windowed readings set on a
# report, returning the wall time's parts goodput and badput divide it into; the instant ones
_WINDOWED = compiled([WALL, STEP_SECONDS, WAIT, PHASE_SECONDS], _KEPT_INDEX,
                     [(r.field, r.tree) for r in WINDOWED if r.tree])
_INSTANT = compiled((), _KEPT_INDEX, [(r.field, r.tree) for r in INSTANT if r.tree])
_NO_GAUGES: dict[str, float | dict[str, float]] = {}  # a point kept in the window's


class History:
    """A bounded window of snapshots and rank totals (see the module docstring)."""

    def __init__(self, window: float = WINDOW_SECONDS, point_seconds: float = POINT_SECONDS,
                 peaks: PeakTable | None = None, instance: str = "",
                 interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 collectors: Sequence[HostCollector] | None = None) -> None:
        self.window = window
        # the ingest's monotonic clock: what ages a rank's step and phase in progress
        self.clock = clock
        self.interval = interval  # the sampler's, in seconds: what a collector's age counts in
        self.view: NodeView | None = None  # the latest cycle's, as observed
        self.point_seconds = point_seconds
        self.peaks = peaks or PeakTable()
        self.instance = instance
        self._points = math.ceil(window / point_seconds) + 1  # per track, at most
        self._gpus: dict[str, _GpuTrack] = {}
        self._host: deque = deque(maxlen=self._points)
        self._host_previous: Point | None = None
        self._host_current: Point | None = None
        # what renders the snapshot's host readings as the page's samples
        self.collectors = host_collectors() if collectors is None else tuple(collectors)
        self._memory: deque = deque(maxlen=int(RSS_SECONDS / SLOW_POINT_SECONDS) + 1)  # (t, B)
        # (t, the refined readings over the window ending at t): their peaks over the hold
        # range are the refinements' hysteresis
        self._host_peaks: deque = deque()
        self._ranks: dict[tuple[str, str], _RankTrack] = {}
        self._departed: dict[tuple[str, str], RankState] = {}
        self._lock = threading.Lock()
        self.first_seen: float | None = None
        self.version = 0

    # -- recording (the sampler's thread) ---------------------------------------------------

    def observe(self, view: NodeView) -> None:
        """Note one sampler cycle's view: its snapshot, the ranks live at its end and who
        holds which GPU (:mod:`exporter.serving.attribution`)."""
        snap, states = view.snapshot, view.states
        t = snap.timestamp
        ranks_busy, unowned = view.busy, view.unowned
        ranks_here, strangers = view.listed, view.strangers
        host = host_samples(self.collectors, snap.host)  # outside the lock: requests wait on it
        with self._lock:
            self.view = view  # its snapshot is the history's latest
            if self.first_seen is None:
                self.first_seen = t
            seen = set()
            for gs in snap.gpus:
                gkey = gs.identity.uuid or gs.identity.index
                seen.add(gkey)
                gtrack = self._gpus.get(gkey)
                if gtrack is None:
                    gtrack = self._gpus[gkey] = _GpuTrack(gs, points=deque(maxlen=self._points))
                gpu = (gs.identity.index, gs.identity.uuid)
                self._note_gpu(gtrack, gs, t,
                               {rank: busy[gpu][0] for rank, busy in ranks_busy.items()
                                if gpu in busy},
                               unowned[gpu][0] if gpu in unowned else None,
                               (frozenset(k for k, on in ranks_here.items() if gpu in on),
                                gpu in strangers))
            for gone in [k for k in self._gpus if k not in seen]:
                del self._gpus[gone]
            self._note_host(snap, host, t)
            live: dict[tuple[str, str], _RankTrack] = {}
            for st in states:
                key = (st.run, st.rank)
                track = self._ranks.get(key)
                if track is None:
                    track = _RankTrack(st, points=deque(maxlen=self._points),
                                       rss=deque(maxlen=int(RSS_SECONDS / SLOW_POINT_SECONDS) + 1))
                    track.points.append(self._rank_point(track, t))
                elif st is not track.state:
                    self._note_push(track, st, t)
                # a rank that stopped pushing keeps its points coming, its rates falling to
                # 0, as a scraped counter that stopped growing does
                if t - track.points[-1].t >= self.point_seconds:
                    track.points.append(self._rank_point(track, t))
                    self._detect(track, t)
                if not track.outside or t - track.outside[-1][0] >= SLOW_POINT_SECONDS:
                    point = track.points[-1]
                    track.outside.append((point.t, _wall(point), {
                        p: v for p, v in _phases(point).items() if p in OUTSIDE_STEP_PHASES}))
                memory = tree_memory(st)
                if memory is not None:
                    if memory[1] != track.measure:  # another measure is another series
                        track.rss.clear()
                        track.measure = memory[1]
                    if not track.rss or t - track.rss[-1][0] >= SLOW_POINT_SECONDS:
                        track.rss.append((t, memory[0]))
                live[key] = track
            self._ranks = live  # a rank the ingest forgot is forgotten here too
            # ... but one that ended without a clean close is reported as such a while
            self._departed = {(st.run, st.rank): st for st in view.departed
                              if (st.run, st.rank) not in live}
            self.version += 1

    def _note_gpu(self, track: _GpuTrack, st: GpuState, t: float,
                  ranks_busy: dict[tuple[str, str], float], unattributed: float | None,
                  here: tuple[frozenset, bool] = (frozenset(), False)) -> None:
        track.state = st
        s = st.sample
        sums = track.sums
        if s is not None and s is not track.last_sample and st.up:
            track.last_sample = s
            for i, value in ((0, s.sm_active), (2, s.tensor_active), (4, s.power_watts)):
                if value is not None:
                    sums[i] += value
                    sums[i + 1] += 1
        if not track.errors or t - track.errors[-1][0] >= SLOW_POINT_SECONDS:
            track.errors.append((t, *_error_counts(st)))
        throttle = sum(st.clock_event_seconds.get(r, 0.0) for r in THROTTLE_REASONS)
        link = s.pcie_link_current_bytes_per_second if s is not None and st.up else None
        memory = s.memory_used_bytes / s.memory_total_bytes if s is not None and st.up and \
            s.memory_total_bytes and s.memory_used_bytes is not None else None
        sm_clock = s.clocks_hertz.get("sm") if s is not None and st.up else None
        point = _GpuPoint(t, st.sampled_seconds, st.busy_seconds, st.pcie_rx_bytes,
                          st.pcie_tx_bytes, throttle, sm=sums[0], sm_n=int(sums[1]),
                          tensor=sums[2], tensor_n=int(sums[3]), power=sums[4],
                          power_n=int(sums[5]), ranks_busy=ranks_busy,
                          unattributed=unattributed, link=link, here=here[0],
                          stranger_here=here[1], memory=memory, sm_clock=sm_clock)
        track.previous, track.current = track.current, point
        if not track.points or t - track.points[-1].t >= self.point_seconds:
            track.points.append(point)

    def _note_host(self, snap: Snapshot, samples: dict[str, float | dict[str, float]],
                   t: float) -> None:
        """Note the host's samples (:func:`host_samples` of the snapshot's readings)."""
        point = Point(t, samples, tuple(samples.get(name) for name in _HOST_KEPT), _HOST_INDEX)
        self._host_previous, self._host_current = self._host_current, point
        if not self._host or t - self._host[-1].t >= self.point_seconds:
            self._host.append(point._replace(gauges=_NO_GAUGES))  # its counters are read only
        mem = snap.host.get("memory")
        if mem is not None and (not self._memory or t - self._memory[-1][0] >= SLOW_POINT_SECONDS):
            self._memory.append((t, mem.available_bytes))
        ratios = _host_window(self._since(self._host, t), point)
        self._host_peaks.append((t, {k: ratios[k] for k in REFINED if k in ratios}))
        while t - self._host_peaks[0][0] > HOLD_SECONDS:
            self._host_peaks.popleft()

    def _note_push(self, track: _RankTrack, st: RankState, t: float) -> None:
        old = track.state
        # the ingest refuses a total that falls within a run_id: only a restart (a new
        # run_id) resets one, or its first push after it where that leaves one out
        if st.run_id != old.run_id or track.pending:
            _carry(track.offsets, track.pending, _counters_of(old), _counters_of(st))
        if st.run_id != old.run_id:  # a restarted process counts from 0
            track.restarts.append(t)
            # a new process is judged as a restart, then as itself: no regime across it
            track.regime_start, track.regime_floor = None, t
            track.rss.clear()  # and its memory is a new process's: no leak across a restart
            if st.bucket_bounds == old.bucket_bounds and old.bucket_counts:
                counts = old.cumulative_counts
                track.bucket_offsets = tuple(
                    a + b for a, b in zip(track.bucket_offsets or (0,) * len(counts), counts,
                                          strict=True))
            else:
                track.bucket_offsets, track.epoch = (), track.epoch + 1
        elif st.bucket_bounds != old.bucket_bounds:
            track.epoch += 1
        track.state = st

    def _detect(self, track: _RankTrack, t: float) -> None:
        """Look for a change of pace in the rank's current regime, in the points the window
        keeps anyway (exporter.heuristics.regime)."""
        since = max(track.regime_floor, track.regime_start or 0.0)
        points = [p for p in track.points if p.t >= since]
        split = next((i for i, p in enumerate(points) if p.t > t - regime.RECENT_SECONDS), 0)
        if split < 2 or len(points) - split < MIN_INTERVALS:
            return
        first, middle, last = points[0], points[split - 1], points[-1]
        if not moved(_growth(first, middle), _growth(middle, last)):
            return  # the means kept their pace: the medians would too
        intervals = [Interval(b.t, b.t - a.t, *_growth(a, b))
                     for a, b in itertools.pairwise(points) if b.epoch == a.epoch]
        start = change_point(intervals, t)
        if start is not None:
            track.regime_start = start

    def regime_starts(self) -> dict[tuple[str, str], float]:
        """Where each live rank's current regime began (unix seconds), for the ranks whose
        pace changed while the daemon watched (the page's
        ``gputrain_training_regime_start_timestamp_seconds``)."""
        with self._lock:
            return {key: tr.regime_start for key, tr in self._ranks.items()
                    if tr.regime_start is not None}

    def _rank_point(self, track: _RankTrack, t: float,
                    gauges: Lookup = _NO_GAUGES) -> Point:
        """The rank's counters now, as its page lines show them, carried across their resets
        (those :data:`_KEPT`), with ``gauges``, its samples as they are (a point kept in the
        window needs none)."""
        st = track.state
        if track.kept_of is not st:
            track.kept, track.kept_of = _counters_of(st), st
        values = track.kept
        if any(x is not None for x in track.offsets):
            values = tuple(_plus(v, x) for v, x in zip(values, track.offsets, strict=True))
        buckets = st.cumulative_counts
        if track.bucket_offsets and len(track.bucket_offsets) == len(buckets):
            buckets = tuple(a + b for a, b in zip(buckets, track.bucket_offsets, strict=True))
        return Point(t, gauges, values, _KEPT_INDEX, buckets, st.bucket_bounds, track.epoch)

    # -- reading (a request's thread) -------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot | None:
        """The latest cycle's snapshot (its view's)."""
        view = self.view
        return None if view is None else view.snapshot

    def size(self) -> int:
        """Points held, all tracks together: bounded by the GPUs, the live ranks and the
        window (see the module docstring)."""
        with self._lock:
            return (sum(len(tr.points) for tr in self._gpus.values()) + len(self._host)
                    + sum(len(tr.points) + len(tr.rss) for tr in self._ranks.values())
                    + len(self._memory))

    def rank_states(self) -> dict[tuple[str, str], RankState]:
        """The latest pushed state of every live (run, rank), and the last of every
        departed one."""
        with self._lock:
            return {**self._departed, **{key: tr.state for key, tr in self._ranks.items()}}

    def collector_ages(self, now: float | None = None) -> dict[str, float]:
        """Each collector's last success, how long before ``now`` (unix seconds; default the
        last snapshot's time) in sampler intervals: a sampler stuck in a hung call publishes
        no snapshot, so only the wall clock shows it."""
        snap = self.snapshot
        if snap is None:
            return {}
        now = snap.timestamp if now is None else now
        return {name: max(0.0, now - c.last_success_timestamp) / self.interval
                for name, c in snap.collectors.items() if c.last_success_timestamp is not None}

    def collectors_failing(self) -> list[str]:
        """The collectors whose last cycle failed, by name."""
        snap = self.snapshot
        return sorted(n for n, c in snap.collectors.items() if not c.success) if snap else []

    def seconds_seen(self) -> float:
        """How much of the window the history covers, in seconds."""
        snap = self.snapshot
        if snap is None or self.first_seen is None:
            return 0.0
        return min(self.window, snap.timestamp - self.first_seen)

    def _since(self, points: deque, now: float, start: float | None = None):
        """The oldest point still inside the window ending at ``now``; with ``start``, the
        oldest at or after it (a rank's window begins at its first push)."""
        for p in points:
            if now - p.t <= self.window + self.point_seconds / 2 and \
                    (start is None or p.t >= start):
                return p
        return None

    def gpu_readings(self, start: float | None = None) -> \
            dict[str, tuple[GpuState, GpuReading, dict[str, float | None]]]:
        """Per GPU (uuid, else index): its state, its readings over the window (as the rules'
        ``gpu:`` series) or from ``start`` on, and its rates over the last cycle (PCIe
        bytes/s)."""
        with self._lock:
            out = {}
            clocks: dict[str, float] = {}  # each GPU's mean SM clock over its window
            for key, tr in self._gpus.items():
                st, now = tr.state, tr.current
                old = None
                if now is not None:
                    old = self._since(tr.points, now.t, start)
                    if start is not None and (old is None or old.t >= now.t):
                        # younger than a point: its last cycle, which lies inside it
                        old = tr.previous
                reading = GpuReading(st.identity.index, st.identity.uuid, up=st.up)
                self._faults(reading, tr)
                s = st.sample if st.up else None  # a lost GPU's last reading is no reading
                if s is not None:
                    reading.pcie_link_max = s.pcie_link_max_bytes_per_second
                if s is not None and s.memory_total_bytes and s.memory_used_bytes is not None:
                    reading.memory_used = s.memory_used_bytes / s.memory_total_bytes
                if old is not None and now is not None:
                    inside = [p for p in (*tr.points, now) if p.t >= old.t]
                    # the link at its best in the window, as max_over_time reads it
                    links = [p.link for p in inside if p.link is not None]
                    reading.pcie_link_now = max(links) if links else None
                    # and as most of the window saw it, as quantile_over_time(0.5) reads it
                    reading.pcie_link_typical = statistics.median(links) if links else None
                    # the memory as most of the window saw it, as quantile_over_time(0.5)
                    # reads it: a GPU at its ceiling two readings in three is at its ceiling
                    used = [p.memory for p in inside if p.memory is not None]
                    if used and s is not None:
                        reading.memory_used = statistics.median(used)
                    sm = [p.sm_clock for p in inside if p.sm_clock is not None]
                    if sm and s is not None:
                        clocks[key] = statistics.fmean(sm)
                    _gpu_window(reading, old, now, s)
                rates: dict[str, float | None] = {"rx": None, "tx": None}
                prev = tr.previous
                if prev is not None and now is not None and now.sampled > prev.sampled:
                    dt = now.sampled - prev.sampled
                    for name, a, b in (("rx", prev.rx, now.rx), ("tx", prev.tx, now.tx)):
                        if a is not None and b is not None:
                            rates[name] = max(0.0, b - a) / dt
                out[key] = (st, reading, rates)
            _clocks_vs_peers(out, clocks)
            return out

    def _faults(self, reading: GpuReading, tr: _GpuTrack) -> None:
        """The GPU's Xid and uncorrectable ECC errors over the fault window, and its row
        remaps, as the fault alerts read them. Errors the exporter found when it started,
        less than a fault window ago, count too (a counter's first sample is no increase)."""
        st, s = tr.state, tr.state.sample
        if tr.errors and tr.current is not None:
            t = tr.current.t
            xid, ecc = _error_counts(st)
            old = next(p for p in tr.errors if t - p[0] <= FAULT_SECONDS)
            fresh = self.first_seen is not None and t - self.first_seen <= FAULT_SECONDS
            reading.xid_errors = xid - old[1]
            reading.ecc_uncorrected = ecc if fresh else ecc - old[2]
        if s is not None and st.up:
            rows = s.remapped_rows
            if rows:
                reading.remap_failed = rows.get("failed", 0.0) > 0
            pending = rows.get("pending", 0.0) > 0 if rows else None
            if s.retired_pages_pending is not None:
                pending = bool(pending) or s.retired_pages_pending > 0
            reading.remap_pending = pending

    def host_readings(self, recent: bool = False, start: float | None = None) -> \
            dict[str, float]:
        """The node's readings as the rules' ``instance:`` series: over the window (or from
        ``start`` on), or with ``recent`` over the last cycle (with byte rates added)."""
        with self._lock:
            now = self._host_current
            if now is None:
                return {}
            old = self._host_previous if recent else self._since(self._host, now.t, start)
            if start is not None and (old is None or old.t >= now.t):
                old = self._host_previous
        out = _host_window(old, now, recent)
        if not recent:
            with self._lock:
                peaks = list(self._host_peaks)
            for name in REFINED:
                seen = [p[name] for t, p in peaks if name in p and now.t - t <= HOLD_SECONDS]
                if seen:
                    out[f"{name}_peak"] = max(seen)
        return out

    def reports(self, gpus: dict | None = None, host: dict[str, float] | None = None,
                now: float | None = None) -> list[RankReport]:
        """One report per live (run, rank), its readings over the window, or from its first
        push where that is later (its GPUs' and node's too: a run is not judged on what its
        GPUs did before it came); no verdict yet. ``gpus`` and ``host`` are
        :meth:`gpu_readings` and :meth:`host_readings` over the whole window where the caller
        has them already; ``now`` (unix seconds) is when the collectors' ages are taken."""
        gpus = self.gpu_readings() if gpus is None else gpus
        ages = self.collector_ages(now)
        host = self.host_readings() if host is None else host
        with self._lock:
            view = self.view
            ranks = list(self._ranks.values())
        if view is None:
            return []
        snap, index = view.snapshot, view.gpus
        recent = self.gpu_readings(snap.timestamp - RECENT_SECONDS)
        with self._lock:
            memories = [(tr.state, list(tr.rss)) for tr in ranks]
            available = list(self._memory)
        outside = _memory_outside(snap.timestamp, snap, available, memories)
        # each rank's share of its cgroup's CPU allowance (as /metrics exports it)
        shares = allowance_shares([tr.state for tr in ranks])
        younger: dict[float, tuple[dict, dict[str, float]]] = {}  # by a rank's first point
        shorter: dict[float, dict] = {}  # a young regime's GPU readings, by its span's start
        out = []
        for tr in ranks:
            with self._lock:
                st = tr.state
                latest = self._rank_point(tr, snap.timestamp,
                                          _Gauges(st, shares.get((st.run, st.rank))))
                old = self._since(tr.points, latest.t)
                rss = list(tr.rss)
                costs = [x for x in tr.outside if x[0] >= latest.t - PERIODIC_SECONDS]
                replaced = list(tr.restarts)
                full = (old is not None and old is not tr.points[0]) or \
                    len(tr.points) == tr.points.maxlen
                # a young regime is read on its own, over the last REGIME, as the rules do;
                # so is a rank younger than the window (its wall seconds), never over what
                # its GPUs did before it came
                age = None if tr.regime_start is None else snap.timestamp - tr.regime_start
                short = None
                if short_window(age, self.window) or short_window(st.wall_seconds, self.window):
                    short = self._since(tr.points, latest.t, latest.t - REGIME_SECONDS)
            # in its first minute (not yet read over the last minute), a rank's GPUs and node
            # are read since its first push: never on what its GPUs did before it came.
            # (The rules cannot: diagnose reads the whole window until the rank is a minute
            # old, docs/how-it-works.md says so)
            rank_gpus, rank_host = gpus, host
            if old is not None and not full and short is None:
                if old.t not in younger:
                    younger[old.t] = (self.gpu_readings(old.t), self.host_readings(start=old.t))
                rank_gpus, rank_host = younger[old.t]
            rep = RankReport("", self.instance, st.run, st.rank, host={**rank_host, **outside},
                             collectors_failing=self.collectors_failing(),
                             collector_ages=dict(ages))
            # as resets() over the restart window and over the rate window
            rep.restarts = float(sum(snap.timestamp - x <= RESTART_SECONDS for x in replaced))
            rep.restarts_recent = float(sum(snap.timestamp - x <= self.window
                                            for x in replaced))
            if age is not None and age < self.window:
                rep.regime_changed_seconds = age
            short_gpus: dict = {}
            # a young regime is read alone: its rates, its GPUs' readings over the same span,
            # and its step-time percentiles and stall share too (the rules' regime_selected
            # and quantile_selected), never the old regime's tail nor the GPUs' time before
            if short is not None and short.t < latest.t and old is not None:
                old = short
                since = latest.t - REGIME_SECONDS  # the GPUs' regime span, whenever it came
                if since not in shorter:
                    shorter[since] = self.gpu_readings(since)
                short_gpus = shorter[since]
            read_gauges(rep, st, snap.timestamp)
            rep.seconds_since_push = max(0.0, snap.timestamp - st.received_unix)
            if st.exit_reason is not None:
                rep.exit, rep.exit_detail = {st.exit_reason: 1.0}, st.exit_detail
            rep.stopped = stopped(st)
            rep.world_size = st.world_size
            mono = self.clock()
            rep.step_in_progress = st.step_in_progress(mono)
            if (phase := st.phase_in_progress(mono)) is not None:
                rep.phase_in_progress = {phase[0]: phase[1]}
            rep.periodic = periodic_shares(costs, latest)
            memory = tree_memory(st)
            rep.memory_measure = None if memory is None else memory[1]
            # as deriv() over the ranges, and the recent one offset by itself: a slope is
            # sustained where both halves rise (a step up lies in one of them only)
            if memory is not None and rss and snap.timestamp - rss[0][0] >= LEAK_MIN_SECONDS:
                for span, growth in _growths(snap.timestamp, rss, memory[0]).items():
                    setattr(rep, f"rss_growth_{span}", growth)
            peak = 0.0
            for index_, uuid in resolve_gpus(st, index, view.listed.get((st.run, st.rank), ())):
                if (last := recent.get(uuid or index_)) is not None and \
                        last[1].busy is not None:
                    rep.recent_busy = max(rep.recent_busy or 0.0, last[1].busy)
                entry = rank_gpus.get(uuid or index_)
                if entry is None:
                    continue
                state, reading, _ = entry
                if (young := short_gpus.get(uuid or index_)) is not None:
                    # its GPUs' windowed readings over the same span as its steps
                    reading = replace(reading, **{f: getattr(young[1], f) for f in REGIME_GPU})
                share = None
                if (unowned := reading.unattributed) is not None:  # no rank of this run's
                    reading = replace(reading, foreign=unowned + sum(
                        v for (run, _), v in reading.shares.items() if run != st.run))
                    # of what the GPU's processes did, the part the rank's own did
                    if (done := unowned + sum(reading.shares.values())) > 0:
                        share = reading.shares.get((st.run, st.rank), 0.0) / done
                        rep.gpu_share[index_] = share
                if (held := view.held.get((st.run, st.rank), {}).get((index_, uuid))) is not None:
                    rep.gpu_memory_held[index_] = held
                rep.gpus.append(reading)
                if not state.identity.parent:  # a MIG slice has no peak of its own
                    # by the rank's share where measured (a stray context adds nothing)
                    peak += self.peaks.peaks(state.identity.name).get(st.precision, 0.0) * (
                        1.0 if share is None else share)
            # the readings written as trees, over the window and as they are now
            env = {**_NO_OPEN_STEP, "peak_flops": peak}
            _INSTANT(latest, latest, env, rep)
            if old is not None:
                wall, step_s, wait, phases = _WINDOWED(old, latest, env, rep)
                if isinstance(wall, float) and wall > 0:
                    rep.goodput, rep.badput = wall_shares(wall, _number(step_s), _number(wait),
                                                          _dict(phases))
                with_open_step(rep, latest.t - old.t)
            rep.gpus.sort(key=lambda x: (len(x.gpu), x.gpu))
            out.append(rep)
        with self._lock:
            departed = list(self._departed.values())
        out.extend(departed_report(st, self.instance, snap.timestamp) for st in departed)
        return sorted(out, key=lambda r: (r.run, rank_order(r.rank)))


def _dict(value: float | dict[str, float] | None) -> dict[str, float]:
    return value if isinstance(value, dict) else {}


def _number(value: float | dict[str, float] | None) -> float:
    return value if isinstance(value, float) else 0.0


def _wall(p: Point) -> float:
    """The rank's wall seconds at ``p`` (elapsed: never reset, always pushed)."""
    return p.values[_WALL_AT]


def _phases(p: Point) -> dict[str, float]:
    """The rank's seconds in each phase at ``p``, carried across its restarts."""
    return _dict(p.counter(PHASE_SECONDS.name))


def _counters_of(st: RankState) -> tuple:
    """The rank's own samples of :data:`_KEPT` (None where absent)."""
    return tuple(read(st) for read in _KEPT_READERS)


def _plus(value: float | dict[str, float] | None,
          carried: float | dict[str, float] | None) -> float | dict[str, float] | None:
    """A counter's sample with what its resets took off it added back."""
    if value is None or carried is None:
        return value
    if isinstance(value, dict):
        before = carried if isinstance(carried, dict) else {}
        return {**before, **{k: v + before.get(k, 0.0) for k, v in value.items()}}
    return value + (carried if not isinstance(carried, dict) else 0.0)


def _carry(offsets: list, pending: dict[int, float], before: tuple, after: tuple) -> None:
    """Add to ``offsets`` each counter of a rank that fell from ``before`` to ``after`` (its
    process restarted: it counts from 0 again) the value it fell from, as ``rate()`` reads a
    reset; a labelled sample gone counts as fallen to 0. A counter ``after`` lacks waits in
    ``pending`` with the value it fell from until a push has it again (an optional total a
    new process sends only once it has one: its communication, its FLOPs). ``offsets``,
    ``before`` and ``after`` are aligned to :data:`_KEPT`, whose names are all counters."""
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if a is None:
            a = pending.get(i)
        if a is None:
            continue
        if b is None:
            if not isinstance(a, dict):
                pending[i] = a
            continue
        pending.pop(i, None)
        if a == b:
            continue
        if isinstance(a, dict):
            carried = offsets[i]
            into: dict[str, float] = carried if isinstance(carried, dict) else {}
            now = b if isinstance(b, dict) else {}
            for k, x in a.items():
                if now.get(k, 0.0) < x:
                    into[k] = into.get(k, 0.0) + x
            offsets[i] = into or None
        elif not isinstance(b, dict) and b < a:
            carried = offsets[i]
            offsets[i] = (carried if isinstance(carried, float) else 0.0) + a


class _Gauges:
    """A rank's samples as its page shows them, read from its state by name when asked (a
    reading reads two or three of them), with the page's line written beside the state's:
    its share of its cgroup's CPU ``allowance``."""

    __slots__ = ("allowance", "st")

    def __init__(self, st: RankState, allowance: float | None) -> None:
        self.st, self.allowance = st, allowance

    def get(self, name: str, /) -> float | dict[str, float] | None:
        if name == ALLOWANCE:
            return self.allowance
        read = READERS.get(name)
        return None if read is None else read(self.st)


def periodic_shares(points: list[tuple[float, float, dict[str, float]]],
                    now: Point) -> dict[str, float]:
    """Of the wall time since the oldest of ``points`` (those inside the periodic window),
    the share in each phase outside the steps, as the reading ``periodic``'s rate over the
    window; {} before a minute of it."""
    if not points:
        return {}
    _, wall, phases = points[0]
    elapsed = _wall(now) - wall
    if elapsed <= 0 or now.t - points[0][0] < SLOW_POINT_SECONDS:
        return {}
    return {p: max(0.0, v - phases.get(p, 0.0)) / elapsed
            for p, v in _phases(now).items() if p in OUTSIDE_STEP_PHASES}


def departed_report(st: RankState, instance: str, now: float) -> RankReport:
    """A departed rank's report (it ended without a clean close and the ingest's ttl ran
    out, or finished before its run's other ranks): how and when it ended, as its page lines
    say, and no readings of its steps."""
    rep = RankReport("", instance, st.run, st.rank)
    rep.seconds_since_push = max(0.0, now - st.received_unix)
    read_gauges(rep, st, now, DEPARTED)
    if st.exit_reason is not None:
        rep.exit, rep.exit_detail = {st.exit_reason: 1.0}, st.exit_detail
    rep.world_size = st.world_size
    return rep


# a rank's readings that are one of its page's gauges as it is (a recording rule's
# `max by (rank) (family)`, or `min`: a Gauge tree) of a family its pushed state writes:
# (the reading, the family)
GAUGE_READINGS = tuple(
    (r, f) for r in of_scope("rank") for f in FAMILIES
    if isinstance(r.tree, Gauge) and f.read is not None and r.tree.name == f.name)


def read_gauges(rep: RankReport, st: RankState, now: float,
                families: tuple[str, ...] | None = None) -> None:
    """Fill ``rep``'s gauge readings (:data:`GAUGE_READINGS`) as the rules read them: its
    family's sample, as the page writes it from ``st`` (a flag as a bool, a time as the
    seconds since it at ``now``); with ``families``, those only (a departed rank's page keeps
    a few)."""
    for reading, family in GAUGE_READINGS:
        if family.read is None or (families is not None and family.name not in families):
            continue
        value = family.read(st)
        if value is None:
            continue
        if reading.since:
            value = max(0.0, now - value)
        setattr(rep, reading.field,
                value > 0 if isinstance(getattr(rep, reading.field), bool) else value)


def stopped(st: RankState, proc: str = "/proc") -> bool:
    """The rank's process is stopped (SIGSTOP, Ctrl-Z: state T; a debugger's stop: t), as
    this daemon's /proc shows the pid it pushed, where the process's start time there is the
    one it pushed (so a pid of another PID namespace, or one reused, is never taken for
    it)."""
    if st.pid is None or st.start_time is None:
        return False
    state = read_state(st.pid, proc)
    return state is not None and state[0] in ("T", "t") and state[1] == st.start_time


def _host_window(old: Point | None, now: Point, recent: bool = False) -> dict[str, float]:
    """The node's readings (the rules' ``instance:`` series) from ``old`` to ``now``, their
    trees evaluated, with the byte rates the page shows added where ``recent``."""
    out = {r.field: v for r, v in zip(NODE_INSTANT, _NODE_INSTANT(now, now, {}, None),
                                      strict=True) if isinstance(v, float)}
    if old is None or now.t <= old.t:
        return out
    values = _NODE_WINDOWED(old, now, {}, None)
    names = [r.field for r in NODE_WINDOWED] + (list(_BYTE_RATES) if recent else [])
    out.update((k, v) for k, v in zip(names, values[:len(names)], strict=True)
               if isinstance(v, float))
    return out


def _error_counts(st: GpuState) -> tuple[float, float]:
    """A GPU's Xid errors and uncorrectable ECC errors, both counted since the exporter
    started (the ECC count from the driver's at the first reading)."""
    return float(sum(st.xid_errors.values())), st.ecc_errors.get("uncorrected", 0.0)


def _growth(a: Point, b: Point) -> tuple[float, float, float, float]:
    """What a rank's steps, step seconds, data wait seconds and samples grew by from ``a`` to
    ``b``."""
    x, y = a.values, b.values  # the four are always pushed: never None
    i, j, k, m = _GROWTH
    return y[i] - x[i], y[j] - x[j], y[k] - x[k], y[m] - x[m]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _clocks_vs_peers(readings: dict[str, tuple[GpuState, GpuReading, dict]],
                     clocks: dict[str, float]) -> None:
    """Each GPU's mean SM clock against the median of the node's GPUs of its model (the
    reading ``sm_clock_vs_peers``, as the rules' ``quantile by (node, name)``)."""
    by_model: dict[str, list[float]] = {}
    for key, hz in clocks.items():
        by_model.setdefault(readings[key][0].identity.name, []).append(hz)
    for key, hz in clocks.items():
        median = statistics.median(by_model[readings[key][0].identity.name])
        if median > 0:
            readings[key][1].sm_clock_vs_peers = hz / median


def _gpu_window(reading: GpuReading, old: _GpuPoint, now: _GpuPoint, sample) -> None:
    """The rules' ``gpu:`` ratios over the window from ``old`` to ``now``, and the shares of
    the GPU's time each rank's processes, and no rank's, kept it busy."""
    sampled = now.sampled - old.sampled
    if sampled > 0:
        # a share leaves the window with its processes (as the rules' instant join does)
        reading.shares = {rank: max(0.0, busy - old.ranks_busy.get(rank, 0.0)) / sampled
                          for rank, busy in now.ranks_busy.items() if rank in now.here}
        if now.unattributed is not None:
            reading.unattributed = max(0.0, now.unattributed - (old.unattributed or 0.0)) / \
                sampled if now.stranger_here else 0.0
        if now.busy is not None:
            reading.busy = (now.busy - (old.busy or 0.0)) / sampled
        link = reading.pcie_link_now or reading.pcie_link_max  # as it runs, else at best
        if now.rx is not None and link:
            reading.pcie_rx_used = (now.rx - (old.rx or 0.0)) / sampled / link
        reading.throttled = (now.throttle - old.throttle) / sampled
    reading.sm_active = _ratio(now.sm - old.sm, now.sm_n - old.sm_n)
    reading.tensor_active = _ratio(now.tensor - old.tensor, now.tensor_n - old.tensor_n)
    power = _ratio(now.power - old.power, now.power_n - old.power_n)
    limit = sample.power_limit_watts if sample is not None else None
    reading.power_used = _ratio(power, limit)


def wall_shares(wall: float, step_s: float, wait: float, phases: dict[str, float]) -> \
        tuple[float, dict[str, float]]:
    """Goodput and badput by cause over a window, as the rules record them: shares of the
    rank's wall time that stay within [0, 1] and add up to 1. A step that straddles the
    window's start counts whole at its end, so at a run's first and last pushes the raw
    differences can go past the wall time by up to a step; the parts that would go negative
    count 0 and the shares are of the parts' sum."""
    in_step = sum(v for p, v in phases.items() if p not in OUTSIDE_STEP_PHASES)
    outside = sum(v for p, v in phases.items() if p in OUTSIDE_STEP_PHASES)
    productive = max(0.0, step_s - wait - in_step)
    outside_steps = max(0.0, wall - step_s - outside)
    parts = {"data_wait": max(0.0, wait), **{p: max(0.0, v) for p, v in phases.items()},
             "outside_steps": outside_steps}
    total = productive + sum(parts.values())
    if total <= 0:
        return 0.0, {k: 0.0 for k in parts}
    return productive / total, {k: v / total for k, v in parts.items()}


def tree_memory(st: RankState) -> tuple[float, str] | None:
    """A rank's process-tree memory in bytes and which it is: its proportional set size
    ("pss") where its client reads ``smaps_rollup``, else its resident memory ("rss")."""
    for key, measure in (("proportional_memory_bytes", "pss"), ("resident_memory_bytes", "rss")):
        if (value := st.process.get(key)) is not None:
            return value, measure
    return None


def _growths(now: float, points: list[tuple[float, float]],
             current: float) -> dict[str, float | None]:
    """As deriv() over each of the leak rule's spans (:data:`LEAK_SPANS`), by its suffix:
    bytes per second, the value ``current`` at ``now`` included."""
    points = [*points, (now, current)]
    out = {}
    for span, (w, o) in LEAK_SPANS.items():
        until = now - duration_seconds(o)
        out[span] = _deriv(points, until - duration_seconds(w), until)
    return out


def _memory_outside(now: float, snap: Snapshot, available: list[tuple[float, float]],
                    ranks: list[tuple[RankState, list[tuple[float, float]]]]) -> dict[str, float]:
    """The node's ``memory_outside_growth_<span>`` readings: how fast its available memory
    falls beyond what its ranks' tree memory explains (bytes per second), as
    :func:`exporter.heuristics.promql.memory_outside` writes it; none before the node's
    memory is seen for the leak rule's recent span."""
    mem = snap.host.get("memory")
    if mem is None or not available or now - available[0][0] < LEAK_MIN_SECONDS:
        return {}
    node = _growths(now, available, mem.available_bytes)
    trees = [_growths(now, points, memory[0]) for st, points in ranks
             if points and (memory := tree_memory(st)) is not None]
    return {f"memory_outside_growth_{span}": -(slope + sum(t[span] or 0.0 for t in trees))
            for span, slope in node.items() if slope is not None}


def _deriv(points: list[tuple[float, float]], since: float,
           until: float = math.inf) -> float | None:
    """Prometheus' deriv(): the least-squares slope of the points from ``since`` to
    ``until``."""
    xs = [(t, v) for t, v in points if since <= t <= until]
    if len(xs) < 2:
        return None
    n = len(xs)
    mt = sum(t for t, _ in xs) / n
    mv = sum(v for _, v in xs) / n
    den = sum((t - mt) ** 2 for t, _ in xs)
    return sum((t - mt) * (v - mv) for t, v in xs) / den if den else None
