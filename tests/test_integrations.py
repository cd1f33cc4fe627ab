"""The framework callbacks in real (tiny, CPU) training runs of their frameworks, beyond
tests/test_accuracy.py (which checks Lightning, Keras with a PyDataset, and transformers
against each framework's own timing): Keras fed NumPy arrays."""

from __future__ import annotations

import os

from conftest import require_module, sample_value

os.environ.setdefault("KERAS_BACKEND", "torch")


def _check(d, run: str, steps: int, samples: int) -> str:
    text = d.metrics()
    labels = {"run": run, "rank": "0"}
    assert sample_value(text, "gputrain_training_steps_total", labels) == steps
    assert sample_value(text, "gputrain_training_samples_total", labels) == samples
    # each batch's fetch is timed, however short: the total is exported and above zero
    wait = sample_value(text, "gputrain_training_data_wait_seconds_total", labels)
    assert wait is not None and wait > 0, wait
    assert sample_value(text, "gputrain_training_step_duration_seconds_sum", labels) > 0
    return text


def test_keras_callback(daemon_factory):
    require_module("torch")
    keras = require_module("keras")
    import numpy as np

    from exporter.client.keras import GpuTrainCallback

    d = daemon_factory()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(40, 4).astype("float32"), np.random.rand(40, 1).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
              callbacks=[GpuTrainCallback(batch_size=8, run="keras", endpoint=d.ingest_url,
                                          flops_per_sample=1e3)])
    text = _check(d, "keras", steps=10, samples=80)
    assert sample_value(text, "gputrain_training_flops_total", {"run": "keras"}) == 80e3
    assert sample_value(text, "gputrain_training_phase_seconds_total",
                        {"run": "keras", "phase": "evaluation"}) > 0
