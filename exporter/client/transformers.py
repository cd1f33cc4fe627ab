"""Hugging Face transformers integration: ``Trainer(..., callbacks=[GpuTrainCallback()])``."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from exporter.client.monitor import Integration, TrainingMonitor


class GpuTrainCallback(Integration, TrainerCallback):
    """Measures optimizer steps of ``Trainer.train``.

    - Data wait is the fetch: the Trainer takes all of a step's micro-batches from its
      iterator before ``on_step_begin``, so with gradient accumulation every micro-batch fetch
      counts. It is timed from the last hook before the fetch (the previous step's end, or the
      log, evaluation or save after it) to ``on_step_begin``; the first step of an epoch also
      includes ``iter()`` of the DataLoader (worker start-up), which has no hook.
    - A step runs from the previous step's end to ``on_step_end``; logging after a step is
      part of the next step.
    - Evaluation (up to ``on_evaluate``) is the phase ``evaluation`` and a checkpoint save (up
      to ``on_save``) the phase ``checkpoint``: neither is in step time or data wait.
    - Samples are ``per_device_train_batch_size x gradient_accumulation_steps`` per step.

    Keyword arguments go to :class:`TrainingMonitor` (the rank defaults to
    ``args.process_index``).
    """

    def __init__(self, monitor: TrainingMonitor | None = None, **monitor_kwargs: Any) -> None:
        super().__init__(monitor, **monitor_kwargs)
        self._samples = 0
        self._eval_since: float | None = None  # the mark before the evaluation now running

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor = self._start_monitor(rank=args.process_index)
        self._start_timer()
        self._samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        # accelerate has wrapped the model in DDP by now (in a process group): its gradient sync
        monitor.watch_communication(kwargs.get("model"))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timer().epoch_start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timer().batch_start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timer().batch_end(self._samples)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timer().mark()

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hooks is not None and self._eval_since is None:
            self._hooks.mark()

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hooks is not None and self._eval_since is None:
            self._eval_since = self._hooks.last_mark  # the evaluation began after the last mark
            self._hooks.phase_begun("evaluation", self._eval_since)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hooks is not None:
            self._hooks.phase_since_mark("evaluation", self._eval_since)
            self._eval_since = None

    def on_predict(self, args: Any, state: Any, control: Any,
                   **kwargs: Any) -> None:
        # Trainer.predict() also calls on_prediction_step, and ends here, not in on_evaluate
        self.on_evaluate(args, state, control, **kwargs)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hooks is not None:
            self._hooks.phase_since_mark("checkpoint")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()
