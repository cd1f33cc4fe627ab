"""py-spy stacks of a rank's process tree, asked for by the daemon.

The daemon queues a request; the answer to the client's next push carries it (see
:mod:`exporter.protocol`, ``STACKS_CAPABILITY``). A thread of the training process then runs
py-spy (the optional extra ``gputrain-exporter[stacks]``) as its own child, on its own process
and every process below it (DataLoader workers, the pin-memory thread, any other child),
``--nonblocking`` so no process is ever paused: ``record`` samples for N seconds, ``dump``
takes one picture of every thread (a stalled rank). A dump asked for with ``"native": true``
(a hung rank) reads the rank's own process with ``--native`` instead: py-spy pauses it for
milliseconds to unwind its C and C++ frames too, so a wait inside a collective shows where it
waits (``c10d::...``, ``gloo::...``); where that cannot be done, the plain dump is taken and
its report says why. The result is reduced to the functions
each role spends its samples in, pushed back, and written as a speedscope file beside the
torch traces. The training thread is never involved: a capture runs while steps go on.

Why the rank's own process runs py-spy: under Yama ``ptrace_scope`` 1 (most distributions) a
process may read the memory of its descendants only, so py-spy as the rank's child may read
the rank; a DataLoader worker, py-spy's sibling, allows its parent's descendants with
``prctl(PR_SET_PTRACER)`` when it is forked. No capability, no host pid namespace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exporter.client.profiling import ReportSlot, prune_traces, trace_budget, trace_dir
from exporter.protocol import (
    MAX_DUMP_FRAMES,
    MAX_DUMP_FRAMES_TOTAL,
    MAX_DUMP_PROCESSES,
    MAX_DUMP_THREADS,
    MAX_FUNCTION_LENGTH,
    MAX_PENDING_COLLECTIVES,
    MAX_PROFILE_ERROR_LENGTH,
    MAX_STACK_TOP,
    MAX_STACKS_SECONDS,
    MAX_TRACE_PATH_LENGTH,
    PROFILE_ID_RE,
    STACK_ROLE_WORDS,
    STACK_ROLES,
    STACKS_MODES,
    STACKS_RATE,
    STACKS_VERSION,
    sanitize,
)

log = logging.getLogger("exporter.client")

PY_SPY_ENV = "GPUTRAIN_PY_SPY"
MAX_RAW_BYTES = 64 * 1024 * 1024  # of py-spy's output read back; past it the capture fails
MAX_STACKS_IN_FILE = 20000  # distinct stacks written to the speedscope file (the most sampled)
PR_SET_PTRACER = 0x59616D61  # "Yama"
PR_GET_DUMPABLE = 3
OWN_THREADS = "gputrain-"  # the client's threads' names begin so
CAP_SYS_PTRACE = 19
NOT_INSTALLED = ("py-spy is not installed in this training environment: install it with "
                 "pip install 'gputrain-exporter[stacks]' (or pip install py-spy), or point "
                 f"{PY_SPY_ENV} at its binary")
# A DataLoader worker's and the pin-memory thread's loops (torch.utils.data._utils)
_WORKER_LOOP = ("_worker_loop", "worker.py")
_PIN_LOOP = ("_pin_memory_loop", "pin_memory.py")
_FRAME = re.compile(r"(?P<function>.*) \((?P<file>[^()]*):(?P<line>\d+)\)")
_PROCESS = re.compile(r'process (?P<pid>\d+):')
_COMMAND = re.compile(r'process (?P<pid>\d+):".*?";(?=process \d+:|thread \()', re.DOTALL)
_THREAD = re.compile(r"thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)(?:: (?P<name>.*))?")
# a thread with more frames than a dump keeps keeps its Python frames and its innermost native
# ones (where it waits), at least this many of them
MIN_NATIVE_FRAMES = 10


def find_py_spy() -> str | None:
    """py-spy's binary: ``GPUTRAIN_PY_SPY``, else beside this Python (a virtual environment's
    bin/, off the PATH when it is not activated), else on the PATH."""
    configured = os.environ.get(PY_SPY_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    beside = Path(sys.executable).parent / "py-spy"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, ValueError):
        return None


def refused_why(pid: int, proc: str = "/proc") -> str:
    """Why ptrace access to ``pid`` is refused, in words, and how to allow it: Yama's
    ``ptrace_scope``, the capability, whether the process is dumpable."""
    reasons = []
    scope = _read(f"{proc}/sys/kernel/yama/ptrace_scope")
    caps = 0
    for line in (_read(f"{proc}/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            caps = int(line.split()[1], 16)
    has_cap = bool(caps >> CAP_SYS_PTRACE & 1)
    if scope == "3":
        reasons.append("Yama ptrace_scope is 3 on this machine: no process may attach to "
                       "another until a reboot (set kernel.yama.ptrace_scope=1 in the boot "
                       "sysctl config to allow it)")
    elif scope == "2" and not has_cap:
        reasons.append("Yama ptrace_scope is 2 on this machine: only a process with "
                       "CAP_SYS_PTRACE may attach; add it to the training process (Kubernetes: "
                       "securityContext.capabilities.add [SYS_PTRACE]; Docker: --cap-add "
                       "SYS_PTRACE), or lower it with sysctl kernel.yama.ptrace_scope=1")
    elif scope == "1" and not has_cap:
        reasons.append("Yama ptrace_scope is 1: py-spy may read this process and its "
                       "descendants only; a child it cannot read (a DataLoader worker started "
                       "with spawn or forkserver, which does not allow its parent's "
                       "descendants) needs CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0")
    if _not_dumpable(pid):
        reasons.append(f"process {pid} is not dumpable (prctl PR_SET_DUMPABLE 0, or a setuid "
                       "program): only CAP_SYS_PTRACE may read it")
    if not has_cap:
        reasons.append("this process has no CAP_SYS_PTRACE (the seccomp profile of an old "
                       "Docker, before 19.03, also refuses process_vm_readv: use "
                       "--security-opt seccomp=... with it allowed)")
    return "; ".join(reasons) or "the kernel refused it (a seccomp or LSM policy)"


def _not_dumpable(pid: int) -> bool:
    """Whether ``pid`` is not dumpable: asked of the kernel for this process; for another, a
    non-dumpable process's /proc files belong to root (proc(5)) whoever runs it."""
    if pid == os.getpid() and sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            return ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
    try:
        st = os.stat(f"/proc/{pid}/environ")
        real = os.stat(f"/proc/{pid}")
    except OSError:
        return False
    return st.st_uid == 0 and real.st_uid != 0


def prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up now: a forked child must not dlopen (another thread of
    the parent may have held the loader's lock at the fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def allow_parent_tracer(call: Callable[..., int] | None) -> None:
    """In a forked child (a DataLoader worker): let the parent's descendants, py-spy among
    them, read this process under Yama ptrace_scope 1. A no-op without Yama."""
    if call is not None:
        with contextlib.suppress(Exception):
            call(PR_SET_PTRACER, os.getppid(), 0, 0, 0)


# -- reading py-spy's output ----------------------------------------------------------------------

def _short(path: str, roots: tuple[str, ...]) -> str:
    """A file as py-spy shows it: less the longest ``sys.path`` entry it is under."""
    best = max((r for r in roots if path.startswith(r + os.sep)), key=len, default=None)
    return (path[len(best) + 1:] if best else os.path.basename(path))[-MAX_FUNCTION_LENGTH:]


def _frame(text: str, roots: tuple[str, ...], stdlib: Callable[[str], bool]) -> dict[str, Any]:
    """One frame of py-spy's raw output (``--full-filenames``): ``std`` marks the standard
    library's (threading, queue, multiprocessing: where a thread waits, not why)."""
    m = _FRAME.fullmatch(text)
    if m is None:
        return {"function": text[:MAX_FUNCTION_LENGTH], "file": "", "line": 0, "std": False}
    return {"function": m["function"][:MAX_FUNCTION_LENGTH], "file": _short(m["file"], roots),
            "line": int(m["line"]), "std": stdlib(m["file"])}


def _layout() -> tuple[tuple[str, ...], Callable[[str], bool]]:
    """This interpreter's ``sys.path`` roots (to shorten files) and a test of a file being
    the standard library's (under stdlib, not under site-packages)."""
    paths = sysconfig.get_paths()
    std = tuple(paths[k] + os.sep for k in ("stdlib", "platstdlib") if k in paths)
    site = tuple(paths[k] + os.sep for k in ("purelib", "platlib") if k in paths)
    roots = tuple({os.path.abspath(p or ".") for p in sys.path} | {
        p.rstrip(os.sep) for p in std + site})
    return roots, lambda f: f.startswith(std) and not f.startswith(site)


def _has(frames: list[dict[str, Any]], loop: tuple[str, str]) -> bool:
    return any(f["function"] == loop[0] and f["file"].endswith(loop[1]) for f in frames)


def _roles(samples: list[dict[str, Any]], main_pid: int) -> dict[tuple[int, str], str]:
    """The role of each (pid, thread) seen: a process is a loader worker when any of its
    stacks runs torch's worker loop (its other threads, a queue feeder, go with it); in the
    main process, the thread that runs the pin-memory loop is the pin-memory thread."""
    workers = {s["pid"] for s in samples if s["pid"] != main_pid and
               _has(s["frames"], _WORKER_LOOP)}
    pinning = {s["tid"] for s in samples if s["pid"] == main_pid and
               _has(s["frames"], _PIN_LOOP)}
    return {(s["pid"], s["tid"]): ("main" if s["tid"] not in pinning else "pin_memory")
            if s["pid"] == main_pid else
            "loader_workers" if s["pid"] in workers else "other" for s in samples}


def parse_collapsed(text: str, main_pid: int) -> list[dict[str, Any]]:
    """py-spy's raw (collapsed) output, ``record --subprocesses --threads``, as samples:
    ``{"pid", "tid", "thread", "frames" (outermost first), "count"}``."""
    out = []
    roots, stdlib = _layout()
    # a process frame quotes its command line, which may hold newlines (python -c "...")
    text = _COMMAND.sub(lambda m: f"process {m['pid']}:;", text)
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        pid, tid, thread = main_pid, "", ""
        frames: list[dict[str, Any]] = []
        for part in stack.split(";"):
            if (m := _PROCESS.match(part)) is not None and not frames:
                pid = int(m["pid"])
            elif (m := _THREAD.fullmatch(part)) is not None and not frames:
                tid, thread = m["tid"], (m["name"] or "")[:MAX_FUNCTION_LENGTH]
            else:
                frames.append(_frame(part, roots, stdlib))
        if thread.startswith(OWN_THREADS):
            continue  # the client's own threads (pushing, running py-spy) are not the rank's
        out.append({"pid": pid, "tid": tid, "thread": thread, "frames": frames,
                    "count": int(n)})
    return out


def _counted(samples: list[dict[str, Any]], roles: dict[tuple[int, str], str]
             ) -> set[tuple[int, str]]:
    """The threads a role's summary counts: each process's main thread (its thread id is
    the pid) and the pin-memory thread. A process's helper threads (queue feeders, a
    resource sharer), parked all the time, would drown the answer; the flame graph keeps
    them. A process whose main thread is not told apart counts every thread."""
    by_pid: dict[int, set[str]] = defaultdict(set)
    for s in samples:
        by_pid[s["pid"]].add(s["tid"])
    out = set()
    for pid, tids in by_pid.items():
        main = {t for t in tids if t == str(pid) or roles[(pid, t)] == "pin_memory"}
        out |= {(pid, t) for t in (main if str(pid) in tids else tids)}
    return out


def _culprit(frames: list[dict[str, Any]]) -> dict[str, Any]:
    """The frame a sample is charged to: the innermost one outside the standard library (a
    thread waiting in ``Queue.get`` or ``Condition.wait`` waits for whoever called them;
    time in C, a sleep or a read, is its innermost Python caller's)."""
    return next((f for f in reversed(frames) if not f["std"]), frames[-1])


def summarise_samples(samples: list[dict[str, Any]], main_pid: int) -> list[dict[str, Any]]:
    """Per role, in STACK_ROLES order: its processes, threads counted, samples, and the
    functions the most samples were charged to (:func:`_culprit`) with their share of the
    role's samples. py-spy samples each thread, running or waiting (``--idle``), at the same
    rate, so a share is a share of the role's time."""
    by_role: dict[str, Counter] = defaultdict(Counter)
    where: dict[str, dict[tuple[str, str], Counter]] = defaultdict(lambda: defaultdict(Counter))
    pids: dict[str, set[int]] = defaultdict(set)
    threads: dict[str, set[tuple[int, str]]] = defaultdict(set)
    role_of = _roles(samples, main_pid)
    counted = _counted(samples, role_of)
    for s in samples:
        if not s["frames"] or (s["pid"], s["tid"]) not in counted:
            continue
        role = role_of[(s["pid"], s["tid"])]
        leaf = _culprit(s["frames"])
        key = (leaf["function"], leaf["file"])
        by_role[role][key] += s["count"]
        where[role][key][leaf["line"]] += s["count"]
        pids[role].add(s["pid"])
        threads[role].add((s["pid"], s["tid"]))
    roles = []
    for role in STACK_ROLES:
        total = sum(by_role[role].values())
        if not total:
            continue
        top = [{"function": fn, "file": file,
                "line": where[role][(fn, file)].most_common(1)[0][0],
                "samples": n, "share": n / total}
               for (fn, file), n in by_role[role].most_common(MAX_STACK_TOP)]
        roles.append({"role": role, "processes": len(pids[role]),
                      "threads": len(threads[role]), "samples": total, "top": top})
    return roles


def speedscope(samples: list[dict[str, Any]], main_pid: int, name: str) -> dict[str, Any]:
    """The samples as a speedscope file (https://www.speedscope.app): one sampled profile per
    thread, named by its role, process and thread; the most sampled stacks if there are more
    than MAX_STACKS_IN_FILE."""
    frames: list[dict[str, Any]] = []
    index: dict[tuple[str, str, int], int] = {}
    profiles: dict[tuple[int, str], dict[str, Any]] = {}
    kept = sorted(samples, key=lambda s: s["count"], reverse=True)[:MAX_STACKS_IN_FILE]
    role_of = _roles(samples, main_pid)
    for s in kept:
        key = (s["pid"], s["tid"])
        if key not in profiles:
            role = STACK_ROLE_WORDS[role_of[key]]
            profiles[key] = {"type": "sampled", "name": f"{role}: pid {s['pid']} thread "
                                                        f"{s['tid']} {s['thread']}".strip(),
                             "unit": "none", "startValue": 0, "endValue": 0,
                             "samples": [], "weights": []}
        stack = []
        for f in s["frames"]:
            k = (f["function"], f["file"], f["line"])
            if k not in index:
                index[k] = len(frames)
                frames.append({"name": f["function"], "file": f["file"], "line": f["line"]})
            stack.append(index[k])
        p = profiles[key]
        p["samples"].append(stack)
        p["weights"].append(s["count"])
        p["endValue"] += s["count"]
    return {"$schema": "https://www.speedscope.app/file-format-schema.json",
            "name": name, "exporter": "gputrain-exporter", "activeProfileIndex": 0,
            "shared": {"frames": frames}, "profiles": list(profiles.values())}


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def _native(frame: dict[str, Any]) -> bool:
    """A frame ``py-spy dump --native`` unwound from machine code: it names its shared object
    (``module``), where a Python frame has none."""
    return bool(frame.get("module"))


def _kept(frames: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The at most ``limit`` frames (innermost first) a dump keeps of a thread's: all where
    they fit; else the Python frames and the innermost native ones (at least
    MIN_NATIVE_FRAMES of them: the pybind and libtorch glue around a call is many frames
    deep), the outermost cut."""
    if len(frames) <= limit:
        return frames
    python = sum(1 for f in frames if not _native(f))
    room = max(MIN_NATIVE_FRAMES, limit - python)
    kept = []
    for f in frames:
        if _native(f):
            if room <= 0:
                continue
            room -= 1
        kept.append(f)
    return kept[:limit]


def parse_dump(dumps: dict[int, Any], main_pid: int) -> list[dict[str, Any]]:
    """One ``py-spy dump --json`` per process (``pid -> its JSON``, or a string saying why
    that process has none: a non-Python child) as processes, the main one first, each
    ``{"pid", "role", "threads": [{"name", "tid", "active", "gil", "role", "frames"
    (innermost first), "where"}]}`` or ``{"pid", "role": "other", "threads": [], "error"}``,
    bounded (MAX_DUMP_*; see :func:`_kept`). A native frame (``--native``) is its function
    and its shared object's name as the file, line 0. ``where`` is the index of the innermost
    Python frame outside the standard library and site-packages (the program's own code), or
    None."""
    libs = _library_roots()
    order = sorted(dumps, key=lambda p: (p != main_pid, p))[:MAX_DUMP_PROCESSES]
    budget = MAX_DUMP_FRAMES_TOTAL
    out: list[dict[str, Any]] = []
    for pid in order:
        raw = dumps[pid]
        if not isinstance(raw, list):
            out.append({"pid": pid, "role": "main" if pid == main_pid else "other",
                        "threads": [], "error": str(raw)[:MAX_FUNCTION_LENGTH]})
            continue
        threads: list[dict[str, Any]] = []
        for t in [t for t in raw if isinstance(t, dict) and not
                  str(t.get("thread_name") or "").startswith(OWN_THREADS)][:MAX_DUMP_THREADS]:
            raw_frames = _kept([f for f in t.get("frames") or [] if isinstance(f, dict)],
                               max(0, min(MAX_DUMP_FRAMES, budget)))
            frames = [{"function": str(f.get("name", "?"))[:MAX_FUNCTION_LENGTH],
                       "file": str(f.get("short_filename") or f.get("filename") or "")
                       [-MAX_FUNCTION_LENGTH:],
                       "line": f.get("line") if isinstance(f.get("line"), int) else 0}
                      for f in raw_frames]
            budget -= len(frames)
            own = next((i for i, f in enumerate(raw_frames) if not _native(f) and
                        not str(f.get("filename", "")).startswith(libs)), None)
            tid = t.get("os_thread_id")
            threads.append({"name": str(t.get("thread_name") or "")[:MAX_FUNCTION_LENGTH],
                            "tid": tid if isinstance(tid, int) else 0,
                            "active": bool(t.get("active")), "gil": bool(t.get("owns_gil")),
                            "role": "pin_memory" if pid == main_pid and
                            _has(frames, _PIN_LOOP) else "", "frames": frames, "where": own})
        worker = any(_has(t["frames"], _WORKER_LOOP) for t in threads)
        role = "main" if pid == main_pid else "loader_workers" if worker else "other"
        for t in threads:
            t["role"] = t["role"] or role
        out.append({"pid": pid, "role": role, "threads": threads})
    return out


# -- the state machine, between the pusher thread and the capture's thread -------------------

class StackSampler(ReportSlot):
    """One capture at a time for one rank. ``offer`` (pusher thread) takes an instruction and
    starts the capture's thread; ``report`` / ``reported`` (pusher thread) carry its state
    to the daemon until it has taken the final one. ``wake`` asks the pusher to push now."""

    what = "stacks"

    def __init__(self, run: str, rank: str, wake: Callable[[], None]) -> None:
        self.run = run
        self.rank = rank
        self._wake = wake
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._busy = False
        self._report: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()
        self._prctl = prctl()  # for the fork hook, which must not look it up

    def offer(self, instruction: Any) -> None:
        """An instruction from a push answer; anything not understood is ignored."""
        if not isinstance(instruction, dict) or instruction.get("type") != "stacks":
            return
        version, sid = instruction.get("version"), instruction.get("id")
        mode, seconds = instruction.get("mode"), instruction.get("seconds")
        native = instruction.get("native") is True  # a dump's; anything but true is no ask
        if not isinstance(version, int) or version > STACKS_VERSION or \
                not isinstance(sid, str) or not PROFILE_ID_RE.fullmatch(sid) or \
                mode not in STACKS_MODES or isinstance(seconds, bool) or \
                not isinstance(seconds, int) or not 1 <= seconds <= MAX_STACKS_SECONDS:
            return
        with self._lock:
            if sid in self._seen or self._busy:
                return
            self._seen.add(sid)
            self._busy = True
            self._report = {"id": sid, "state": "running", "mode": mode,
                            "started": time.time()}
        log.info("gputrain: the daemon asks for py-spy stacks (%s, %s)", sid, mode)
        self._thread = threading.Thread(target=self._capture, args=(sid, mode, seconds, native),
                                        name="gputrain-stacks", daemon=True)
        self._thread.start()
        self._wake()

    def in_child(self) -> None:
        """After a fork (a DataLoader worker): never capture here, and let the parent's
        py-spy read this process."""
        self._busy, self._report, self._proc = True, None, None
        allow_parent_tracer(self._prctl)

    def close(self, timeout: float = 5.0) -> None:
        """Training ended: stop a capture under way (py-spy writes what it has on SIGINT)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(2)
        if self._thread is not None:
            self._thread.join(timeout)

    def _capture(self, sid: str, mode: str, seconds: int, native: bool = False) -> None:
        started = time.time()
        try:
            result = capture(mode, seconds, self._pid, self.run, self.rank, sid, self._started,
                             native)
            state: dict[str, Any] = {"id": sid, "state": "done", "mode": mode,
                                     "started": started, "finished": time.time(), **result}
        except Exception as exc:
            message = str(exc) if isinstance(exc, CaptureFailed) else \
                f"{type(exc).__name__}: {exc}"
            log.warning("gputrain: stacks %s failed: %s", sid, message)
            state = {"id": sid, "state": "failed", "mode": mode, "started": started,
                     "error": message[:MAX_PROFILE_ERROR_LENGTH]}
        with self._lock:
            self._report = state
            self._busy = False
            self._proc = None
        self._wake()

    def _started(self, proc: subprocess.Popen) -> None:
        self._proc = proc


class CaptureFailed(Exception):
    """py-spy could not take the capture; the message says why and how to allow it."""


_REFUSED = re.compile(r"permission denied|operation not permitted", re.IGNORECASE)
# a nonblocking read torn by the running process: worth taking again
_TORN = re.compile(r"failed to get stack trace", re.IGNORECASE)
DUMP_ATTEMPTS = 3


def _refused(pid: int) -> CaptureFailed:
    return CaptureFailed(f"py-spy was refused access to process {pid} (ptrace): "
                         f"{refused_why(pid)}")


def _run_py_spy(args: list[str], pid: int, timeout: float,
                started: Callable[[subprocess.Popen], None]) -> tuple[str, str]:
    """Run py-spy, return its stdout and stderr; raise CaptureFailed with the reason in
    words."""
    binary = find_py_spy()
    if binary is None:
        raise CaptureFailed(NOT_INSTALLED)
    try:
        proc = subprocess.Popen([binary, *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "RUST_BACKTRACE": "0"})
    except OSError as exc:
        raise CaptureFailed(f"cannot run py-spy ({binary}): {exc.strerror}") from None
    started(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CaptureFailed(f"py-spy did not finish within {timeout:.0f} s") from None
    text = err.decode("utf-8", "replace")
    if proc.returncode != 0:
        if _REFUSED.search(text):
            raise _refused(pid)
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(" ")]
        raise CaptureFailed("py-spy failed: " + (" ".join(lines[:3]) or
                                                 f"exit status {proc.returncode}"))
    return out.decode("utf-8", "replace"), text


def _output_path(run: str, rank: str, sid: str, kind: str) -> Path:
    directory = trace_dir(run)
    directory.mkdir(parents=True, exist_ok=True)
    path = (directory / f"{sanitize(run)}-rank{sanitize(rank)}-{sanitize(sid)}.{kind}.json"
            ).resolve()
    if path.parent != directory or len(str(path)) > MAX_TRACE_PATH_LENGTH:
        raise CaptureFailed(f"the stacks' file {str(path)[:80]}... is outside or too long for "
                            f"the trace directory: set GPUTRAIN_TRACE_DIR to a short one")
    return path


def _write(path: Path, doc: dict[str, Any]) -> int:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    partial.replace(path)
    with contextlib.suppress(OSError):
        prune_traces(path.parent, trace_budget(), path)
    return path.stat().st_size


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (py-spy's own processes left out), at most
    MAX_DUMP_PROCESSES."""
    import psutil

    ours = os.path.realpath(find_py_spy() or "/")
    pids = [pid]
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, OSError):
                if os.path.realpath(child.exe()) == ours:
                    continue
            pids.append(child.pid)
    return pids[:MAX_DUMP_PROCESSES]


def _dump(pid: int, started: Callable[[subprocess.Popen], None], native: bool = False) -> Any:
    """``py-spy dump --nonblocking --json`` of one process (``native``: ``--native``
    instead, which pauses the process while it reads; py-spy takes no --native without
    blocking). A nonblocking read walks the frames while the process runs on: it sometimes
    fails mid-walk ("Failed to get stack traces") where the stack changed under it; such a
    read is taken again, up to DUMP_ATTEMPTS times in all. A refusal or a process that is no
    Python fails at once."""
    how = ["--native"] if native else ["--nonblocking"]
    for attempt in range(DUMP_ATTEMPTS):
        try:
            # 10 s each at most: the daemon gives a dump STACKS_GRACE (120 s) in all
            out, _ = _run_py_spy(["dump", "--pid", str(pid), *how, "--json"], pid, 10.0,
                                 started)
            return json.loads(out)
        except CaptureFailed as exc:
            if not _TORN.search(str(exc)) or attempt == DUMP_ATTEMPTS - 1:
                raise
            time.sleep(0.05 * (attempt + 1))  # let the walked frames settle
    raise AssertionError("unreachable")


def _dump_tree(pid: int, started: Callable[[subprocess.Popen], None], native: bool = False
               ) -> tuple[dict[int, Any], str | None]:
    """``py-spy dump --json`` of ``pid`` and each descendant, one at a time: py-spy's own
    ``--subprocesses`` is not in its JSON, and one non-Python child (a logging agent) fails
    its whole dump. The main process must be readable; a child that is not says why. With
    ``native``, the main process's frames are unwound natively where py-spy can (else the
    second value says why not)."""
    dumps: dict[int, Any] = {}
    warning = None
    for p in _tree(pid):
        try:
            if p == pid and native:
                try:
                    dumps[p] = _dump(p, started, native=True)
                    continue
                except (CaptureFailed, ValueError) as exc:
                    warning = f"native frames were not available ({exc}); the stacks are " \
                              "Python frames only"
                    log.info("gputrain: %s", warning)
            dumps[p] = _dump(p, started)
        except (CaptureFailed, ValueError) as exc:
            if p == pid:
                raise
            dumps[p] = ("not a Python process" if "python version" in str(exc).lower()
                        else str(exc))
    return dumps, warning


def pending_collectives(limit: int = MAX_PENDING_COLLECTIVES) -> list[dict[str, Any]] | None:
    """The collectives this process has started and not finished, from PyTorch's flight
    recorder (on by default since 2.x for gloo and NCCL: ``TORCH_FR_BUFFER_SIZE``), read from
    this thread while the training thread may be blocked in one: the newest ``limit``, each
    its name (``gloo:all_reduce``), sequence number in its process group, the group, and its
    age in seconds. None where torch.distributed is not up, the recorder is off, or this torch
    has no on-demand dump (a private API: ``_dump_fr_trace_json``)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return None
        from torch._C._distributed_c10d import _dump_fr_trace_json

        doc = json.loads(_dump_fr_trace_json())
    except Exception:  # an older or newer torch, a group torn down: no record, no harm
        return None
    if "entries" not in doc:
        return None  # TORCH_FR_BUFFER_SIZE=0
    done = {str(k): int(v.get("last_completed_collective", -1))
            for k, v in (doc.get("pg_status") or {}).items() if isinstance(v, dict)}
    now_ns = time.time_ns()
    out = []
    for e in doc["entries"]:
        seq = e.get("collective_seq_id")
        # on gloo an entry's state stays "scheduled": pending is not retired, or past the
        # group's last completed collective
        retired = e.get("retired")
        if not isinstance(seq, int) or retired or (
                retired is None and seq <= done.get(str(e.get("pg_id")), -1)):
            continue
        group = e.get("process_group")
        out.append({"name": str(e.get("profiling_name", "?"))[:MAX_FUNCTION_LENGTH],
                    "seq": seq, "group": str(group[1] if isinstance(group, list) and
                                             len(group) > 1 else group)[:MAX_FUNCTION_LENGTH],
                    "seconds": max(0.0, (now_ns - int(e.get("time_created_ns") or now_ns))
                                   / 1e9)})
    return out[-limit:]


def capture(mode: str, seconds: int, pid: int, run: str, rank: str, sid: str,
            started: Callable[[subprocess.Popen], None] = lambda p: None,
            native: bool = False) -> dict[str, Any]:
    """Take one capture of ``pid`` and its descendants; the report's result fields.
    ``native``: a dump with the main process's native frames (see :func:`_dump_tree`)."""
    if mode == "dump":
        dumps, warning = _dump_tree(pid, started, native)
        processes = parse_dump(dumps, pid)
        path = _output_path(run, rank, sid, "dump")
        pending = pending_collectives() if native else None
        size = _write(path, {"run": run, "rank": rank, "id": sid, "processes": processes,
                             **({"collectives": pending} if pending is not None else {})})
        return {"processes": processes, "file": str(path), "file_bytes": size,
                **({"collectives": pending} if pending is not None else {}),
                **({"warning": warning[:MAX_PROFILE_ERROR_LENGTH]} if warning else {})}
    with tempfile.TemporaryDirectory(prefix="gputrain-stacks-") as tmp:
        raw = os.path.join(tmp, "stacks.txt")
        t0 = time.monotonic()
        _, err = _run_py_spy(
            ["record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--threads",
             "--function", "--idle", "--full-filenames", "--rate", str(STACKS_RATE),
             "--duration", str(seconds), "--format", "raw", "--output", raw],
            pid, seconds + 60.0, started)
        took = min(float(seconds), time.monotonic() - t0)
        try:
            if os.path.getsize(raw) > MAX_RAW_BYTES:
                raise CaptureFailed(f"py-spy wrote over {MAX_RAW_BYTES >> 20} MiB of stacks")
            with open(raw, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except FileNotFoundError:
            text = ""  # no sample: every thread idle
    samples = parse_collapsed(text, pid)
    if not any(s["pid"] == pid for s in samples):
        # py-spy goes on, silently, with the children it can read: the rank's own process it
        # must read, and one dump of it says why it cannot (raising the refusal in words)
        if _REFUSED.search(err):
            raise _refused(pid)
        _run_py_spy(["dump", "--pid", str(pid), "--nonblocking"], pid, 30.0, started)
        raise CaptureFailed(f"py-spy read no stack of process {pid} in {seconds} s: "
                            + (" ".join(err.split())[-200:] or "it said nothing"))
    roles = summarise_samples(samples, pid)
    path = _output_path(run, rank, sid, "speedscope")
    size = _write(path, speedscope(samples, pid, f"{run} rank {rank} ({sid})"))
    result = {"seconds": took, "rate": STACKS_RATE,
              "samples": sum(s["count"] for s in samples), "roles": roles, "file": str(path),
              "file_bytes": size}
    if _REFUSED.search(err):  # the rank itself was read, not every child
        result["warning"] = ("py-spy could not read some child processes: "
                             + refused_why(pid))[:MAX_PROFILE_ERROR_LENGTH]
    return result
