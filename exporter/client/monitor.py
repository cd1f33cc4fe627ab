"""TrainingMonitor: step time, data-wait time and samples, measured on the training thread.

The hot path only reads ``time.perf_counter`` and updates a few numbers: no I/O, no lock, no
CUDA synchronisation, no allocation that grows. A background daemon thread (see
:mod:`exporter.client.pusher`) sends the cumulative totals to the daemon every few seconds.
The two threads need no lock: every total only grows, each is read in one step, and the step
count is the sum of the one copy of the histogram's buckets (``list()`` of a list runs without
a thread switch), so a push's histogram is always consistent. A push may see a step's
seconds before its data wait (never the reverse) and carry the rest one push later. The step
in progress is read the same way: its start and the outside-step phase open in it, the phase
first (a read torn by the phase's end says too little for one push, never a negative time or
the phase's seconds as the step's).

The end of the process is said with the final push (``exit_reason``, see
:data:`exporter.protocol.EXIT_REASONS`): :meth:`TrainingMonitor.close` and the ``with`` block
say ``closed`` (``exception`` where the block is left by one); at the interpreter's exit
(atexit) an exception nobody caught says ``exception``, and so does a ``sys.exit()`` with a
status other than 0 (:class:`_ExitRequest`), else a :meth:`TrainingMonitor.wrap` loop that ran
to its end ``completed``, else ``exited``. SIGTERM and SIGHUP say ``signal``
where the monitor may catch them (see :class:`_SignalGoodbye`).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import hashlib
import logging
import math
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import weakref
from _sitebuiltins import Quitter
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from time import perf_counter as _now
from typing import Any, NoReturn, TypeVar

# imported with the module, never first by the pusher thread: a fork (a multiprocessing rank,
# a DataLoader worker) while that thread held psutil's import lock left the child's first
# push, and its goodbye, waiting for ever on a lock no thread of the child would release
try:
    import psutil
except ImportError:  # the monitor's birth then stands for the process's start
    psutil = None

from exporter.client.comm import DDPComm, find_ddp
from exporter.client.profiling import RankProfiler
from exporter.client.pusher import Pusher
from exporter.client.stacks import StackSampler
from exporter.protocol import (
    CLEAN_EXITS,
    DEFAULT_INGEST_URL,
    DEFAULT_PRECISION,
    DEFAULT_PUSH_INTERVAL_SECONDS,
    EVALUATION_PHASE,
    LOADER_START_PHASE,
    MAX_BUCKETS,
    MAX_LOADER_WORKERS,
    MAX_PHASE_NAME_LENGTH,
    MAX_PHASES,
    MAX_SECONDS,
    MAX_WORLD_SIZE,
    OTHER_PHASE,
    OUTSIDE_STEP_PHASES,
    PRECISIONS,
    sanitize,
)
from exporter.terminal import ingest_address

log = logging.getLogger("exporter.client")

T = TypeVar("T")
_END = object()  # wrap()'s marker for the next() that raised StopIteration

# Step-duration histogram bounds, in seconds: 1 ms to 60 s.
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
DEFAULT_ENDPOINT = DEFAULT_INGEST_URL
_AUTOCAST_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}
# The signals whose default action ends the process, said with a goodbye where nobody else
# handles them; and the seconds the goodbye may take at most, so that a daemon that is down or
# slow never holds up the death the signal asked for by more
GOODBYE_SIGNALS = ("SIGTERM", "SIGHUP")
SIGNAL_GOODBYE_SECONDS = 0.8


def _autocast_precision() -> str | None:
    """bf16 or fp16 when this thread is inside ``torch.autocast`` (torch already imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        for device in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device):
                return _AUTOCAST_PRECISION.get(str(torch.get_autocast_dtype(device))
                                               .removeprefix("torch."))
    except (AttributeError, TypeError, RuntimeError):  # an older torch: no device argument
        return None
    return None


