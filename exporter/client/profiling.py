"""On-demand ``torch.profiler`` traces of a running rank, asked for by the daemon.

The daemon queues a request; the answer to the client's next push carries it (see
:mod:`exporter.protocol`, ``PROFILE_INSTRUCTION``). The pusher thread hands it to
:class:`RankProfiler`; the training thread starts ``torch.profiler`` at its next step boundary
(one warm-up step, then N recorded steps, as ``torch.profiler.schedule`` does), stops it after
them, and a background thread exports a gzipped Chrome trace and reduces the events to a
summary that the next push carries back. Nothing here can raise into the training loop, and
while no profile is asked for the loop pays nothing (the monitor calls in only when asked).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from exporter.protocol import (
    MAX_OP_NAME_LENGTH,
    MAX_PROFILE_ERROR_LENGTH,
    MAX_PROFILE_STEPS,
    MAX_PROFILE_TOP_OPS,
    MAX_TRACE_PATH_LENGTH,
    PROFILE_ID_RE,
    PROFILE_VERSION,
    as_text,
    sanitize,
)

log = logging.getLogger("exporter.client")

TRACE_DIR_ENV = "GPUTRAIN_TRACE_DIR"
TRACE_BUDGET_ENV = "GPUTRAIN_TRACE_BUDGET_MB"
DEFAULT_TRACE_BUDGET_MB = 1024
# Ranges that are not operators: the profiler's own step marks
_NOT_OPERATORS = re.compile(r"ProfilerStep[#*]")
_OPTIMIZER = ("Optimizer.step#", "Optimizer.zero_grad#")
_BACKWARD = "autograd::engine::evaluate_function"
UNAVAILABLE = ("profiling unavailable: torch cannot be imported in this training process "
               "(the profile uses torch.profiler)")


def torch_available() -> bool:
    """True when torch can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def trace_dir(run: str) -> Path:
    """Where traces go: ``GPUTRAIN_TRACE_DIR``, else ``<tmp>/gputrain-traces-<uid>/<run>``."""
    configured = os.environ.get(TRACE_DIR_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return (Path(tempfile.gettempdir()) / f"gputrain-traces-{uid}" / sanitize(run)).resolve()


def trace_path(directory: Path, run: str, rank: str, profile_id: str) -> Path:
    """The trace file for one profile: a name built from sanitised parts, inside
    ``directory`` (checked, so no run or rank name can point it elsewhere)."""
    name = f"{sanitize(run)}-rank{sanitize(rank)}-{sanitize(profile_id)}.pt.trace.json.gz"
    path = (directory / name).resolve()
    if path.parent != directory:
        raise ValueError(f"trace path {path} is outside the trace directory {directory}")
    return path


# A trace of ours, and only ours: a user's own torch.profiler traces beside them are never pruned
# (torch traces, and the py-spy stacks' speedscope and dump files of exporter.client.stacks)
_OUR_TRACE = re.compile(r".+-rank.+-p-[0-9a-f]{12}\.(pt\.trace\.json\.gz|speedscope\.json|"
                        r"dump\.json)")


def trace_budget() -> int:
    """Bytes the traces may take (``GPUTRAIN_TRACE_BUDGET_MB``, default 1024 MiB)."""
    raw = os.environ.get(TRACE_BUDGET_ENV)
    if raw:
        try:
            mib = float(raw)
            if mib > 0:
                return int(mib * 1024 * 1024)
        except ValueError:
            pass
        log.warning("gputrain: %s=%r is not a size in MiB above 0; using %d", TRACE_BUDGET_ENV,
                    raw, DEFAULT_TRACE_BUDGET_MB)
    return DEFAULT_TRACE_BUDGET_MB * 1024 * 1024


def prune_traces(directory: Path, budget: int, keep: Path) -> list[Path]:
    """Delete the oldest of our traces (and stacks' files) until they take at most
    ``budget`` bytes, never ``keep`` (the one just written). Counts ``directory`` and, where
    it is a run's directory under the default ``<tmp>/gputrain-traces-<uid>``, every run's
    beside it. Returns what it deleted."""
    configured = os.environ.get(TRACE_DIR_ENV)
    files = (directory.glob("*-rank*-p-*.json*") if configured else
             directory.parent.glob("*/*-rank*-p-*.json*"))
    found = []
    for f in files:
        if _OUR_TRACE.fullmatch(f.name):
            with contextlib.suppress(OSError):  # another rank pruned it first
                st = f.stat()
                found.append((st.st_mtime, f, st.st_size))
    total = sum(size for _, _, size in found)
    pruned = []
    for _, f, size in sorted(found):
        if total <= budget:
            break
        if f == keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
        total -= size
        pruned.append(f)
    if pruned:
        log.info("gputrain: deleted %d old trace(s) to keep the traces within %d MiB (%s)",
                 len(pruned), budget // (1024 * 1024), TRACE_BUDGET_ENV)
    return pruned


# -- reducing a profile to where each step's time went ----------------------------------------

def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(intervals: list[tuple[float, float]], taken: list[tuple[float, float]]
           ) -> list[tuple[float, float]]:
    """``intervals`` less every point in ``taken`` (both unions)."""
    out = []
    for a, b in intervals:
        cur = a
        for c, d in taken:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def split_step(window: tuple[float, float], data_wait: float,
               ops: list[tuple[str, float, float]],
               device: list[tuple[float, float]]) -> dict[str, float]:
    """Where one step's time went, in seconds (times in microseconds, the profiler's clock).

    ``window`` is the step (one ``ProfilerStep``), ``data_wait`` the client's own measure of
    its fetch (seconds, at the step's start, where every integration fetches), ``ops`` the
    training thread's operations at any depth and the backward pass's (name, start, end), and
    ``device`` the GPU's kernel and copy intervals. The parts, in this order of precedence:
    data_loading; backward (from the first to the last autograd function); optimizer
    (``Optimizer.step``/``zero_grad``); forward (from the first operation after the fetch to
    the backward, or every other operation when there is none); other (operations after the
    backward); idle (no operation recorded on the training thread: Python that calls no torch
    op, sleeps). An optimizer step that runs the forward and backward in its closure
    (Lightning's) counts as optimizer only outside them. They sum to the step. ``gpu_busy``:
    seconds the GPU ran anything (with CUDA).
    """
    lo, hi = window
    inside = [(n, a, b) for n, a, b in ops if b > lo and a < hi]
    data = [(lo, min(hi, lo + data_wait * 1e6))]
    taken = list(data)
    backward: list[tuple[float, float]] = []
    autograd = [(a, b) for n, a, b in inside if n.startswith(_BACKWARD)]
    if autograd:
        span = _clip([(min(a for a, _ in autograd), max(b for _, b in autograd))], lo, hi)
        backward = _minus(span, taken)
        taken = _union(taken + backward)
    steps = [(a, b) for n, a, b in inside if n.startswith(_OPTIMIZER)]
    closures = [(a, b) for a, b in steps if any(a <= c and d <= b for c, d in autograd)]
    optimizer = _minus(_union(_clip([r for r in steps if r not in closures], lo, hi)), taken)
    taken = _union(taken + optimizer)
    rest = _union(_clip([(a, b) for n, a, b in inside if not n.startswith(_OPTIMIZER)
                         and not n.startswith(_BACKWARD)], lo, hi))
    busy = _minus(rest, taken)
    if backward:
        first = min((a for a, _ in busy if a < backward[0][0]), default=None)
        forward = [] if first is None else _minus([(first, backward[0][0])], taken)
    else:
        forward = busy
    taken = _union(taken + forward)
    in_closure = _minus(_union(_clip(closures, lo, hi)), taken)
    optimizer = _union(optimizer + in_closure)
    taken = _union(taken + in_closure)
    other = _minus(rest, taken)
    taken = _union(taken + other)
    parts = {
        "data_loading": _length(data), "forward": _length(forward),
        "backward": _length(backward), "optimizer": _length(optimizer),
        "other": _length(other), "idle": _length(_minus([(lo, hi)], taken)),
    }
    out = {k: v / 1e6 for k, v in parts.items()}
    out["seconds"] = (hi - lo) / 1e6
    if device:
        out["gpu_busy"] = _length(_union(_clip(device, lo, hi))) / 1e6
    return out


def summarise(prof: Any, data_waits: list[float]) -> dict[str, Any]:
    """The steps and top operators of a finished ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    steps = sorted((e for e in events if e.name.startswith("ProfilerStep")),
                   key=lambda e: e.time_range.start)
    main_threads = {e.thread for e in steps}
    ops: list[tuple[float, str, float]] = []
    device: list[tuple[float, float]] = []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if e.device_type != DeviceType.CPU:
            device.append((start, end))
        elif e.name.startswith(_BACKWARD) or (e.thread in main_threads and
                                              not e.name.startswith("ProfilerStep")):
            ops.append((start, e.name, end))  # autograd on any thread: CUDA runs its own
    ops.sort()
    device.sort()
    starts = [a for a, _, _ in ops]
    device_starts = [a for a, _ in device]
    split = []
    for i, s in enumerate(steps[:MAX_PROFILE_STEPS]):
        lo, hi = s.time_range.start, s.time_range.end
        # an operation belongs to the step it starts in (the profiler's ranges nest in steps)
        mine = [(n, a, b) for a, n, b in ops[bisect_left(starts, lo):bisect_left(starts, hi)]]
        gpu = device[bisect_left(device_starts, lo):bisect_left(device_starts, hi)]
        split.append(split_step((lo, hi), data_waits[i] if i < len(data_waits) else 0.0,
                                mine, gpu))
    return {"device": "cuda" if device else "cpu", "steps": split,
            "top_ops": top_operators(prof.key_averages())}


def top_operators(averages: Iterable[Any], n: int = MAX_PROFILE_TOP_OPS) -> list[dict[str, Any]]:
    """The ``n`` operators with the most self time: on the GPU when it ran any, else the CPU."""
    rows = []
    for a in averages:
        if _NOT_OPERATORS.match(a.key):
            continue
        dev = getattr(a, "self_device_time_total", None)
        if dev is None:  # torch before 2.4
            dev = getattr(a, "self_cuda_time_total", 0.0)
        rows.append({"name": a.key[:MAX_OP_NAME_LENGTH], "calls": int(a.count),
                     "self_cpu_seconds": a.self_cpu_time_total / 1e6,
                     "self_device_seconds": (dev or 0.0) / 1e6})
    on_device = any(r["self_device_seconds"] > 0 for r in rows)
    key = "self_device_seconds" if on_device else "self_cpu_seconds"
    rows.sort(key=lambda r: r[key], reverse=True)
    return rows[:n]


# -- the state machine, between the pusher thread and the training thread ---------------------

class ReportSlot:
    """The report a rank owes the daemon on what it was asked for (a profile, a capture):
    sent with every push until the daemon has taken the final one, dropped when refused so
    that the totals' pushes go on. Subclasses set ``_lock``, ``_report`` and ``what``."""

    what = "profile"
    _lock: threading.Lock
    _report: dict[str, Any] | None

    def report(self) -> dict[str, Any] | None:
        """The state to send with the next push."""
        return self._report

    def reported(self, report: dict[str, Any], refused: str | None = None) -> None:
        """The daemon took ``report`` (a final one is not sent again), or ``refused`` it."""
        with self._lock:
            if self._report is report and (refused is not None or
                                           report["state"] in ("done", "failed")):
                self._report = None
        if refused is not None:
            log.warning("gputrain: the daemon refused %s %s's report: %s", self.what,
                        report.get("id"), refused)


class RankProfiler(ReportSlot):
    """One profile at a time for one rank.

    ``offer`` (pusher thread) takes an instruction; ``at_boundary`` (training thread, only
    while :attr:`wanted`) drives the profiler; ``report`` / ``reported`` (pusher thread) carry
    the state to the daemon until it has taken the final one. ``wake`` asks the pusher to push
    now; ``attention`` tells the monitor to call in at its next step boundary.
    """

    def __init__(self, run: str, rank: str, wake: Callable[[], None],
                 attention: Callable[[], None]) -> None:
        self.run = run
        self.rank = rank
        self._wake = wake
        self._attention = attention
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._id: str | None = None
        self._steps = 0
        self._state: str | None = None  # accepted, running, done, failed
        self._report: dict[str, Any] | None = None
        self._prof: Any = None
        self._ready = False
        self._records: list[tuple[float, float]] = []  # (step seconds, data wait) per step
        self._started = 0.0
        self._writer: threading.Thread | None = None
        self._torch: bool | None = None  # torch can be imported here; looked up when asked
        self._cuda = False  # the profile records CUDA activities

    @property
    def wanted(self) -> bool:
        """The training thread has something to do at its next step boundary."""
        return self._state in ("accepted", "running") and self._prof is not _FINISHING

    def offer(self, instruction: Any) -> None:
        """An instruction from a push answer; anything not understood is ignored."""
        if not isinstance(instruction, dict) or instruction.get("type") != "profile":
            return
        version = instruction.get("version")
        pid, steps = instruction.get("id"), instruction.get("steps")
        if not isinstance(version, int) or version > PROFILE_VERSION or \
                not isinstance(pid, str) or not PROFILE_ID_RE.fullmatch(pid) or \
                not isinstance(steps, int) or isinstance(steps, bool) or \
                not 1 <= steps <= MAX_PROFILE_STEPS:
            return
        if self._torch is None:  # find_spec, not an import: this is the pusher thread
            self._torch = torch_available()
        with self._lock:
            if pid == self._id and self._state == "accepted":
                self._attention()  # the monitor may have missed the first call
                return
            if pid in self._seen or self._state in ("accepted", "running"):
                return
            self._seen.add(pid)
            if not self._torch:
                self._id, self._state = pid, "failed"
                self._report = {"id": pid, "state": "failed", "error": UNAVAILABLE}
                log.warning("gputrain: the daemon asks for a profile (%s): %s", pid,
                            UNAVAILABLE)
                self._wake()
                return
            self._id, self._steps, self._state = pid, steps, "accepted"
            self._report = {"id": pid, "state": "accepted"}
            self._ready = False
            self._records = []
        log.info("gputrain: the daemon asks for a %d-step profile (%s); it starts at the next "
                 "step", steps, pid)
        self._attention()

    def at_boundary(self, step_seconds: float, data_wait: float) -> None:
        """A step just ended (training thread). Never raises."""
        try:
            if self._prof is None:
                self._start()
            elif self._prof is not _FINISHING:
                self._records.append((step_seconds, data_wait))
                self._prof.step()
                if self._ready or len(self._records) > self._steps + 1:
                    self._stop()
        except Exception as exc:  # torch missing, a profiler already running, anything
            self._fail(as_text(f"{type(exc).__name__}: {exc}"))

    def close(self, timeout: float = 10.0) -> None:
        """Training ended (training thread): a profile still recording cannot finish; one
        being written gets up to ``timeout`` seconds, so the last push can carry it."""
        writer = self._writer
        if self._prof is _FINISHING and writer is not None:
            writer.join(timeout)
        elif self._state in ("accepted", "running"):
            done = max(0, len(self._records) - 1)
            self._fail(f"training ended after {done} of {self._steps} profiled steps")

    def in_child(self) -> None:
        """After a fork (a DataLoader worker): never profile here. torch leaves a recording
        profiler on in a forked child, where nobody collects what it records and it slows
        the worker's ops (1.5-2x on a CPU, so the profile's own data loading would grow):
        stop it here, and only here."""
        prof, self._prof = self._prof, None
        self._state, self._report, self._torch = None, None, False
        if prof is None or prof is _FINISHING:
            return
        with contextlib.suppress(Exception):
            import torch  # imported already: the parent was profiling with it
            from torch.profiler import ProfilerActivity

            if not torch._C._autograd._profiler_enabled():  # the warm-up step: not yet on
                return
            if self._cuda:  # CUPTI after a fork is not to be touched: only the CPU callbacks
                torch._C._autograd._toggle_collection_dynamic(False, {ProfilerActivity.CPU})
            else:
                torch._C._autograd._disable_profiler()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities,
                       schedule=schedule(wait=0, warmup=1, active=self._steps, repeat=1),
                       on_trace_ready=self._on_ready)
        prof.start()
        self._prof = prof
        self._started = time.time()
        with self._lock:
            self._state = "running"
            self._report = {"id": self._id, "state": "running", "started": self._started}
        self._wake()

    def _on_ready(self, prof: Any) -> None:
        self._ready = True

    def _stop(self) -> None:
        prof = self._prof
        self._prof = _FINISHING
        prof.stop()
        waits = [w for _, w in self._records[1:]]  # the first step was the warm-up
        self._writer = threading.Thread(target=self._finish, args=(prof, waits, self._id),
                                        name="gputrain-profile", daemon=True)
        self._writer.start()

    def _finish(self, prof: Any, waits: list[float], pid: str) -> None:
        partial: Path | None = None
        try:
            summary = summarise(prof, waits)
            directory = trace_dir(self.run)
            directory.mkdir(parents=True, exist_ok=True)
            path = trace_path(directory, self.run, self.rank, pid)
            if len(str(path)) > MAX_TRACE_PATH_LENGTH:
                raise ValueError(f"the trace path is over {MAX_TRACE_PATH_LENGTH} characters: "
                                 f"set {TRACE_DIR_ENV} to a shorter directory")
            with tempfile.NamedTemporaryFile(suffix=".json", dir=directory) as raw:
                prof.export_chrome_trace(raw.name)
                partial = path.with_name(path.name + ".partial")
                with open(raw.name, "rb") as src, gzip.open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                partial.replace(path)
        except Exception as exc:
            log.warning("gputrain: profile %s could not be written: %s", pid, exc)
            if partial is not None:
                partial.unlink(missing_ok=True)
            self._fail(as_text(f"{type(exc).__name__}: {exc}"))
            return
        size = path.stat().st_size
        log.info("gputrain: profile %s written to %s (%d bytes)", pid, path, size)
        try:
            prune_traces(directory, trace_budget(), path)
        except OSError as exc:  # the profile itself is written; pruning is housekeeping
            log.warning("gputrain: could not prune old traces in %s: %s", directory, exc)
        with self._lock:
            self._state = "done"
            self._report = {"id": pid, "state": "done", "started": self._started,
                            "finished": time.time(), "trace": as_text(str(path)),
                            "trace_bytes": size,
                            **summary}
            self._prof = None
        self._wake()

    def _fail(self, message: str) -> None:
        prof, self._prof = self._prof, None
        if prof is not None and prof is not _FINISHING:
            with contextlib.suppress(Exception):  # already stopped, or never started
                prof.stop()
        log.warning("gputrain: profile %s failed: %s", self._id, message)
        with self._lock:
            self._state = "failed"
            self._report = {"id": self._id, "state": "failed",
                            "error": message[:MAX_PROFILE_ERROR_LENGTH]}
        self._wake()


_FINISHING = object()  # the profiler stopped; the background thread is writing the trace
