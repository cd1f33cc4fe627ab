"""The push protocol, shared by the training client and the daemon's ingest.

Standard library only: the client imports it without any daemon code. The push's schema is
PUSH_FIELDS and PROCESS_FIELDS: the ingest reads their scalar fields through it, the client's
keys are tested against it, and docs/push-protocol.md's field table is generated from it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

# Where the daemon listens by default: metrics (and the status page) on every address, pushes
# on the loopback (a token is required to listen elsewhere)
DEFAULT_METRICS_PORT = 19400
DEFAULT_INGEST_PORT = 19401
DEFAULT_INGEST_URL = f"http://127.0.0.1:{DEFAULT_INGEST_PORT}"
DEFAULT_PUSH_INTERVAL_SECONDS = 5.0  # the client pushes its totals this often
# Phases that are no part of any step: the client keeps them out of step time, and the rules
# and verdicts count them beside the steps, never as a phase of one
# the phase wrap() declares from iter() to an epoch's first batch (its DataLoader's workers
# starting): outside steps as the others, but no user's declaration (see catalogue.stuck_starts)
LOADER_START_PHASE = "dataloader_start"
# ... and an evaluation: declared, or seen by the client in a watched model's eval() mode
EVALUATION_PHASE = "evaluation"
OUTSIDE_STEP_PHASES = frozenset({LOADER_START_PHASE, EVALUATION_PHASE, "checkpoint"})
# How a rank's process ended, said with its goodbye. A clean end: the user's close() (or the
# monitor's context manager left without an exception), or the wrapped loop run to its end; a
# failure: an exception nobody caught (its type is sent; a collective's timeout is one) or a
# signal that ended it (its name). "exited" is neither: the interpreter ended normally without
# either, which a hand-written loop that never calls close() does, and so does a crash that a
# launcher caught and turned into an exit status (a multiprocessing child, torch's spawn
# included, says the exception its target raised: see the client's _close_at_exit).
CLEAN_EXITS = ("closed", "completed")
FAILED_EXITS = ("exception", "signal")
EXIT_REASONS = (*CLEAN_EXITS, "exited", *FAILED_EXITS)
# ... and one the daemon sees, never pushed: the process it saw run is gone without a goodbye,
# so no handler of its ran (SIGKILL, the OOM killer, an abort such as NCCL's watchdog's, a
# crash in native code, os._exit): a failure
KILLED_EXIT = "killed"
# its detail where the kernel's OOM killer killed a process on the node while it died
OOM_KILLED = "OOMKilled"
# the longest a time-like field may say (seconds): a year; a real clock meets it
MAX_SECONDS = 366 * 86400.0
# a Unix time a client sends is within this of the daemon's clock (ten years: a clock that far
# off is no clock to correct, and past it the correction loses the time's precision: the push
# says which field is out of range), and never past LATEST_UNIX
MAX_CLOCK_OFFSET_SECONDS = 10 * MAX_SECONDS
LATEST_UNIX = 2.0**33  # the year 2242: no report's start or finish is later
PUSH_PATH = "/api/v1/push"
PROFILE_PATH = "/api/v1/profile"  # POST a request; GET PROFILE_PATH/<id> its state
ALERTS_PATH = "/api/v1/alerts"  # Alertmanager's webhook
SCHEMA_VERSION = 1
MAX_BODY_BYTES = 1024 * 1024
# Whole-number counters (steps, bucket counts, a pid, a trace's bytes): a JSON integer up to
# MAX_COUNT, or a float without a fraction up to MAX_EXACT_FLOAT (past it, a float holds no
# exact integer: 9.3e18 is not a count of steps). Float counters are any finite number >= 0.
MAX_COUNT = 2**63 - 1
MAX_EXACT_FLOAT = 2**53
MAX_NAME_LENGTH = 128  # run and rank
MAX_PHASE_NAME_LENGTH = 64
# What one rank may push, so that the page stays bounded at --ingest.max-series ranks (the
# lines a rank adds: exporter.serving.training.MAX_SERIES_PER_RANK, from its families)
MAX_PHASES = 16
MAX_BUCKETS = 32
MAX_GPUS = 16
MAX_WORLD_SIZE = 1 << 20  # ranks in one run
# the DataLoader workers a rank may state (its slow steps and the loader's count: two lines)
MAX_LOADER_WORKERS = 4096
# FLOP/s no GPU reaches: twice the fastest dense datasheet peak (B200, FP4: 9 PFLOP/s). A
# rank's FLOPs may grow by at most this per GPU it lists (MAX_GPUS where it lists none) per
# second of its wall time, plus FLOPS_SLACK_SECONDS of it.
MAX_GPU_FLOPS = 2e16
FLOPS_SLACK_SECONDS = 10.0
# a client's clock may differ from the daemon's by this much before its timestamps are moved
CLOCK_TOLERANCE_SECONDS = 2.0
# the arithmetic a rank states it trains in: its GPUs' peak FLOP/s at this precision is the
# denominator of its model FLOPs utilisation
PRECISIONS = ("fp8", "bf16", "fp16", "tf32", "fp32")
DEFAULT_PRECISION = "bf16"
OTHER_PHASE = "other"  # where a client counts phases past MAX_PHASES - 1 names
NAME_CHARS = "A-Za-z0-9_.:-"  # run, rank and phase names
# fullmatch, never match-with-$ (which accepts a final newline)
NAME_RE = re.compile(f"[{NAME_CHARS}]+")
RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
GPU_REF_RE = re.compile(r"\d{1,4}|(GPU|MIG)-[A-Za-z0-9/-]{1,120}")


# Profiles (see exporter.client.profiling). A push that lists PROFILE_CAPABILITY in
# "capabilities" gets a JSON answer whose "instructions" may hold
# {"type": "profile", "version": PROFILE_VERSION, "id": ..., "steps": N}; a client ignores a
# type it does not know or a version above its own.
PROFILE_CAPABILITY = "profile"
PROFILE_VERSION = 1
PROFILE_ID_RE = re.compile(r"p-[0-9a-f]{12}")
DEFAULT_PROFILE_STEPS = 20
MAX_PROFILE_STEPS = 200
MAX_PROFILE_TOP_OPS = 10
MAX_OP_NAME_LENGTH = 200  # characters of an operator's name in a profile's summary
MAX_TRACE_PATH_LENGTH = 512
MAX_PROFILE_ERROR_LENGTH = 500
# where a profiled step's time went, in seconds; they sum to the step
STEP_PARTS = ("data_loading", "forward", "backward", "optimizer", "other", "idle")

# Stacks (see exporter.client.stacks): py-spy samples a rank's process tree. A push that lists
# STACKS_CAPABILITY may be answered with {"type": "stacks", "version": STACKS_VERSION, "id": ...,
# "mode": "record" | "dump", "seconds": N}; the client reports in the push's "stacks" field.
STACKS_CAPABILITY = "stacks"
STACKS_VERSION = 1
STACKS_MODES = ("record", "dump")  # sample for N seconds; one dump of every thread
DEFAULT_STACKS_SECONDS = 10
MAX_STACKS_SECONDS = 60
STACKS_RATE = 100  # samples per second and thread
# the roles of a rank's process tree, in the order they are shown
STACK_ROLES = ("main", "pin_memory", "loader_workers", "other")
STACK_ROLE_WORDS = {"main": "main process", "pin_memory": "pin-memory thread",
                    "loader_workers": "loader workers", "other": "other children"}
MAX_STACK_TOP = 5  # functions listed per role
MAX_FUNCTION_LENGTH = 200  # characters of a function's or a file's name
# a dump: at most this many processes, threads per process, frames per thread and in all
MAX_DUMP_PROCESSES = 16
MAX_DUMP_THREADS = 32
MAX_DUMP_FRAMES = 30
MAX_DUMP_FRAMES_TOTAL = 1500
# a hang's dump also lists the collectives its process started and has not finished (PyTorch's
# flight recorder), the newest this many
MAX_PENDING_COLLECTIVES = 8


class Refused(Exception):
    """A request the daemon refuses: ``status`` is the HTTP code, the message says why (a push,
    a profile request, an Alertmanager call); ``retry_after``, in whole seconds, when trying
    again later helps."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def count(value: object, field: str) -> int:
    """A whole-number counter from JSON (see MAX_COUNT); Refused(400) naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(400, f"field '{field}' must be a whole number, got "
                           f"{type(value).__name__}")
    if isinstance(value, int):
        if value > MAX_COUNT:
            raise Refused(400, f"field '{field}' is too large (over 2^63 - 1)")
    elif value != value or value in (float("inf"), float("-inf")) or \
            not value.is_integer() or value > MAX_EXACT_FLOAT:
        raise Refused(400, f"field '{field}' must be a whole number (a float at most 2^53), "
                           f"got {value!r}")
    if value < 0:
        raise Refused(400, f"field '{field}' must be >= 0, got {value!r}")
    return int(value)


def amount(value: object, field: str) -> float:
    """A non-negative finite number from JSON (seconds, samples, FLOPs): an integer up to
    MAX_COUNT or any finite float; Refused(400) naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(400, f"field '{field}' must be a number, got {json_kind(value)}")
    if isinstance(value, int) and value > MAX_COUNT:  # before isfinite, which overflows on it
        raise Refused(400, f"field '{field}' is too large (over 2^63 - 1)")
    if not math.isfinite(value) or value < 0:
        raise Refused(400, f"field '{field}' must be a finite number >= 0, got {value!r}")
    return float(value)


