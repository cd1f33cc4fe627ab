"""Training-run metric families from the ingest's live (run, rank) states.

The families are one table (:data:`FAMILIES`); :class:`TrainingCollector` writes the page's
lines from it directly, each rank's lines once per push and reused until its next one (about
20x faster than formatting through prometheus_client, which matters at hundreds of ranks). Its
``collect()`` for a prometheus_client registry reads those same lines back: one renderer.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from exporter.reading.sampler import CollectorStatus, Snapshot
from exporter.serving.ingest import IngestStore, RankState
from exporter.serving.stalls import SLOW_STEP_FACTOR

LABELS = ["run", "rank"]


class GpuIndex:
    """One snapshot's GPUs, indexed once per render: by UUID, by index and by NVML pid."""

    def __init__(self, snap: Snapshot) -> None:
        self.by_uuid = {g.identity.uuid: g.identity.index for g in snap.gpus if g.identity.uuid}
        self.by_index = {g.identity.index: g.identity.uuid for g in snap.gpus}
        self.by_pid: dict[int, list[tuple[str, str]]] = {}
        for g in snap.gpus:
            for pid in g.sample.pids if g.sample is not None else ():
                self.by_pid.setdefault(pid, []).append((g.identity.index, g.identity.uuid))


def resolve_gpus(st: RankState, gpus: Snapshot | GpuIndex) -> list[tuple[str, str]]:
    """(gpu index, uuid) pairs a rank uses: from its pushed UUIDs or indices, else from the
    GPUs whose NVML process list holds its pid. Only GPUs this node has are returned."""
    idx = gpus if isinstance(gpus, GpuIndex) else GpuIndex(gpus)
    out: list[tuple[str, str]] = []
    for ref in st.gpus:
        if ref in idx.by_uuid:
            out.append((idx.by_uuid[ref], ref))
        elif ref in idx.by_index:
            out.append((ref, idx.by_index[ref]))
    if not out and st.pid is not None:
        out = list(idx.by_pid.get(st.pid, ()))
    return out


def _ppid(pid: int) -> int | None:
    """The parent of ``pid`` (psutil, from /proc), or None when it cannot be read."""
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except (psutil.Error, OSError):
        return None


GpuKey = tuple[str, str]  # (gpu index, uuid)


class Owners:
    """Which rank holds each process on a GPU: the one whose pushed pid is the process or an
    ancestor of it (a launcher's child, a compile or DataLoader worker that touched CUDA). A
    process's parent is read once (psutil) and kept while the process is on a GPU. Pids are
    never labels: they only join NVML's process list to the pushed ranks. One instance serves
    the page thread and the sampler's (thread-safe)."""

    MAX_DEPTH = 16

    def __init__(self, parent_of: Callable[[int], int | None] = _ppid) -> None:
        self._parent_of = parent_of
        self._parents: dict[int, int | None] = {}
        self._lock = threading.Lock()

    def attribute(self, snap: Snapshot, states: list[RankState]) -> tuple[
            dict[tuple[str, str], dict[GpuKey, float]], dict[GpuKey, tuple[int, float]]]:
        """Bytes each (run, rank) holds per GPU, and per GPU the count and bytes of the
        processes no rank owns. The parents of processes no longer on any GPU are forgotten."""
        by_pid = {st.pid: (st.run, st.rank) for st in states if st.pid is not None}
        ranks: dict[tuple[str, str], dict[GpuKey, float]] = {}
        others: dict[GpuKey, tuple[int, float]] = {}
        seen: set[int] = set()
        with self._lock:
            for g in snap.gpus:
                if not g.up or g.sample is None:
                    continue
                key = (g.identity.index, g.identity.uuid)
                count, held = 0, 0.0
                for pid in dict.fromkeys((*g.sample.pids, *g.sample.process_memory)):
                    used = g.sample.process_memory.get(pid, 0.0)
                    owner = self._owner(pid, by_pid, seen)
                    if owner is None:
                        count, held = count + 1, held + used
                    else:
                        mine = ranks.setdefault(owner, {})
                        mine[key] = mine.get(key, 0.0) + used
                others[key] = (count, held)
            self._parents = {pid: ppid for pid, ppid in self._parents.items() if pid in seen}
        return ranks, others

    def owner(self, pid: int, by_pid: dict) -> tuple[str, str] | None:
        """The (run, rank) whose pushed pid (``by_pid``) is ``pid`` or an ancestor of it."""
        with self._lock:
            return self._owner(pid, by_pid, set())

    def _owner(self, pid: int, by_pid: dict, seen: set[int]) -> tuple[str, str] | None:
        for _ in range(self.MAX_DEPTH):
            seen.add(pid)
            if pid in by_pid:
                return by_pid[pid]
            if pid not in self._parents:
                self._parents[pid] = self._parent_of(pid)
            parent = self._parents[pid]
            if parent is None or parent <= 1:
                return None
            pid = parent
        return None


