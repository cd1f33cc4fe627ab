"""The framework callbacks, each in a real (tiny, CPU) training run of its framework."""

from __future__ import annotations

import os

from conftest import require_module, sample_value

os.environ.setdefault("KERAS_BACKEND", "torch")


def _check(d, run: str, steps: int, samples: int) -> str:
    text = d.metrics()
    labels = {"run": run, "rank": "0"}
    assert sample_value(text, "gputrain_training_steps_total", labels) == steps
    assert sample_value(text, "gputrain_training_samples_total", labels) == samples
    assert sample_value(text, "gputrain_training_data_wait_seconds_total", labels) >= 0
    assert sample_value(text, "gputrain_training_step_duration_seconds_sum", labels) > 0
    return text


def test_lightning_callback(daemon_factory, tmp_path):
    torch = require_module("torch")
    pl = require_module("lightning.pytorch")
    from exporter.client.lightning import GpuTrainCallback

    d = daemon_factory()

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[GpuTrainCallback(run="lightning", endpoint=d.ingest_url)])
    trainer.fit(Tiny(), loader, loader)
    text = _check(d, "lightning", steps=10, samples=80)
    assert sample_value(text, "gputrain_training_phase_seconds_total",
                        {"run": "lightning", "phase": "evaluation"}) > 0


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
              callbacks=[GpuTrainCallback(batch_size=8, run="keras", endpoint=d.ingest_url)])
    text = _check(d, "keras", steps=10, samples=80)
    assert sample_value(text, "gputrain_training_phase_seconds_total",
                        {"run": "keras", "phase": "evaluation"}) > 0


def test_transformers_callback(daemon_factory, tmp_path):
    torch = require_module("torch")
    transformers = require_module("transformers")
    from exporter.client.transformers import GpuTrainCallback

    d = daemon_factory()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.layer(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return {"x": torch.randn(4), "labels": torch.randn(1)}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                          num_train_epochs=1, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=Data(),
                                   callbacks=[GpuTrainCallback(run="hf", endpoint=d.ingest_url)])
    trainer.train()
    _check(d, "hf", steps=8, samples=32)
