"""Keras integration: ``model.fit(..., callbacks=[GpuTrainCallback(batch_size=32)])``."""

from __future__ import annotations

from typing import Any

import keras

from exporter.client.monitor import HookTimer, TrainingMonitor


class GpuTrainCallback(keras.callbacks.Callback):
    """Measures step time, data wait (the gap between Keras' batch hooks, where it fetches the
    next batch) and samples (``batch_size`` per step); evaluation time is the phase
    ``evaluation``. Other keyword arguments go to :class:`TrainingMonitor`."""

    def __init__(self, batch_size: int, monitor: TrainingMonitor | None = None,
                 **monitor_kwargs: Any) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.monitor = monitor
        self._kwargs = monitor_kwargs
        self._hooks: HookTimer | None = None
        self._training = False

    def on_train_begin(self, logs: Any = None) -> None:
        if self.monitor is None:
            self.monitor = TrainingMonitor(**self._kwargs)
        self._hooks = HookTimer(self.monitor)
        self._training = True

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._hooks.pause()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._hooks.batch_start()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._hooks.batch_end(self.batch_size)

    def on_test_begin(self, logs: Any = None) -> None:
        if self._training:
            self._hooks.pause()
            self.monitor.phase("evaluation").__enter__()

    def on_test_end(self, logs: Any = None) -> None:
        if self._training:
            self.monitor.phase("evaluation").__exit__(None, None, None)

    def on_train_end(self, logs: Any = None) -> None:
        self._training = False
        if self.monitor is not None:
            self.monitor.close()
