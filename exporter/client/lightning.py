"""PyTorch Lightning integration: ``Trainer(callbacks=[GpuTrainCallback(run="resnet")])``."""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from exporter.client.monitor import HookTimer, TrainingMonitor, batch_len


class GpuTrainCallback(Callback):
    """Measures step time, data wait (the gap Lightning spends fetching the next batch) and
    samples from Lightning's hooks; validation time is the phase ``evaluation``.

    ``batch_size`` (samples per step) defaults to ``len()`` of the batch; other keyword
    arguments go to :class:`TrainingMonitor` (the rank defaults to ``trainer.global_rank``).
    """

    def __init__(self, batch_size: int | None = None, monitor: TrainingMonitor | None = None,
                 **monitor_kwargs: Any) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.monitor = monitor
        self._kwargs = monitor_kwargs
        self._hooks: HookTimer | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is None:
            self._kwargs.setdefault("rank", trainer.global_rank)
            self.monitor = TrainingMonitor(**self._kwargs)
        self._hooks = HookTimer(self.monitor)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._hooks.pause()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._hooks.batch_start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._hooks.batch_end(self.batch_size or batch_len(batch))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        self._hooks.pause()
        self.monitor.phase("evaluation").__enter__()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.monitor.phase("evaluation").__exit__(None, None, None)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is not None and stage == "fit":
            self.monitor.close()