def default_run() -> str:
    """GPUTRAIN_RUN, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, else the script's name; a job that
    torch.distributed launches without a run id (torchrun's is "none" unless --rdzv-id is
    given) adds what its ranks share and another job does not: a short digest of its
    rendezvous (MASTER_ADDR:MASTER_PORT), so two jobs of one script are two runs."""
    for var in ("GPUTRAIN_RUN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(var) and os.environ[var] != "none":
            return os.environ[var]
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    name = os.path.splitext(script)[0]
    name = name if name and name not in ("-c", "-m") else "python"
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        digest = hashlib.sha256(f"{addr}:{port}".encode()).hexdigest()[:6]
        return f"{name}-{digest}"
    return name


def default_rank() -> str:
    """RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK, else 0."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var):
            return os.environ[var]
    return "0"


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


def world_size() -> int | None:
    """The ranks of the run: torch.distributed's world size once its process group is up,
    else WORLD_SIZE (torchrun, Slurm's launchers set it); None where neither says."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # a process group torn down between the two calls
        pass
    env = os.environ.get("WORLD_SIZE", "")
    return int(env) if env.isdigit() and 0 < int(env) <= MAX_WORLD_SIZE else None


def collective_timeout() -> float | None:
    """The shortest collective timeout of this process's groups, in seconds: what
    ``init_process_group(timeout=...)`` (or a framework's own call of it, or
    ``_set_pg_timeout``) set, NCCL's watchdog and gloo's waits end the job at. None where
    torch.distributed is not up or this torch keeps it elsewhere (its private attributes,
    read with care: a group torn down between two reads is skipped)."""
    dist = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    try:
        if dist is None or torch is None or not dist.is_available() or \
                not dist.is_initialized():
            return None
        groups = list(dist.distributed_c10d._world.pg_map)
    except Exception:
        return None
    seconds: list[float] = []
    for group in groups:
        try:
            for device in list(group._device_types):
                timeout = group._get_backend(device).options._timeout
                seconds.append(float(timeout.total_seconds()))
        except Exception:  # a backend without options (a wrapper), or torn down meanwhile
            continue
    found = [s for s in seconds if 0 < s <= MAX_SECONDS]
    return min(found) if found else None


def cuda_gpu_refs() -> list[str]:
    """The GPUs this process uses: torch's current CUDA device UUID when torch has initialised
    CUDA, else the entries of GPUTRAIN_GPUS (indices or UUIDs, comma-separated: a CPU-only
    tour against the demo backend), else those of CUDA_VISIBLE_DEVICES. Call it from the
    training thread: CUDA's current device is per thread."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
                return [uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid]
        except Exception as exc:  # an old torch without .uuid, a broken driver
            log.debug("cannot read the CUDA device UUID: %s", exc)
    visible = os.environ.get("GPUTRAIN_GPUS") or os.environ.get("CUDA_VISIBLE_DEVICES", "")
    refs = [v.strip() for v in visible.split(",") if v.strip()]
    return [r for r in refs if r.isdigit() or r.startswith(("GPU-", "MIG-"))]


class _DataWait:
    __slots__ = ("_m", "_t0")

    def __init__(self, monitor: TrainingMonitor) -> None:
        self._m = monitor
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = _now()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        m = self._m
        t0 = self._t0
        m._pending_wait += _now() - t0
        if m._boundary is None:
            m._boundary = t0
        if exc_type is not None:  # StopIteration, say: no step will claim this fetch
            m._flush_wait()


class _Step:
    __slots__ = ("_m", "samples")

    def __init__(self, monitor: TrainingMonitor) -> None:
        self._m = monitor
        self.samples: float = 0

    def __enter__(self) -> None:
        if self._m._boundary is None:
            self._m._boundary = _now()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        m = self._m
        now = _now()
        # TrainingMonitor._step_done, inlined: this runs once per step of a hand-written loop
        step_s = now - m._boundary  # type: ignore[operator]  # set by __enter__
        m._step_seconds += step_s
        m._wait_seconds += m._pending_wait
        m._samples += self.samples
        m._flops += self.samples * m._flops_per_sample
        m._counts[bisect_left(m._bounds, step_s)] += 1
        m._last_step = now
        if m._attention:  # GPUs to look for, or a profile asked for
            m._attend(step_s)
        m._pending_wait = 0.0
        m._boundary = now


class _Phase:
    __slots__ = ("_m", "_name", "_outside", "_t0")

    def __init__(self, monitor: TrainingMonitor, name: str, outside: bool) -> None:
        self._m = monitor
        self._name = name
        self._outside = outside
        self._t0 = 0.0

    def __enter__(self) -> None:
        m = self._m
        if m._held is not None:
            m._settle(True)
        self._t0 = t0 = _now()
        if self._outside:
            m._outside_depth += 1
            if m._outside_depth == 1:  # pushed while it lasts: a long evaluation is no stall
                m._open_phase = (self._name, t0)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        elapsed = _now() - self._t0
        m = self._m
        if self._outside:
            m._outside_depth -= 1
            if m._outside_depth == 0:
                m._open_phase = None  # before the total grows: a push never counts it twice
        m._add_phase(self._name, elapsed, self._outside)


def exit_name(exc_type: type) -> str:
    """How a goodbye names an exception's type: its qualified name, after its module unless
    that is ``builtins`` (``RuntimeError``, ``torch.distributed.DistBackendError``)."""
    module = getattr(exc_type, "__module__", None)
    name = str(getattr(exc_type, "__qualname__", None) or getattr(exc_type, "__name__", "?"))
    return sanitize(name if module in (None, "builtins") else f"{module}.{name}")


def _uncaught() -> BaseException | None:
    """The exception that ended the main module, once the interpreter has printed it: it sets
    ``sys.last_exc`` (3.12) and ``sys.last_value`` before running the atexit handlers (a
    ``sys.exit()`` sets neither)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) else None


def _process_age() -> float | None:
    """Seconds since this process started (psutil), so that start-up counts as time outside
    steps; None where it cannot be read."""
    if psutil is None:
        return None
    try:
        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # the process table unreadable
        return None


def daemon_address(endpoint: str | None = None, url: str | None = None) -> str:
    """The ingest address a monitor pushes to: ``endpoint=`` (or its alias ``url=``), else
    ``GPUTRAIN_URL``, else the node's own daemon; checked once, here, so a mistake is a
    ValueError naming where the address came from and what is wrong, never a push retried for
    ever."""
    if endpoint and url and endpoint != url:
        raise ValueError(f"TrainingMonitor: endpoint={endpoint!r} and url={url!r} differ; give "
                         "one (url= is another name for endpoint=)")
    given = endpoint or url
    if given:
        return ingest_address(given, "endpoint=" if endpoint else "url=")
    env = os.environ.get("GPUTRAIN_URL")
    return ingest_address(env, "GPUTRAIN_URL") if env else DEFAULT_ENDPOINT


class TrainingMonitor:
    """Measures a training loop and pushes its totals to the gputrain-exporter daemon.

    ``run`` and ``rank`` label the series (see :func:`default_run`, :func:`default_rank`);
    ``endpoint`` (or ``url``) defaults to ``GPUTRAIN_URL``, then ``http://127.0.0.1:19401``, and
    is checked at once (:func:`daemon_address`: a ValueError says what is wrong); ``token`` to
    ``GPUTRAIN_TOKEN`` (or the file named by ``GPUTRAIN_TOKEN_FILE``). ``push_interval`` is in
    seconds. If the daemon is down, training goes on unslowed and the totals arrive later.
    For an ``https://`` endpoint, ``ca_file`` (``GPUTRAIN_CA_FILE``) is the CA bundle that
    signed the daemon's certificate, and ``tls_server_name`` (``GPUTRAIN_TLS_SERVER_NAME``)
    the name to verify it against when the endpoint is a node IP (a DaemonSet).

    What is measured: a step runs from the end of the previous step (or its first fetch after
    a new epoch) to its own end, less the time spent in :data:`OUTSIDE_STEP_PHASES`
    (evaluation, checkpoint saves, DataLoader start-up); its data wait is the time blocked
    fetching its batch. A fetch that no step follows (the ``next()`` that ends an epoch) is
    added to the data-wait and step-second totals at once, so no fetch is ever lost.

    The final push says how the process ended (see the module). Made on the main thread (and
    started), the monitor catches SIGTERM and SIGHUP where their disposition is the default
    (never where a launcher, a framework or the script set a handler first; never in a
    forked child, a DataLoader worker, which gets the default back at the fork): the
    signal sends the goodbye (``signal``, with its name) within
    :data:`SIGNAL_GOODBYE_SECONDS`, then ends the process by the same signal, exit status
    unchanged, even while the training thread waits inside a C++ collective.
    """

    def __init__(self, run: str | None = None, rank: str | int | None = None,
                 endpoint: str | None = None, push_interval: float = DEFAULT_PUSH_INTERVAL_SECONDS,
                 token: str | None = None, buckets: Iterable[float] = DEFAULT_BUCKETS,
                 start: bool = True, ca_file: str | None = None,
                 tls_server_name: str | None = None, flops_per_sample: float | None = None,
                 precision: str | None = None, url: str | None = None) -> None:
        self.run = sanitize(run or default_run())
        self.rank = sanitize(str(rank if rank is not None else default_rank()))
        self.endpoint = daemon_address(endpoint, url)
        self.push_interval = float(push_interval)
        self.token = token or _env_token()
        self.run_id = os.urandom(8).hex()
        self._wall_offset = time.time() - time.perf_counter()
        self._created = _now()
        # when the process started, on the perf_counter clock: looked up by the first push
        # (psutil's /proc read stays off the training thread), else the monitor's birth
        self._process_start: float | None = None
        self._bounds = tuple(float(b) for b in buckets)
        if len(self._bounds) > MAX_BUCKETS or any(
                b <= a for a, b in zip((0.0, *self._bounds), self._bounds, strict=False)):
            raise ValueError(f"buckets must be at most {MAX_BUCKETS} positive, increasing "
                             f"bounds in seconds, got {self._bounds}")
        self._counts = [0] * (len(self._bounds) + 1)  # per bucket, not cumulative; +Inf last
        self._step_seconds = 0.0
        self._wait_seconds = 0.0
        self._samples = 0.0
        self._flops = 0.0
        self._flops_per_sample = 0.0
        self._flops_known = False
        self._loader_workers: int | None = None  # of the DataLoader wrap() iterates
        self.precision = DEFAULT_PRECISION
        self.set_flops_per_sample(flops_per_sample, precision)
        self._last_step = 0.0  # perf_counter of the last step's end; 0 = none yet
        self._phases: dict[str, float] = {}
        self._phase_timers: dict[tuple[str, bool | None], _Phase] = {}
        # The open step interval: where it began (None: no step open, e.g. after new_epoch();
        # moved later by the time of outside-step phases within it), and the fetch time in it.
        self._boundary: float | None = None
        self._pending_wait = 0.0
        self._outside_depth = 0
        self._open_phase: tuple[str, float] | None = None  # the outermost outside phase: start
        # an integration's epoch start (_epoch_started): its first fetch began here
        self._starting: float | None = None
        self._reported_phases: dict[str, float] = {}  # the pusher thread's, to stay monotonic
        self._wrap_samples: float | None = None  # samples of the wrap() step in progress
        # a wrap() step ended by the loop's closing (a break, or an exception out of its body):
        # (samples, seconds, data wait, end); see wrap()
        self._held: tuple[float, float, float, float] | None = None
        self._completed = False  # the last wrap() ran its iterable to its end
        # the models watch_communication() was given, whose mode (model.eval()) tells an
        # evaluation nobody declared; the pusher thread's: the mode the steps advance in, the
        # step count it was seen at, and when the model was first seen out of it
        self._models: list[weakref.ref] = []
        self._mode_trains: bool | None = None
        self._mode_steps = -1
        self._eval_advances = 0  # pushes in a row that saw steps advance with it in eval()
        self._eval_since: float | None = None
        # an uncaught exception from before the monitor (an interactive session's) is not its,
        # nor one being handled around it (a fork child started inside an except block
        # inherits its parent's stack)
        self._earlier_exc = _uncaught()
        self._handled_exc = sys.exc_info()[1]
        self._data_wait = _DataWait(self)
        self._step = _Step(self)
        self._gpus: list[str] = []
        self._redetect = True  # look for the GPUs again after the first step (CUDA is up then)
        # the step's end calls _attend while this is set: one test on the hot path for both
        self._attention = True
        self._comm: list[DDPComm] = []
        self._pid = os.getpid()
        self._closed = False
        self._profiler = RankProfiler(self.run, self.rank, lambda: self._pusher.wake(),
                                      self._want_attention)
        self._stacks = StackSampler(self.run, self.rank, lambda: self._pusher.wake())
        self._pusher = Pusher(self.totals, self.run, self.rank, self.run_id, self.endpoint,
                              self.push_interval, self.token,
                              ca_file or os.environ.get("GPUTRAIN_CA_FILE") or None,
                              tls_server_name or os.environ.get("GPUTRAIN_TLS_SERVER_NAME")
                              or None, profiler=self._profiler, stacks=self._stacks)
        if start:
            self._pusher.start()
            _SIGNALS.watch(self)
        _EXIT.install()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _disable_in_child(ref))
        atexit.register(_close_at_exit, ref)
        # a multiprocessing child started by fork ends by os._exit() once its target returns:
        # no atexit handler runs there, its finalizers do (the first goodbye wins)
        multiprocessing.util.Finalize(None, _close_at_exit, args=(ref,), exitpriority=0)

    def set_flops_per_sample(self, flops: float | None, precision: str | None = None) -> None:
        """The model FLOPs of one training sample (forward and backward; see
        :mod:`exporter.client.flops`), from here on; ``None`` stops counting. ``precision``
        (fp8, bf16, fp16, tf32, fp32) is the arithmetic the GPUs run it in: by default the
        dtype of an active ``torch.autocast``, else bf16. MFU is the FLOPs' rate over the
        GPUs' peak at that precision."""
        if flops is not None and not (isinstance(flops, (int, float)) and flops >= 0
                                      and math.isfinite(flops)):
            raise ValueError(f"flops_per_sample must be a finite number >= 0, got {flops!r}")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{precision!r}")
        self.precision = precision or _autocast_precision() or self.precision
        self._flops_known = self._flops_known or flops is not None
        self._flops_per_sample = float(flops or 0.0)

    def watch_communication(self, model: Any) -> bool:
        """Measure the gradient communication of ``model`` (a DistributedDataParallel
        module, or a framework's wrapper of one) from DDP's own timers (see
        :mod:`exporter.client.comm`): seconds in collectives, the part the step waited for,
        bytes all-reduced. True where it is measured; False where ``model`` is no DDP model.
        Call it once per model, on the training thread, before training."""
        self._watch_mode(model)
        ddp = find_ddp(model)
        if ddp is None:
            return False
        if any(c._ddp is ddp for c in self._comm):
            return True
        meter = DDPComm(ddp)
        if meter.working:
            self._comm.append(meter)
        return meter.working

    def _watch_mode(self, model: Any) -> None:
        """Read ``model``'s mode from the pusher thread: switched to ``eval()`` while no step
        ends, after steps that ran in ``train()``, the rank is in an evaluation nobody declared
        (see :meth:`_undeclared_evaluation`). A DDP wrapper's own flag is read through its
        module, which ``eval()`` on either reaches."""
        inner = getattr(model, "module", model)
        if not isinstance(getattr(inner, "training", None), bool):
            return
        if not any(ref() is inner for ref in self._models):
            self._models.append(weakref.ref(inner))

    def _undeclared_evaluation(self, steps: int, now: float) -> float | None:
        """Since when the rank evaluates without saying so (the pusher thread's, at each
        push): a watched model out of the mode its steps run in (``eval()`` after steps in
        ``train()``) while no step ends, until a step ends; None otherwise. A model trained
        in ``eval()`` (frozen batch norm) has no such evaluation: its steps advance in that
        mode."""
        models = [m for m in (ref() for ref in self._models) if m is not None]
        if not models:
            return None
        trains = all(bool(m.training) for m in models)
        if steps != self._mode_steps:  # steps advanced: the mode they run in
            self._mode_steps, self._eval_since = steps, None
            if steps == 0:
                return None  # none yet: a sanity validation before training is no baseline
            # a push just after the last step may find eval() already called: steps run in
            # eval() only when two pushes in a row see them advance so
            self._eval_advances = 0 if trains else self._eval_advances + 1
            if trains or self._eval_advances >= 2:
                self._mode_trains = trains
            return None
        if self._mode_trains and not trains and self._eval_since is None:
            self._eval_since = now
        # once seen, until the step ends: back in train() the step holds the evaluation's
        # time, which must not read as a step far past its pace before it ends
        return self._eval_since

    # -- measuring ---------------------------------------------------------------------------

    def wrap(self, iterable: Iterable[T], batch_size: int | None = None) -> Iterator[T]:
        """Iterate ``iterable``: time blocked in ``next()`` is data wait (the last ``next()``,
        which ends the epoch, too); a step ends when the loop body asks for the next batch.
        ``iter(iterable)`` and the first ``next()`` after it (DataLoader workers starting and
        warming up: without ``persistent_workers=True`` each epoch pays it again) are the
        phase ``dataloader_start``, outside any step. A DataLoader's ``num_workers`` is pushed
        (its batches come in groups of that many). Samples are ``batch_size`` or
        ``batch_len(batch)``. :meth:`new_epoch` applies inside.

        A loop left early (``break``, or an exception out of its body) closes the generator
        at once, in the same way: its last step is held, then counted as training goes on
        (the next step, phase, wrap or epoch) or ends cleanly (closed, completed), and
        dropped where the process ends any other way: an exception (a collective that timed
        out after a long hang is no step), or an exit that says neither (a launcher such as
        ``torch.multiprocessing.spawn`` may have caught one)."""
        if self._held is not None:
            self._settle(True)
        self._completed = False
        self.note_loader(iterable)
        start = self.phase(LOADER_START_PHASE)
        with start:
            it = iter(iterable)
        self._detect_gpus()
        clock = _now
        done = self._step_done
        first = True
        batch: Any
        while True:
            t0 = clock()
            try:
                if first:
                    with start:
                        batch = next(it)
                else:
                    batch = next(it)
            except StopIteration:
                batch = _END
            if first:  # the workers' start-up: no step's data wait, and no step's time
                first = False
                if self._boundary is None:
                    self._boundary = clock()
            else:
                self._pending_wait += clock() - t0
                if self._boundary is None:
                    self._boundary = t0
            if batch is _END:  # the fetch that ends the epoch: no step will claim it
                self._flush_wait()
                self._completed = True
                return
            n = batch_size if batch_size is not None else batch_len(batch)
            self._wrap_samples = n  # this step is open until the body asks for the next batch
            try:
                yield batch
            except GeneratorExit:
                if self._wrap_samples is not None:
                    self._wrap_samples = None
                    self._hold(n, clock())
                raise
            now = clock()
            if self._wrap_samples is not None:  # else new_epoch() in the body ended it
                self._wrap_samples = None
                done(n, now)

    def note_loader(self, loader: object) -> None:
        """Push ``loader``'s ``num_workers`` (a torch DataLoader's; a framework's combined
        loader: its first DataLoader's); anything else is left unstated. :meth:`wrap` does it
        for the loader it wraps."""
        for candidate in (loader, *(getattr(loader, "flattened", None) or ())):
            workers = getattr(candidate, "num_workers", None)
            if isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0:
                self._loader_workers = workers
                return

    def data_wait(self) -> _DataWait:
        """``with monitor.data_wait(): batch = next(it)`` for hand-written loops. A fetch that
        raises (StopIteration at the end of an epoch) still counts as data wait."""
        return self._data_wait

    def step(self, samples: float = 0) -> _Step:
        """``with monitor.step(samples=32): ...``: a step ends when the block ends; its time
        runs from the previous step's end (so it includes the data wait before it)."""
        self._step.samples = samples
        return self._step

    def phase(self, name: str, outside_step: bool | None = None) -> _Phase:
        """``with monitor.phase("checkpoint"): ...``: seconds spent in a named phase.

        A phase named in :data:`OUTSIDE_STEP_PHASES` (``evaluation``, ``checkpoint``,
        ``dataloader_start``), or any phase with ``outside_step=True``, is not part of the step
        it interrupts; any other phase (``callbacks``, ``logging``) is part of its step."""
        key = (name, outside_step)
        timer = self._phase_timers.get(key)
        if timer is None:
            clean = sanitize(name, MAX_PHASE_NAME_LENGTH)
            outside = clean in OUTSIDE_STEP_PHASES if outside_step is None else outside_step
            timer = self._phase_timers[key] = _Phase(self, clean, outside)
        return timer

    def new_epoch(self) -> None:
        """Time from here to the next fetch is not part of any step: call it before work
        between epochs that is not a phase. Inside a :meth:`wrap` loop body it ends the step
        in progress here (call it before that work, not after)."""
        if self._held is not None:
            self._settle(True)
        if self._wrap_samples is not None:
            self._step_done(self._wrap_samples, _now())
            self._wrap_samples = None
        self._flush_wait()
        self._starting = None  # before the step closes: a push never reads an old start
        self._boundary = None

    # -- primitives for the framework integrations (training thread only) ------------------

    def _epoch_started(self) -> None:
        """A framework's epoch begins: :meth:`new_epoch`, and until the epoch's first fetch
        ends, pushes say the rank is in its DataLoader's start (``open_phase``
        ``dataloader_start``), as :meth:`wrap` declares it: hooks cannot tell the workers'
        start from that fetch, and a start that hangs while the peers wait is a hang the
        daemon names (a rank with no step open and no phase would be judged never). The
        time stays the first step's fetch, as before: it is not added to the phase."""
        self.new_epoch()
        self._starting = _now()

    # -- the seam for framework integrations (docs/client.md, "Writing an integration") -----

    def fetched(self, seconds: float, at: float | None = None) -> None:
        """A batch fetch took ``seconds`` and ended at ``at`` (``time.perf_counter()``
        seconds; now by default): data wait of the step in progress. Training thread."""
        self._fetched(seconds, _now() if at is None else at)

    def step_done(self, samples: float, at: float | None = None) -> None:
        """The step in progress ended at ``at`` (``time.perf_counter()`` seconds; now by
        default), with ``samples`` samples. Training thread."""
        self._step_done(samples, _now() if at is None else at)

    def detect_gpus(self) -> None:
        """Look up the GPUs this process uses: once training has started (the framework has
        moved the model by then). Training thread."""
        self._detect_gpus()

    def _fetched(self, seconds: float, now: float) -> None:
        """A fetch of ``seconds`` that ended at ``now`` belongs to the open step."""
        self._pending_wait += seconds
        if self._boundary is None:
            self._boundary = now - seconds

    def _step_done(self, samples: float, now: float) -> None:
        """End the open step at ``now``."""
        if self._boundary is None:  # a step with no fetch seen: it began at the last mark
            self._boundary = now
        step_s = now - self._boundary
        self._step_seconds += step_s
        self._wait_seconds += self._pending_wait
        self._samples += samples
        self._flops += samples * self._flops_per_sample
        self._counts[bisect_left(self._bounds, step_s)] += 1
        self._last_step = now
        if self._attention:
            self._attend(step_s)
        self._pending_wait = 0.0
        self._boundary = now

    def _add_phase(self, name: str, seconds: float, outside: bool) -> None:
        """Count ``seconds`` of phase ``name`` that just ended."""
        phases = self._phases
        if name in phases:
            phases[name] += seconds
        elif len(phases) < MAX_PHASES - 1 or name == OTHER_PHASE:
            phases[name] = seconds
        else:  # the daemon takes MAX_PHASES names per rank; the rest are counted together
            if OTHER_PHASE not in phases:
                log.warning("gputrain: more than %d phase names; %r and any later ones are "
                            "counted as phase %r", MAX_PHASES - 1, name, OTHER_PHASE)
                phases[OTHER_PHASE] = 0.0
            phases[OTHER_PHASE] += seconds
        # only the outermost outside phase is taken out, and only of a step that is open
        if outside and self._outside_depth == 0 and self._boundary is not None:
            self._boundary += seconds

    def _flush_wait(self) -> None:
        """Fetch time that no step will claim goes into the totals now (step seconds too, so
        data wait never exceeds step time); it is taken out of the open step."""
        wait = self._pending_wait
        if not wait:
            return
        self._step_seconds += wait  # before the wait: a push never sees more wait than steps
        self._wait_seconds += wait
        self._pending_wait = 0.0
        if self._boundary is not None:
            self._boundary += wait

    def _hold(self, samples: float, now: float) -> None:
        """The wrap() step in progress ended at ``now`` by the loop's closing: hold it (see
        :meth:`wrap`); the next step is timed from ``now`` as after any other."""
        if self._held is not None:
            self._settle(True)
        if self._boundary is None:
            self._boundary = now
        self._held = (samples, now - self._boundary, self._pending_wait, now)
        self._pending_wait = 0.0
        self._boundary = now
        self._attention = True  # the next step's end settles it

    def _settle(self, count: bool) -> None:
        """Count the held step (``count``: training went on, or ended cleanly), or drop it
        (the process ends otherwise: see :meth:`wrap`); a dropped one's fetch stays data
        wait, as a fetch no step claimed."""
        held = self._held
        if held is None:
            return
        self._held = None
        samples, step_s, wait, end = held
        if not count:
            self._step_seconds += wait  # before the wait: see _flush_wait
            self._wait_seconds += wait
            return
        self._step_seconds += step_s
        self._wait_seconds += wait
        self._samples += samples
        self._flops += samples * self._flops_per_sample
        self._counts[bisect_left(self._bounds, step_s)] += 1
        self._last_step = max(self._last_step, end)

    def _detect_gpus(self) -> None:
        """Called on the training thread at the start of a wrap and after the first step."""
        self._gpus = cuda_gpu_refs()
        self._redetect = self._redetect and not any(self._counts)
        self._attention = self._redetect or self._profiler.wanted or self._held is not None

    def _attend(self, step_s: float) -> None:
        """At a step's end, while :attr:`_attention` is set (training thread): look for the
        GPUs again, and drive a profile the daemon asked for (this step's fetch is still in
        ``_pending_wait``); count a held step."""
        if self._held is not None:
            self._settle(True)
        if self._redetect:
            self._detect_gpus()
        profiler = self._profiler
        if profiler.wanted:
            profiler.at_boundary(step_s, self._pending_wait)
        self._attention = self._redetect or profiler.wanted

    def _want_attention(self) -> None:
        """The pusher thread has a profile for the training thread to start."""
        self._attention = True

    # -- reading (pusher thread) -------------------------------------------------------------

    def totals(self) -> dict[str, Any]:
        """A copy of the cumulative totals (safe from any thread, no lock: see the module). An
        outside-step phase in progress (an evaluation) counts its seconds so far."""
        wait = self._wait_seconds  # before the step seconds, which grow first
        counts = list(self._counts)
        cumulative, running = [], 0
        for c in counts[:-1]:
            running += c
            cumulative.append(running)
        last = self._last_step
        phases = dict(self._phases)
        open_phase = self._open_phase  # read after the totals (see _Phase.__exit__)
        boundary = self._boundary  # after the phase: see the module
        starting = self._starting  # after the step's start: see new_epoch
        now = _now()
        in_progress: dict[str, Any] = {}
        if open_phase is not None:
            name, t0 = open_phase
            key = name if name in phases or len(phases) < MAX_PHASES - 1 else OTHER_PHASE
            phases[key] = phases.get(key, 0.0) + max(0.0, now - t0)
            in_progress["open_phase"] = name
            in_progress["open_phase_seconds"] = min(MAX_SECONDS, max(0.0, now - t0))
        elif boundary is None and starting is not None:  # a framework's epoch start
            in_progress["open_phase"] = LOADER_START_PHASE
            in_progress["open_phase_seconds"] = min(MAX_SECONDS, max(0.0, now - starting))
        evaluating = None
        if self._models and open_phase is None and boundary is not None:
            evaluating = self._undeclared_evaluation(running + counts[-1], now)
        if evaluating is not None:  # pushed as an evaluation in progress, counted as the step
            in_progress["open_phase"] = EVALUATION_PHASE
            in_progress["open_phase_seconds"] = min(MAX_SECONDS, max(0.0, now - evaluating))
        if boundary is not None:  # a phase holds the step: its time up to the phase's start
            upto = now if open_phase is None else open_phase[1]
            if evaluating is not None:
                upto = max(boundary, evaluating)
            in_progress["step_open_seconds"] = min(MAX_SECONDS, max(0.0, upto - boundary))
        # between a phase's end and its total a read may see neither: report no less than before
        reported = self._reported_phases
        for name, seconds in list(reported.items()):
            if phases.get(name, 0.0) < seconds:
                phases[name] = seconds
        reported.update(phases)
        return {
            "steps": running + counts[-1],
            "step_seconds": self._step_seconds,
            "data_wait_seconds": wait,
            "samples": self._samples,
            "phases": phases,
            "last_step_timestamp": last + self._wall_offset if last else None,
            "step_buckets": list(self._bounds),
            "step_counts": cumulative,
            "gpus": list(self._gpus),
            "precision": self.precision,
            "elapsed_seconds": max(0.0, now - self._started()),
            **({"flops": self._flops} if self._flops_known else {}),
            **({"loader_workers": min(self._loader_workers, MAX_LOADER_WORKERS)}
               if self._loader_workers is not None else {}),
            **self._comm_totals(),
            **({"world_size": world} if (world := world_size()) else {}),
            **({"collective_timeout_seconds": limit}
               if (limit := collective_timeout()) is not None else {}),
            **in_progress,
        }

    def _comm_totals(self) -> dict[str, float]:
        """The communication totals of the watched DDP models; none where none is watched."""
        out: dict[str, float] = {}
        for meter in list(self._comm):
            for key, value in meter.totals().items():
                out[key] = out.get(key, 0.0) + value
        return out

    def _started(self) -> float:
        if self._process_start is None:  # two threads may both look: the same answer
            age = _process_age()
            self._process_start = self._created if age is None else _now() - age
        return self._process_start

    # -- lifecycle ---------------------------------------------------------------------------

    def flush(self, timeout: float = 2.0) -> bool:
        """Push now and wait up to ``timeout`` seconds; True when the daemon took it."""
        return self._pusher.push_now(timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Send the final totals with the goodbye (``closed``) and stop the pusher, waiting
        ``timeout`` seconds at most for the daemon. Safe to call twice."""
        self._end("closed", None, timeout)

    def _end(self, reason: str, detail: str | None = None, timeout: float = 1.0,
             quick: bool = False) -> None:
        """The goodbye, saying how the process ended (``reason``, ``detail``: see
        protocol.EXIT_REASONS); a held step counts where the end is clean (CLEAN_EXITS,
        which ``exited`` is not). ``quick`` (a signal, maybe off the training thread): the
        totals as they are, no capture awaited."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        if not quick:
            self._settle(reason in CLEAN_EXITS)
            self._flush_wait()
            self._profiler.close()
            self._stacks.close()
        self._pusher.stop(goodbye=True, timeout=timeout, reason=reason, detail=detail)
        if not quick:
            _SIGNALS.forget(self)

    def __enter__(self) -> TrainingMonitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        # sys.exit(0) (or sys.exit()) inside the block ends the process with status 0: the
        # program's own clean end, as leaving the block is; any other status is a failure,
        # named by the exception its caller was handling where there was one (as at exit)
        if exc_type is None or (isinstance(exc, SystemExit) and clean_status(exc.code)):
            self._end("closed")
        elif isinstance(exc, SystemExit):
            self._end("exception", exit_name(type(self._exited_by(exc))))
        else:
            self._end("exception", exit_name(exc_type))

    def _exited_by(self, exc: SystemExit) -> BaseException:
        """What a failing SystemExit stands for: the exception its caller was handling (an
        ``except`` that logs and calls ``sys.exit(1)``), else itself; never one this monitor
        was created inside (a fork child's inherited stack)."""
        context = exc.__context__
        return context if context is not None and context is not self._handled_exc else exc


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
    """In a forked child (a DataLoader worker) the monitor must never push or profile."""
    _EXIT.forget()  # the parent's sys.exit() is not the child's
    monitor = ref()
    if monitor is not None:
        monitor._closed = True
        monitor._pusher.disable()
        monitor._attention = False
        monitor._profiler.in_child()
        monitor._stacks.in_child()


def _close_at_exit(ref: weakref.ref) -> None:
    """The interpreter exits, or a multiprocessing child's target ended: say why (see the
    module)."""
    monitor = ref()
    if monitor is None:
        return
    exc = _uncaught()
    if exc is None:
        # a multiprocessing child runs its finalizers in the finally its target's exception
        # passes through, before the traceback is printed: that exception ends the process
        # (sys.exit(0) there ends it cleanly, as in the main module)
        passing = sys.exc_info()[1]
        if isinstance(passing, SystemExit) and not clean_status(passing.code) and \
                passing.__context__ is not None:
            # a launcher's wrapper that caught the target's exception and exits 1 with it
            # (torch.multiprocessing.spawn's): the exception it caught is the end
            passing = passing.__context__
        if passing is not None and passing is not monitor._handled_exc and not (
                isinstance(passing, SystemExit) and clean_status(passing.code)):
            exc = passing
    if exc is None and (requested := _EXIT.failure(monitor)) is not None:
        # sys.exit(1) in the main module, where the interpreter keeps no record of it
        exc = monitor._exited_by(requested)
    if exc is not None and exc is not monitor._earlier_exc:
        monitor._end("exception", exit_name(type(exc)))
    else:
        monitor._end("completed" if monitor._completed else "exited")


class _SignalGoodbye:
    """SIGTERM and SIGHUP, caught where their disposition was the default, for the monitors
    of this process: the goodbye (``signal``), then the default again and the signal raised
    anew, so that the process dies by it with the exit status it would have had.

    Python runs a signal's handler on the main thread only, between two bytecodes: never
    while the training thread waits inside a C++ call (a hung collective), so such a kill
    would wait for the call's timeout. The handler also writes the signal's number to a pipe
    (``signal.set_wakeup_fd``, where nobody else uses it) that a thread of the monitor
    reads: that thread says the goodbye and ends the process where the main thread cannot.
    Whichever comes first does it. Either acts only while the monitor's handler is the
    signal's own (a framework that installs its own after it, and calls it, keeps the
    signal), and never in a forked child."""

    def __init__(self) -> None:
        self._forks = False  # the fork hooks are registered
        self._mask: set[int] | None = None  # the forking thread's, while it forks
        self._reset()

    def _reset(self) -> None:
        self._monitors: weakref.WeakSet[TrainingMonitor] = weakref.WeakSet()
        self._signums: set[int] = set()  # the signals caught
        self._pid = os.getpid()
        self._claim = threading.Lock()
        self._claimer: int | None = None
        self._done = threading.Event()
        self._pipe: tuple[int, int] | None = None  # (read, write): the wakeup fd's
        self._libc_signal: Any = None

    def _ours(self, signum: int) -> bool:
        """Whether the monitor's handler is ``signum``'s (a bound method is made anew at
        each access: compared by ==)."""
        return signal.getsignal(signum) == self._handle

    def watch(self, monitor: TrainingMonitor) -> None:
        """Catch the signals for ``monitor`` where they may be caught (where it is made)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if os.getpid() != self._pid:  # forked before any monitor watched (else see _in_child)
            self._reset()
        for name in GOODBYE_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:  # Windows
                continue
            try:
                if signal.getsignal(signum) is signal.SIG_DFL:
                    signal.signal(signum, self._handle)
                    self._signums.add(signum)
            except (ValueError, OSError):  # a subinterpreter
                continue
        if not any(self._ours(n) for n in self._signums):
            return
        self._monitors.add(monitor)
        if not self._forks:
            self._forks = True
            os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork,
                                after_in_child=self._in_child)
        if self._pipe is None:
            self._start_watcher()

    def forget(self, monitor: TrainingMonitor) -> None:
        """``monitor`` has said goodbye: with none left, the signals are the default's again
        (on the main thread; elsewhere the handler, finding none, acts as the default)."""
        self._monitors.discard(monitor)
        if any(not m._closed for m in self._monitors) or os.getpid() != self._pid or \
                threading.current_thread() is not threading.main_thread():
            return
        for signum in list(self._signums):
            if self._ours(signum):
                signal.signal(signum, signal.SIG_DFL)
            self._signums.discard(signum)
        self._stop_watcher()

    def _start_watcher(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        earlier: int | None = None
        with contextlib.suppress(ValueError):  # not the main interpreter's main thread
            earlier = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if earlier != -1:  # someone else's (an asyncio loop): theirs it stays
            if earlier is not None:
                signal.set_wakeup_fd(earlier)
            os.close(read)
            os.close(write)
            return
        try:
            import ctypes

            libc_signal = ctypes.CDLL(None).signal
            libc_signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            libc_signal.restype = ctypes.c_void_p
            self._libc_signal = libc_signal
        except (OSError, AttributeError):  # no libc to restore the default from a thread
            pass
        self._pipe = (read, write)
        threading.Thread(target=self._watch, args=(read,), name="gputrain-signals",
                         daemon=True).start()

    def _stop_watcher(self) -> None:
        if self._pipe is None:
            return
        write = self._pipe[1]
        self._pipe = None
        current = signal.set_wakeup_fd(-1)
        if current != write:
            signal.set_wakeup_fd(current)
        os.close(write)  # the watcher reads the end of the pipe and returns; it closes read

    def _watch(self, read: int) -> None:
        try:
            while True:
                data = os.read(read, 64)
                if not data:
                    return
                for signum in data:
                    if signum in self._signums and self._ours(signum):
                        self._end(signum)
        except OSError:
            return
        finally:
            os.close(read)

    def _handle(self, signum: int, frame: object) -> None:
        if self._ours(signum):  # else a later handler called it: theirs
            self._end(signum)

    def _end(self, signum: int) -> None:
        """Say goodbye once (whoever comes second waits for the first), then die by
        ``signum``."""
        if os.getpid() == self._pid:
            if not self._claim.acquire(blocking=False):
                if self._claimer != threading.get_ident():  # the same signal twice: die now
                    self._done.wait(SIGNAL_GOODBYE_SECONDS + 1.0)
                self._die(signum)
                return
            self._claimer = threading.get_ident()
            try:
                deadline = time.monotonic() + SIGNAL_GOODBYE_SECONDS
                name = signal.Signals(signum).name
                for monitor in list(self._monitors):
                    left = deadline - time.monotonic()
                    if left > 0.05:
                        monitor._end("signal", name, left, quick=True)
            except Exception as exc:  # the goodbye is a courtesy; the death is owed
                log.debug("gputrain: no goodbye at %s: %s", signum, exc)
            finally:
                self._done.set()
        self._die(signum)

    def _die(self, signum: int) -> None:
        """The default action of ``signum``, as if never caught."""
        try:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, signal.SIG_DFL)
            elif self._libc_signal is not None:  # Python allows signal.signal on the main
                self._libc_signal(signum, None)  # thread only
            else:
                os._exit(128 + signum)
        except Exception:
            os._exit(128 + signum)
        os.kill(os.getpid(), signum)

    def _before_fork(self) -> None:
        # the child has the parent's handler and pipe until its fork hook runs: a signal sent
        # to it before then waits for the default (else it would wake the parent's watcher)
        if self._signums and os.getpid() == self._pid:
            self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, self._signums)

    def _after_fork(self) -> None:
        mask, self._mask = self._mask, None
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _in_child(self) -> None:
        """After a fork (a DataLoader worker): the default again, nothing of the parent's."""
        with contextlib.suppress(ValueError):  # forked from a thread Python cannot call main
            for signum in self._signums:
                if self._ours(signum):
                    signal.signal(signum, signal.SIG_DFL)
            if self._pipe is not None:
                current = signal.set_wakeup_fd(-1)
                if current != self._pipe[1]:
                    signal.set_wakeup_fd(current)
        for fd in self._pipe or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reset()
        self._after_fork()  # a signal that came meanwhile now ends the child, as the default


_SIGNALS = _SignalGoodbye()


def clean_status(code: object) -> bool:
    """Whether ``SystemExit(code)`` ends the process with status 0, as CPython exits: None,
    or an integer whose low byte is 0 (``sys.exit(256)`` is status 0); any other object is
    printed and is status 1 (``sys.exit(0.0)``, ``sys.exit("no data")``)."""
    return code is None or (isinstance(code, int) and code & 0xFF == 0)


class _ExitRequest:
    """The last ``sys.exit()`` the main thread called: its status, the exception being handled
    then, and when. A process that ends by ``sys.exit(1)`` (a script's ``except: log;
    sys.exit(1)``, Hydra's error handler, ``sys.exit(main())``) failed, as its launcher sees it,
    but the interpreter keeps no record of the status that an atexit handler could read: so the
    first monitor wraps ``sys.exit`` and the ``exit()``/``quit()`` builtins (once; the wrapper
    records and calls the one it found). A SystemExit caught and survived leaves its record
    behind: a monitor that made a step since reads past it. A ``raise SystemExit(1)`` of the
    script's own is not seen (it reads ``exited``: nothing but a trace function would see it),
    nor is a status another thread's ``sys.exit`` asks for (it ends that thread only), nor, in a
    forked child, its parent's."""

    def __init__(self) -> None:
        self.installed = False
        self.forget()

    def forget(self) -> None:
        self.requested = False
        self.status: object = None
        self.context: BaseException | None = None
        self.at = 0.0  # perf_counter, as a monitor's steps are timed

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        original = sys.exit

        @functools.wraps(original)  # sys.exit by name: it pickles as the original does
        def exit(status: str | int | None = None) -> NoReturn:
            self.record(status)
            original(status)

        sys.exit = exit
        # the builtins exit() and quit() (site's, absent under python -S) raise SystemExit
        # themselves: a script's exit(1) is as common as sys.exit(1)
        for name in ("exit", "quit"):
            found = getattr(builtins, name, None)
            if type(found) is Quitter:
                setattr(builtins, name, _RecordedQuitter(found, self))

    def record(self, status: object) -> None:
        """Note a status the main thread asks to exit with (another thread's ends it only)."""
        if threading.current_thread() is threading.main_thread():
            self.requested, self.status, self.context = True, status, sys.exc_info()[1]
            self.at = _now()

    def failure(self, monitor: TrainingMonitor) -> SystemExit | None:
        """The SystemExit of the main thread's last ``sys.exit()`` where its status says a
        failure, its context the exception handled then; None where there was none, its
        status is 0, or ``monitor`` made a step after it (it was caught: the program went
        on)."""
        if not self.requested or clean_status(self.status) or \
                (monitor._last_step or 0.0) > self.at:
            return None
        exc = SystemExit(self.status)
        exc.__context__ = self.context
        return exc


class _RecordedQuitter(Quitter):
    """site's ``exit``/``quit`` builtin, its status recorded first (:class:`_ExitRequest`):
    a Quitter still (its name, its text in an interactive session, ``isinstance``)."""

    def __init__(self, original: Quitter, request: _ExitRequest) -> None:
        super().__init__(original.name, original.eof)
        self.request = request

    def __call__(self, code: sys._ExitCode | None = None) -> NoReturn:
        self.request.record(code)
        super().__call__(code)


_EXIT = _ExitRequest()


class HookTimer:
    """Step timing for frameworks that announce batches through hooks but do not expose the
    fetch itself: the fetch is the time from the last *mark* (the end of the previous step,
    or of whatever ran after it: logging, an evaluation, a checkpoint save) to the start of
    the next batch. Each integration calls :meth:`mark` after work that is not a fetch."""

    def __init__(self, monitor: TrainingMonitor) -> None:
        self.monitor = monitor
        self._mark = _now()
        self._detected = False

    @property
    def last_mark(self) -> float:
        """``time.perf_counter()`` seconds of the last mark."""
        return self._mark

    def mark(self) -> float:
        """Whatever ran until now was not a fetch."""
        self._mark = now = _now()
        return now

    def epoch_start(self) -> None:
        """A new epoch: the time since the last step is no step; until its first batch the
        rank is in its DataLoader's start (:meth:`TrainingMonitor._epoch_started`)."""
        self.monitor._epoch_started()
        self.mark()

    def batch_start(self) -> None:
        """The framework has its batch: the time since the last mark was the fetch."""
        now = _now()
        if not self._detected:
            self._detected = True
            self.monitor.detect_gpus()
        self.monitor.fetched(now - self._mark, now)

    def batch_end(self, samples: float) -> None:
        """The step is done."""
        self.monitor.step_done(samples, self.mark())

    def phase_begun(self, name: str, since: float | None = None) -> None:
        """The phase ``name`` began at the last mark (or ``since``) and is running: pushes
        count it while it lasts, where it is outside steps (:meth:`phase_since_mark` ends it)."""
        m = self.monitor
        timer = m.phase(name)
        if timer._outside and m._outside_depth == 0:
            m._open_phase = (timer._name, self._mark if since is None else since)

    def phase_since_mark(self, name: str, since: float | None = None) -> None:
        """The time from the last mark (or ``since``) to now was the phase ``name``."""
        start = self._mark if since is None else since
        now = self.mark()
        m = self.monitor
        if m._outside_depth == 0:
            m._open_phase = None  # before the total grows: a push never counts it twice
        m._add_phase(name, now - start, m.phase(name)._outside)


class Integration:
    """What every framework callback holds, mixed in before the framework's own base class:
    the monitor (given, or made from the callback's keyword arguments when training begins)
    and, for a framework that announces batches through hooks, its :class:`HookTimer`."""

    # the hook that makes the monitor, named in the error of a hook that runs before it
    _begins = "on_train_begin"

    def __init__(self, monitor: TrainingMonitor | None = None, **monitor_kwargs: Any) -> None:
        super().__init__()
        self.monitor = monitor
        self._kwargs = monitor_kwargs
        self._hooks: HookTimer | None = None

    def _start_monitor(self, **defaults: Any) -> TrainingMonitor:
        """The monitor, made now unless one was given; ``defaults`` fill in keyword arguments
        the user left out (the framework's rank)."""
        if self.monitor is None:
            self.monitor = TrainingMonitor(**{**defaults, **self._kwargs})
        return self.monitor

    def _start_timer(self) -> HookTimer:
        """A step timer from now on (training begins)."""
        self._hooks = HookTimer(self._monitor())
        return self._hooks

    def _monitor(self) -> TrainingMonitor:
        if self.monitor is None:
            raise RuntimeError(f"gputrain: a training hook ran before {self._begins}")
        return self.monitor

    def _timer(self) -> HookTimer:
        """The step timer: from the start of training on."""
        if self._hooks is None:
            raise RuntimeError(f"gputrain: a training hook ran before {self._begins}")
        return self._hooks

    def _close(self, exc: BaseException | None = None) -> None:
        """Training has ended (``closed``), or ``exc`` ended it (``exception``): the final
        push."""
        if self.monitor is not None:
            if exc is None:
                self.monitor.close()
            else:
                self.monitor._end("exception", exit_name(type(exc)))
