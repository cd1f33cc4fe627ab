"""Keras integration: ``model.fit(..., callbacks=[GpuTrainCallback(batch_size=32)])``."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any

import keras

from exporter.client.monitor import Integration, TrainingMonitor

log = logging.getLogger("exporter.client")

# the ModelCheckpoint methods that may save (wrapped as the phase "checkpoint")
_CHECKPOINT_HOOKS = ("on_train_batch_end", "on_epoch_end")


class GpuTrainCallback(Integration, keras.callbacks.Callback):
    """Measures step time, data wait and samples of ``model.fit``.

    - Data wait is the fetch: the time from the end of one batch's callbacks (all of them) to
      the start of the next batch's, in which fit only takes the next batch from its iterator.
    - A step runs from the end of one batch's callbacks to the end of the next one's. With
      ``steps_per_execution=k`` a step is one execution of k batches (``batch_size * k``
      samples).
    - Validation is the phase ``evaluation``; the hooks of every ``ModelCheckpoint`` are the
      phase ``checkpoint``: neither is in step time or data wait.

    To see the ends of *all* callbacks, the callback wraps the methods of the ``CallbackList``
    that ``fit`` calls it from, for the duration of ``fit``. Where it cannot find that list it
    falls back to its own hooks (then other callbacks' batch-end work counts as data wait) and
    logs so at debug level. Other keyword arguments go to :class:`TrainingMonitor`.
    """

    def __init__(self, batch_size: int, monitor: TrainingMonitor | None = None,
                 **monitor_kwargs: Any) -> None:
        super().__init__(monitor, **monitor_kwargs)
        self.batch_size = batch_size
        self._training = False
        self._wrapped: list[tuple[Any, str]] = []  # (object, method name) to restore
        self._begin_step = 0

    # -- fit's CallbackList, wrapped -----------------------------------------------------------

    def _wrap_callback_list(self, callbacks: Any) -> None:
        hooks, monitor = self._timer(), self._monitor()

        def around(obj: Any, name: str, before: Any = None, after: Any = None) -> None:
            original = getattr(obj, name)

            @functools.wraps(original)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if before is not None:
                    before(*args)
                try:
                    return original(*args, **kwargs)
                finally:
                    if after is not None:
                        after(*args)

            setattr(obj, name, wrapper)
            self._wrapped.append((obj, name))

        def batch_begin(batch: int, *_: Any) -> None:
            self._begin_step = batch
            hooks.batch_start()

        def batch_end(batch: int, *_: Any) -> None:
            hooks.batch_end(self.batch_size * (batch - self._begin_step + 1))

        evaluation = monitor.phase("evaluation")
        around(callbacks, "on_epoch_begin", after=lambda *_: hooks.epoch_start())
        around(callbacks, "on_train_batch_begin", before=batch_begin)
        around(callbacks, "on_train_batch_end", after=batch_end)
        around(callbacks, "on_test_begin", before=lambda *_: evaluation.__enter__())
        around(callbacks, "on_test_end", after=lambda *_: evaluation.__exit__(None, None, None))
        checkpoint = monitor.phase("checkpoint")
        for cb in callbacks.callbacks:
            if isinstance(cb, keras.callbacks.ModelCheckpoint):
                for name in _CHECKPOINT_HOOKS:
                    around(cb, name, before=lambda *_: checkpoint.__enter__(),
                           after=lambda *_: checkpoint.__exit__(None, None, None))

    def _unwrap(self) -> None:
        for obj, name in reversed(self._wrapped):
            with contextlib.suppress(AttributeError):
                delattr(obj, name)  # the class's method shows through again
        self._wrapped.clear()

    # -- Keras hooks ---------------------------------------------------------------------------

    def on_train_begin(self, logs: Any = None) -> None:
        self._start_monitor()
        self._start_timer()
        self._training = True
        # fit calls this from CallbackList.on_train_begin: that list is the one to time
        caller = sys._getframe(1).f_locals.get("self")
        if isinstance(caller, keras.callbacks.CallbackList) and self in caller.callbacks:
            self._wrap_callback_list(caller)
        else:
            log.debug("gputrain: fit's CallbackList not found; timing from this callback's "
                      "own hooks")

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if not self._wrapped:
            self._timer().epoch_start()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self._wrapped:
            self._timer().batch_start()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # defined in any case: a callback with this hook keeps Keras' batch hooks synchronous
        if not self._wrapped:
            self._timer().batch_end(self.batch_size)

    def on_test_begin(self, logs: Any = None) -> None:
        if self._training and not self._wrapped:
            self._monitor().phase("evaluation").__enter__()

    def on_test_end(self, logs: Any = None) -> None:
        if self._training and not self._wrapped:
            self._monitor().phase("evaluation").__exit__(None, None, None)

    def on_train_end(self, logs: Any = None) -> None:
        self._training = False
        self._unwrap()
        self._close()
