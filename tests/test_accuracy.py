"""Data wait, step time, steps and samples against each framework's own timing.

Each test injects a known delay, measures it with the framework's own instrument (or, where
the framework has none, with the delayed code timing itself: a reference that a loaded
machine stretches exactly as much as the client's clock), and reads what a user reads: the
daemon's /metrics after ``flush()``. Data wait must be within 2 % where the reference times
the same call, 5 % elsewhere; steps and samples exact. The framework versions are pinned in
tests/frameworks.txt.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from conftest import require_module, sample_value

from exporter.client import TrainingMonitor

os.environ.setdefault("KERAS_BACKEND", "torch")


@pytest.fixture(autouse=True)
def no_collector_pause() -> Iterator[None]:
    """Each test compares two clocks around the same call. A garbage collection that lands
    between the reference's end stamp and the client's is counted by one and not the other;
    with torch, Lightning, Keras and transformers imported a full one takes 50-250 ms (CI saw
    +14 % on 26 fetches). What the clocks agree on is the subject here, not the collector."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass
class Measured:
    steps: float
    samples: float
    wait: float
    step_seconds: float
    phases: dict[str, float] = field(default_factory=dict)


def measured(d, run: str) -> Measured:
    """What the daemon exports for (run, rank 0)."""
    text = d.metrics()
    labels = {"run": run, "rank": "0"}
    phases = {}
    for phase in ("evaluation", "checkpoint", "dataloader_start", "callbacks"):
        value = sample_value(text, "gputrain_training_phase_seconds_total",
                             {**labels, "phase": phase})
        if value is not None:
            phases[phase] = value
    return Measured(
        steps=sample_value(text, "gputrain_training_steps_total", labels),
        samples=sample_value(text, "gputrain_training_samples_total", labels),
        wait=sample_value(text, "gputrain_training_data_wait_seconds_total", labels),
        step_seconds=sample_value(text, "gputrain_training_step_duration_seconds_sum", labels),
        phases=phases)


def report(case: str, got: float, reference: float) -> None:
    """Print the error, for the README's table (``pytest -s tests/test_accuracy.py``)."""
    print(f"\naccuracy {case}: {got:.4f} s against {reference:.4f} s "
          f"({(got / reference - 1) * 100:+.2f} %)")