Totals = tuple[dict[tuple[str, str], dict[GpuKey, tuple[float, float]]],
               dict[GpuKey, tuple[float, float]]]


class GpuShares:
    """Each rank's busy seconds on each GPU, and each GPU's busy seconds that no rank owns: the
    sampler's per-process busy counters summed by their owner (a rank's pushed pid or a
    descendant of it, as :class:`Owners` finds it), snapshot after snapshot. A rank's counter
    grows while the rank is live (a restarted process of it goes on counting into it); a
    snapshot observed twice counts once, so the page thread and the history may both call
    :meth:`observe`, and :meth:`totals` answers as of a given snapshot. A GPU whose driver gives
    per-process samples has an unattributed counter (0 where every process is a rank's); one
    whose driver gives none has none: never a misleading zero. Seconds: SM busy and
    memory-bandwidth busy."""

    KEEP = 4  # the totals of this many snapshots: the page may be a cycle behind the history

    def __init__(self, owners: Owners | None = None) -> None:
        self.owners = owners or Owners()
        self._lock = threading.Lock()
        self._cycle = -1
        self._last: dict[tuple[GpuKey, int], tuple[float, float]] = {}  # (gpu, pid) -> totals
        self._ranks: dict[tuple[str, str], dict[GpuKey, tuple[float, float]]] = {}
        self._others: dict[GpuKey, tuple[float, float]] = {}
        self._by_cycle: dict[int, Totals] = {}

    def observe(self, snap: Snapshot, states: list[RankState]) -> None:
        """Count the busy seconds the processes added since the last snapshot observed."""
        with self._lock:
            if snap.cycle <= self._cycle:
                return
            by_pid = {st.pid: (st.run, st.rank) for st in states if st.pid is not None}
            live = {(st.run, st.rank) for st in states}
            # built aside and taken at once: a failure half-way counts nothing twice
            ranks = {k: dict(v) for k, v in self._ranks.items() if k in live}
            others = dict(self._others)
            last: dict[tuple[GpuKey, int], tuple[float, float]] = {}
            for g in snap.gpus:
                key = (g.identity.index, g.identity.uuid)
                if g.sample is not None and g.sample.process_utilization is not None:
                    others.setdefault(key, (0.0, 0.0))
                for pid, busy in g.process_busy_seconds.items():
                    now = (busy, g.process_memory_busy_seconds.get(pid, 0.0))
                    before = self._last.get((key, pid), (0.0, 0.0))
                    last[(key, pid)] = now
                    added = (max(0.0, now[0] - before[0]), max(0.0, now[1] - before[1]))
                    owner = self.owners.owner(pid, by_pid)
                    held = others if owner is None else ranks.setdefault(owner, {})
                    was = held.get(key, (0.0, 0.0))
                    held[key] = (was[0] + added[0], was[1] + added[1])
            self._cycle, self._last, self._ranks, self._others = snap.cycle, last, ranks, others
            self._by_cycle[snap.cycle] = (ranks, others)
            for old in sorted(self._by_cycle)[:-self.KEEP]:
                del self._by_cycle[old]

    def totals(self, cycle: int | None = None) -> Totals:
        """(run, rank) -> GPU -> (busy, memory busy) seconds, and GPU -> the same no rank
        owns, as of snapshot ``cycle`` where it is still kept, else the latest observed."""
        with self._lock:
            return self._by_cycle.get(cycle, (self._ranks, self._others))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class Family(NamedTuple):
    """One family of the training collector: its name as exported (a counter's with
    ``_total``), type, help text and label names."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ("run", "rank")

    def empty(self) -> Metric:
        """The family as prometheus_client builds it, with no samples (for describe())."""
        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
               "histogram": HistogramMetricFamily}[self.kind]
        return cls(self.name, self.help, labels=list(self.labels))


# Every family, in page order. The first ones are a rank's own (written from its pushed state
# alone, cached per push); then what joins a rank to this node's GPUs and profiles, the GPUs'
# processes no rank owns, and the ingest's own counters.
FAMILIES: tuple[Family, ...] = (
    Family("gputrain_training_steps_total", "counter", "Training steps completed."),
    Family("gputrain_training_data_wait_seconds_total", "counter",
           "Seconds the training loop was blocked waiting for the data loader (inside step "
           "time)."),
    Family("gputrain_training_samples_total", "counter", "Training samples processed."),
    Family("gputrain_training_flops_total", "counter",
           "Model FLOPs of the training steps (forward and backward), from the FLOPs per sample "
           "the client states."),
    Family("gputrain_training_elapsed_seconds_total", "counter",
           "Wall seconds of the rank since its process started, restarts included (the gap "
           "between a process's last push and its successor's first counts): the denominator "
           "of goodput and MFU."),
    Family("gputrain_training_slow_step_seconds_total", "counter",
           f"Seconds of steps over {SLOW_STEP_FACTOR:g}x the rank's median step, counted by the "
           "daemon from the "
           "pushed step histogram (a lower bound): what rare long stalls cost."),
    Family("gputrain_training_step_duration_seconds", "histogram",
           "Wall time of one training step, data wait included, in seconds."),
    Family("gputrain_training_phase_seconds_total", "counter",
           "Seconds spent in each named phase (callbacks, checkpoint, evaluation, ...).",
           ("run", "rank", "phase")),
    Family("gputrain_training_last_step_timestamp_seconds", "gauge",
           "Unix time the last step ended."),
    Family("gputrain_training_last_push_timestamp_seconds", "gauge",
           "Unix time the daemon last heard from the rank."),
    Family("gputrain_training_process_cpu_seconds_total", "counter",
           "CPU seconds of the training process and its children (DataLoader workers)."),
    Family("gputrain_training_process_cpu_allowance_cores", "gauge",
           "CPU cores the training process's cgroup allows it (cgroup v2 cpu.max quota over "
           "period, cpuset.cpus.effective; the machine's CPUs where neither limits it)."),
    Family("gputrain_training_process_cpu_throttled_seconds_total", "counter",
           "Seconds the kernel throttled the training process's cgroup (cpu.stat "
           "throttled_usec): time at its CPU quota."),
    Family("gputrain_training_process_resident_memory_bytes", "gauge",
           "Resident memory of the training process and its children, in bytes."),
    Family("gputrain_training_process_read_bytes_total", "counter",
           "Bytes the training process and its children read (storage and page cache)."),
    Family("gputrain_training_gpu_info", "gauge",
           "The GPUs a rank uses and the precision it trains in; always 1. Join on gpu/uuid.",
           ("run", "rank", "gpu", "uuid", "precision")),
    Family("gputrain_training_gpu_memory_bytes", "gauge",
           "GPU memory the rank's processes hold on each GPU, in bytes (NVML's compute "
           "processes whose pid is the rank's pushed pid or a descendant of it).",
           ("run", "rank", "gpu", "uuid")),
    Family("gputrain_training_gpu_busy_seconds_total", "counter",
           "Seconds the rank's processes kept each GPU's SMs busy: NVML's per-process "
           "utilisation samples of the rank's pushed pid and its descendants, integrated (the "
           "GPU's share that is this rank's; never a pid as a label).",
           ("run", "rank", "gpu", "uuid")),
    Family("gputrain_training_gpu_memory_busy_seconds_total", "counter",
           "Seconds the rank's processes kept each GPU's memory busy (read or written: NVML's "
           "per-process memory utilisation), integrated.", ("run", "rank", "gpu", "uuid")),
    Family("gputrain_training_profile_info", "gauge",
           "The rank's last finished profile (`gputrain-exporter profile`, or an alert): the "
           "trace's path on the rank's machine; the value is the Unix time it finished.",
           ("run", "rank", "trace")),
    Family("gputrain_gpu_unattributed_memory_bytes", "gauge",
           "GPU memory held by processes that no pushing rank owns, in bytes: someone else on "
           "the GPU (or a job without the client).", ("gpu", "uuid")),
    Family("gputrain_gpu_unattributed_processes", "gauge",
           "Compute processes on the GPU that no pushing rank owns.", ("gpu", "uuid")),
    Family("gputrain_gpu_unattributed_busy_seconds_total", "counter",
           "Seconds the GPU's SMs were busy with processes that no pushing rank owns (NVML's "
           "per-process utilisation, integrated): someone else on the GPU, or a job without "
           "the client. Absent where the driver gives no per-process samples.",
           ("gpu", "uuid")),
    Family("gputrain_gpu_unattributed_memory_busy_seconds_total", "counter",
           "Seconds the GPU's memory was busy for processes that no pushing rank owns.",
           ("gpu", "uuid")),
    Family("gputrain_ingest_requests_total", "counter",
           "Push requests received, by HTTP status code.", ("code",)),
    Family("gputrain_ingest_series", "gauge", "Live (run, rank) pairs the daemon holds.", ()),
)
INDEX = {f.name: i for i, f in enumerate(FAMILIES)}


class TrainingCollector:
    """Renders every live (run, rank) the ingest holds, plus the ingest's own counters."""

    def __init__(self, store: IngestStore, snapshot: Callable[[], Snapshot],
                 owners: Owners | None = None, shares: GpuShares | None = None) -> None:
        self._store = store
        self._snapshot = snapshot
        self.shares = shares or GpuShares(owners)
        self._owners = self.shares.owners
        self._status = CollectorStatus(True, 0.0, time.time())
        # a rank's own lines by family index, until its next push
        self._lines: dict[tuple[str, str], tuple[RankState, tuple[tuple[int, str], ...]]] = {}

    def describe(self) -> list[Metric]:
        return [f.empty() for f in FAMILIES]

    @property
    def status(self) -> CollectorStatus:
        """The last render, as a collector status (the ingest has no sampling cycle)."""
        return self._status

    def collect(self) -> Iterator[Metric]:
        """The families for a prometheus_client registry: :meth:`render`'s lines, read back."""
        yield from text_string_to_metric_families(self.render().decode())

    def render(self, openmetrics: bool = False) -> bytes:
        """The training families' exposition (text format, or OpenMetrics without ``# EOF``),
        each rank's own lines reused until its next push."""
        started = time.perf_counter()
        states = sorted(self._store.states(), key=lambda s: (s.run, s.rank))
        snap = self._snapshot()
        gpus = GpuIndex(snap)
        held, others = self._owners.attribute(snap, states)
        self.shares.observe(snap, states)
        busy, unowned = self.shares.totals(snap.cycle)
        profiles = self._store.profiles.latest_done()
        chunks: list[list[str]] = [[] for _ in FAMILIES]
        cache: dict[tuple[str, str], tuple[RankState, tuple[tuple[int, str], ...]]] = {}
        for st in states:
            key = (st.run, st.rank)
            hit = self._lines.get(key)
            lines = hit[1] if hit is not None and hit[0] is st else _rank_lines(st)
            cache[key] = (st, lines)
            for i, chunk in lines:
                chunks[i].append(chunk)
            lbl = _labels(st)
            chunks[INDEX["gputrain_training_gpu_info"]].extend(
                f'gputrain_training_gpu_info{{gpu="{_escape(index)}",precision="{st.precision}",'
                f'{lbl},uuid="{_escape(uuid)}"}} 1.0\n' for index, uuid in resolve_gpus(st, gpus))
            chunks[INDEX["gputrain_training_gpu_memory_bytes"]].extend(
                f'gputrain_training_gpu_memory_bytes{{gpu="{_escape(index)}",{lbl},'
                f'uuid="{_escape(uuid)}"}} {floatToGoString(used)}\n'
                for (index, uuid), used in sorted(held.get(key, {}).items()))
            for (index, uuid), seconds in sorted(busy.get(key, {}).items()):
                for name, v in zip(("gputrain_training_gpu_busy_seconds_total",
                                    "gputrain_training_gpu_memory_busy_seconds_total"), seconds,
                                   strict=True):
                    chunks[INDEX[name]].append(f'{name}{{gpu="{_escape(index)}",{lbl},'
                                               f'uuid="{_escape(uuid)}"}} {floatToGoString(v)}\n')
            if (done := profiles.get(key)) is not None:
                chunks[INDEX["gputrain_training_profile_info"]].append(
                    f'gputrain_training_profile_info{{{lbl},trace="{_escape(done.trace)}"}} '
                    f"{floatToGoString(done.finished)}\n")
        self._lines = cache  # forgets ranks that are gone
        for name, field in (("gputrain_gpu_unattributed_memory_bytes", 1),
                            ("gputrain_gpu_unattributed_processes", 0)):
            chunks[INDEX[name]].extend(
                f'{name}{{gpu="{_escape(index)}",uuid="{_escape(uuid)}"}} '
                f"{floatToGoString(v[field])}\n" for (index, uuid), v in others.items())
        for (index, uuid), seconds in sorted(unowned.items()):
            for name, v in zip(("gputrain_gpu_unattributed_busy_seconds_total",
                                "gputrain_gpu_unattributed_memory_busy_seconds_total"), seconds,
                               strict=True):
                chunks[INDEX[name]].append(f'{name}{{gpu="{_escape(index)}",'
                                           f'uuid="{_escape(uuid)}"}} {floatToGoString(v)}\n')
        chunks[INDEX["gputrain_ingest_requests_total"]].extend(
            f'gputrain_ingest_requests_total{{code="{code}"}} {floatToGoString(n)}\n'
            for code, n in sorted(self._store.requests().items()))
        chunks[INDEX["gputrain_ingest_series"]].append(
            f"gputrain_ingest_series {floatToGoString(len(states))}\n")
        out: list[str] = []
        always = ("gputrain_ingest_requests_total", "gputrain_ingest_series")
        for family, header, lines in zip(FAMILIES, self._headers[openmetrics], chunks,
                                         strict=True):
            if lines or family.name in always:
                out.append(header)
                out.extend(lines)
        self._status = CollectorStatus(True, time.perf_counter() - started, time.time())
        return "".join(out).encode()

    @functools.cached_property
    def _headers(self) -> dict[bool, tuple[str, ...]]:
        """The HELP and TYPE lines of each family in both formats, from prometheus_client's
        own encoders (so they match whatever version is installed)."""
        from prometheus_client.exposition import generate_latest
        from prometheus_client.openmetrics.exposition import generate_latest as generate_om

        out: dict[bool, tuple[str, ...]] = {}
        for om, encode in ((False, generate_latest), (True, generate_om)):
            out[om] = tuple(encode(_One(f.empty())).decode().removesuffix("# EOF\n")
                            for f in FAMILIES)
        return out


