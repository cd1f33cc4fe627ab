"""The client in a real PyTorch loop: DataLoader with and without worker processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import ROOT, require_module, sample_value

from exporter.client import TrainingMonitor

torch = require_module("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class SlowImages(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        time.sleep(0.002)
        return torch.zeros(3, 8, 8), i % 10


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_loop_with_workers(daemon_factory, workers):
    d = daemon_factory()
    m = TrainingMonitor(run=f"torch-w{workers}", endpoint=d.ingest_url, push_interval=0.2)
    model = torch.nn.Linear(192, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowImages(), batch_size=8, num_workers=workers)
    for _epoch in range(2):
        for x, y in m.wrap(loader):  # samples from len() of the first tensor
            loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    # the loader's workers were joined at each epoch's end: whatever they could have sent
    # was sent, and close() answers after the final push
    m.close()
    text = d.metrics()
    labels = {"run": f"torch-w{workers}", "rank": "0"}
    assert sample_value(text, "gputrain_training_steps_total", labels) == 16
    assert sample_value(text, "gputrain_training_samples_total", labels) == 128
    wait = sample_value(text, "gputrain_training_data_wait_seconds_total", labels)
    assert wait > 0.05  # 8 x 2 ms per batch, fetched by the main process or a worker
    assert sample_value(text, "gputrain_ingest_requests_total", {"code": "200"}) >= 1
    assert sample_value(text, "gputrain_ingest_requests_total", {"code": "409"}) is None
    assert sample_value(text, "gputrain_ingest_requests_total", {"code": "400"}) is None


def test_example_script_trains_on_cpu(daemon_factory):
    """The README's laptop tour: the example on the CPU, with no variable to set, is listed on
    demo GPU 0 (its rank) as NVML would list it."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=2")
    out = subprocess.run(
        [sys.executable, "examples/pytorch_train.py", "--steps", "6", "--batch-size", "16",
         "--workers", "2", "--pin-memory", "--uint8-transfer", "--amp", "--run", "example",
         "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"GPUTRAIN_URL": d.ingest_url, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "steps=6" in out.stdout
    text = d.metrics()
    assert sample_value(text, "gputrain_training_steps_total", {"run": "example"}) == 6
    assert sample_value(text, "gputrain_training_samples_total", {"run": "example"}) == 96
    # listed on demo GPU 0 from the sampler cycle after its first push
    assert d.wait_sample("gputrain_training_gpu_info", {"run": "example", "gpu": "0"}) == 1


class GroupedBatches(Dataset):
    """Items that take 60 ms each (a sleep: no CPU): a worker makes a batch of 4 in about
    0.24 s, so a loader of 4 workers delivers its batches four at a time, one every 60 ms on
    average; a loop slower than that would never wait (30 ms items were too little on a busy
    2-core CI machine: 2 slow steps of 316)."""

    def __len__(self) -> int:
        return 4 * 4 * 20

    def __getitem__(self, i: int):
        time.sleep(0.06)
        return torch.zeros(8), i % 10


def test_a_loaders_period_is_judged_input_bound_not_a_stall(daemon_factory, monkeypatch):
    """A real DataLoader with 4 workers whose batches arrive in groups of 4 (one step waits
    about 0.2 s, the three after it take 4 ms): the client pushes its 4 workers, and the
    daemon's verdict is input-bound, naming the loader's period, with no step-time stall
    (whose p99-over-median test the pattern passes many times over)."""
    import requests
    from conftest import wait_until

    monkeypatch.setenv("GPUTRAIN_GPUS", "0")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    m = TrainingMonitor(run="loader-period", endpoint=d.ingest_url, push_interval=0.2)
    loader = DataLoader(GroupedBatches(), batch_size=4, num_workers=4, persistent_workers=True)
    try:
        for _epoch in range(2):
            for _x, _y in m.wrap(loader):
                time.sleep(0.004)  # the step's own work
        text = d.metrics()
        labels = {"run": "loader-period", "rank": "0"}
        assert sample_value(text, "gputrain_training_loader_workers", labels) == 4
        slow = sample_value(text, "gputrain_training_slow_steps_total", labels)
        steps = sample_value(text, "gputrain_training_steps_total", labels)
        assert 0.15 < slow / steps < 0.35, (slow, steps)  # about one step in four

        def judged() -> dict | None:
            # input-bound, or its refinement where this busy machine's CPUs are saturated
            doc = requests.get(d.url + "/api/v1/status", timeout=10).json()
            ranks = [r for run in doc["runs"] for r in run["ranks"]]
            found = {r["verdict"]: r for r in ranks} | \
                {a["verdict"]: a for r in ranks for a in r["also"]}
            return found if "input-bound" in found else None

        found = wait_until(judged, timeout=30, what="the finding input-bound")
        assert "the loader's 4 workers deliver their batches together" in \
            found["input-bound"]["reason"]
        assert "prefetch_factor" in found["input-bound"]["advice"]
        assert "step-time-stalls" not in found, found
    finally:
        m.close()
