"""PyTorch Lightning integration: ``Trainer(callbacks=[GpuTrainCallback(run="resnet")])``."""

from __future__ import annotations

from time import perf_counter as _now
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from exporter.client.monitor import Integration, TrainingMonitor, batch_len

# The profiler actions Lightning itself wraps around the training fetch and a checkpoint save
FETCH_ACTION = "[_TrainingEpochLoop].train_dataloader_next"
CHECKPOINT_ACTION = "save_checkpoint"


class _TimingProfiler:
    """A pass-through of Lightning's Profiler interface in front of the trainer's own profiler
    (``PassThroughProfiler`` unless the user set one): it times the actions the monitor needs
    and hands every call on, so ``SimpleProfiler`` or ``PyTorchProfiler`` report as before."""

    def __init__(self, inner: Any, monitor: TrainingMonitor) -> None:
        self.__dict__["_inner"] = inner
        self.__dict__["_monitor"] = monitor
        self.__dict__["_fetch_t0"] = None
        self.__dict__["_checkpoint"] = monitor.phase("checkpoint")

    def start(self, action_name: str) -> None:
        if action_name == FETCH_ACTION:
            self.__dict__["_fetch_t0"] = _now()
        elif action_name == CHECKPOINT_ACTION:
            self._checkpoint.__enter__()
        self._inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self._inner.stop(action_name)
        if action_name == FETCH_ACTION:
            t0 = self._fetch_t0
            if t0 is not None:
                now = _now()
                self._monitor.fetched(now - t0, now)
                self.__dict__["_fetch_t0"] = None
        elif action_name == CHECKPOINT_ACTION:
            self._checkpoint.__exit__(None, None, None)

    def profile(self, action_name: str) -> Any:
        return _Action(self, action_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


class _Action:
    """``with profiler.profile(name):`` without a generator per call."""

    __slots__ = ("_name", "_profiler")

    def __init__(self, profiler: _TimingProfiler, name: str) -> None:
        self._profiler = profiler
        self._name = name

    def __enter__(self) -> str:
        self._profiler.start(self._name)
        return self._name

    def __exit__(self, *exc: object) -> None:
        self._profiler.stop(self._name)


class GpuTrainCallback(Integration, Callback):
    """Measures step time, data wait and samples of ``Trainer.fit``.

    - Data wait is the fetch itself: the action ``train_dataloader_next`` that Lightning wraps
      around every training batch fetch, timed through a pass-through in front of the trainer's
      profiler (a profiler you set keeps working and reports as before). Lightning prefetches
      one batch, so a step's data wait is the fetch done during it.
    - A step runs from one ``on_train_batch_end`` to the next, less the phases below.
    - Validation is the phase ``evaluation``; ``Trainer.save_checkpoint`` (``ModelCheckpoint``
      and any other caller) is the phase ``checkpoint``: neither is in step time or data wait.
    - The end of ``fit`` is the goodbye: ``closed``, or ``exception`` with the type of the one
      that ended it (``on_exception``: a KeyboardInterrupt, Lightning's SIGTERMException).

    ``batch_size`` (samples per step) defaults to ``len()`` of the batch; other keyword
    arguments go to :class:`TrainingMonitor` (the rank defaults to ``trainer.global_rank``).
    """

    _begins = "setup"

    def __init__(self, batch_size: int | None = None, monitor: TrainingMonitor | None = None,
                 **monitor_kwargs: Any) -> None:
        super().__init__(monitor, **monitor_kwargs)
        self.batch_size = batch_size
        self._profiler: _TimingProfiler | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        monitor = self._start_monitor(rank=trainer.global_rank)
        if stage == "fit" and self._profiler is None:
            self._profiler = _TimingProfiler(trainer.profiler, monitor)
            trainer.profiler = self._profiler

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._monitor().detect_gpus()
        # the DDP strategy has wrapped the module by now: its gradient sync, from DDP's timers
        self._monitor().watch_communication(getattr(trainer.strategy, "model", None))

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._monitor()._epoch_started()
        self._monitor().note_loader(getattr(trainer, "train_dataloader", None))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._monitor().step_done(self.batch_size or batch_len(batch))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._monitor().phase("evaluation").__enter__()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._monitor().phase("evaluation").__exit__(None, None, None)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._restore_profiler(trainer)
        if stage == "fit":
            self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # fit ended by an exception (no teardown hook follows): the goodbye names its type
        self._restore_profiler(trainer)
        if getattr(trainer.state, "fn", None) == "fit":
            self._close(exception)

    def _restore_profiler(self, trainer: Any) -> None:
        if self._profiler is not None and trainer.profiler is self._profiler:
            trainer.profiler = self._profiler._inner  # the trainer's own, for its summary
        self._profiler = None
