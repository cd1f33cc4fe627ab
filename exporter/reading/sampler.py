"""The sampler: a background loop that reads every GPU and the host each interval.

It integrates utilisation into busy seconds and turns the sources' cumulative values into
monotonic counters, then publishes an immutable :class:`Snapshot`. Scrapes render the latest
snapshot and never call NVML. Each GPU is read in its own worker thread, so one slow or lost
GPU does not hold up the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from exporter.reading.gpu_backends import BackendUnavailable, GpuBackend, GpuIdentity, GpuSample
from exporter.reading.nvml import GpuLostError, StaleHandleError

if TYPE_CHECKING:
    from exporter.reading.collectors.base import HostCollector

log = logging.getLogger(__name__)

LOST_GPU_RETRY_SECONDS = 10.0
BACKEND_RETRY_SECONDS = 60.0


@dataclass(frozen=True)
class CollectorStatus:
    """How a collector's last cycle went (seconds; wall-clock timestamp, and the same moment
    on the daemon's monotonic clock, which ages it: a wall clock that steps or is minutes off
    never makes a reading look frozen)."""

    success: bool
    duration_seconds: float
    last_success_timestamp: float | None
    last_success_monotonic: float | None = None


@dataclass
class GpuState:
    """One GPU in a snapshot: its latest reading and its integrated counters.

    Each counter here is the exported one: it counts from the exporter's start and never goes
    down, whatever its source did (the source's own counters are GpuSample's ``*_counter_*``
    and ``ecc_volatile_errors``). A counter is None until its source has given a value, so
    that a GPU without, say, an energy counter exports no energy series rather than a zero.
    """

    identity: GpuIdentity
    up: bool = False
    sample: GpuSample | None = None
    sampled_seconds: float = 0.0
    busy_seconds: float | None = None
    energy_joules: float | None = None
    pcie_rx_bytes: float | None = None
    pcie_tx_bytes: float | None = None
    clock_event_seconds: dict[str, float] = field(default_factory=dict)
    xid_errors: dict[int, int] = field(default_factory=dict)
    nvlink_rx_bytes: float | None = None
    nvlink_tx_bytes: float | None = None
    # from the driver's volatile count at the first reading, then its increases: monotonic
    # across a driver reload, where the volatile count starts again from 0
    ecc_errors: dict[str, float] = field(default_factory=dict)
    # per process on the GPU, the seconds it kept the SMs (and the memory) busy while it was
    # there: its utilisation samples integrated like the GPU's own busy time; a process is
    # forgotten once it leaves the GPU
    process_busy_seconds: dict[int, float] = field(default_factory=dict)
    process_memory_busy_seconds: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """Everything a scrape renders. Immutable once published."""

    cycle: int
    timestamp: float
    backend: str
    driver_version: str
    gpus: tuple[GpuState, ...] = ()
    host: dict[str, Any] = field(default_factory=dict)  # each host collector's reading
    collectors: dict[str, CollectorStatus] = field(default_factory=dict)


class _GpuSlot:
    """The sampler's private, mutable state for one GPU."""

    def __init__(self, identity: GpuIdentity) -> None:
        self.state = GpuState(identity)
        self.previous: GpuSample | None = None
        self.pending: Future | None = None
        self.pending_since = 0.0
        self.lost = False
        self.next_retry = 0.0