class SelfTimed:
    """Durations of the calls made while ``active``: the reference for an injected delay."""

    def __init__(self) -> None:
        self.active = True
        self.durations: list[float] = []

    def sleep(self, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        if self.active:
            self.durations.append(time.perf_counter() - t0)

    @property
    def total(self) -> float:
        return sum(self.durations)


# -- plain PyTorch: wrap() against torch.profiler -------------------------------------------

@pytest.mark.parametrize("workers", [0, 4])
def test_wrap_matches_torch_profiler(daemon_factory, workers):
    """Data wait is every next() of the DataLoader, the one that ends the epoch (and shuts the
    workers down) included, but the first of each epoch: iter() and that first batch (the
    workers' start and warm-up) are the phase dataloader_start."""
    torch = require_module("torch")
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import DataLoader, Dataset

    # with workers, 20 ms a sample keeps a loaded scheduler's preemption (a fixed few ms over
    # the 26 fetches) well inside the 2 %
    per_sample = 0.002 if workers == 0 else 0.020

    class Slow(Dataset):
        def __len__(self) -> int:
            return 96

        def __getitem__(self, i: int):
            time.sleep(per_sample)
            return torch.zeros(16), i % 4

    d = daemon_factory()
    run = f"profiler-w{workers}"
    m = TrainingMonitor(run=run, endpoint=d.ingest_url, push_interval=60)
    model = torch.nn.Linear(16, 4)
    loader = DataLoader(Slow(), batch_size=8, num_workers=workers)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _epoch in range(2):
            for x, _y in m.wrap(loader):
                model(x).sum().backward()
    assert m.flush(10)
    fetches = sorted((e for e in prof.events() if e.name.startswith("enumerate(DataLoader)")),
                     key=lambda e: e.time_range.start)
    assert len(fetches) == 2 * 13  # 12 batches and the ending next() a epoch
    firsts = (0, 13)  # each epoch's first batch: the workers' start and warm-up
    reference = sum(e.cpu_time_total for i, e in enumerate(fetches) if i not in firsts) / 1e6
    warm_up = sum(fetches[i].cpu_time_total for i in firsts) / 1e6
    got = measured(d, run)
    report(f"wrap, {workers} workers, data wait vs torch.profiler", got.wait, reference)
    assert got.steps == 24 and got.samples == 192
    assert got.wait == pytest.approx(reference, rel=0.02)
    assert got.wait <= got.step_seconds
    # iter() (forking the workers) and the first batches are a phase, not data wait
    assert got.phases["dataloader_start"] >= 0.98 * warm_up
    if workers:  # a worker's first batch waits for its start: 8 samples of 20 ms at least
        assert warm_up >= 2 * 8 * per_sample
    m.close()


def test_new_epoch_and_phases_inside_wrap(daemon_factory):
    """new_epoch() in the loop body ends the step there; an evaluation phase in the body is
    taken out of its step; neither is data wait."""
    fetch, compute, evaluation, gap = SelfTimed(), SelfTimed(), SelfTimed(), SelfTimed()

    def loader():
        for i in range(30):
            fetch.sleep(0.010)
            yield i

    d = daemon_factory()
    m = TrainingMonitor(run="epochs", endpoint=d.ingest_url, push_interval=60)
    for i in m.wrap(loader(), batch_size=4):
        compute.sleep(0.010)
        if i % 10 == 4:
            with m.phase("evaluation"):
                evaluation.sleep(0.030)
        if i % 10 == 9:  # the end of an "epoch" of an endless loader
            m.new_epoch()
            gap.sleep(0.040)
    assert m.flush(10)
    got = measured(d, "epochs")
    # the first fetch after iter() is the loader's start (the phase dataloader_start), never
    # data wait; new_epoch() in the body starts no new iter(), so the later fetches are waits
    first, waits = fetch.durations[0], fetch.total - fetch.durations[0]
    report("wrap + new_epoch + phase, data wait", got.wait, waits)
    report("wrap + new_epoch + phase, step time", got.step_seconds, waits + compute.total)
    assert got.steps == 30 and got.samples == 120
    assert got.wait == pytest.approx(waits, rel=0.02)
    assert got.step_seconds == pytest.approx(waits + compute.total, rel=0.05)
    assert got.phases["dataloader_start"] >= 0.98 * first
    assert got.phases["evaluation"] == pytest.approx(evaluation.total, rel=0.02)
    m.close()


def test_hand_written_loop_counts_the_fetch_that_ends_the_epoch(daemon_factory):
    fetch, compute = SelfTimed(), SelfTimed()

    def loader():
        for i in range(5):
            fetch.sleep(0.010)
            yield i
        fetch.sleep(0.050)  # e.g. joining worker processes

    d = daemon_factory()
    m = TrainingMonitor(run="manual-epochs", endpoint=d.ingest_url, push_interval=60)
    for _epoch in range(2):
        it = loader()
        while True:
            try:
                with m.data_wait():
                    next(it)
            except StopIteration:
                break
            with m.step(samples=2):
                compute.sleep(0.005)
        m.new_epoch()
        time.sleep(0.050)  # between epochs: no step
    assert m.flush(10)
    got = measured(d, "manual-epochs")
    assert got.steps == 10 and got.samples == 20
    assert got.wait == pytest.approx(fetch.total, rel=0.02)
    assert got.step_seconds == pytest.approx(fetch.total + compute.total, rel=0.05)
    m.close()


# -- Lightning: against SimpleProfiler ---------------------------------------------------------

@pytest.mark.parametrize("delay", [0.0, 0.002])
def test_lightning_matches_simple_profiler(daemon_factory, tmp_path, delay):
    """With validation and a slow ModelCheckpoint save every 5 steps: data wait is Lightning's
    own train_dataloader_next, the saves are the phase checkpoint, validation the phase
    evaluation, and the user's SimpleProfiler still works."""
    torch = require_module("torch")
    pl = require_module("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.profilers import SimpleProfiler

    from exporter.client.lightning import FETCH_ACTION, GpuTrainCallback

    class Data(torch.utils.data.Dataset):
        def __init__(self, n: int, delay: float) -> None:
            self.n, self.delay = n, delay

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            if self.delay:
                time.sleep(self.delay)
            return torch.randn(4), torch.randn(1)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_save_checkpoint(self, checkpoint) -> None:
            time.sleep(0.05)  # a slow file system

    d = daemon_factory()
    run = f"lightning-{delay}"
    profiler = SimpleProfiler()
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, profiler=profiler,
        limit_val_batches=3,
        callbacks=[GpuTrainCallback(run=run, endpoint=d.ingest_url, push_interval=60,
                                    flops_per_sample=1e6),
                   ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(Data(160, delay), batch_size=8),
                torch.utils.data.DataLoader(Data(24, 0.01), batch_size=8))
    assert trainer.profiler is profiler  # handed back for its summary
    durations = profiler.recorded_durations
    got = measured(d, run)  # the callback closed the monitor: its final push is in
    report(f"Lightning, delay {delay}, data wait vs SimpleProfiler", got.wait,
           sum(durations[FETCH_ACTION]))
    report(f"Lightning, delay {delay}, checkpoint vs SimpleProfiler",
           got.phases["checkpoint"], sum(durations["save_checkpoint"]))
    assert got.steps == 40 and got.samples == 320
    assert sample_value(d.metrics(), "gputrain_training_flops_total", {"run": run}) == 320e6
    # the loader's workers (none here) are pushed, as wrap() pushes a DataLoader's
    assert sample_value(d.metrics(), "gputrain_training_loader_workers", {"run": run}) == 0
    # ours encloses Lightning's own timing of each fetch: never less, and more only by its
    # start()/stop() calls, which a loaded scheduler may preempt: 2 % or 0.25 ms a fetch,
    # plus 20 ms for a preemption or two between ours and Lightning's (a scheduler quantum is
    # milliseconds: two CPU burners beside a 4-worker suite once put 15 ms over 40 fetches).
    # A wait measured around anything more than the fetch (the step: 0.45 s here) is far out
    reference, fetches = sum(durations[FETCH_ACTION]), len(durations[FETCH_ACTION])
    assert reference - 1e-6 <= got.wait <= reference + max(0.02 * reference,
                                                           0.00025 * fetches) + 0.02
    assert got.phases["checkpoint"] == pytest.approx(sum(durations["save_checkpoint"]),
                                                     rel=0.02)
    assert got.phases["checkpoint"] > 8 * 0.05
    assert got.phases["evaluation"] > 2 * 3 * 0.01 * 8
    assert got.wait <= got.step_seconds


# -- Keras: against an injected PyDataset delay --------------------------------------------------

def test_keras_data_wait_is_the_pydataset_fetch(daemon_factory, tmp_path):
    """With validation, a ModelCheckpoint saving every 5 batches and the progress bar on."""
    require_module("torch")
    keras = require_module("keras")
    import numpy as np

    from exporter.client.keras import GpuTrainCallback

    fetch = SelfTimed()

    class Slow(keras.utils.PyDataset):
        def __init__(self, n: int, delay: float, timer: SelfTimed | None) -> None:
            super().__init__()
            self.n, self.delay, self.timer = n, delay, timer

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            if self.timer is not None:
                self.timer.sleep(self.delay)
            return (np.random.rand(8, 4).astype("float32"),
                    np.random.rand(8, 1).astype("float32"))

    class StartReference(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # fit peeks at a batch before training
            fetch.durations.clear()

    d = daemon_factory()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch}-{batch}.keras"),
                                                 save_freq=5)
    model.fit(Slow(15, 0.04, fetch), epochs=2, verbose=1, validation_data=Slow(4, 0, None),
              callbacks=[StartReference(),
                         GpuTrainCallback(batch_size=8, run="keras", endpoint=d.ingest_url,
                                          push_interval=60),
                         checkpoint])
    got = measured(d, "keras")
    report("Keras, data wait vs PyDataset delay", got.wait, fetch.total)
    assert got.steps == 30 and got.samples == 240
    assert got.wait == pytest.approx(fetch.total, rel=0.05)
    assert got.phases["checkpoint"] > 0 and got.phases["evaluation"] > 0
    assert got.wait <= got.step_seconds
    assert len(list(tmp_path.glob("*.keras"))) == 6  # the checkpoints were really written


# -- transformers: against the Trainer's own runtime and an injected collator delay ------------

def test_transformers_against_trainer_runtime_and_collator(daemon_factory, tmp_path):
    """Gradient accumulation 2 (every micro-batch fetch counts), evaluation every 4 steps, a
    save every 6: data wait is the collator's time, and step time plus the evaluation and
    checkpoint phases is the Trainer's own train_runtime."""
    torch = require_module("torch")
    transformers = require_module("transformers")
    from exporter.client.transformers import GpuTrainCallback

    collate = SelfTimed()

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.layer(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __init__(self, n: int, evaluation: bool) -> None:
            self.n, self.evaluation = n, evaluation

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            return {"x": torch.randn(4), "labels": torch.randn(1), "eval": self.evaluation}

    def collator(items):
        collate.active = not items[0]["eval"]  # only the training fetches are data wait
        collate.sleep(0.040)
        return {k: torch.stack([it[k] for it in items]) for k in ("x", "labels")}

    class Watch(transformers.TrainerCallback):
        """What a push sees of an evaluation while it runs."""

        seen: list[float] = []

        def on_prediction_step(self, args, state, control, **kwargs):
            self.seen.append(callback.monitor.totals()["phases"].get("evaluation", 0.0))

    d = daemon_factory()
    callback = GpuTrainCallback(run="hf", endpoint=d.ingest_url, push_interval=60,
                                flops_per_sample=2e6, precision="fp32")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, max_steps=12, report_to=[], use_cpu=True,
        save_strategy="steps", save_steps=6, eval_strategy="steps", eval_steps=4,
        logging_strategy="steps", logging_steps=2, disable_tqdm=True,
        remove_unused_columns=False)
    trainer = transformers.Trainer(
        model=Tiny(), args=args, train_dataset=Data(64, False), eval_dataset=Data(16, True),
        data_collator=collator, callbacks=[callback, Watch()])
    out = trainer.train()
    runtime = trainer.state.global_step / out.metrics["train_steps_per_second"]
    got = measured(d, "hf")
    report("transformers, data wait vs collator delay", got.wait, collate.total)
    report("transformers, step time + phases vs train_runtime", got.step_seconds
           + got.phases.get("evaluation", 0) + got.phases.get("checkpoint", 0), runtime)
    assert got.steps == trainer.state.global_step == 12
    assert got.samples == 12 * 4 * 2
    assert sample_value(d.metrics(), "gputrain_training_flops_total", {"run": "hf"}) == 96 * 2e6
    assert got.wait == pytest.approx(collate.total, rel=0.05)
    assert got.phases["evaluation"] > 0 and got.phases["checkpoint"] > 0
    # an evaluation in progress is pushed as it runs (each batch's collator sleeps 40 ms), and
    # what a push saw is never more than the total
    assert len(Watch.seen) >= 4 and Watch.seen[0] > 0.03
    assert Watch.seen == sorted(Watch.seen) and Watch.seen[-1] <= got.phases["evaluation"]
    accounted = got.step_seconds + got.phases["evaluation"] + got.phases["checkpoint"]
    assert accounted == pytest.approx(runtime, rel=0.05)
    # Trainer.predict() runs prediction steps too, and ends in on_predict: the evaluation it
    # counts ends there, rather than growing in every push for ever
    trainer.predict(Data(8, True))
    before = callback.monitor.totals()["phases"]["evaluation"]
    time.sleep(0.05)
    assert callback.monitor.totals()["phases"]["evaluation"] == before


# -- flush() is exact --------------------------------------------------------------------------

def test_flush_waits_for_the_totals_it_was_called_with():
    """With pushes constantly in flight, every flush() that returns True leaves the daemon
    holding at least the steps done before it was called (read from the daemon's store: its
    page is built a moment later, off the request path)."""
    from exporter.reading.sampler import Sampler
    from exporter.serving.ingest import IngestStore
    from exporter.serving.routes import IngestSite
    from exporter.serving.server import make_server, serve_in_thread

    store = IngestStore()
    server = make_server("127.0.0.1", 0, IngestSite, store, Sampler(None).healthy)
    serve_in_thread(server, "flush-test")
    m = TrainingMonitor(run="flushy", endpoint=f"http://127.0.0.1:{server.address[1]}",
                        push_interval=0.001)
    try:
        done = 0
        for _ in range(15):
            for _ in m.wrap(range(7), batch_size=1):
                pass
            done += 7
            assert m.flush(10)
            held = [st.steps for st in store.states() if st.run == "flushy"]
            assert held == [done]
    finally:
        m.close()
        server.shutdown()
