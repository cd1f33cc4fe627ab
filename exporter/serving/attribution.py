"""Attribution: which rank is on which GPU, and each rank's share of its GPUs, once per cycle.

Every sampler cycle :class:`Attribution` joins the new snapshot with the ranks live at its end
(their pushed pids and GPUs, NVML's process lists, the host's process tree) into one
:class:`NodeView`. The view is immutable: ``/metrics``, the status history (and through it the
status document, the page and ``top``) only read it, as prometheus_client's ``collect()`` only
reads, so every surface sees the same join of the same cycle.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

from exporter.reading.host_processes import HostProcess, read_process
from exporter.reading.sampler import Snapshot
from exporter.serving.ingest import RankState

if TYPE_CHECKING:
    from exporter.reading.sampler import Sampler
    from exporter.serving.ingest import IngestStore

log = logging.getLogger(__name__)

class GpuIndex:
    """One snapshot's GPUs, indexed once per render: by UUID, by index and by NVML pid."""

    def __init__(self, snap: Snapshot) -> None:
        self.by_uuid = {g.identity.uuid: g.identity.index for g in snap.gpus if g.identity.uuid}
        # a UUID without its "GPU-"/"MIG-" prefix: what identifies the device (a rank on a MIG
        # slice may push the slice's UUID as "GPU-...", as torch names every device)
        self.by_body = {uuid_body(u): (i, u) for u, i in self.by_uuid.items()}
        self.by_index = {g.identity.index: g.identity.uuid for g in snap.gpus}
        self.by_pid: dict[int, list[tuple[str, str]]] = {}
        for g in snap.gpus:
            for pid in g.sample.pids if g.sample is not None else ():
                self.by_pid.setdefault(pid, []).append((g.identity.index, g.identity.uuid))


def uuid_body(ref: str) -> str:
    """A device UUID without its ``GPU-`` or ``MIG-`` prefix (an index stays as it is)."""
    return ref[4:].lower() if ref[:4] in ("GPU-", "MIG-") else ref


