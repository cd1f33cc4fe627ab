"""Profiles of running ranks: asked for by ``gputrain-exporter profile`` or by an alert,
handed to the rank in the answer to its next push, and kept with their results.

A profile goes queued (asked for) -> accepted (the rank's client has it and waits for a step
boundary) -> running -> done or failed; one that no client takes in time is expired. The
client does the profiling (:mod:`exporter.client.profiling`); this module only queues,
delivers, validates what comes back and keeps a bounded record of it.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple, Protocol

from exporter.heuristics.location import Location, classify_dump
from exporter.protocol import (
    DEFAULT_PROFILE_STEPS,
    DEFAULT_STACKS_SECONDS,
    MAX_DUMP_FRAMES,
    MAX_DUMP_FRAMES_TOTAL,
    MAX_DUMP_PROCESSES,
    MAX_DUMP_THREADS,
    MAX_FUNCTION_LENGTH,
    MAX_NAME_LENGTH,
    MAX_OP_NAME_LENGTH,
    MAX_PENDING_COLLECTIVES,
    MAX_PROFILE_ERROR_LENGTH,
    MAX_PROFILE_STEPS,
    MAX_PROFILE_TOP_OPS,
    MAX_STACK_TOP,
    MAX_STACKS_SECONDS,
    MAX_TRACE_PATH_LENGTH,
    NAME_RE,
    PROFILE_CAPABILITY,
    PROFILE_ID_RE,
    PROFILE_PATH,
    PROFILE_VERSION,
    STACK_ROLES,
    STACKS_CAPABILITY,
    STACKS_MODES,
    STACKS_VERSION,
    STEP_PARTS,
    Refused,
    check_unicode,
    number,
    unix_time,
)


class Rank(Protocol):
    """What the board reads of a live rank (the ingest's RankState)."""

    run: str
    rank: str
    run_id: str
    capabilities: tuple[str, ...]


FINAL = ("done", "failed", "expired")
QUEUE_TIMEOUT = 60.0  # seconds for the rank to take it: it pushes every few seconds
START_TIMEOUT = 600.0  # seconds from taking it to the first step boundary
RUN_TIMEOUT = 1800.0  # seconds from the start to the result
STACKS_GRACE = 120.0  # seconds past a capture's own for py-spy to start, finish and report
KINDS = ("torch", "stacks")  # one open profile of each kind per rank
MAX_OPEN = 64  # profiles queued, accepted or running at once, over all ranks
KEEP = 64  # finished profiles kept for the API and the status page
MAX_ALERTS = 1000  # alerts in one webhook call
MAX_SKIPPED_SHOWN = 20  # skipped alerts listed in a webhook answer (all are counted)
MAX_NAMES_SHOWN = 5  # live runs or ranks a refusal lists (the rest are counted)

HANG_TRIGGER = "hang"  # a dump the daemon took on its own when a run hung


class HangLocation(NamedTuple):
    """Where a hang's capture found a rank, and the rank's steps when it was asked for."""

    location: str
    function: str
    steps: int

    def current(self, steps: int) -> bool:
        """Whether it still says where a rank with ``steps`` steps is: none since the dump."""
        return steps == self.steps


@dataclass
class Profile:
    """One profile request and, once the rank has sent it, its result."""

    id: str
    run: str
    rank: str
    steps: int  # torch: steps recorded; stacks: 0
    trigger: str  # "cli", or "alert:<alertname>"
    requested: float  # unix seconds
    requested_at: float  # monotonic
    state: str = "queued"
    run_id: str | None = None  # the process it was handed to
    changed_at: float = 0.0  # monotonic, of the last state change
    started: float | None = None
    finished: float | None = None
    error: str | None = None
    trace: str | None = None
    trace_bytes: int | None = None
    device: str | None = None
    step_parts: list[dict[str, float]] = field(default_factory=list)
    top_ops: list[dict[str, Any]] = field(default_factory=list)
    kind: str = "torch"  # or "stacks": py-spy over the rank's process tree
    mode: str | None = None  # stacks: "record" (sample for ``seconds``) or "dump"
    seconds: int = 0  # stacks, record: the seconds asked for
    stacks: dict[str, Any] = field(default_factory=dict)  # stacks: the client's result
    native: bool = False  # a dump with native frames (a wait inside a C++ collective shows)
    steps_at: int = 0  # the rank's steps when it was asked for (a hang's capture)
    # a dump's main thread: where the rank is (exporter.heuristics.location), once done
    location: Location | None = None

    def document(self, brief: bool = False) -> dict[str, Any]:
        """The JSON the API answers with; ``brief`` leaves out the per-step parts (up to
        MAX_PROFILE_STEPS of them) and keeps their mean, and of a dump keeps where each
        thread is (:func:`dump_summary`), for the status document."""
        doc: dict[str, Any] = {
            "id": self.id, "kind": self.kind, "run": self.run, "rank": self.rank,
            "steps": self.steps, "trigger": self.trigger, "state": self.state,
            "requested": self.requested, "started": self.started, "finished": self.finished}
        if self.error:
            doc["error"] = self.error
        if self.kind == "stacks":
            doc.update(mode=self.mode, seconds=self.seconds)
            if self.native:
                doc["native"] = True
            if self.location is not None:
                doc["location"] = asdict(self.location)
            if self.state == "done":
                result = dict(self.stacks)
                if brief and "processes" in result:
                    result["where"] = dump_summary(result.pop("processes"))
                doc.update(result)
            return doc
        if self.state == "done":
            doc.update(trace=self.trace, trace_bytes=self.trace_bytes, device=self.device,
                       mean=mean_parts(self.step_parts), top_ops=self.top_ops)
            if not brief:
                doc["step_parts"] = self.step_parts
        return doc


def mean_parts(steps: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each part (and of ``seconds``, ``gpu_busy``) over the profiled steps."""
    if not steps:
        return {}
    keys = ("seconds", *STEP_PARTS, *(("gpu_busy",) if all("gpu_busy" in s for s in steps)
                                      else ()))
    return {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in keys}


def parse_report(report: Any) -> dict[str, Any]:
    """Validate the ``profile`` field of a push (the client's state of one profile)."""
    if not isinstance(report, dict):
        raise Refused(400, "field 'profile' must be an object")
    pid, state = report.get("id"), report.get("state")
    if not isinstance(pid, str) or not PROFILE_ID_RE.fullmatch(pid):
        raise Refused(400, "'profile.id' must be a profile id (p- and 12 hex digits)")
    if state not in ("accepted", "running", "done", "failed"):
        raise Refused(400, "'profile.state' must be accepted, running, done or failed, "
                           f"got {state!r}")
    out: dict[str, Any] = {"id": pid, "state": state}
    for key in ("started", "finished"):
        if report.get(key) is not None:
            out[key] = unix_time(report[key], f"profile.{key}")
    if state == "failed":
        out["error"] = _text(report.get("error", ""), "profile.error",
                             MAX_PROFILE_ERROR_LENGTH)
    if state != "done":
        return out
    out["trace"] = _path(report.get("trace"), "profile.trace")
    out["trace_bytes"] = number(report.get("trace_bytes"), "profile.trace_bytes", True)
    device = report.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise Refused(400, f"'profile.device' must be cpu or cuda, got {device!r}")
    out["device"] = device
    steps = report.get("steps")
    if not isinstance(steps, list) or len(steps) > MAX_PROFILE_STEPS:
        raise Refused(400, f"'profile.steps' must be an array of at most "
                           f"{MAX_PROFILE_STEPS} steps")
    out["steps"] = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise Refused(400, f"'profile.steps[{i}]' must be an object")
        keys = ("seconds", *STEP_PARTS) + (("gpu_busy",) if "gpu_busy" in step else ())
        out["steps"].append({k: number(step.get(k), f"profile.steps[{i}].{k}")
                             for k in keys})
    ops = report.get("top_ops", [])
    if not isinstance(ops, list) or len(ops) > MAX_PROFILE_TOP_OPS:
        raise Refused(400, f"'profile.top_ops' must be an array of at most "
                           f"{MAX_PROFILE_TOP_OPS} operators")
    out["top_ops"] = []
    for i, op in enumerate(ops):
        if not isinstance(op, dict) or not isinstance(op.get("name"), str):
            raise Refused(400, f"'profile.top_ops[{i}]' must be an object with a name")
        out["top_ops"].append({
            "name": op["name"][:MAX_OP_NAME_LENGTH],
            "calls": number(op.get("calls"), f"profile.top_ops[{i}].calls", True),
            "self_cpu_seconds": number(op.get("self_cpu_seconds"),
                                        f"profile.top_ops[{i}].self_cpu_seconds"),
            "self_device_seconds": number(op.get("self_device_seconds", 0.0),
                                           f"profile.top_ops[{i}].self_device_seconds")})
    return out


def _path(value: Any, where: str) -> str:
    """A file on the rank's machine, as the client names it."""
    if not isinstance(value, str) or not value or len(value) > MAX_TRACE_PATH_LENGTH or \
            any(ord(c) < 32 for c in value):
        raise Refused(400, f"'{where}' must be a path of 1-{MAX_TRACE_PATH_LENGTH} "
                           "printable characters")
    return value


def _text(value: Any, where: str, limit: int = MAX_FUNCTION_LENGTH) -> str:
    if not isinstance(value, str):
        raise Refused(400, f"'{where}' must be a string")
    return value[:limit]


def _frames(frames: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(frames, list) or len(frames) > MAX_DUMP_FRAMES:
        raise Refused(400, f"'{where}' must be an array of at most {MAX_DUMP_FRAMES} frames")
    out = []
    for i, f in enumerate(frames):
        if not isinstance(f, dict):
            raise Refused(400, f"'{where}[{i}]' must be an object")
        out.append({"function": _text(f.get("function"), f"{where}[{i}].function"),
                    "file": _text(f.get("file", ""), f"{where}[{i}].file"),
                    "line": number(f.get("line", 0), f"{where}[{i}].line", True)})
    return out


def _collectives(value: Any) -> list[dict[str, Any]]:
    """A dump's pending collectives (the flight recorder's, see
    :func:`exporter.client.stacks.pending_collectives`), checked."""
    w = "stacks.collectives"
    if not isinstance(value, list) or len(value) > MAX_PENDING_COLLECTIVES:
        raise Refused(400, f"'{w}' must be an array of at most {MAX_PENDING_COLLECTIVES}")
    out = []
    for i, c in enumerate(value):
        if not isinstance(c, dict):
            raise Refused(400, f"'{w}[{i}]' must be an object")
        out.append({"name": _text(c.get("name"), f"{w}[{i}].name"),
                    "seq": number(c.get("seq", 0), f"{w}[{i}].seq", True),
                    "group": _text(c.get("group", ""), f"{w}[{i}].group"),
                    "seconds": number(c.get("seconds", 0), f"{w}[{i}].seconds")})
    return out


def where_is(stacks: dict[str, Any]) -> Location:
    """Where a dump found the rank: its main thread's frames
    (:func:`exporter.heuristics.location.classify_dump`), unless the flight recorder shows a
    collective it started and has not finished while the frames say no more than computing
    (a Python-only dump of a rank waiting in DDP's all-reduce reads as its backward pass):
    the direct record wins over the frames' guess."""
    found = classify_dump(stacks["processes"])
    pending = stacks.get("collectives") or []
    if pending and found.location in ("computing", "elsewhere"):
        name = pending[-1]["name"]
        return replace(found, location="collective", function=name,
                       collective=name.split(":", 1)[-1])
    return found


def parse_stacks_report(report: Any) -> dict[str, Any]:
    """Validate the ``stacks`` field of a push (the client's state of one py-spy capture)."""
    if not isinstance(report, dict):
        raise Refused(400, "field 'stacks' must be an object")
    pid, state, mode = report.get("id"), report.get("state"), report.get("mode")
    if not isinstance(pid, str) or not PROFILE_ID_RE.fullmatch(pid):
        raise Refused(400, "'stacks.id' must be a profile id (p- and 12 hex digits)")
    if state not in ("running", "done", "failed"):
        raise Refused(400, f"'stacks.state' must be running, done or failed, got {state!r}")
    if mode not in STACKS_MODES:
        raise Refused(400, f"'stacks.mode' must be record or dump, got {mode!r}")
    out: dict[str, Any] = {"id": pid, "state": state}
    for key in ("started", "finished"):
        if report.get(key) is not None:
            out[key] = unix_time(report[key], f"stacks.{key}")
    if state == "failed":
        out["error"] = _text(report.get("error", ""), "stacks.error", MAX_PROFILE_ERROR_LENGTH)
    if state != "done":
        return out
    result: dict[str, Any] = {"file": _path(report.get("file"), "stacks.file"),
                              "file_bytes": number(
        report.get("file_bytes"), "stacks.file_bytes", True)}
    if report.get("warning") is not None:
        result["warning"] = _text(report["warning"], "stacks.warning",
                                  MAX_PROFILE_ERROR_LENGTH)
    if mode == "record":
        result["seconds_sampled"] = number(report.get("seconds"), "stacks.seconds")
        result["rate"] = number(report.get("rate"), "stacks.rate")
        result["samples"] = number(report.get("samples"), "stacks.samples", True)
        roles = report.get("roles")
        if not isinstance(roles, list) or len(roles) > len(STACK_ROLES):
            raise Refused(400, "'stacks.roles' must be an array of at most "
                               f"{len(STACK_ROLES)} roles")
        result["roles"] = []
        for i, r in enumerate(roles):
            w = f"stacks.roles[{i}]"
            if not isinstance(r, dict) or r.get("role") not in STACK_ROLES:
                raise Refused(400, f"'{w}' must be an object whose role is one of "
                                   f"{', '.join(STACK_ROLES)}")
            top = r.get("top")
            if not isinstance(top, list) or len(top) > MAX_STACK_TOP:
                raise Refused(400, f"'{w}.top' must be an array of at most {MAX_STACK_TOP}")
            result["roles"].append({
                "role": r["role"],
                **{k: number(r.get(k), f"{w}.{k}", True)
                   for k in ("processes", "threads", "samples")},
                "top": [{**_frames([{k: f.get(k) for k in ("function", "file", "line")}
                                    if isinstance(f, dict) else f], f"{w}.top[{j}]")[0],
                         "samples": number(f.get("samples"), f"{w}.top[{j}].samples", True),
                         "share": min(1.0, number(f.get("share"), f"{w}.top[{j}].share"))}
                        for j, f in enumerate(top)]})
    else:
        processes = report.get("processes")
        if not isinstance(processes, list) or len(processes) > MAX_DUMP_PROCESSES:
            raise Refused(400, "'stacks.processes' must be an array of at most "
                               f"{MAX_DUMP_PROCESSES} processes")
        result["processes"] = []
        total = 0
        for i, p in enumerate(processes):
            w = f"stacks.processes[{i}]"
            threads = p.get("threads") if isinstance(p, dict) else None
            if not isinstance(threads, list) or len(threads) > MAX_DUMP_THREADS or \
                    p.get("role") not in STACK_ROLES:
                raise Refused(400, f"'{w}' must be an object with a role and at most "
                                   f"{MAX_DUMP_THREADS} threads")
            entry: dict[str, Any] = {"pid": number(p.get("pid"), f"{w}.pid", True),
                                     "role": p["role"], "threads": []}
            if p.get("error") is not None:
                entry["error"] = _text(p["error"], f"{w}.error")
            for j, t in enumerate(threads):
                if not isinstance(t, dict):
                    raise Refused(400, f"'{w}.threads[{j}]' must be an object")
                frames = _frames(t.get("frames"), f"{w}.threads[{j}].frames")
                total += len(frames)
                own = t.get("where")
                entry["threads"].append({
                    "name": _text(t.get("name", ""), f"{w}.threads[{j}].name"),
                    "tid": number(t.get("tid", 0), f"{w}.threads[{j}].tid", True),
                    "active": t.get("active") is True, "gil": t.get("gil") is True,
                    "role": t.get("role") if t.get("role") in STACK_ROLES else p["role"],
                    "frames": frames,
                    "where": own if isinstance(own, int) and not isinstance(own, bool)
                    and 0 <= own < len(frames) else None})
            result["processes"].append(entry)
        if total > MAX_DUMP_FRAMES_TOTAL:
            raise Refused(400, f"'stacks.processes' hold {total} frames; at most "
                               f"{MAX_DUMP_FRAMES_TOTAL}")
        if report.get("collectives") is not None:
            result["collectives"] = _collectives(report["collectives"])
    out["result"] = result
    return out


MAX_WHERE = 12  # threads a dump's summary names (the status document, top)


def dump_summary(processes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where the threads of a dump are, at most MAX_WHERE of them, the main process's main
    thread first, then the running ones: its innermost frame and, where that is library
    code, the innermost frame of the program's own code (``caller``). Helper threads parked
    in library code only (queue feeders) are left out; each process's main thread never."""
    rows = []
    for p in processes:
        if p.get("error"):
            rows.append({"pid": p["pid"], "role": p["role"], "thread": "", "error": p["error"]})
        for t in p["threads"]:
            main = t["name"] == "MainThread"
            if not t["frames"] or not (main or t["active"] or t["where"] is not None):
                continue
            row = {"pid": p["pid"], "role": t["role"], "thread": t["name"],
                   "active": t["active"], "at": t["frames"][0]}
            if t["where"]:
                row["caller"] = t["frames"][t["where"]]
            rows.append(row)
    rows.sort(key=lambda r: (r["role"] != "main", r["thread"] != "MainThread",
                             not r.get("active"), "error" in r))
    return rows[:MAX_WHERE]


def _rank_order(rank: str) -> tuple[int, int | str]:
    return (0, int(rank)) if rank.isdigit() else (1, rank)


def few(names: Any, key: Callable[[str], Any] | None = None) -> str:
    """At most MAX_NAMES_SHOWN of ``names``, in order, and how many more: a message stays
    short however many runs or ranks push here."""
    shown = heapq.nsmallest(MAX_NAMES_SHOWN, names, key=key)
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _asked(alert: Any, profiled: frozenset[str]
           ) -> tuple[str, str | None, str | None, str | None] | None:
    """One webhook alert: None when it asks for nothing (not firing, or not an alert a
    profile can explain); else (alertname, run, rank, why it is malformed or None). Values
    that are not short names are never echoed."""
    if not isinstance(alert, dict):
        return "?", None, None, "the alert is not an object"
    labels = alert.get("labels")
    if not isinstance(labels, dict):
        return "?", None, None, "the alert has no labels object"
    if alert.get("status") != "firing":
        return None
    name = labels.get("alertname")
    if not isinstance(name, str):
        return "?", None, None, "the alert's alertname is not a string"
    if name not in profiled:
        return None
    run, rank = labels.get("run"), labels.get("rank")
    if not all(isinstance(v, str) and len(v) <= MAX_NAME_LENGTH and NAME_RE.fullmatch(v)
               for v in (run, rank)):
        shown = [v if isinstance(v, str) and len(v) <= MAX_NAME_LENGTH else None
                 for v in (run, rank)]
        return name, shown[0], shown[1], "the alert names no valid run and rank"
    return name, run, rank, None


class ProfileBoard:
    """The daemon's profiles: requests, delivery in push answers, results, the alert
    webhook's rate limit. ``states`` gives the live ranks (the ingest's)."""

    def __init__(self, states: Callable[[], Sequence[Rank]], alert_interval: float = 3600.0,
                 profiled_alerts: frozenset[str] = frozenset(),
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 rank_interval: float = 0.0,
                 stack_alerts: dict[str, str] | None = None) -> None:
        self._states = states
        self.alert_interval = alert_interval
        self.rank_interval = rank_interval
        self.profiled_alerts = profiled_alerts
        # alertname -> the py-spy capture its firing asks for ("record" or "dump")
        self.stack_alerts = dict(stack_alerts or {})
        self._clock = clock
        self._wall = wall_clock
        self._cond = threading.Condition()
        self._profiles: OrderedDict[str, Profile] = OrderedDict()
        self._open: dict[tuple[str, str, str], Profile] = {}  # per rank and kind, not final
        # (run, kind) -> monotonic time of its alert profile
        self._last_alert: dict[tuple[str, str], float] = {}
        # (run, rank, kind) -> its last profile's
        self._last_profile: dict[tuple[str, str, str], float] = {}
        self.version = 0  # changes when a profile is asked for or changes state
        self.listeners: list[Callable[[], None]] = []

    # -- asking -------------------------------------------------------------------------------

    def request(self, run: str, rank: str | None = None, steps: int = DEFAULT_PROFILE_STEPS,
                trigger: str = "cli", live: dict[str, dict[str, Rank]] | None = None,
                mode: str | None = None, seconds: int = DEFAULT_STACKS_SECONDS,
                native: bool = False) -> Profile:
        """Queue a profile of ``rank`` of ``run`` (its lowest rank here when None), one of
        each kind per rank at a time and at most one of a kind per rank per
        ``rank_interval`` seconds: a torch profile of ``steps`` steps, or with ``mode``
        (record, dump) py-spy stacks of the rank's process tree, recorded for ``seconds``.
        ``live`` is :meth:`live` where the caller has it. Raises Refused."""
        kind = "torch" if mode is None else "stacks"
        if mode is not None and mode not in STACKS_MODES:
            raise Refused(400, f"mode must be record or dump, got {str(mode)[:20]!r}")
        if mode is not None and not 1 <= seconds <= MAX_STACKS_SECONDS:
            raise Refused(400, f"seconds must be 1-{MAX_STACKS_SECONDS}, got {seconds}")
        if mode is None and not 1 <= steps <= MAX_PROFILE_STEPS:
            raise Refused(400, f"steps must be 1-{MAX_PROFILE_STEPS}, got {steps}")
        live = self.live() if live is None else live
        ranks = live.get(run)
        if ranks and rank is None:
            rank = min(ranks, key=_rank_order)
        state = ranks.get(rank) if ranks and rank is not None else None
        if state is None or rank is None:
            raise Refused(404, self._not_here(run, rank, live))
        if kind == "torch" and PROFILE_CAPABILITY not in state.capabilities:
            raise Refused(409, f"rank {rank} of run {run} cannot be profiled: its "
                               "client does not offer it (a gputrain client from before "
                               "profiles)")
        if kind == "stacks" and STACKS_CAPABILITY not in state.capabilities:
            raise Refused(409, f"rank {rank} of run {run} cannot take py-spy stacks: its "
                               "client does not offer it (a gputrain client from before "
                               "stacks: upgrade gputrain-exporter in the training "
                               "environment)")
        what = "profiled" if kind == "torch" else "sampled by py-spy"
        noun = "profile" if kind == "torch" else "py-spy capture"
        with self._cond:
            self._expire_locked()
            existing = self._open.get((run, rank, kind))
            if existing is not None:
                raise Refused(409, f"rank {rank} of run {run} is already being {what} "
                                   f"({existing.id}, {existing.state}, asked for by "
                                   f"{existing.trigger}); one {noun} per rank at a time: "
                                   f"wait for it with GET {PROFILE_PATH}/{existing.id}")
            now = self._clock()
            last = self._last_profile.get((run, rank, kind))
            if last is not None and now - last < self.rank_interval:
                left = self.rank_interval - (now - last)
                raise Refused(429, f"rank {rank} of run {run} was {what} {now - last:.0f} s "
                                   f"ago; at most one {noun} of a rank per "
                                   f"{self.rank_interval:.0f} s (--profile.rank-interval): "
                                   f"try again in {math.ceil(left)} s",
                              retry_after=math.ceil(left))
            if len(self._open) >= MAX_OPEN:
                raise Refused(429, f"{len(self._open)} profiles are already queued or "
                                   "running on this daemon; try again later")
            profile = Profile(id="p-" + os.urandom(6).hex(), run=run, rank=rank,
                              steps=steps if kind == "torch" else 0, trigger=trigger,
                              requested=self._wall(), requested_at=now, changed_at=now,
                              kind=kind, mode=mode,
                              seconds=seconds if mode == "record" else 0,
                              native=native and mode == "dump",
                              steps_at=int(getattr(state, "steps", 0)))
            self._profiles[profile.id] = profile
            self._open[(run, rank, kind)] = profile
            if self.rank_interval > 0:
                # ranks whose interval has passed are forgotten: the table stays bounded
                if len(self._last_profile) >= MAX_OPEN:
                    self._last_profile = {k: t for k, t in self._last_profile.items()
                                          if now - t < self.rank_interval}
                self._last_profile[(run, rank, kind)] = now
            self._trim_locked()
            self._changed_locked()
        self._notify()
        return profile

    def live(self) -> dict[str, dict[str, Rank]]:
        """The live ranks by run and rank."""
        out: dict[str, dict[str, Rank]] = {}
        for s in self._states():
            out.setdefault(s.run, {})[s.rank] = s
        return out

    def get(self, pid: str) -> Profile | None:
        with self._cond:
            self._expire_locked()
            return self._profiles.get(pid)

    def recent(self, n: int = 20) -> list[Profile]:
        """The last ``n`` profiles asked for, newest first."""
        with self._cond:
            self._expire_locked()
            return list(reversed(self._profiles.values()))[:n]

    def latest_done(self) -> dict[tuple[str, str], Profile]:
        """Per (run, rank), its last finished profile."""
        with self._cond:
            out: dict[tuple[str, str], Profile] = {}
            for p in self._profiles.values():
                if p.state == "done" and p.kind == "torch":
                    out[(p.run, p.rank)] = p
            return out

    def hang_locations(self) -> dict[tuple[str, str], HangLocation]:
        """Per (run, rank), where its last hang capture found it (a dump the daemon took on
        its own, classified), with the rank's steps when it was asked for."""
        with self._cond:
            return {(p.run, p.rank): HangLocation(p.location.location, p.location.function,
                                                  p.steps_at)
                    for p in self._profiles.values()
                    if p.location is not None and p.trigger == HANG_TRIGGER}

    def capture_hang(self, run: str, ranks: list[str]) -> list[str]:
        """Dump, with native frames, each of ``ranks`` of ``run`` that push here and offer
        stacks, for a hang (one capture per rank at a time, within the board's bounds);
        returns the ids started. A rank already being captured, or over a bound, is left out
        (it is logged by the caller's count, never raised)."""
        live = self.live()
        started = []
        for rank in ranks:
            state = live.get(run, {}).get(rank)
            if state is None or STACKS_CAPABILITY not in state.capabilities:
                continue
            try:
                started.append(self.request(run, rank, trigger=HANG_TRIGGER, live=live,
                                            mode="dump", native=True).id)
            except Refused:
                continue
        return started

    # -- the push path ------------------------------------------------------------------------

    def latest_stacks(self) -> dict[tuple[str, str], Profile]:
        """Per (run, rank), its last finished py-spy capture."""
        with self._cond:
            return {(p.run, p.rank): p for p in self._profiles.values()
                    if p.state == "done" and p.kind == "stacks"}

    def on_push(self, state: Rank, report: dict[str, Any] | None,
                stacks: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Apply a rank's reports (its torch profile's, its stacks') and return the
        instructions for its push answer."""
        changed = False
        with self._cond:
            self._expire_locked()
            if report is not None:
                changed = self._apply_locked(state, report, "torch")
            if stacks is not None:
                changed = self._apply_locked(state, stacks, "stacks") or changed
            instructions = []
            for kind, capability in (("torch", PROFILE_CAPABILITY),
                                     ("stacks", STACKS_CAPABILITY)):
                profile = self._open.get((state.run, state.rank, kind))
                if profile is None or profile.state not in ("queued", "accepted") or \
                        capability not in state.capabilities:
                    continue
                if profile.run_id != state.run_id:  # first delivery, or the rank restarted
                    profile.run_id = state.run_id
                    if profile.state == "accepted":
                        profile.state, profile.changed_at = "queued", self._clock()
                if kind == "torch":
                    instructions.append({"type": "profile", "version": PROFILE_VERSION,
                                         "id": profile.id, "steps": profile.steps})
                else:
                    instructions.append({"type": "stacks", "version": STACKS_VERSION,
                                         "id": profile.id, "mode": profile.mode,
                                         "seconds": profile.seconds or DEFAULT_STACKS_SECONDS,
                                         **({"native": True} if profile.native else {})})
            if changed:
                self._changed_locked()
        if changed:
            self._notify()
        return instructions

    def _apply_locked(self, state: Rank, report: dict[str, Any], kind: str) -> bool:
        profile = self._profiles.get(report["id"])
        if profile is None or (profile.run, profile.rank) != (state.run, state.rank) or \
                profile.state in FINAL or profile.run_id not in (None, state.run_id) or \
                profile.kind != kind:
            return False  # unknown, finished, or from a process it was not handed to
        order = ("queued", "accepted", "running", "done", "failed")
        if order.index(report["state"]) <= order.index(profile.state):
            return False
        profile.state = report["state"]
        profile.changed_at = self._clock()
        profile.started = report.get("started", profile.started)
        if profile.state in FINAL:
            self._open.pop((profile.run, profile.rank, kind), None)
            profile.finished = report.get("finished") or self._wall()
        if profile.state == "failed":
            profile.error = report.get("error") or "the client gave no reason"
        elif profile.state == "done" and kind == "stacks":
            profile.stacks = report["result"]
            if profile.mode == "dump" and profile.stacks.get("processes"):
                profile.location = where_is(profile.stacks)
        elif profile.state == "done":
            profile.trace = report["trace"]
            profile.trace_bytes = report["trace_bytes"]
            profile.device = report["device"]
            profile.step_parts = report["steps"]
            profile.top_ops = report["top_ops"]
        return True

    # -- Alertmanager -------------------------------------------------------------------------

    def alerts(self, raw: bytes) -> dict[str, Any]:
        """Alertmanager's webhook: each firing alert of ``profiled_alerts`` naming a run and
        a rank that push here starts one profile, at most one per run per
        ``alert_interval`` seconds. Returns what was started and what was skipped, and why:
        a malformed alert is skipped with a short reason, and the answer stays short
        whatever the number of alerts and live runs (MAX_SKIPPED_SHOWN are listed, all are
        counted). A body that is not the webhook's JSON is refused whole (Refused)."""
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise Refused(400, "the body must be Alertmanager's webhook JSON") from None
        check_unicode(body, raw)
        alerts = body.get("alerts") if isinstance(body, dict) else None
        if not isinstance(alerts, list):
            raise Refused(400, "the body must be Alertmanager's webhook JSON: an object "
                               "with an 'alerts' array")
        if len(alerts) > MAX_ALERTS:
            raise Refused(413, f"{len(alerts)} alerts in one call; the limit is "
                               f"{MAX_ALERTS}")
        started: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        total_skipped = 0
        live = self.live()  # once per call: each alert then costs a lookup
        wanted = self.profiled_alerts | frozenset(self.stack_alerts)
        for alert in alerts:
            asked = _asked(alert, wanted)
            if asked is None:
                continue  # resolved, or an alert neither a profile nor stacks can explain
            name, run, rank, why = asked
            modes: list[str | None] = []
            state = live.get(run or "", {}).get(rank or "")
            if why is None and state is not None:
                # a client from before stacks is profiled as before, without a complaint
                modes = [*([None] if name in self.profiled_alerts else []),
                         *([self.stack_alerts[name]] if name in self.stack_alerts and
                           STACKS_CAPABILITY in state.capabilities else [])]
            reasons = [why] if why is not None else [] if modes else [
                self._not_here(run, rank, live)]
            for mode in modes:
                why, pid = self._alert(name, run or "", rank or "", live, mode)
                if why is None:
                    started.append({"alertname": name, "run": run, "rank": rank, "id": pid,
                                    "kind": "torch" if mode is None else "stacks"})
                else:
                    reasons.append(why)
            for why in reasons:
                total_skipped += 1
                if len(skipped) < MAX_SKIPPED_SHOWN:
                    skipped.append({"alertname": name, "run": run, "rank": rank,
                                    "reason": why})
        return {"started": started, "skipped": skipped, "skipped_total": total_skipped}

    @staticmethod
    def _not_here(run: str | None, rank: str | None, live: dict[str, dict[str, Rank]]) -> str:
        """Why an alert's rank cannot be profiled here (it does not push here, or cannot
        take what the alert asks for)."""
        ranks = live.get(run or "")
        if not ranks:
            return f"no rank of run {run!r} pushes to this daemon; runs here: " \
                   f"{few(live) or 'none'}"
        if rank not in ranks:
            return f"run {run!r} has no rank {rank!r} pushing to this daemon; its ranks " \
                   f"here: {few(ranks, _rank_order)}"
        return f"rank {rank} of run {run} cannot take py-spy stacks: its client does not " \
               "offer it (a gputrain client from before stacks)"

    def _alert(self, name: str, run: str, rank: str, live: dict[str, dict[str, Rank]],
               mode: str | None = None) -> tuple[str | None, str | None]:
        """Start a profile (``mode`` None) or a py-spy capture (record, dump) for one valid
        alert: (why not, None) or (None, its id). Each kind has its own slot per run."""
        now = self._clock()
        slot = (run, "torch" if mode is None else "stacks")
        with self._cond:  # take the run's slot before asking: concurrent calls race
            last = self._last_alert.get(slot)
            if last is None or now - last >= self.alert_interval:
                # runs whose slot is free again are forgotten (Slurm job ids never recur)
                self._last_alert = {r: t for r, t in self._last_alert.items()
                                    if now - t < self.alert_interval}
                self._last_alert[slot] = now
        if last is not None and now - last < self.alert_interval:
            what = "profiled" if mode is None else "sampled by py-spy"
            return (f"run {run} was {what} for an alert {now - last:.0f} s ago; at most "
                    f"one per {self.alert_interval:.0f} s"), None
        try:
            profile = self.request(run, rank, DEFAULT_PROFILE_STEPS, f"alert:{name}", live,
                                   mode=mode)
        except Refused as exc:
            with self._cond:  # nothing started: the slot stays free
                if self._last_alert.get(slot) == now:
                    del self._last_alert[slot]
            return str(exc), None
        return None, profile.id

    # -- housekeeping -------------------------------------------------------------------------

    def _expire_locked(self) -> None:
        now = self._clock()
        changed = False
        for key, p in list(self._open.items()):
            waited = now - p.changed_at
            why = None
            if p.state == "queued" and waited > QUEUE_TIMEOUT:
                why = (f"rank {p.rank} did not take it within {QUEUE_TIMEOUT:.0f} s (it "
                       "stopped pushing?)")
            elif p.state == "accepted" and waited > START_TIMEOUT:
                why = f"no step of rank {p.rank} ended in {START_TIMEOUT:.0f} s"
            elif p.state == "running" and waited > (RUN_TIMEOUT if p.kind == "torch" else
                                                    p.seconds + STACKS_GRACE):
                why = f"rank {p.rank} sent no result in {waited:.0f} s"
            if why:
                p.state, p.error, p.finished, p.changed_at = "expired", why, self._wall(), now
                del self._open[key]
                changed = True
        if changed:
            self._changed_locked()

    def _trim_locked(self) -> None:
        finished = [pid for pid, p in self._profiles.items() if p.state in FINAL]
        for pid in finished[:max(0, len(self._profiles) - KEEP - MAX_OPEN)]:
            del self._profiles[pid]

    def _changed_locked(self) -> None:
        self.version += 1
        self._cond.notify_all()

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()