def json_kind(v: object) -> str:
    """How an error message names a JSON value's type."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


def is_name(value: str, max_length: int = MAX_NAME_LENGTH) -> bool:
    """A valid run, rank or phase name."""
    return len(value) <= max_length and NAME_RE.fullmatch(value) is not None


def sanitize(name: str, max_length: int = MAX_NAME_LENGTH) -> str:
    """``name`` made valid: other characters become ``_``, cut to ``max_length``."""
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c in "_.:-") else "_" for c in name)
    return cleaned[:max_length] or "_"


def as_text(value: str) -> str:
    """``value`` with every lone surrogate written as its escape (``\\udcff``): what a
    client sends for a path read with Python's surrogateescape (a non-UTF-8 byte in a
    directory's name), and how an error message quotes a bad key."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _encodable(s: str) -> bool:
    if s.isascii():  # O(1) in CPython: the common case
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unicode_fault(doc: object, raw: bytes | None = None) -> str | None:
    """The field of a parsed JSON document (keys included) whose string is not valid Unicode
    text (a lone surrogate such as ``"\\ud800"``, which JSON's escapes allow but UTF-8
    cannot encode), or None. ``raw``, the bytes it was parsed from, skips the walk where no
    ``\\u`` escape could have made one."""
    if raw is not None and b"\\u" not in raw and b"\\U" not in raw:
        return None
    stack: list[tuple[object, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path or "(the body)"
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{as_text(key)}" if path else as_text(key)
                if not _encodable(key):
                    return where
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def check_unicode(doc: object, raw: bytes | None = None) -> None:
    """Refused(400) naming the field whose string is not valid Unicode (see unicode_fault):
    such a string could never be written to a page or a log."""
    where = unicode_fault(doc, raw)
    if where is not None:
        raise Refused(400, f"field '{where}' is not valid Unicode text (a lone surrogate "
                           "escape such as \\ud800; send UTF-8 strings, e.g. paths decoded "
                           "with errors='replace')")


def number(value: Any, field: str, integer: bool = False) -> float:
    """A counter's value from JSON: :func:`count` where ``integer``, else :func:`amount`
    (the ingest's, the profile's and the stacks report's one number check), the common
    cases first: a push holds some 40 numbers."""
    t = type(value)
    if t is int and 0 <= value <= MAX_COUNT:
        return value if integer else float(value)
    if t is float and not integer and 0.0 <= value < math.inf:
        return value
    if integer and not isinstance(value, bool) and isinstance(value, (int, float)):
        return count(value, field)
    return amount(value, field)


# -- the push's fields -----------------------------------------------------------------------

# how a field's value is checked: a whole number (count), a finite number >= 0 (amount), a
# Unix time in seconds (timestamp, an amount), one of the field's choices (enum), true or
# false (bool); the other kinds hold structure that the ingest checks in code
NUMBER_KINDS = frozenset({"count", "amount", "timestamp"})
SCALAR_KINDS = NUMBER_KINDS | {"enum", "bool"}
_ABSENT: Any = object()


@dataclass(frozen=True)
class Field:
    """One field of a push: its ``name``, ``kind`` (see SCALAR_KINDS; ``const``, ``name``,
    ``array``, ``object`` for those checked in code), whether a push must hold it, the largest value
    taken (``bound``; None: the kind's own), whether it is a total that never goes down
    within one run_id (``cumulative``), its ``choices`` and ``default`` where absent, and a
    one-line ``doc`` with units."""

    name: str
    kind: str
    doc: str
    required: bool = False
    bound: float | None = None
    cumulative: bool = False
    choices: tuple[str, ...] = ()
    default: Any = None


PUSH_FIELDS: tuple[Field, ...] = (
    Field("version", "const", f"the schema's version: {SCHEMA_VERSION}", required=True),
    Field("run", "name", "the run's name: 1-128 of [A-Za-z0-9_.:-]", required=True),
    Field("rank", "name", "the rank: the run's rules (an integer is accepted)", required=True),
    Field("run_id", "name", "random per process: 1-64 of [A-Za-z0-9_-]; a new one is a "
                            "counter reset", required=True),
    Field("steps", "count", "steps done", required=True, cumulative=True),
    Field("step_seconds", "amount", "seconds in steps, data wait included", required=True,
          cumulative=True),
    Field("data_wait_seconds", "amount", "seconds the steps waited for their batch",
          required=True, cumulative=True),
    Field("samples", "amount", "samples trained on", required=True, cumulative=True),
    Field("last_step_timestamp", "timestamp", "when the last step ended, Unix seconds by the "
                                              "client's clock (null before the first)"),
    Field("flops", "amount", "model FLOPs, where the client knows its FLOPs per sample",
          cumulative=True),
    Field("elapsed_seconds", "amount", "seconds since the process started, by the client's "
                                       "clock (else the daemon's)", cumulative=True,
          bound=10 * MAX_SECONDS),
    Field("comm_seconds", "amount", "seconds of gradient communication that ran (DDP)",
          cumulative=True),
    Field("comm_exposed_seconds", "amount", "the part of comm_seconds the steps waited for "
                                            "(at most it and step_seconds)", cumulative=True),
    Field("comm_bytes", "amount", "gradient bytes all-reduced", cumulative=True),
    Field("loader_workers", "count", "the wrapped DataLoader's num_workers",
          bound=MAX_LOADER_WORKERS),
    Field("world_size", "count", "the ranks of the run: torch.distributed's world size, else "
                                 "WORLD_SIZE (a node's daemon then knows which it cannot see)",
          bound=MAX_WORLD_SIZE),
    Field("collective_timeout_seconds", "amount", "the shortest collective timeout of the "
                                                  "rank's process groups, seconds (what "
                                                  "init_process_group's timeout set): a "
                                                  "collective that waits this long ends the "
                                                  "job", bound=MAX_SECONDS),
    Field("precision", "enum", "the arithmetic the rank trains in: its GPUs' peak FLOP/s at "
                               "it is MFU's denominator", choices=PRECISIONS,
          default=DEFAULT_PRECISION),
    Field("step_buckets", "array", f"the step histogram's finite upper bounds, seconds, "
                                   f"increasing (at most {MAX_BUCKETS})"),
    Field("step_counts", "array", "the steps at or under each bound, cumulative"),
    Field("phases", "object", f"seconds per named phase (at most {MAX_PHASES} names of 1-"
                              f"{MAX_PHASE_NAME_LENGTH} characters)"),
    Field("process", "object", "the rank's process tree: the process.* fields"),
    Field("gpus", "array", f"the rank's GPUs: NVML indices or GPU-/MIG- UUIDs (at most "
                           f"{MAX_GPUS})"),
    Field("capabilities", "array", "what the client reads in a JSON answer: profile, stacks"),
    Field("profile", "object", "the client's state of a profile (docs/profiles.md)"),
    Field("stacks", "object", "the client's state of a py-spy capture"),
    Field("step_open_seconds", "amount", "seconds the step in progress has run at this push, "
                                         "outside-step phases excluded (absent: none open)",
          bound=MAX_SECONDS),
    Field("open_phase", "name", "the outside-step phase in progress (evaluation, checkpoint, "
                                "dataloader_start, or one opened with outside_step=True)"),
    Field("open_phase_seconds", "amount", "seconds the open_phase has run at this push",
          bound=MAX_SECONDS),
    Field("goodbye", "bool", "true at the process's end: the rank's series go a minute later "
                             "(a failure's stay --ingest.ttl, then its end alone "
                             "--ingest.dead-ttl)", default=False),
    Field("exit_reason", "enum", "with goodbye: how the process ended; closed and completed "
                                 "are clean, exception and signal failures, exited neither "
                                 "(absent: closed)", choices=EXIT_REASONS),
    Field("exit_detail", "name", "with a failure: the exception's type or the signal's name "
                                 "(1-128 of [A-Za-z0-9_.:-])"),
)
PROCESS_FIELDS: tuple[Field, ...] = (
    Field("cpu_seconds", "amount", "CPU seconds of the process tree", cumulative=True),
    Field("resident_memory_bytes", "amount", "the tree's resident memory (RSS), bytes"),
    Field("proportional_memory_bytes", "amount", "the tree's proportional set size (PSS), "
                                                 "bytes, where smaps_rollup is readable"),
    Field("read_bytes", "amount", "bytes the tree read from storage", cumulative=True),
    Field("cpu_allowance_cores", "amount", "the CPU cores its cgroup (v2) allows"),
    Field("cpu_allowance_group", "count", "where a quota or cpuset limits it: the cgroup that "
                                          "sets the allowance, as its inode number (the "
                                          "ranks that share it share the allowance; never a "
                                          "label)"),
    Field("cpu_throttled_seconds", "amount", "seconds its cgroup (v2) was throttled",
          cumulative=True),
    Field("pid", "count", "the process's pid in its own PID namespace (never a label)"),
    Field("start_time", "count", "the process's start, clock ticks after boot "
                                 "(/proc/self/stat field 22)"),
)


def scalar(f: Field, value: object, where: str = "") -> Any:
    """``value`` of the scalar field ``f`` (``where``: its path's prefix, such as
    ``process.``) checked; Refused(400) saying what is wrong."""
    name = where + f.name
    if f.kind in NUMBER_KINDS:
        v = number(value, name, f.kind == "count")
        if f.bound is not None and v > f.bound:
            raise Refused(400, f"field '{name}' must be at most {f.bound:g}, got {v:g}")
        return v
    if f.kind == "bool":
        if not isinstance(value, bool):
            raise Refused(400, f"field '{name}' must be true or false, got {json_kind(value)}")
        return value
    if f.kind == "enum" and value not in f.choices:
        raise Refused(400, f"field '{name}' must be one of {', '.join(f.choices)}, got "
                           f"{value!r}")
    return value


def unix_time(value: Any, field: str) -> float:
    """A Unix time from JSON (a profile's or a capture's start or finish): a number >= 0 and
    at most LATEST_UNIX; Refused(400) naming ``field``."""
    v = number(value, field)
    if v > LATEST_UNIX:
        raise Refused(400, f"field '{field}' is {v:g}: no Unix time a clock gives (at most "
                           f"{LATEST_UNIX:g})")
    return v


def read_scalars(body: dict, fields: tuple[Field, ...], where: str = "") -> dict[str, Any]:
    """The scalar fields of ``body`` checked: a number's null is its absence; an absent
    field is its default (None where it has none), Refused(400) where it is required."""
    out: dict[str, Any] = {}
    for f in fields:
        if f.kind not in SCALAR_KINDS:
            continue
        value = body.get(f.name, _ABSENT)
        if value is _ABSENT or (value is None and f.kind in NUMBER_KINDS):
            if f.required:
                raise Refused(400, f"missing field '{where}{f.name}'")
            out[f.name] = f.default
        else:
            out[f.name] = scalar(f, value, where)
    return out


def cumulative(fields: tuple[Field, ...], required: bool) -> tuple[str, ...]:
    """The names of the totals among ``fields`` that only grow within one run_id, required
    or optional."""
    return tuple(f.name for f in fields if f.cumulative and f.required == required)


def field_table() -> str:
    """docs/push-protocol.md's table of the push's fields."""
    rows = ["| field | kind | required | bound | meaning |", "| --- | --- | --- | --- | --- |"]
    for where, fields in (("", PUSH_FIELDS), ("process.", PROCESS_FIELDS)):
        for f in fields:
            kind = f.kind + (", cumulative" if f.cumulative else "")
            if f.choices:
                kind += ": " + ", ".join(f.choices)
            bound = (f"<= {f.bound:g}" if f.bound is not None else
                     "2^63-1 (a float: 2^53)" if f.kind == "count" else
                     "finite" if f.kind in NUMBER_KINDS else "")
            default = f" (default `{json.dumps(f.default)}`)" if f.default is not None else ""
            rows.append(f"| `{where}{f.name}` | {kind} | {'yes' if f.required else 'no'} | "
                        f"{bound} | {f.doc}{default} |")
    return "\n".join(rows) + "\n"