def resolve_gpus(st: RankState, gpus: Snapshot | GpuIndex,
                 listed: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """(gpu index, uuid) pairs a rank uses: its pushed UUIDs or indices (torch's current
    device), and every GPU whose NVML process list holds its process or a descendant
    (``listed``, as :class:`Owners` joins them: one process may drive several GPUs, as
    device_map="auto" or pipeline stages in one process do); else the GPUs that list its pid.
    Only GPUs this node has are returned."""
    idx = gpus if isinstance(gpus, GpuIndex) else GpuIndex(gpus)
    out: list[tuple[str, str]] = []
    for ref in st.gpus:
        if ref in idx.by_uuid:
            out.append((idx.by_uuid[ref], ref))
        elif uuid_body(ref) in idx.by_body:
            out.append(idx.by_body[uuid_body(ref)])
        elif ref in idx.by_index:
            out.append((ref, idx.by_index[ref]))
    for key in sorted(listed, key=lambda k: (len(k[0]), k)):
        if key not in out and idx.by_index.get(key[0]) == key[1]:
            out.append(key)
    if not out and st.pid is not None:
        out = list(idx.by_pid.get(st.pid, ()))
    return out


GpuKey = tuple[str, str]  # (gpu index, uuid)
RankKey = tuple[str, str]  # (run, rank)
UNRESOLVED = ("", "")  # a process this daemon cannot read: whose it is, is unknown



class RankProcesses:
    """The pushed ranks by what names their process on the host: the pid the process sees
    and its start time (both pushed), matched to a host process's ``NSpid`` and start time;
    a rank whose client pushes no start time (before 0.9) by its pid taken as the host's."""

    def __init__(self, states: Iterable[RankState]) -> None:
        self.by_start: dict[tuple[int, int], RankKey] = {}
        self.by_pid: dict[int, RankKey] = {}
        for st in states:
            if st.pid is None:
                continue
            if st.start_time is None:
                self.by_pid[st.pid] = (st.run, st.rank)
            else:
                self.by_start[(st.pid, st.start_time)] = (st.run, st.rank)

    def match(self, p: HostProcess) -> RankKey | None:
        """The rank whose process ``p`` is, if any."""
        if p.start_ticks is not None:
            hit = self.by_start.get((p.ns_pid, p.start_ticks))
            if hit is not None:
                return hit
        return self.by_pid.get(p.pid)


class Owners:
    """Which rank holds each process on a GPU: the one whose process (see
    :class:`RankProcesses`) is the process or an ancestor of it on the host (a launcher's
    child, a compile or DataLoader worker that touched CUDA). A process is read once (its
    ``/proc`` entry) and kept while it is on a GPU. A process this daemon cannot read (no
    hostPID, a sandbox) is :data:`UNRESOLVED`: neither a rank's nor a stranger's. Pids are never
    labels: they only join NVML's process list to the pushed ranks."""

    MAX_DEPTH = 16

    def __init__(self, parent_of: Callable[[int], int | None] | None = None,
                 read: Callable[[int], HostProcess | None] = read_process) -> None:
        if parent_of is not None:  # a scripted process tree without namespaces
            def read(pid: int) -> HostProcess:
                return HostProcess(pid, pid, parent_of(pid) or 0, None)
        self._read = read
        self._procs: dict[int, HostProcess | None] = {}
        self._lock = threading.Lock()

    def resolve(self, snap: Snapshot, states: Iterable[RankState]) -> dict[int, RankKey | None]:
        """The owner of every process on a GPU of ``snap`` (listed, holding memory or with
        busy seconds): its (run, rank), None for no rank's, :data:`UNRESOLVED` where it cannot
        be read. The processes no longer on any GPU are forgotten."""
        keys = RankProcesses(states)
        out: dict[int, RankKey | None] = {}
        seen: set[int] = set()
        with self._lock:
            for g in snap.gpus:
                listed = (*g.sample.pids, *g.sample.process_memory) if g.sample else ()
                for pid in (*listed, *g.process_busy_seconds):
                    if pid not in out:
                        out[pid] = self._owner(pid, keys, seen)
            self._procs = {pid: p for pid, p in self._procs.items() if pid in seen}
        return out

    def attribute(self, snap: Snapshot, states: Iterable[RankState],
                  owner_of: dict[int, RankKey | None] | None = None) -> tuple[
            dict[RankKey, dict[GpuKey, float]], dict[GpuKey, tuple[int, float]]]:
        """Bytes each (run, rank) holds per GPU, and per GPU the count and bytes of the
        processes no rank owns (those that cannot be read left out: unknown); ``owner_of``:
        :meth:`resolve`'s answer for ``snap``, where the caller has it."""
        if owner_of is None:
            owner_of = self.resolve(snap, states)
        ranks: dict[RankKey, dict[GpuKey, float]] = {}
        others: dict[GpuKey, tuple[int, float]] = {}
        for g in snap.gpus:
            if not g.up or g.sample is None:
                continue
            key = (g.identity.index, g.identity.uuid)
            count, held, unknown = 0, 0.0, 0
            for pid in dict.fromkeys((*g.sample.pids, *g.sample.process_memory)):
                used = g.sample.process_memory.get(pid, 0.0)
                owner = owner_of[pid]
                if owner is UNRESOLVED:
                    unknown += 1
                elif owner is None:
                    count, held = count + 1, held + used
                else:
                    mine = ranks.setdefault(owner, {})
                    mine[key] = mine.get(key, 0.0) + used
            if not unknown or count:
                others[key] = (count, held)
        return ranks, others

    def _owner(self, pid: int, keys: RankProcesses, seen: set[int]) -> RankKey | None:
        if pid in keys.by_pid:  # needs no /proc: a client that pushes the host's pid
            seen.add(pid)
            return keys.by_pid[pid]
        for depth in range(self.MAX_DEPTH):
            seen.add(pid)
            if pid not in self._procs:
                self._procs[pid] = self._read(pid)
            p = self._procs[pid]
            if p is None:
                return UNRESOLVED if depth == 0 else None
            hit = keys.match(p)
            if hit is not None:
                return hit
            if p.ppid <= 1:
                return None
            pid = p.ppid
        return None


# busy and memory-busy seconds (SM busy, memory-bandwidth busy)
Seconds = tuple[float, float]


class Counted(NamedTuple):
    """:meth:`GpuShares.count`'s answer: the share fields of a :class:`NodeView`."""

    busy: dict[RankKey, dict[GpuKey, Seconds]]
    unowned: dict[GpuKey, Seconds]
    listed: dict[RankKey, frozenset[GpuKey]]
    strangers: frozenset[GpuKey]
    unresolved: dict[GpuKey, int]


class GpuShares:
    """Each rank's busy seconds on each GPU, and each GPU's busy seconds that no rank owns: the
    sampler's per-process busy counters summed by their owner (a rank's pushed pid or a
    descendant of it, as :meth:`Owners.resolve` finds it), snapshot after snapshot. A rank's counter
    grows while the rank is live (a restarted process of it goes on counting into it). A GPU
    whose driver gives per-process samples has an unattributed counter (0 where every process is
    a rank's); one whose driver gives none has none: never a misleading zero. Only
    :class:`Attribution` counts, once per snapshot."""

    def __init__(self) -> None:
        self._last: dict[tuple[GpuKey, int], Seconds] = {}  # (gpu, pid) -> its totals
        self._ranks: dict[RankKey, dict[GpuKey, Seconds]] = {}
        self._others: dict[GpuKey, Seconds] = {}
        self._warned = False

    def count(self, snap: Snapshot, states: Iterable[RankState],
              owner_of: dict[int, RankKey | None]) -> Counted:
        """Count the busy seconds the processes added since the last snapshot counted, each
        to its owner (``owner_of``: :meth:`Owners.resolve`'s answer for ``snap``), and say who
        is where as of ``snap``."""
        live = {(st.run, st.rank) for st in states}
        # built aside and taken at once: a failure half-way counts nothing twice
        ranks = {k: dict(v) for k, v in self._ranks.items() if k in live}
        others = dict(self._others)
        last: dict[tuple[GpuKey, int], Seconds] = {}
        unresolved: dict[GpuKey, int] = {}
        listed: dict[RankKey, set[GpuKey]] = {}
        strangers: set[GpuKey] = set()
        for g in snap.gpus:
            key = (g.identity.index, g.identity.uuid)
            pids = g.sample.pids if g.sample is not None else ()
            owners = [owner_of[pid] for pid in dict.fromkeys((*pids, *g.process_busy_seconds))]
            for o in owners:
                if o is not None and o is not UNRESOLVED:
                    listed.setdefault(o, set()).add(key)
            if any(o is None for o in owners):
                strangers.add(key)
            if unknown := sum(o is UNRESOLVED for o in owners):
                unresolved[key] = unknown
            if g.sample is not None and g.sample.process_utilization is not None:
                if owners and all(o is UNRESOLVED for o in owners):
                    others.pop(key, None)  # no process readable: unknown, not zero
                else:
                    others.setdefault(key, (0.0, 0.0))
            for pid, busy in g.process_busy_seconds.items():
                now = (busy, g.process_memory_busy_seconds.get(pid, 0.0))
                before = self._last.get((key, pid), (0.0, 0.0))
                last[(key, pid)] = now
                added = (max(0.0, now[0] - before[0]), max(0.0, now[1] - before[1]))
                owner = owner_of[pid]
                if owner is UNRESOLVED:
                    continue  # whose it is is unknown: never counted as a stranger's
                held = others if owner is None else ranks.setdefault(owner, {})
                was = held.get(key, (0.0, 0.0))
                held[key] = (was[0] + added[0], was[1] + added[1])
        self._last, self._ranks, self._others = last, ranks, others
        if unresolved and not self._warned:
            self._warned = True
            log.warning("%d GPU process(es) cannot be read in /proc: their GPU shares are "
                        "unknown. Run the daemon in the host's PID namespace (Kubernetes "
                        "hostPID: true, docker --pid=host, compose pid: host).",
                        sum(unresolved.values()))
        return Counted({k: dict(v) for k, v in ranks.items()}, dict(others),
                       {k: frozenset(v) for k, v in listed.items()}, frozenset(strangers),
                       unresolved)


@dataclass(frozen=True)
class NodeView:
    """One sampler cycle's node, joined once. Its readers never change it.

    ``held``: bytes each (run, rank) holds per GPU; ``others``: per GPU, the count and bytes
    of the processes no rank owns (a GPU whose processes cannot be read left out: unknown).
    ``busy``: each live rank's busy and memory-busy seconds per GPU (counters: a rank's total
    on a GPU its processes left is kept, in case they come back); ``listed``: the GPUs its
    processes are on now (a share counts only there: one that exited leaves the window with its
    processes); ``unowned``: per GPU, the seconds of processes no rank owns; ``strangers``: the
    GPUs a process no rank owns is on; ``unresolved``: per GPU, its processes none can read."""

    snapshot: Snapshot
    states: tuple[RankState, ...] = ()
    held: Mapping[RankKey, Mapping[GpuKey, float]] = field(default_factory=dict)
    others: Mapping[GpuKey, tuple[int, float]] = field(default_factory=dict)
    busy: Mapping[RankKey, Mapping[GpuKey, Seconds]] = field(default_factory=dict)
    unowned: Mapping[GpuKey, Seconds] = field(default_factory=dict)
    listed: Mapping[RankKey, frozenset[GpuKey]] = field(default_factory=dict)
    strangers: frozenset[GpuKey] = frozenset()
    unresolved: Mapping[GpuKey, int] = field(default_factory=dict)
    # the ranks that ended without a clean close, after their ttl (IngestStore.departed)
    departed: tuple[RankState, ...] = ()

    @property
    def cycle(self) -> int:
        return self.snapshot.cycle

    @functools.cached_property
    def gpus(self) -> GpuIndex:
        """The snapshot's GPUs, indexed (built once per view, on first use)."""
        return GpuIndex(self.snapshot)


class Attribution:
    """Builds one :class:`NodeView` per sampler cycle and publishes it as :attr:`latest` (a
    plain attribute read: safe from any thread); :attr:`listeners` are called with each new
    view, in the sampler's thread. A snapshot seen twice is joined once."""

    def __init__(self, owners: Owners | None = None, snapshot: Snapshot | None = None) -> None:
        self.owners = owners or Owners()
        self._shares = GpuShares()
        # before the first cycle: the given snapshot (a sampler's first), nobody attributed
        self.latest = NodeView(snapshot if snapshot is not None else Snapshot(-1, 0.0, "", ""))
        self.listeners: list[Callable[[NodeView], None]] = []
        self._joined = -1  # the last snapshot cycle joined
        self._failed = False  # a join has failed (logged once)
        self._failed_reap = False  # ... and so has a look for the ranks' processes
        self._lock = threading.Lock()

    def update(self, snap: Snapshot, states: Iterable[RankState],
               departed: Iterable[RankState] = ()) -> NodeView:
        """The view of ``snap`` with the ranks live at its end (and those departed);
        published and told to the listeners when it is new."""
        with self._lock:
            if snap.cycle <= self._joined:
                return self.latest
            self._joined = snap.cycle
            states = tuple(sorted(states, key=lambda s: (s.run, s.rank)))
            try:
                owner_of = self.owners.resolve(snap, states)  # once: both joins read it
                held, others = self.owners.attribute(snap, states, owner_of)
                view = NodeView(snap, states, held, others,
                                *self._shares.count(snap, states, owner_of))
            except Exception:  # a bug here must not freeze the page: this cycle joins nothing
                if not self._failed:
                    log.exception("attributing the GPUs' processes to ranks failed; the "
                                  "cycles it fails in show no attribution (logged once)")
                self._failed = True
                view = NodeView(snap, states)
            if departed:
                view = replace(view, departed=tuple(departed))
            self.latest = view
        for listener in list(self.listeners):
            listener(view)
        return view

    def follow(self, sampler: Sampler, store: IngestStore | None) -> None:
        """Build a view after each of ``sampler``'s cycles, with ``store``'s live ranks (those
        whose process died without a goodbye marked so first: :meth:`IngestStore.reap`);
        before any other listener of the sampler runs."""
        def cycle() -> None:
            if store is not None:
                try:
                    store.reap()
                except Exception:  # a bug there must not stop the cycle: nothing is reaped
                    if not self._failed_reap:
                        log.exception("looking for the ranks' processes in /proc failed; "
                                      "no rank is marked killed while it fails (logged once)")
                    self._failed_reap = True
            self.update(sampler.snapshot, store.states() if store is not None else (),
                        store.departed() if store is not None else ())

        sampler.listeners.insert(0, cycle)
