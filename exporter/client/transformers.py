"""Hugging Face transformers integration: ``Trainer(..., callbacks=[GpuTrainCallback()])``."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from exporter.client.monitor import HookTimer, TrainingMonitor


class GpuTrainCallback(TrainerCallback):
    """Measures optimizer steps: step time, data wait (the gap between ``on_step_end`` and the
    next ``on_step_begin``, where the Trainer fetches the batch) and samples
    (``per_device_train_batch_size x gradient_accumulation_steps``). With gradient
    accumulation the fetches of the inner micro-batches fall inside the step and are not
    counted as data wait. Keyword arguments go to :class:`TrainingMonitor` (the rank defaults
    to ``args.process_index``)."""

    def __init__(self, monitor: TrainingMonitor | None = None, **monitor_kwargs: Any) -> None:
        self.monitor = monitor
        self._kwargs = monitor_kwargs
        self._hooks: HookTimer | None = None
        self._samples = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            self._kwargs.setdefault("rank", args.process_index)
            self.monitor = TrainingMonitor(**self._kwargs)
        self._hooks = HookTimer(self.monitor)
        self._samples = args.per_device_train_batch_size * args.gradient_accumulation_steps

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._hooks.pause()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._hooks.batch_start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._hooks.batch_end(self._samples)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._hooks.pause()  # evaluation ran after the last step: not data wait

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._hooks.pause()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
