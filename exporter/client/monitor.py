"""TrainingMonitor: step time, data-wait time and samples, measured on the training thread.

The hot path only reads ``time.perf_counter`` and updates a few numbers: no I/O, no lock, no
CUDA synchronisation, no allocation that grows. A background daemon thread (see
:mod:`exporter.client.pusher`) sends the cumulative totals to the daemon every few seconds.
Consistency between the two threads comes from a sequence counter (a seqlock): the training
thread makes it odd while it updates and even when done; the pusher retries a copy that
straddled an update.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from time import perf_counter as _now
from typing import Any, TypeVar

log = logging.getLogger("exporter.client")

T = TypeVar("T")

# Step-duration histogram bounds, in seconds: 1 ms to 60 s.
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
DEFAULT_ENDPOINT = "http://127.0.0.1:19401"


def default_run() -> str:
    """GPUTRAIN_RUN, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, else the script's name."""
    for var in ("GPUTRAIN_RUN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        # torchrun's run id is "none" unless --rdzv-id is given: that names no run
        if os.environ.get(var) and os.environ[var] != "none":
            return os.environ[var]
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    name = os.path.splitext(script)[0]
    return name if name and name not in ("-c", "-m") else "python"


def default_rank() -> str:
    """RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK, else 0."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var):
            return os.environ[var]
    return "0"


def sanitize(name: str) -> str:
    """Make a run or phase name fit the ingest's [A-Za-z0-9_.:-]{1,128}."""
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c in "_.:-") else "_" for c in name)
    return cleaned[:128] or "_"


