"""scripts/gpu-proof.sh, the GPU proof sized to one loan of a GPU machine, run here with
--cpu-demo so it never rots; and the harness flaws it fixes (TF32, CPU preprocessing with uint8
transfers, bytes per sample, the summary window, a small /dev/shm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time

from conftest import ENV_BIN, ROOT
from gpu.checks import check
from gpu.harness import adapt_workers, first_push


def test_the_proof_script_writes_one_archive_with_the_preflight_and_the_scenarios(tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-proof.sh"), "--cpu-demo", "--out", str(out),
         "--seconds", "12", "--budget", "400"], cwd=ROOT, capture_output=True, text=True,
        env={"PATH": f"{ENV_BIN}:/usr/bin:/bin", "PYTHON": sys.executable,
             "TMPDIR": str(tmp_path)}, timeout=480)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert time.monotonic() - started < 400
    assert [p.name for p in out.iterdir()] == ["gpu-proof.tar.gz"]  # one file comes back
    with tarfile.open(out / "gpu-proof.tar.gz") as tar:
        # the data filter where this Python has it (3.11.4 and later; Debian 12's is 3.11.2)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "x", **safe)
    got = tmp_path / "x" / "gpu-proof"
    pre = json.loads((got / "preflight.json").read_text())
    assert pre["driver_version"] and pre["nvml_version"]
    assert pre["shm"]["total_bytes"] > 0
    # each NVML call the sampler makes, timed; the cycle's cost per GPU
    calls = pre["calls"]
    assert calls["nvmlDeviceGetPowerUsage"]["calls_per_cycle"] == 1
    assert calls["nvmlDeviceGetPowerUsage"]["mean_ms"] > 0
    assert "nvmlDeviceGetPowerUsage" in pre["answering"]
    assert pre["cycle_ms"]["0"]["mean"] > 0
    summary = json.loads((got / "summary.json").read_text())
    names = [r["scenario"] for r in summary["scenarios"]]
    assert names == ["cpu-slow-input", "cpu-healthy"]
    for r in summary["scenarios"]:
        assert r["returncode"] == 0, r
        assert r["first_push_seconds"] is not None and r["measured"]["window_seconds"] > 0
        assert (got / f"{r['scenario']}.prom.gz").stat().st_size > 0
    timing = json.loads((got / "timing.json").read_text())
    assert timing["harness_returncode"] == 0
    assert 0 <= timing["preflight"] <= timing["total"] <= 400
    # the checks run back on any machine from the archive
    replayed = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "checks.py"),
                               str(got / "summary.json")], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert replayed.returncode == 0, replayed.stdout


def test_a_small_dev_shm_gets_fewer_workers_and_says_so():
    flags = ("--model", "resnet18", "--image-size", "224", "--workers", "8",
             "--batch-size", "256", "--uint8-transfer")
    small, note = adapt_workers(flags, 64 * 2**20)  # a container's default /dev/shm
    assert small[small.index("--workers") + 1] == "0"
    assert "64 MiB" in note and "--workers 8 -> 0" in note
    roomy, note = adapt_workers(flags, 25 * 2**30)  # the near miss: it fits
    assert roomy == flags and note == ""


def test_the_summary_window_opens_at_the_first_push_not_at_the_start():
    scrapes = [(100.0, {}), (101.0, {}),
               (102.0, {("gputrain_training_steps_total", (("rank", "0"), ("run", "a"))): 1.0})]
    assert first_push(scrapes, "a") == 102.0
    assert first_push(scrapes, "b") is None


def result(name: str, bytes_per_sample: float, *flags: str) -> dict:
    return {"scenario": name, "returncode": 0, "nvidia_smi": {
        "power": {"exporter": 300.0, "nvidia_smi": 300.0, "samples": 5,
                  "relative_difference": 0.0},
        "memory": {"exporter": 1.0, "nvidia_smi": 1.0, "samples": 5,
                   "relative_difference": 0.0}},
        "args": ["--image-size", "224", "--uint8-transfer", *flags],
        "measured": {"pcie_rx_bytes_per_sample": bytes_per_sample,
                     "pcie_rx_bytes_per_second": 1e9, "tensor_active": 0.3}}


UINT8_224 = 3 * 224 * 224  # bytes of one uint8 image


def test_host_to_device_is_judged_by_bytes_per_sample_not_rates():
    """The inflated input crosses PCIe at a lower rate (the step rate drops) but 20 times the
    bytes a sample: that passes; the near miss, twice the bytes a sample, does not."""
    amp = result("s003-6-amp", 1.1 * UINT8_224, "--amp")
    h2d = result("s002-h2d-copy", 1.08 * 20 * UINT8_224, "--amp", "--h2d-inflate", "20")
    h2d["measured"]["pcie_rx_bytes_per_second"] = 0.5e9  # lower than amp's
    assert not [f for f in check([amp, h2d]) if "PCIe" in f]
    h2d["measured"]["pcie_rx_bytes_per_sample"] = 2 * UINT8_224
    assert [f for f in check([amp, h2d]) if "PCIe bytes per sample" in f]


def test_the_pcie_bytes_read_are_held_to_the_bytes_the_trainer_sent():
    """At least 0.9 and at most 1.5 times the input a sample (1.07-1.13 on an H200); true fp32
    read 12-16 times on the H200 and is held to the lower bound only."""
    def pcie(r: dict) -> list[str]:
        return [f for f in check([r]) if "PCIe received" in f]

    assert not pcie(result("s003-5-tf32", 1.08 * UINT8_224))
    assert pcie(result("s003-5-tf32", 0.8 * UINT8_224))  # a reading that lost bytes
    assert pcie(result("s003-5-tf32", 1.6 * UINT8_224))  # traffic that is not the input
    assert not pcie(result("s003-5-uint8", 16 * UINT8_224, "--no-tf32"))
    assert pcie(result("s003-5-uint8", 0.8 * UINT8_224, "--no-tf32"))


def test_no_tf32_makes_fp32_true_fp32():
    code = ("import sys, torch; sys.argv[1:] = []; sys.path.insert(0, 'examples');"
            "import pytorch_train as t;"
            "t.main(['--device', 'cpu', '--steps', '1', '--batch-size', '2', '--no-tf32']);"
            "print('TF32', torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT),
                                         "GPUTRAIN_URL": "http://127.0.0.1:9"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "TF32 False False" in run.stdout


def test_cpu_preprocessing_works_on_uint8_transfers_too():
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from pytorch_train import SyntheticImages

    plain = SyntheticImages(4, uint8=True, cpu_work=0, input_sleep_ms=0, inflate=1)[1][0]
    worked = SyntheticImages(4, uint8=True, cpu_work=20, input_sleep_ms=0, inflate=1)[1][0]
    assert worked.dtype == plain.dtype == torch.uint8
    assert not torch.equal(worked, plain)  # the augmentation ran before the uint8 copy
