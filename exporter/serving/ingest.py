"""The push endpoint's logic: validate a training client's state and keep it per (run, rank).

A push carries the client's cumulative totals, so a lost or repeated push loses nothing. A
push is validated whole before anything is stored: a rejected push leaves the state as it was.
docs/push-protocol.md has the schema.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise
from typing import Any

from exporter.heuristics.stalls import slow_step_count, slow_step_seconds
from exporter.protocol import (
    CLEAN_EXITS,
    CLOCK_TOLERANCE_SECONDS,
    DEFAULT_PRECISION,
    EXIT_REASONS,
    FAILED_EXITS,
    FLOPS_SLACK_SECONDS,
    GPU_REF_RE,
    KILLED_EXIT,
    MAX_BUCKETS,
    MAX_CLOCK_OFFSET_SECONDS,
    MAX_GPU_FLOPS,
    MAX_GPUS,
    MAX_NAME_LENGTH,
    MAX_PHASE_NAME_LENGTH,
    MAX_PHASES,
    NAME_RE,
    OOM_KILLED,
    PROCESS_FIELDS,
    PUSH_FIELDS,
    RUN_ID_RE,
    SCALAR_KINDS,
    SCHEMA_VERSION,
    Refused,
    check_unicode,
    cumulative,
    is_name,
    json_kind,
    number,
    read_scalars,
)
from exporter.reading.host_processes import (
    find_host_pid,
    process_gone,
    read_oom_kills,
    read_state,
    runs_as,
)
from exporter.serving.profiles import ProfileBoard, parse_report, parse_stacks_report

MAX_CAPABILITIES = 8
log = logging.getLogger(__name__)
GOODBYE_GRACE_SECONDS = 60.0  # a finished rank's final totals stay this long, for one more scrape
FORMER_RUN_IDS = 4  # run_ids a (run, rank) had before its current one, remembered
DEAD_TTL_SECONDS = 3600.0  # a rank that ended without a clean close is reported this long after
REAP_SECONDS = 1.0  # the ranks' processes are looked for in /proc at most this often
CONFIRM_SECONDS = 3.0  # a process found gone is dead when still gone this much later
REFUSED_SECONDS = 120.0  # a rank whose push was refused this recently is heard, not frozen
OOM_CHANGES = 64  # the last changes of the node's OOM kill count kept, (time, count)

# the totals that only grow within one run_id: the required ones; those only where the
# client sends them (the communication fields where it measures a DDP model); the process's
COUNTERS = cumulative(PUSH_FIELDS, required=True)
OPTIONAL_COUNTERS = cumulative(PUSH_FIELDS, required=False)
PROCESS_COUNTERS = cumulative(PROCESS_FIELDS, required=False)
# the scalar fields a RankState keeps under their own name (goodbye is returned beside it)
_STATE_FIELDS = tuple(f.name for f in PUSH_FIELDS if f.kind in SCALAR_KINDS and
                      f.name != "goodbye")
_TIMESTAMPS = tuple(f.name for f in PUSH_FIELDS if f.kind == "timestamp")
_PROCESS_IDS = ("pid", "start_time")  # kept apart from the process's figures


@dataclass
class RankState:
    """The latest accepted state of one (run, rank)."""

    run: str
    rank: str
    run_id: str
    received_at: float  # monotonic
    received_unix: float
    expires_at: float = 0.0  # monotonic
    steps: int = 0
    step_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    samples: float = 0.0
    flops: float | None = None  # model FLOPs, when the client knows its FLOPs per sample
    elapsed_seconds: float | None = None  # since the process started, by the client's clock
    # gradient communication, where the client measures it: seconds in collectives, the part
    # the steps waited for, bytes all-reduced
    comm_seconds: float | None = None
    comm_exposed_seconds: float | None = None
    comm_bytes: float | None = None
    # wall seconds of the rank across its processes (see IngestStore.push): goodput's and
    # MFU's denominator
    wall_seconds: float = 0.0
    precision: str = DEFAULT_PRECISION
    bucket_bounds: tuple[float, ...] = ()
    bucket_counts: tuple[int, ...] = ()
    phases: dict[str, float] = field(default_factory=dict)
    # seconds of its process's steps over SLOW_STEP_FACTOR times its median (the daemon's
    # count from the pushed buckets: see exporter.heuristics.stalls)
    slow_step_seconds: float = 0.0
    slow_steps: float = 0.0  # ... and how many steps they were
    # the DataLoader's worker processes, where the client wraps one (its batches come in
    # groups of this many: one slow step, then the rest fast)
    loader_workers: int | None = None
    world_size: int | None = None  # the ranks of its run, where the client says
    # its process groups' shortest collective timeout, seconds, where the client says
    collective_timeout_seconds: float | None = None
    last_step_timestamp: float | None = None  # on the daemon's clock (see _clock_skew)
    # the client's clock minus the daemon's, as its timestamps show it (0 within
    # CLOCK_TOLERANCE_SECONDS); its timestamps are moved by it
    clock_skew: float = 0.0
    process: dict[str, float] = field(default_factory=dict)
    # the cgroup its CPU allowance comes from (an inode number), where a limit sets it
    allowance_group: int | None = None
    pid: int | None = None  # as the rank's process sees itself (inside its PID namespace)
    start_time: int | None = None  # the process's start, clock ticks after boot
    gpus: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()  # what the client understands in a push answer
    profile_report: dict[str, Any] | None = None  # the client's state of a profile, this push
    stacks_report: dict[str, Any] | None = None  # and of a py-spy capture
    finished: bool = False  # it said goodbye at a clean end: finished, not vanished
    # it said goodbye at a failure (an exception, a signal): failed, never finished
    failed: bool = False
    # the step in progress and the outside-step phase in progress, as of this push (see
    # step_in_progress(): the daemon's own clock ages them)
    step_open_seconds: float | None = None
    open_phase: str | None = None
    open_phase_seconds: float | None = None
    exit_reason: str | None = None  # with a goodbye: how the process ended
    exit_detail: str | None = None  # ... the exception's type or the signal's name
    # this daemon found its process running (not stopped) in its /proc at its last look
    # (IngestStore.reap): a rank that stops pushing while it runs is frozen, not gone
    process_running: bool = False

    def step_in_progress(self, now: float) -> float | None:
        """Seconds the rank's open step has run at ``now`` (monotonic), outside-step phases
        excluded: what it pushed, aged by the daemon's own clock since (no client clock
        enters it); None where no step is open or the rank has ended.

        A process that has made no step yet, outside any phase, is in its first step since it
        started (its ``elapsed_seconds``): a rank waiting in a barrier, a broadcast or the
        rendezvous before its first batch has been making no step all that time, and is judged
        as any first step is (its allowance, or its stacks)."""
        if self.exit_reason is not None:
            return None
        if self.step_open_seconds is None:
            if self.steps or self.open_phase is not None or self.elapsed_seconds is None:
                return None
            return self.elapsed_seconds + max(0.0, now - self.received_at)
        if self.open_phase is not None:  # a phase holds the step: it does not grow
            return self.step_open_seconds
        return self.step_open_seconds + max(0.0, now - self.received_at)

    def phase_in_progress(self, now: float) -> tuple[str, float] | None:
        """The outside-step phase in progress and its seconds at ``now`` (monotonic)."""
        if self.open_phase is None or self.open_phase_seconds is None or \
                self.exit_reason is not None:
            return None
        return self.open_phase, self.open_phase_seconds + max(0.0, now - self.received_at)

    @property
    def cumulative_counts(self) -> tuple[int, ...]:
        """The step histogram's cumulative counts with the +Inf bucket, which is every step
        (the client sends the finite buckets only)."""
        return (*self.bucket_counts, self.steps)


def _reject_constant(name: str) -> Any:
    raise Refused(400, f"invalid JSON: {name} is not a number JSON allows")


def _name(body: dict, key: str, what: str) -> str:
    v = body.get(key)
    if isinstance(v, int) and not isinstance(v, bool) and key == "rank":
        v = str(v)
    if not isinstance(v, str):
        raise Refused(400, f"field '{key}' must be a string, got {json_kind(v)}")
    if not v:
        raise Refused(400, f"field '{key}' must not be empty")
    if len(v) > MAX_NAME_LENGTH:
        raise Refused(400, f"field '{key}' is {len(v)} characters; the limit is "
                           f"{MAX_NAME_LENGTH}")
    if not NAME_RE.fullmatch(v):
        raise Refused(400, f"field '{key}' may only hold letters, digits and _ . : - "
                           f"({what}), got {v!r}")
    return v


def parse_push(raw: bytes, now: float, now_unix: float) -> tuple[RankState, bool]:
    """Validate a push body; returns the state it describes and whether it says goodbye."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise Refused(400, "the body must be UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise Refused(400, f"invalid JSON: {exc.msg} at line {exc.lineno} column "
                           f"{exc.colno}") from None
    except RecursionError:
        raise Refused(400, "invalid JSON: nested too deeply") from None
    except ValueError as exc:  # an integer over Python's digit limit (4,300 digits)
        raise Refused(400, f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Refused(400, f"the body must be a JSON object, got {json_kind(body)}")
    check_unicode(body, raw)
    version = body.get("version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise Refused(400, f"field 'version' must be {SCHEMA_VERSION}, got {version!r}")
    run = _name(body, "run", "the run's name")
    rank = _name(body, "rank", "the rank")
    run_id = body.get("run_id")
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
        raise Refused(400, "field 'run_id' must be 1-64 letters, digits, _ or -")
    st = RankState(run=run, rank=rank, run_id=run_id, received_at=now, received_unix=now_unix)
    scalars = read_scalars(body, PUSH_FIELDS)
    for f in _TIMESTAMPS:  # a clock that far off is no clock: its time would corrupt the rest
        ts = scalars[f]
        if ts is not None and abs(ts - now_unix) > MAX_CLOCK_OFFSET_SECONDS:
            raise Refused(400, f"field '{f}' is {ts:.6g}, over ten years from the daemon's "
                               f"clock ({now_unix:.10g}): check the client machine's clock")
    for key in _STATE_FIELDS:
        setattr(st, key, scalars[key])
    _check_comm(st)
    _parse_histogram(body, st)
    _parse_phases(body, st)
    _parse_process(body, st)
    _parse_gpus(body, st)
    _parse_profile(body, st)
    goodbye = scalars["goodbye"]
    _parse_end(body, st, goodbye)
    return st, goodbye


def _optional_name(body: dict, key: str, what: str) -> str | None:
    """A name field that may be absent (or null)."""
    return None if body.get(key) is None else _name(body, key, what)


def _parse_end(body: dict, st: RankState, goodbye: bool) -> None:
    """The open phase, and how the process ended: a goodbye without ``exit_reason`` (a client
    from before it) is a clean close(); one with a failure's reason is a failure."""
    st.open_phase = _optional_name(body, "open_phase", "a phase's name")
    if st.open_phase is not None and len(st.open_phase) > MAX_PHASE_NAME_LENGTH:
        raise Refused(400, f"field 'open_phase' is longer than {MAX_PHASE_NAME_LENGTH} "
                           "characters")
    if st.open_phase is None and st.open_phase_seconds is not None:
        raise Refused(400, "field 'open_phase_seconds' comes with 'open_phase'")
    st.exit_detail = _optional_name(body, "exit_detail", "an exception's type or a signal")
    if not goodbye and (st.exit_reason is not None or st.exit_detail is not None):
        raise Refused(400, "fields 'exit_reason' and 'exit_detail' come with 'goodbye': true")
    if goodbye:
        st.exit_reason = st.exit_reason or "closed"
        st.failed = st.exit_reason in FAILED_EXITS
        st.finished = st.exit_reason in CLEAN_EXITS


def _check_comm(st: RankState) -> None:
    """The exposed communication is part of the communication and of the steps."""
    if st.comm_exposed_seconds is not None:
        if st.comm_seconds is None:
            raise Refused(400, "field 'comm_exposed_seconds' needs 'comm_seconds' beside it")
        if st.comm_exposed_seconds > st.comm_seconds:
            raise Refused(400, f"'comm_exposed_seconds' ({st.comm_exposed_seconds:g}) is more "
                               f"than 'comm_seconds' ({st.comm_seconds:g}): the exposed part "
                               "of the communication is part of it")
    if st.comm_exposed_seconds is not None and st.comm_exposed_seconds > st.step_seconds:
        raise Refused(400, f"'comm_exposed_seconds' ({st.comm_exposed_seconds:g}) is more than "
                           f"'step_seconds' ({st.step_seconds:g}): a step's wait for its "
                           "gradients is part of the step")


def _parse_histogram(body: dict, st: RankState) -> None:
    bounds, counts = body.get("step_buckets"), body.get("step_counts")
    if bounds is None and counts is None:
        return
    if not isinstance(bounds, list) or not isinstance(counts, list):
        raise Refused(400, "fields 'step_buckets' and 'step_counts' must both be arrays")
    if len(bounds) != len(counts):
        raise Refused(400, f"'step_buckets' has {len(bounds)} bounds but 'step_counts' "
                           f"has {len(counts)} counts")
    if len(bounds) > MAX_BUCKETS:
        raise Refused(400, f"at most {MAX_BUCKETS} histogram buckets, got {len(bounds)}")
    b = [number(x, "step_buckets") for x in bounds]
    c = [int(number(x, "step_counts", integer=True)) for x in counts]
    if any(x >= y for x, y in pairwise(b)) or (b and b[0] <= 0):
        raise Refused(400, "'step_buckets' must be positive and strictly increasing")
    if any(x > y for x, y in pairwise(c)):
        raise Refused(400, "'step_counts' must be cumulative (never decreasing)")
    if c and c[-1] > st.steps:
        raise Refused(400, f"'step_counts' counts {c[-1]} steps but 'steps' is "
                           f"{st.steps}")
    st.bucket_bounds, st.bucket_counts = tuple(b), tuple(c)


def _parse_phases(body: dict, st: RankState) -> None:
    phases = body.get("phases") or {}
    if not isinstance(phases, dict):
        raise Refused(400, f"field 'phases' must be an object, got {json_kind(phases)}")
    if len(phases) > MAX_PHASES:
        raise Refused(400, f"at most {MAX_PHASES} phases, got {len(phases)}")
    for name in phases:
        if not NAME_RE.fullmatch(name) or len(name) > MAX_PHASE_NAME_LENGTH:
            raise Refused(400, f"phase name {name!r} must be 1-64 letters, digits, _ . : -")
        if phases[name] is None:
            raise Refused(400, f"missing field 'phases.{name}'")
        st.phases[name] = number(phases[name], f"phases.{name}")


def _parse_process(body: dict, st: RankState) -> None:
    proc = body.get("process")
    if proc is None:
        return
    if not isinstance(proc, dict):
        raise Refused(400, f"field 'process' must be an object, got {json_kind(proc)}")
    values = read_scalars(proc, PROCESS_FIELDS, "process.")
    st.pid, st.start_time = (values.pop(key) for key in _PROCESS_IDS)
    group = values.pop("cpu_allowance_group", None)
    st.allowance_group = int(group) if group is not None else None
    st.process = {key: v for key, v in values.items() if v is not None}


def _parse_gpus(body: dict, st: RankState) -> None:
    gpus = body.get("gpus") or []
    if not isinstance(gpus, list) or len(gpus) > MAX_GPUS:
        raise Refused(400, f"field 'gpus' must be an array of at most {MAX_GPUS} GPU "
                           "UUIDs or indices")
    for g in gpus:
        if not isinstance(g, str) or not GPU_REF_RE.fullmatch(g):
            raise Refused(400, f"'gpus' entries must be a GPU index or a GPU-/MIG- UUID, "
                               f"got {g!r}")
    st.gpus = tuple(dict.fromkeys(gpus))


def _parse_profile(body: dict, st: RankState) -> None:
    caps = body.get("capabilities") or []
    if not isinstance(caps, list) or len(caps) > MAX_CAPABILITIES or not all(
            isinstance(c, str) and 0 < len(c) <= MAX_PHASE_NAME_LENGTH for c in caps):
        raise Refused(400, f"field 'capabilities' must be an array of at most "
                           f"{MAX_CAPABILITIES} short strings")
    st.capabilities = tuple(dict.fromkeys(caps))
    if body.get("profile") is not None:
        st.profile_report = parse_report(body["profile"])
    if body.get("stacks") is not None:
        st.stacks_report = parse_stacks_report(body["stacks"])


def _check_monotonic(old: RankState, new: RankState) -> None:
    """Within one run_id every total only grows; a decrease means a client bug."""
    for key in COUNTERS:
        if getattr(new, key) < getattr(old, key):
            raise Refused(409, f"'{key}' went down from {getattr(old, key)} to "
                               f"{getattr(new, key)} within run_id {new.run_id}; a "
                               "restarted process must use a new run_id")
    for key in OPTIONAL_COUNTERS:
        before, after = getattr(old, key), getattr(new, key)
        if before is not None and (after is None or after < before):
            raise Refused(409, f"'{key}' went {'missing' if after is None else 'down'} "
                               f"within run_id {new.run_id} (was {before})")
    if old.bucket_bounds and new.bucket_bounds != old.bucket_bounds:
        raise Refused(409, "'step_buckets' changed within one run_id")
    for a, b in zip(old.bucket_counts, new.bucket_counts, strict=False):
        if b < a:
            raise Refused(409, "'step_counts' went down within one run_id")
    for name, seconds in old.phases.items():
        if new.phases.get(name, 0.0) < seconds:
            raise Refused(409, f"phase '{name}' went down within one run_id")
    for key in PROCESS_COUNTERS:
        if key in old.process and new.process.get(key, 0.0) < old.process[key]:
            raise Refused(409, f"'process.{key}' went down within one run_id")


def _check_flops(old: RankState | None, new: RankState) -> None:
    """FLOPs that no GPU could have done are refused (a wrong FLOPs per sample would make
    every MFU figure absurd): the growth since the last push of this run_id (or since the
    process started, where the client says when) is bounded by the rank's wall seconds at
    MAX_GPU_FLOPS per GPU. A first push without ``elapsed_seconds`` only sets the base."""
    if new.flops is None or (old is None and new.elapsed_seconds is None):
        return
    before = old.flops if old is not None and old.flops is not None else 0.0
    seconds = new.wall_seconds - (old.wall_seconds if old is not None else 0.0)
    gpus = len(new.gpus) or MAX_GPUS
    most = (max(0.0, seconds) + FLOPS_SLACK_SECONDS) * MAX_GPU_FLOPS * gpus
    if new.flops - before > most:
        raise Refused(400, f"field 'flops' grew by {new.flops - before:.3g} in {seconds:.0f} s "
                           f"of wall time: more than {gpus} GPU(s) can do (at most "
                           f"{MAX_GPU_FLOPS:.0e} FLOP/s each); check the FLOPs per sample "
                           "the client states")


def _clock_skew(old: RankState | None, new: RankState) -> None:
    """Move ``last_step_timestamp`` onto the daemon's clock. A step cannot end after the
    push that reports it, nor (when steps grew since the last push) before that push: past
    CLOCK_TOLERANCE_SECONDS either way, the difference is the client's clock skew, kept
    for the run_id and taken off its timestamps (so a clock a day ahead cannot hide a stall,
    nor one behind invent one); a timestamp is never after the push."""
    ts = new.last_step_timestamp
    skew = old.clock_skew if old is not None else 0.0
    if ts is not None:
        now = new.received_unix
        if ts - skew - now > CLOCK_TOLERANCE_SECONDS:
            skew = ts - now
        elif old is not None and new.steps > old.steps and \
                old.received_unix - (ts - skew) > CLOCK_TOLERANCE_SECONDS:
            skew = ts - old.received_unix
        new.last_step_timestamp = min(ts - skew, now)
    new.clock_skew = skew


def _slow_steps(old: RankState | None, new: RankState) -> float:
    """The process's slow steps so far, counted as :func:`_slow_step_seconds` counts their
    seconds."""
    if old is None or old.run_id != new.run_id:
        counts = new.cumulative_counts
        return slow_step_count(new.bucket_bounds, (0,) * len(counts), counts)
    if old.bucket_bounds != new.bucket_bounds:
        return old.slow_steps
    return old.slow_steps + slow_step_count(new.bucket_bounds, old.cumulative_counts,
                                            new.cumulative_counts)


def _slow_step_seconds(old: RankState | None, new: RankState) -> float:
    """The process's seconds in slow steps so far: its previous push's, and those of the
    steps since (none counted across a change of bucket bounds)."""
    if old is None or old.run_id != new.run_id:
        counts = new.cumulative_counts
        return slow_step_seconds(new.bucket_bounds, (0,) * len(counts), counts,
                                 new.step_seconds)
    if old.bucket_bounds != new.bucket_bounds:
        return old.slow_step_seconds
    return old.slow_step_seconds + slow_step_seconds(
        new.bucket_bounds, old.cumulative_counts, new.cumulative_counts,
        new.step_seconds - old.step_seconds)


def _wall_seconds(old: RankState | None, new: RankState) -> float:
    """The rank's wall seconds at ``new``: its process's age on its first push; then the
    client's clock (the daemon's where the client sends none); and across a restart (a new
    run_id) the whole gap from the old process's last push, so start-up, crash and restart
    count as time outside steps."""
    if old is None:
        return new.elapsed_seconds or 0.0
    before, now = old.elapsed_seconds, new.elapsed_seconds
    if old.run_id == new.run_id and before is not None and now is not None:
        return old.wall_seconds + (now - before)
    return old.wall_seconds + max(0.0, new.received_at - old.received_at)


def allowance_shares(states: list[RankState]) -> dict[tuple[str, str], float]:
    """Each live rank's share of its cgroup's CPU allowance, in cores: the allowance divided
    among the ranks on this node that share the cgroup setting it (the ranks of one pod or
    job share its quota, and each at a quarter of it is the pod at its limit); a rank alone
    under its limit, or that says no group, has the whole of it."""
    groups: dict[tuple[int, float], int] = {}
    for st in states:
        cores = st.process.get("cpu_allowance_cores")
        if st.allowance_group is not None and cores is not None and st.exit_reason is None:
            key = (st.allowance_group, cores)
            groups[key] = groups.get(key, 0) + 1
    out = {}
    for st in states:
        cores = st.process.get("cpu_allowance_cores")
        if cores is None:
            continue
        n = groups.get((st.allowance_group, cores), 1) if st.allowance_group is not None else 1
        out[(st.run, st.rank)] = cores / n
    return out


class IngestStore:
    """The live (run, rank) states, bounded in number and expired after ``ttl`` seconds.

    A rank that ended without a clean close (silent without a goodbye, or a goodbye that says
    it failed) is not forgotten when its ``ttl`` runs out: it becomes *departed* for
    ``dead_ttl`` more seconds, its counters gone and its end kept (when it last pushed, how it
    ended), so that every surface and its alert still say the run died (:meth:`departed`).
    A new push of that (run, rank) ends it."""

    def __init__(self, max_series: int = 1024, ttl: float = 600.0, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 alert_interval: float = 3600.0,
                 profiled_alerts: frozenset[str] = frozenset(),
                 rank_interval: float = 0.0,
                 stack_alerts: dict[str, str] | None = None,
                 dead_ttl: float = DEAD_TTL_SECONDS, proc: str = "/proc") -> None:
        """``proc``: the /proc this daemon sees the ranks' processes in (tests give another)."""
        self._proc = proc
        self.max_series = max_series
        self.ttl = ttl
        self.dead_ttl = dead_ttl
        self._token = token
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._states: dict[tuple[str, str], RankState] = {}
        # the ranks that ended without a clean close, after their ttl: (their last state, the
        # monotonic time they are forgotten), oldest first
        self._departed: dict[tuple[str, str], tuple[RankState, float]] = {}
        self._requests: dict[str, int] = {}
        # the run_ids a (run, rank) had before its current one: run_id -> the monotonic time
        # of its last push (a few, the latest kept). A restarted process takes a new run_id
        # and never returns to an old one: one that does is a second process pushing the same
        # (run, rank) beside the first, which would read as a restart at every turn
        self._former: dict[tuple[str, str], dict[str, float]] = {}
        self._shared_logged: set[tuple[str, str]] = set()  # warned once each
        self.version = 0
        # changes of how the ranks ended (a goodbye, a kill found, a rank departed or
        # forgotten): what the state file (--ingest.state-file) is written for at once
        self.ends = 0
        self._next_expiry = math.inf  # no state expires before this (monotonic)
        # ranks taken back from the state file, not ended: shown from their first push or
        # this monotonic time (states())
        self._held: dict[tuple[str, str], float] = {}
        self.listeners: list[Callable[[], None]] = []  # called after every change
        self.profiles = ProfileBoard(self.states, alert_interval, profiled_alerts, clock,
                                     wall_clock, rank_interval, stack_alerts)
        # the (run, rank)s whose process this daemon has found in its /proc: (its run_id, its
        # pid here: the one pushed, or the host's for a rank in a container, by its NSpid and
        # start time). One no longer found there died (reap); one never found may run where
        # this daemon cannot see (another PID namespace), and is judged by its pushes alone
        self._seen: dict[tuple[str, str], tuple[str, int]] = {}
        self._searched: dict[tuple[str, str], str] = {}  # a host pid looked for, by run_id
        # a seen process found gone: (its run_id, since when), until confirmed
        self._gone: dict[tuple[str, str], tuple[str, float]] = {}
        # the state letter of a seen process at the last look (T: stopped)
        self._letters: dict[tuple[str, str], str] = {}
        # the (run, rank)s whose last pushes were refused: when (monotonic)
        self._refused: dict[tuple[str, str], float] = {}
        self._oom_claimed = 0  # the node's OOM kill count up to which ranks took the kills
        self._reaped = -math.inf
        self._oom_kills: deque[tuple[float, int]] = deque(maxlen=OOM_CHANGES)

    def authorized(self, header: str | None) -> bool:
        """True when no token is configured or the header carries it."""
        if self._token is None:
            return True
        if not header or not header.startswith("Bearer "):
            return False
        try:  # aiohttp reads a byte that is not UTF-8 as a lone surrogate
            given = header[7:].strip().encode("utf-8")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(given, self._token.encode())

    @property
    def guarded(self) -> bool:
        """An ingest token is set: what the status hides (paths on a rank's machine) is
        hidden on /metrics too."""
        return self._token is not None

    def now(self) -> float:
        """The store's monotonic clock: what ages a rank's step and phase in progress."""
        return self._clock()

    def wall(self) -> float:
        """The store's wall clock (Unix seconds): the clock of the history's points."""
        return self._wall()

    def count(self, code: int) -> None:
        """Count one push by its HTTP status; /metrics shows it at once."""
        with self._lock:
            self._requests[str(code)] = self._requests.get(str(code), 0) + 1
            self.version += 1
        self._changed()

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def requests(self) -> dict[str, int]:
        with self._lock:
            return dict(self._requests)

    def push(self, raw: bytes) -> str:
        """Apply one push; returns a short message, raises Refused (state untouched)."""
        return self.accept(raw)[0]

    def accept(self, raw: bytes) -> tuple[str, RankState, list[dict[str, Any]]]:
        """Apply one push: its message, the state it set, and the instructions for the
        answer (a profile to take). Raises Refused, the state untouched."""
        new, goodbye = parse_push(raw, self._clock(), self._wall())
        key = (new.run, new.rank)
        with self._lock:
            self._expire_locked()
            old = self._states.get(key)
            same = old if old is not None and old.run_id == new.run_id else None
            try:
                switched = old if old is not None and old.run_id != new.run_id else None
                if switched is not None:
                    self._not_a_second_process(key, switched, new)
                if same is not None:
                    _check_monotonic(same, new)
                new.wall_seconds = _wall_seconds(old, new)
                _check_flops(same, new)
            except Refused:
                # its client runs and is heard, refused: a silence of it is no freeze
                self._refused[key] = new.received_at
                raise
            if same is not None and not goodbye:
                new.process_running = same.process_running  # until the next look says
            _clock_skew(same, new)
            new.slow_step_seconds = _slow_step_seconds(old, new)
            new.slow_steps = _slow_steps(old, new)
            if old is None and len(self._states) >= self.max_series:
                raise Refused(429, f"{len(self._states)} (run, rank) pairs are live, the "
                                   f"limit (--ingest.max-series) is {self.max_series}")
            if goodbye and not new.finished:
                # a failure (or an end it cannot tell from one) is remembered as long as a
                # silent rank: it is the news
                new.expires_at = new.received_at + self.ttl
                message = "goodbye"
            elif goodbye:
                # Keep the final totals a little, so the last increments reach Prometheus.
                new.expires_at = new.received_at + min(self.ttl, GOODBYE_GRACE_SECONDS)
                message = "goodbye"
            else:
                new.expires_at = new.received_at + self.ttl
                message = "ok"
            if switched is not None:  # a restart: remember the old run_id
                former = self._former.setdefault(key, {})
                former.pop(switched.run_id, None)
                former[switched.run_id] = switched.received_at
                while len(former) > FORMER_RUN_IDS:
                    del former[next(iter(former))]
            self._states[key] = new
            self._held.pop(key, None)
            # it lives again: a new process, or a late push
            revived = self._departed.pop(key, None) is not None
            if goodbye or revived or (old is not None and old.exit_reason is not None):
                self.ends += 1
            if same is None and not goodbye:  # a new process: found in /proc from its first push
                self._look(new)
                self._count_oom_kills(new.received_at)
            self._next_expiry = min(self._next_expiry, new.expires_at)
            self.version += 1
        instructions = self.profiles.on_push(new, new.profile_report, new.stacks_report)
        new.profile_report = new.stacks_report = None
        self._changed()
        return message, new, instructions

    def _not_a_second_process(self, key: tuple[str, str], old: RankState,
                              new: RankState) -> None:
        """Refuse a push of a second process of this (run, rank) (two jobs with one run name,
        a script started twice): one whose run_id it had before its current one, within the
        ttl, or, from its first push, one whose predecessor still runs (:meth:`_lives`). The
        process that holds the (run, rank) keeps it, the other is told why (409): no switch
        reads as a restart."""
        seen = self._former.get(key, {}).get(new.run_id)
        if (seen is None or self._clock() - seen > self.ttl) and not self._lives(old, new):
            return
        if key not in self._shared_logged:
            if len(self._shared_logged) >= self.max_series:
                self._shared_logged.clear()
            self._shared_logged.add(key)
            log.warning("run %r rank %r is pushed by two processes at once (run_ids %s and "
                        "%s): the one that holds it is kept, the other refused (409)",
                        new.run, new.rank, old.run_id, new.run_id)
        raise Refused(409, f"run {new.run!r} rank {new.rank!r} is pushed by another process "
                           f"(run_id {old.run_id}, this one {new.run_id}): give each process its "
                           "own run name (GPUTRAIN_RUN) or rank")

    def _lives(self, old: RankState, new: RankState) -> bool:
        """The current process of the (run, rank) still runs beside a new one that pushes
        it, as this daemon's /proc shows both (the pid and the start time each pushed): a
        second process, not a restart (a restarted process's predecessor is gone). False
        where it cannot tell: a pid of another PID namespace, no process ids pushed, or a
        process that said goodbye."""
        if old.finished or old.failed or old.exit_reason is not None or None in (
                old.pid, old.start_time, new.pid, new.start_time) or old.pid == new.pid:
            return False
        return all(runs_as(read_state(st.pid, self._proc), st.start_time)  # type: ignore[arg-type]
                   for st in (old, new))

    def reap(self) -> list[RankState]:
        """Mark failed, ``killed``, each rank whose process this daemon found running in its
        /proc and no longer finds (gone, a zombie, or its pid another process's), on two looks
        CONFIRM_SECONDS apart, while no goodbye came: nothing of it ran to say so (SIGKILL,
        the OOM killer, an abort such as NCCL's watchdog's, a crash in native code,
        ``os._exit``). Its detail is ``OOMKilled`` where the node's OOM kill count grew since
        its last push by a kill no other rank took. Called each sampler cycle, it reads /proc
        at most every REAP_SECONDS; returns the states it marked."""
        now = self._clock()
        if now - self._reaped < REAP_SECONDS:
            return []
        self._reaped = now
        with self._lock:
            watched = [st for st in self._states.values() if st.exit_reason is None
                       and st.pid is not None and st.start_time is not None]
        dead, running = [], {}
        for st in watched:
            key = (st.run, st.rank)
            found = self._look(st, search=True)
            # stopped (T, or t: a debugger's) is not running; nor is one whose client is
            # heard but refused: its silence here is no freeze. One found gone runs until
            # its death is confirmed (below): it must not depart as silent first
            running[key] = st.process_running if found is not True else \
                self._letters.get(key) not in ("T", "t") and \
                now - self._refused.get(key, -math.inf) > REFUSED_SECONDS
            if found is not False or self._seen.get(key, ("",))[0] != st.run_id:
                self._gone.pop(key, None)
                continue
            since = self._gone.get(key)
            if since is None or since[0] != st.run_id:
                self._gone[key] = since = (st.run_id, now)
            if now - since[1] >= CONFIRM_SECONDS:  # a goodbye may be late: the client waits 1 s
                dead.append(st)
        marked = []
        with self._lock:
            if watched:  # after the processes: a kill that ended one is counted by now
                self._count_oom_kills(now)
            dying = {id(st) for st in dead}
            for st in watched:  # whether each still runs: said where it changed
                key = (st.run, st.rank)
                if st.process_running != running[key] and self._states.get(key) is st and \
                        id(st) not in dying:
                    self._states[key] = replace(st, process_running=running[key])
                    self._next_expiry = min(self._next_expiry, st.expires_at)
                    self.version += 1
            for st in dead:
                key = (st.run, st.rank)
                if self._states.get(key) is not st:  # a push came meanwhile: its own word
                    continue
                detail = OOM_KILLED if self._claim_oom_kill(st.received_at) else None
                # (its ttl from its death: a frozen rank killed long after its last push is
                # news now, reported the whole dead ttl after it)
                self._states[key] = new = replace(st, exit_reason=KILLED_EXIT, failed=True,
                                                  exit_detail=detail, process_running=False,
                                                  expires_at=max(st.expires_at, now))
                self._next_expiry = min(self._next_expiry, new.expires_at)
                marked.append(new)
            for memo in (self._seen, self._searched, self._gone, self._letters,
                         self._refused):
                for key in [k for k in memo if k not in self._states
                            or self._states[k].exit_reason is not None]:
                    del memo[key]
            if marked:
                self.version += 1
                self.ends += 1
        for st in marked:
            log.warning("run %s rank %s: its process (pid %s) is gone without a goodbye%s",
                        st.run, st.rank, st.pid, ": the node's OOM killer killed a process "
                        "meanwhile" if st.exit_detail else " (killed, or a crash in native code)")
        if marked:
            self._changed()
        return marked

    def _look(self, st: RankState, search: bool = False) -> bool | None:
        """Whether the rank's process runs, as this daemon's /proc shows it (its pid here with
        the start time it pushed, not a zombie; seen, it is remembered). Its pid here is the
        pushed one, or, with ``search``, the host pid of the process that calls itself so
        (a rank in a container, a daemon on the host: a scan of /proc, once per process).
        None where /proc cannot say (an error reading it other than the pid's absence)."""
        if st.pid is None or st.start_time is None:
            return False
        key = (st.run, st.rank)
        seen = self._seen.get(key)
        pid = seen[1] if seen is not None and seen[0] == st.run_id else st.pid
        state = read_state(pid, self._proc)
        if state is None and not process_gone(pid, self._proc):
            return None
        if not runs_as(state, st.start_time):
            if (seen is not None and seen[0] == st.run_id) or not search or \
                    self._searched.get(key) == st.run_id:
                return False
            self._searched[key] = st.run_id
            found = find_host_pid(st.pid, st.start_time, self._proc)
            if found is None:
                return False
            pid = found
            state = read_state(pid, self._proc)
        self._seen[key] = (st.run_id, pid)
        self._letters[key] = state[0] if state is not None else ""
        return True

    def _count_oom_kills(self, now: float) -> None:
        """Note the node's OOM kill count at ``now`` where it changed (under the lock)."""
        kills = read_oom_kills(self._proc)
        if kills is not None and (not self._oom_kills or self._oom_kills[-1][1] != kills):
            self._oom_kills.append((now, kills))

    def _claim_oom_kill(self, t: float) -> bool:
        """Whether the node's OOM kill count grew since ``t`` (monotonic, as the reaps saw it
        change) by a kill no rank claimed yet; one is then claimed (under the lock)."""
        if not self._oom_kills:
            return False
        before = self._oom_kills[0][1]
        for when, count in self._oom_kills:
            if when <= t:
                before = count
        before = max(before, self._oom_claimed)
        if self._oom_kills[-1][1] <= before:
            return False
        self._oom_claimed = before + 1
        return True

    def _expire_locked(self) -> None:
        # A scan of every rank only when one may be due: not on every push and scrape.
        now = self._clock()
        if now < self._next_expiry:
            return
        stale = [k for k, st in self._states.items() if self._expiry(st) <= now]
        # the runs with a rank that still runs: a rank of one that finished first is kept (its
        # end alone) while they may wait for it in a collective (uneven inputs)
        running = {st.run for st in self._states.values()
                   if st.exit_reason is None and st.expires_at > now}
        for k in stale:
            st = self._states.pop(k)
            self._former.pop(k, None)
            if not st.finished and self.dead_ttl > 0:
                # its end is the news: kept, without its counters, for dead_ttl more
                self._departed.pop(k, None)
                self._departed[k] = (st, st.expires_at + self.dead_ttl)
            elif st.finished and st.run in running and self.dead_ttl > 0:
                self._departed.pop(k, None)
                self._departed[k] = (st, st.expires_at + self.ttl)
        # ... and forgotten with the grace of its run's last goodbye, as a clean end is
        gone = [k for k, (st, until) in self._departed.items()
                if until <= now or (st.finished and st.run not in running)]
        for k in gone:
            del self._departed[k]
        while len(self._departed) > self.max_series:  # bounded as the live ones: oldest go
            del self._departed[next(iter(self._departed))]
        self._next_expiry = min(min(map(self._expiry, self._states.values()),
                                    default=math.inf),
                                min((until for _, until in self._departed.values()),
                                    default=math.inf))
        if stale or gone:
            self.version += 1
            self.ends += 1

    def _expiry(self, st: RankState) -> float:
        """When a live state goes (monotonic): its ttl after its last push; one whose process
        still runs (frozen, or cut off) stays live, its silence growing, dead_ttl more: it has
        not departed."""
        if st.process_running and st.exit_reason is None:
            return st.expires_at + self.dead_ttl
        return st.expires_at

    def states_version(self) -> int:
        """A number that changes whenever the rendered states would (pushes, expiry)."""
        with self._lock:
            self._expire_locked()
            return self.version

    def states(self) -> list[RankState]:
        """The live states, stale ones dropped first; a rank taken back from the state file
        that had not ended shows from its first push, or once RESTORE_GRACE_SECONDS passed
        without one (its client retries a restarted daemon at most a minute apart: silent
        until then, it would read vanished)."""
        with self._lock:
            self._expire_locked()
            if not self._held:
                return list(self._states.values())
            now = self._clock()
            for key in [k for k, until in self._held.items() if until <= now]:
                del self._held[key]
            return [st for key, st in self._states.items()
                    if key not in self._held or st.exit_reason is not None]

    def departed(self) -> list[RankState]:
        """The last states of the ranks that ended without a clean close and whose ``ttl``
        ran out, for ``dead_ttl`` after it: what /metrics, the status page and ``top`` keep
        saying of a run that died; and of a rank that finished while its run's other ranks
        still ran, for ``ttl`` after its goodbye's grace: the peer they may wait for."""
        with self._lock:
            self._expire_locked()
            return [st for st, _ in self._departed.values()]

    # -- a restart loses nothing: the state file (exporter.serving.state_file) -----------------

    def saved(self) -> dict[str, Any]:
        """The ranks as a JSON-able document: each live and departed rank's last state, its
        monotonic times as seconds from now (a restarted daemon's clock starts anew), the pid
        this daemon found its process at. Profiles and requests in flight are not kept."""
        with self._lock:
            self._expire_locked()
            now, wall = self._clock(), self._wall()
            ranks = []
            for st, until in [*((st, None) for st in self._states.values()),
                              *self._departed.values()]:
                row = {f.name: getattr(st, f.name) for f in fields(RankState)
                       if f.name not in _UNSAVED}
                row["received_ago"] = now - st.received_at
                row["expires_in"] = st.expires_at - now
                row["departed_for"] = None if until is None else until - now
                seen = self._seen.get((st.run, st.rank))
                row["seen_pid"] = seen[1] if until is None and seen is not None and \
                    seen[0] == st.run_id else None
                ranks.append(row)
        return {"version": STATE_VERSION, "saved_unix": wall, "ranks": ranks}

    def restore(self, doc: Any) -> tuple[int, int]:
        """Take back the ranks of a :meth:`saved` document, aged by the time since it was
        saved (a live rank past its ttl departs, a departed one past its time is gone, as if
        the daemon had run throughout). Before any push: what a push brings replaces it.
        Returns (ranks restored, rows refused); a document of another version is refused
        whole (ValueError). Live and departed ranks are each bounded as the store bounds
        them."""
        if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION or \
                not isinstance(doc.get("ranks"), list) or not _finite(doc.get("saved_unix")):
            raise ValueError(f"not a version {STATE_VERSION} state document")
        now = self._clock()
        # the time it was down, never less than none (a clock set back)
        down = max(0.0, self._wall() - doc["saved_unix"])
        kept, refused = 0, 0
        with self._lock:
            for row in doc["ranks"]:
                try:
                    st, departed_for, pid = _restored(row, now, down, self.ttl + self.dead_ttl)
                except (ValueError, TypeError, Refused):
                    refused += 1
                    continue
                key = (st.run, st.rank)
                full = len(self._states) >= self.max_series if departed_for is None else \
                    len(self._departed) >= self.max_series or self.dead_ttl <= 0
                if key in self._states or key in self._departed or full:
                    refused += 1
                    continue
                if departed_for is None:
                    self._states[key] = st
                    if pid is not None:  # its process is watched as before: gone, it was killed
                        self._seen[key] = (st.run_id, pid)
                    if st.exit_reason is None:
                        self._held[key] = now + RESTORE_GRACE_SECONDS
                else:
                    self._departed[key] = (st, now + departed_for)
                kept += 1
            self._next_expiry = -math.inf  # what aged out while down goes at the next look
            self.version += 1
            self.ends += 1
        return kept, refused


STATE_VERSION = 1
# a restored rank that had not ended waits this long for its client's push before it shows
# (the client's longest retry interval, pusher.MAX_BACKOFF, a push interval and a margin)
RESTORE_GRACE_SECONDS = 90.0
# a rank's state not kept across a restart: what a push answers once
_UNSAVED = frozenset({"received_at", "expires_at", "profile_report", "stacks_report",
                      "process_running"})  # (the last: the next look's to say)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ints(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# a saved field's type (as RankState annotates it) -> what a value of it must be: a field of
# another type cannot be saved until it has a check here (its rows would all be refused)
_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "float": _finite,
    "int": _ints,
    "bool": lambda v: isinstance(v, bool),
    "tuple[float, ...]": lambda v: isinstance(v, list) and all(map(_finite, v)),
    "tuple[int, ...]": lambda v: isinstance(v, list) and all(map(_ints, v)),
    "tuple[str, ...]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "dict[str, float]": lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and _finite(x) for k, x in v.items()),
}


def _typed(name: str, annotation: str, value: Any) -> Any:
    """``value`` as the field ``name`` of that annotation holds it (a list as a tuple);
    ValueError where it is not one."""
    kind = annotation.removesuffix(" | None")
    if value is None and kind != annotation:
        return None
    if kind not in _TYPE_CHECKS or not _TYPE_CHECKS[kind](value):
        raise ValueError(f"field {name!r} is not a {annotation}")
    return tuple(value) if kind.startswith("tuple") else value


def _restored(row: Any, now: float, down: float,
              longest: float) -> tuple[RankState, float | None, int | None]:
    """One row of a state document as (its state, seconds it stays departed or None where it
    is live, the pid its process was found at); raises ValueError (or Refused) where the row
    is not one this daemon wrote: each field of its type, the names, phases, GPUs, histogram
    and end checked as a push's are, so that nothing read back can break the page."""
    if not isinstance(row, dict):
        raise ValueError("not an object")
    kwargs: dict[str, Any] = {"received_at": 0.0}  # set below, from its age
    for f in fields(RankState):
        if f.name not in _UNSAVED and f.name in row:
            kwargs[f.name] = _typed(f.name, str(f.type), row[f.name])
    st = RankState(**kwargs)
    if not (is_name(st.run) and is_name(st.rank) and RUN_ID_RE.fullmatch(st.run_id)):
        raise ValueError("not a run, rank and run_id")
    # what reaches a label or a check of the next push, as a push's own
    body = {"step_buckets": list(st.bucket_bounds), "step_counts": list(st.bucket_counts),
            "phases": st.phases, "gpus": list(st.gpus), "capabilities": list(st.capabilities),
            "open_phase": st.open_phase, "exit_detail": st.exit_detail}
    scratch = RankState(st.run, st.rank, st.run_id, 0.0, 0.0, steps=st.steps,
                        open_phase_seconds=st.open_phase_seconds)
    if st.bucket_bounds or st.bucket_counts:
        _parse_histogram(body, scratch)
    _parse_phases(body, scratch)
    _parse_gpus(body, scratch)
    _parse_profile(body, scratch)
    _parse_end(body, scratch, goodbye=True)  # (names checked; scratch takes the rest)
    if st.exit_reason not in (None, *EXIT_REASONS, KILLED_EXIT):
        raise ValueError("not an end this daemon says")
    if any(not isinstance(k, str) or not NAME_RE.fullmatch(k) for k in st.process):
        raise ValueError("not a process's figures")
    for name in ("received_ago", "expires_in"):
        if not _finite(row.get(name)):
            raise ValueError(name)
    # its times run on across the restart, each within what the daemon would have kept
    st.received_at = now - min(longest, max(0.0, row["received_ago"]) + down)
    st.expires_at = now + min(longest, row["expires_in"]) - down
    departed_for = row.get("departed_for")
    if departed_for is not None:
        if not _finite(departed_for):
            raise ValueError("departed_for")
        departed_for = min(longest, departed_for) - down
    pid = row.get("seen_pid")
    if pid is not None and (not _ints(pid) or pid <= 0):
        raise ValueError("seen_pid")
    return st, departed_for, pid
