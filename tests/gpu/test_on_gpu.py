"""Proof on a real GPU (skipped without one): the exporter's GPU metrics against nvidia-smi
under load, GPM activity on Hopper and newer moving with AMP, PCIe bytes rising with a larger
transfer, and the recordings replaying to the alerts the seeds diagnose.

Run on a GPU machine: ``python3 -m pytest tests/gpu`` (or, without pytest,
``python3 tests/gpu/harness.py --out DIR``, which writes the same checks to summary.json)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gpu import harness
from gpu.checks import check


def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.returncode == 0 and "GPU 0" in out.stdout


pytestmark = pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and nvidia-smi")

QUICK = ["s003-5-uint8", "s003-6-amp", "s002-h2d-copy"]


def test_gpu_metrics_match_nvidia_smi_and_move_with_the_load(tmp_path):
    seconds = os.environ.get("GPUTRAIN_GPU_SECONDS", "45")
    code = harness.main(["--out", str(tmp_path), "--scenarios", ",".join(QUICK),
                         "--seconds", seconds, "--warmup", "15"])
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not check(summary["scenarios"]), "\n".join(check(summary["scenarios"]))
    assert code == 0