class _One:
    """A registry of one family, to take its header from an encoder."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterator[Metric]:
        yield self._family


def _labels(st: RankState) -> str:
    # label names sorted, as prometheus_client writes them; names are validated at ingest
    return f'rank="{st.rank}",run="{st.run}"'


def _rank_lines(st: RankState) -> tuple[tuple[int, str], ...]:
    """One rank's own lines, by the index of their family in FAMILIES (those it has)."""
    fg = floatToGoString
    lbl = _labels(st)
    bounds = (*map(fg, st.bucket_bounds), "+Inf")
    hist = [f'gputrain_training_step_duration_seconds_bucket{{le="{b}",{lbl}}} {fg(c)}\n'
            for b, c in zip(bounds, st.cumulative_counts, strict=True)]
    hist.append(f"gputrain_training_step_duration_seconds_count{{{lbl}}} {fg(st.steps)}\n")
    hist.append(f"gputrain_training_step_duration_seconds_sum{{{lbl}}} {fg(st.step_seconds)}\n")
    proc = st.process
    values = {
        "gputrain_training_steps_total": st.steps,
        "gputrain_training_data_wait_seconds_total": st.data_wait_seconds,
        "gputrain_training_samples_total": st.samples,
        "gputrain_training_flops_total": st.flops,
        "gputrain_training_elapsed_seconds_total": st.wall_seconds,
        "gputrain_training_slow_step_seconds_total": st.slow_step_seconds if st.bucket_bounds
        else None,
        "gputrain_training_last_step_timestamp_seconds": st.last_step_timestamp,
        "gputrain_training_last_push_timestamp_seconds": st.received_unix,
        "gputrain_training_process_cpu_seconds_total": proc.get("cpu_seconds"),
        "gputrain_training_process_resident_memory_bytes": proc.get("resident_memory_bytes"),
        "gputrain_training_process_cpu_allowance_cores": proc.get("cpu_allowance_cores"),
        "gputrain_training_process_cpu_throttled_seconds_total":
            proc.get("cpu_throttled_seconds"),
        "gputrain_training_process_read_bytes_total": proc.get("read_bytes"),
    }
    out = [(INDEX[name], f"{name}{{{lbl}}} {fg(v)}\n") for name, v in values.items()
           if v is not None]
    out.append((INDEX["gputrain_training_step_duration_seconds"], "".join(hist)))
    out.extend((INDEX["gputrain_training_phase_seconds_total"],
                f'gputrain_training_phase_seconds_total{{phase="{name}",{lbl}}} {fg(seconds)}\n')
               for name, seconds in sorted(st.phases.items()))
    return tuple(out)