def batch_len(batch: Any) -> int:
    """Samples in a batch: len() of its first tensor-like element ((x, y) -> len(x);
    {"input_ids": x, ...} -> len(x)); a flat list counts its items."""
    first = batch
    if isinstance(batch, Mapping) and batch:
        first = next(iter(batch.values()))
    elif isinstance(batch, (list, tuple)) and batch and not hasattr(batch, "shape"):
        head = batch[0]
        if hasattr(head, "shape") or isinstance(head, (list, tuple, Mapping)):
            first = head
    shape = getattr(first, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    try:
        return len(first)
    except TypeError:
        return 1


def cuda_gpu_refs() -> list[str]:
    """The GPUs this process uses: torch's current CUDA device UUID when torch has initialised
    CUDA, else the entries of CUDA_VISIBLE_DEVICES. Call it from the training thread: CUDA's
    current device is per thread."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
                return [uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid]
        except Exception as exc:  # an old torch without .uuid, a broken driver
            log.debug("cannot read the CUDA device UUID: %s", exc)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    refs = [v.strip() for v in visible.split(",") if v.strip()]
    return [r for r in refs if r.isdigit() or r.startswith(("GPU-", "MIG-"))]


class _DataWait:
    __slots__ = ("_m", "_t0")

    def __init__(self, monitor: TrainingMonitor) -> None:
        self._m = monitor
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = t = _now()
        if self._m._boundary is None:
            self._m._boundary = t

    def __exit__(self, *exc: object) -> None:
        self._m._pending_wait += _now() - self._t0


class _Step:
    __slots__ = ("_m", "samples")

    def __init__(self, monitor: TrainingMonitor) -> None:
        self._m = monitor
        self.samples: float = 0

    def __enter__(self) -> None:
        if self._m._boundary is None:
            self._m._boundary = _now()

    def __exit__(self, *exc: object) -> None:
        m = self._m
        now = _now()
        # _record, inlined: this runs once per step of a hand-written loop
        step_s = now - m._boundary
        m._seq += 1
        m._steps += 1
        m._step_seconds += step_s
        m._wait_seconds += m._pending_wait
        m._samples += self.samples
        m._counts[bisect_left(m._bounds, step_s)] += 1
        m._last_step = now
        m._seq += 1
        m._pending_wait = 0.0
        m._boundary = now
        if m._gpus_seen_at_step <= 0:
            m._detect_gpus()


class _Phase:
    __slots__ = ("_m", "_name", "_t0")

    def __init__(self, monitor: TrainingMonitor, name: str) -> None:
        self._m = monitor
        self._name = name
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = _now()

    def __exit__(self, *exc: object) -> None:
        m = self._m
        elapsed = _now() - self._t0
        m._seq += 1
        m._phases[self._name] = m._phases.get(self._name, 0.0) + elapsed
        m._seq += 1


class TrainingMonitor:
    """Measures a training loop and pushes its totals to the gputrain-exporter daemon.

    ``run`` and ``rank`` label the series (see :func:`default_run`, :func:`default_rank`);
    ``endpoint`` defaults to ``GPUTRAIN_URL``, then ``http://127.0.0.1:19401``; ``token`` to
    ``GPUTRAIN_TOKEN`` (or the file named by ``GPUTRAIN_TOKEN_FILE``). ``push_interval`` is in
    seconds. If the daemon is down, training goes on unslowed and the totals arrive later.
    """

    def __init__(self, run: str | None = None, rank: str | int | None = None,
                 endpoint: str | None = None, push_interval: float = 5.0,
                 token: str | None = None, buckets: Iterable[float] = DEFAULT_BUCKETS,
                 start: bool = True) -> None:
        self.run = sanitize(run or default_run())
        self.rank = sanitize(str(rank if rank is not None else default_rank()))
        self.endpoint = (endpoint or os.environ.get("GPUTRAIN_URL") or DEFAULT_ENDPOINT).rstrip(
            "/")
        self.push_interval = float(push_interval)
        self.token = token or _env_token()
        self.run_id = os.urandom(8).hex()
        self._wall_offset = time.time() - time.perf_counter()
        self._bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # per bucket, not cumulative; +Inf last
        self._seq = 0
        self._steps = 0
        self._step_seconds = 0.0
        self._wait_seconds = 0.0
        self._samples = 0.0
        self._last_step = 0.0  # perf_counter of the last step's end; 0 = none yet
        self._phases: dict[str, float] = {}
        self._phase_timers: dict[str, _Phase] = {}
        self._boundary: float | None = None
        self._pending_wait = 0.0
        self._data_wait = _DataWait(self)
        self._step = _Step(self)
        self._gpus: list[str] = []
        self._gpus_seen_at_step = -1
        self._pid = os.getpid()
        self._closed = False
        from exporter.client.pusher import Pusher

        self._pusher = Pusher(self)
        if start:
            self._pusher.start()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _disable_in_child(ref))
        atexit.register(_close_at_exit, ref)

    # -- measuring ---------------------------------------------------------------------------

    def wrap(self, iterable: Iterable[T], batch_size: int | None = None) -> Iterator[T]:
        """Iterate ``iterable``; time blocked in ``next()`` is data wait, a step ends when the
        loop body asks for the next batch. Samples are ``batch_size`` or ``batch_len(batch)``."""
        clock = _now
        record = self._record
        prev = clock()
        self._detect_gpus()
        it = iter(iterable)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            waited = clock() - prev
            n = batch_size if batch_size is not None else batch_len(batch)
            try:
                yield batch
            except GeneratorExit:
                now = clock()
                record(now - prev, waited, n, now)
                raise
            now = clock()
            record(now - prev, waited, n, now)
            prev = now
            if self._gpus_seen_at_step == 0:
                self._detect_gpus()

    def data_wait(self) -> _DataWait:
        """``with monitor.data_wait(): batch = next(it)`` for hand-written loops."""
        return self._data_wait

    def step(self, samples: float = 0) -> _Step:
        """``with monitor.step(samples=32): ...``: a step ends when the block ends; its time
        runs from the previous step's end (so it includes the data wait before it)."""
        self._step.samples = samples
        return self._step

    def phase(self, name: str) -> _Phase:
        """``with monitor.phase("checkpoint"): ...``: seconds spent in a named phase."""
        timer = self._phase_timers.get(name)
        if timer is None:
            timer = self._phase_timers[name] = _Phase(self, sanitize(name)[:64])
        return timer

    def new_epoch(self) -> None:
        """Forget the last step boundary, so time between epochs is not counted as a step."""
        self._boundary = None
        self._pending_wait = 0.0

    def _record(self, step_s: float, wait_s: float, samples: float, now: float) -> None:
        if self._gpus_seen_at_step < 0:
            self._gpus_seen_at_step = 0
        self._seq += 1
        self._steps += 1
        self._step_seconds += step_s
        self._wait_seconds += wait_s
        self._samples += samples
        self._counts[bisect_left(self._bounds, step_s)] += 1
        self._last_step = now
        self._seq += 1

    def _detect_gpus(self) -> None:
        """Called on the training thread at the start of a wrap and after its first step."""
        self._gpus = cuda_gpu_refs()
        self._gpus_seen_at_step = self._steps

    # -- reading (pusher thread) -------------------------------------------------------------

    def totals(self) -> dict[str, Any]:
        """A consistent copy of the cumulative totals (safe from any thread)."""
        for _ in range(1000):
            seq = self._seq
            if seq & 1:
                time.sleep(0)
                continue
            copy = {
                "steps": self._steps,
                "step_seconds": self._step_seconds,
                "data_wait_seconds": self._wait_seconds,
                "samples": self._samples,
                "counts": list(self._counts),
                "phases": dict(self._phases),
                "last_step": self._last_step,
            }
            if self._seq == seq:
                break
        cumulative, running = [], 0
        for c in copy.pop("counts")[:-1]:
            running += c
            cumulative.append(running)
        last = copy.pop("last_step")
        copy["last_step_timestamp"] = last + self._wall_offset if last else None
        copy["step_buckets"] = list(self._bounds)
        copy["step_counts"] = cumulative
        copy["gpus"] = list(self._gpus)
        return copy

    # -- lifecycle ---------------------------------------------------------------------------

    def flush(self, timeout: float = 2.0) -> bool:
        """Push now and wait up to ``timeout`` seconds; True when the daemon took it."""
        return self._pusher.push_now(timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Send the final totals (and goodbye) and stop the pusher. Safe to call twice."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self._pusher.stop(goodbye=True, timeout=timeout)

    def __enter__(self) -> TrainingMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env_token() -> str | None:
    token = os.environ.get("GPUTRAIN_TOKEN")
    path = os.environ.get("GPUTRAIN_TOKEN_FILE")
    if not token and path:
        try:
            with open(path, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            log.warning("gputrain: cannot read GPUTRAIN_TOKEN_FILE %s: %s", path, exc)
    return token or None


def _disable_in_child(ref: weakref.ref) -> None:
    """In a forked child (a DataLoader worker) the monitor must never push."""
    monitor = ref()
    if monitor is not None:
        monitor._closed = True
        monitor._pusher.disable()


def _close_at_exit(ref: weakref.ref) -> None:
    monitor = ref()
    if monitor is not None:
        monitor.close()


class HookTimer:
    """Step timing from a framework's batch-begin and batch-end hooks.

    The framework fetches the next batch between one batch's end hook and the next one's begin
    hook, so that gap is the data wait; a step runs from one batch end to the next.
    """

    def __init__(self, monitor: TrainingMonitor) -> None:
        self.monitor = monitor
        self._last_end: float | None = None
        self._wait = 0.0

    def batch_start(self) -> None:
        now = _now()
        if self._last_end is None:
            self._last_end = now
            self.monitor._detect_gpus()
        self._wait = now - self._last_end

    def batch_end(self, samples: float) -> None:
        m = self.monitor
        now = _now()
        if self._last_end is None:
            return
        m._record(now - self._last_end, self._wait, samples, now)
        self._last_end = now

    def pause(self) -> None:
        """Between epochs or around validation: the gap is not a step."""
        self._last_end = None