def _integrate_link(st: GpuState, sample: GpuSample, prev: GpuSample | None, link: str,
                    dt: float) -> None:
    """Add a link's received and transmitted bytes since ``prev`` to the GPU's counters
    (``<link>_rx_bytes``, ``<link>_tx_bytes``): the source's rates (bytes/s) times the ``dt``
    seconds seen where it gives rates (the backend gives them where they are the better
    source, as GPM's for PCIe), else the increase of its own cumulative counters
    (``<link>_rx_counter_bytes``, ``<link>_tx_counter_bytes``)."""
    rx, tx = (getattr(sample, f"{link}_{d}_counter_bytes") for d in ("rx", "tx"))
    if getattr(sample, f"{link}_rx_bytes_per_second") is not None:
        add = (getattr(sample, f"{link}_rx_bytes_per_second") * dt,
               (getattr(sample, f"{link}_tx_bytes_per_second") or 0.0) * dt)
    elif rx is not None and tx is not None:
        before = tuple(getattr(prev, f"{link}_{d}_counter_bytes") for d in ("rx", "tx")) \
            if prev else (None, None)
        add = (_delta(rx, before[0]), _delta(tx, before[1]))
    else:
        return
    for direction, inc in zip(("rx", "tx"), add, strict=True):
        name = f"{link}_{direction}_bytes"
        setattr(st, name, (getattr(st, name) or 0.0) + inc)


def _integrate_processes(st: GpuState, sample: GpuSample, dt: float) -> None:
    """Add each process's busy seconds since the last reading (its utilisation ratios over the
    ``dt`` seconds seen) to its counters; forget the processes that left the GPU."""
    shares = sample.process_utilization or {}
    if sample.process_seconds is not None:  # weighted by the source's own sample period
        added: dict[int, tuple[float, float | None]] = dict(sample.process_seconds)
    else:
        added = {pid: (sm * dt, None if memory is None else memory * dt)
                 for pid, (sm, memory) in shares.items()}
    for pid, (sm_s, memory_s) in added.items():
        st.process_busy_seconds[pid] = st.process_busy_seconds.get(pid, 0.0) + sm_s
        if memory_s is not None:
            st.process_memory_busy_seconds[pid] = \
                st.process_memory_busy_seconds.get(pid, 0.0) + memory_s
    here = {*sample.pids, *shares}
    for counters in (st.process_busy_seconds, st.process_memory_busy_seconds):
        for pid in [p for p in counters if p not in here]:
            del counters[pid]


def _delta(current: float | None, previous: float | None) -> float:
    """The increase of a source counter; 0 across a reset or a missing value."""
    if current is None or previous is None or current < previous:
        return 0.0
    return current - previous


class Sampler:
    """Reads GPUs (unless ``gpu`` is not in ``collectors``) and every host collector given,
    every ``interval`` seconds, in a daemon thread. A cycle waits ``read_wait`` seconds (real
    time; 0.8 of the interval unless given) for the GPUs' reads; a read that takes longer is
    taken in by a later cycle."""

    def __init__(
        self,
        backend: GpuBackend | None,
        host: Sequence[HostCollector] | None = (),
        interval: float = 1.0,
        collectors: set[str] | frozenset[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        read_wait: float | None = None,
    ) -> None:
        self.backend = backend
        self.host = tuple(host or ())
        self.interval = interval
        self.read_wait = 0.8 * interval if read_wait is None else read_wait
        self.collectors = set(collectors) if collectors is not None else {
            "gpu", *(c.name for c in self.host)}
        self._clock = clock
        self._wall = wall_clock
        self._slots: list[_GpuSlot] = []
        self._backend_ready = False
        self._backend_error: str | None = None
        self._no_driver = False  # no NVIDIA driver at all (a CPU node): no collector fails
        self._backend_next_try = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._status: dict[str, CollectorStatus] = {}
        self._cycle = 0
        self._last_cycle_at: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._running = False  # start() was called: the background threads run
        self._xid_started = False
        self._xid_lock = threading.Lock()
        self._snapshot = Snapshot(0, wall_clock(), self._backend_name(), "")
        self.listeners: list[Callable[[], None]] = []  # called after each new snapshot

    # -- lifecycle -------------------------------------------------------------------------

    def _backend_name(self) -> str:
        return getattr(self.backend, "name", "none") if self.backend is not None else "none"

    @property
    def snapshot(self) -> Snapshot:
        """The latest published snapshot (a plain attribute read: safe from any thread)."""
        return self._snapshot

    @property
    def gpu_error(self) -> str | None:
        """Why no GPU can be read, or None."""
        return self._backend_error

    def start(self) -> None:
        """Run one cycle now, then keep sampling in the background."""
        self._running = True
        self.run_once()
        t = threading.Thread(target=self._loop, name="gputrain-sampler", daemon=True)
        t.start()
        self._threads.append(t)
        self._watch_xid()

    def _watch_xid(self) -> None:
        """Start the Xid event watch once the backend is open (at start, or when a driver
        that was missing appears later)."""
        if self._running and not self._xid_started and self._wants_gpu() and \
                self._backend_ready:
            self._xid_started = True
            x = threading.Thread(target=self._xid_loop, name="gputrain-xid", daemon=True)
            x.start()
            self._threads.append(x)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.interval + 2.0)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None and self._backend_ready:
            self.backend.close()

    def now(self) -> float:
        """The sampler's monotonic clock (seconds): what ages its collectors' last success."""
        return self._clock()

    def wall(self) -> float:
        """The sampler's wall clock (Unix seconds): the time of its snapshots."""
        return self._wall()

    def healthy(self) -> bool:
        """True when a cycle completed within the last three intervals."""
        last = self._last_cycle_at
        return last is not None and self._clock() - last <= 3 * self.interval

    def _loop(self) -> None:
        next_at = self._clock() + self.interval
        while not self._stop.wait(max(0.0, next_at - self._clock())):
            try:
                self.run_once()
            except Exception:  # the loop must outlive any bug in one cycle
                log.exception("sampler cycle failed")
            next_at += self.interval
            now = self._clock()
            if next_at < now:  # fell behind (suspend, overload): skip, do not burst
                next_at = now + self.interval

    # -- one cycle -------------------------------------------------------------------------

    def _wants_gpu(self) -> bool:
        return "gpu" in self.collectors and self.backend is not None

    def run_once(self) -> Snapshot:
        """Read everything once and publish a snapshot; returns it."""
        gpus: tuple[GpuState, ...] = ()
        if self._wants_gpu():
            gpus = self._timed("gpu", self._sample_gpus)
            if self._no_driver and not self._backend_ready:
                # a node without an NVIDIA driver serves host metrics by design (the log and
                # the page say so once): no collector fails; a driver that goes away does
                self._status.pop("gpu", None)
        readings = {}
        for collector in self.host:
            reading = self._timed(collector.name, collector.read)
            if reading is not None:
                readings[collector.name] = reading
        self._cycle += 1
        snap = Snapshot(
            cycle=self._cycle,
            timestamp=self._wall(),
            backend=self._backend_name(),
            driver_version=getattr(self.backend, "driver_version", "") or "",
            gpus=gpus or (),
            host=readings,
            collectors=dict(self._status),
        )
        self._snapshot = snap
        self._last_cycle_at = self._clock()
        for listener in self.listeners:
            listener()
        return snap

    def _timed(self, name: str, fn: Callable):
        started = self._clock()
        try:
            result = fn()
            ok = result is not None
        except Exception as exc:
            # a warning when it starts failing, not every cycle while it goes on failing
            failing = name in self._status and not self._status[name].success
            log.log(logging.DEBUG if failing else logging.WARNING, "collector %s failed: %s%s",
                    name, exc, " (logged again only after it recovers)" if not failing else "",
                    exc_info=log.isEnabledFor(10))
            result, ok = None, False
        duration = self._clock() - started
        previous = self._status.get(name)
        if ok:
            self._status[name] = CollectorStatus(ok, duration, self._wall(), self._clock())
        else:
            self._status[name] = CollectorStatus(
                ok, duration, previous.last_success_timestamp if previous else None,
                previous.last_success_monotonic if previous else None)
        return result

    def _gpu_backend(self) -> GpuBackend:
        """The GPU backend, on the paths that run only with one."""
        if self.backend is None:
            raise RuntimeError("no GPU backend configured")
        return self.backend

    def _open_backend(self) -> bool:
        if self._backend_ready:
            return True
        now = self._clock()
        if now < self._backend_next_try:
            return False
        self._backend_next_try = now + BACKEND_RETRY_SECONDS
        backend = self._gpu_backend()
        try:
            identities = backend.start()
        except BackendUnavailable as exc:
            if self._backend_error is None:
                log.warning("No NVIDIA GPU can be read (%s): serving host metrics only, "
                            "retrying every %.0fs (--gpu.backend=demo simulates GPUs)", exc,
                            BACKEND_RETRY_SECONDS)
            self._backend_error = str(exc)
            self._no_driver = exc.no_driver
            return False
        self._backend_error = None
        self._backend_ready = True
        self._slots = [_GpuSlot(i) for i in identities]
        self._size_pool()
        log.info("%s backend: %d GPU(s), driver %s", backend.name, len(self._slots),
                 backend.driver_version or "unknown")
        self._watch_xid()
        return True

    def _size_pool(self) -> None:
        """One worker per GPU, so that a hung GPU holds up no other."""
        if self._pool is not None and self._pool_size >= len(self._slots):
            return
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # its running reads finish on their own
        self._pool_size = max(1, len(self._slots))
        self._pool = ThreadPoolExecutor(max_workers=self._pool_size,
                                        thread_name_prefix="gputrain-gpu")

    def _rescan(self) -> None:
        """Take the backend's new list of GPUs (MIG devices reconfigured): a GPU still listed
        keeps its slot and counters, a new one starts from nothing, a gone one is dropped."""
        rescan = getattr(self.backend, "rescan", None)
        try:
            identities = rescan() if rescan is not None else None
        except Exception as exc:
            log.warning("listing the GPUs again failed: %s", exc)
            return
        if identities is None:
            return
        old = {slot.state.identity: slot for slot in self._slots}
        self._slots = [old.pop(i) if i in old else _GpuSlot(i) for i in identities]
        self._size_pool()
        log.info("GPUs now: %s", ", ".join(i.index for i in identities))

    def _sample_gpus(self) -> tuple[GpuState, ...] | None:
        if not self._open_backend():
            return None
        self._rescan()
        now = self._clock()
        backend, pool = self._gpu_backend(), self._pool
        assert pool is not None  # sized when the backend opened
        started: list[_GpuSlot] = []
        for slot in self._slots:
            if slot.pending is not None:
                continue  # still busy with an earlier read: do not pile up
            if slot.lost:
                if now < slot.next_retry:
                    continue
                slot.next_retry = now + LOST_GPU_RETRY_SECONDS
                slot.pending = pool.submit(self._reopen_and_sample, slot.state.identity)
            else:
                slot.pending = pool.submit(backend.sample, slot.state.identity)
            slot.pending_since = now
            started.append(slot)
        waiting = [s.pending for s in self._slots if s.pending is not None]
        if waiting:
            wait_futures(waiting, timeout=self.read_wait)
        for slot in self._slots:
            fut = slot.pending
            if fut is None:
                continue
            if not fut.done():
                if self._clock() - slot.pending_since > 3 * self.interval and slot.state.up:
                    log.warning("GPU %s has not answered for %.1fs: marking it down",
                                slot.state.identity.index, self._clock() - slot.pending_since)
                    slot.state.up = False
                continue
            slot.pending = None
            self._absorb(slot, fut)
        with self._xid_lock:
            return tuple(replace(s.state, clock_event_seconds=dict(s.state.clock_event_seconds),
                                 xid_errors=dict(s.state.xid_errors),
                                 ecc_errors=dict(s.state.ecc_errors),
                                 process_busy_seconds=dict(s.state.process_busy_seconds),
                                 process_memory_busy_seconds=dict(
                                     s.state.process_memory_busy_seconds))
                         for s in self._slots)

    def _reopen_and_sample(self, identity: GpuIdentity) -> GpuSample:
        backend = self._gpu_backend()
        if not backend.reopen(identity):
            raise GpuLostError(f"GPU {identity.index} is still lost")
        return backend.sample(identity)

    def _absorb(self, slot: _GpuSlot, fut: Future) -> None:
        st = slot.state
        try:
            sample: GpuSample = fut.result()
        except StaleHandleError as exc:  # a MIG device reconfigured away: listed again next
            log.info("GPU %s (%s) is gone: %s", st.identity.index, st.identity.uuid, exc)
            slot.lost, st.up, slot.previous = True, False, None
            slot.next_retry = self._clock() + LOST_GPU_RETRY_SECONDS
            return
        except GpuLostError as exc:
            if not slot.lost:
                log.error("GPU %s (%s) is lost: %s; retrying every %.0fs", st.identity.index,
                          st.identity.uuid, exc, LOST_GPU_RETRY_SECONDS)
                slot.next_retry = self._clock() + LOST_GPU_RETRY_SECONDS
            slot.lost, st.up, slot.previous = True, False, None
            return
        except Exception as exc:
            log.warning("reading GPU %s failed: %s", st.identity.index, exc)
            st.up, slot.previous = False, None
            return
        if slot.lost:
            log.info("GPU %s answers again", st.identity.index)
        slot.lost, st.up = False, True
        prev = slot.previous
        dt = 0.0 if prev is None else max(0.0, sample.timestamp - prev.timestamp)
        # A gap much longer than the interval is time we did not see: do not guess it.
        dt_seen = dt if dt <= 3 * self.interval else 0.0
        st.sampled_seconds += dt_seen
        if sample.utilization is not None:
            st.busy_seconds = (st.busy_seconds or 0.0) + sample.utilization * dt_seen
        if sample.energy_counter_joules is not None:
            inc = _delta(sample.energy_counter_joules, prev.energy_counter_joules if prev else None)
            st.energy_joules = (st.energy_joules or 0.0) + inc
        elif sample.power_watts is not None:
            st.energy_joules = (st.energy_joules or 0.0) + sample.power_watts * dt_seen
        for link in ("pcie", "nvlink"):  # bytes each way: the source's counters, else rates
            _integrate_link(st, sample, prev, link, dt_seen)
        for kind, count in sample.ecc_volatile_errors.items():
            before = prev.ecc_volatile_errors.get(kind) if prev else None
            if kind not in st.ecc_errors:
                st.ecc_errors[kind] = count  # the errors since the driver loaded
            else:
                st.ecc_errors[kind] += _delta(count, before)
        _integrate_processes(st, sample, dt_seen)
        for reason in set(st.clock_event_seconds) - set(sample.clock_event_counter_seconds):
            del st.clock_event_seconds[reason]  # its source was found untrustworthy: gone
        for reason, seconds in sample.clock_event_counter_seconds.items():
            before = prev.clock_event_counter_seconds.get(reason) if prev else None
            st.clock_event_seconds[reason] = st.clock_event_seconds.get(reason, 0.0) + _delta(
                seconds, before)
        st.sample = sample
        slot.previous = sample

    # -- Xid events ------------------------------------------------------------------------

    def _xid_loop(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                events = self._gpu_backend().wait_xid(1.0)
            except Exception as exc:
                log.warning("Xid event watch failed: %s; retrying in 10s", exc)
                self._stop.wait(10.0)
                continue
            with self._xid_lock:
                # the GPUs of now: a MIG rescan may have changed them since the last event
                by_index = {s.state.identity.index: s for s in self._slots}
                for index, xid in events:
                    slot = by_index.get(index)
                    if slot is not None:
                        slot.state.xid_errors[xid] = slot.state.xid_errors.get(xid, 0) + 1
                        log.warning("Xid %d on GPU %s", xid, index)
            if not events:
                # A backend without events returns at once: do not spin.
                self._stop.wait(max(0.0, 1.0 - (self._clock() - started)))
