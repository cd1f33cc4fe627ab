"""The checks a GPU run must pass (tests/gpu/checks.py) catch what they are meant to."""

from __future__ import annotations

from gpu.checks import check


def result(name: str, power=(300.0, 305.0), memory=(10000.0, 10050.0), util=(90.0, 92.0),
           sm=0.7, tensor=0.0, rx=1e9, gpu_name="NVIDIA H100 80GB HBM3", mfu=0.1,
           rx_per_sample=150e3) -> dict:
    def cmp(pair):
        ours, theirs = pair
        return {"exporter": ours, "nvidia_smi": theirs, "samples": 30,
                "relative_difference": abs(ours - theirs) / theirs}

    return {"scenario": name, "returncode": 0, "trainer_errors": "", "gpu_name": gpu_name,
            "nvidia_smi": {"power": cmp(power), "memory": cmp(memory), "util": cmp(util)},
            "measured": {"sm_active": sm, "tensor_active": tensor,
                         "pcie_rx_bytes_per_second": rx, "mfu": mfu,
                         "pcie_rx_bytes_per_sample": rx_per_sample}}


def test_a_good_run_passes():
    assert check([result("s003-5-uint8"), result("s003-6-amp", tensor=0.3, mfu=0.15),
                  result("s003-7-compile", tensor=0.3, mfu=0.2),
                  result("s002-h2d-copy", rx=9e9, rx_per_sample=3e6)]) == []


def test_each_failure_is_named():
    failures = check([result("s003-5-uint8", power=(250.0, 300.0)),
                      result("s003-6-amp", tensor=0.0, memory=(10000.0, 11000.0), mfu=0.15),
                      result("s002-h2d-copy", rx=1.5e9, sm=None, util=(40.0, 90.0),
                             rx_per_sample=300e3)])
    text = "\n".join(failures)
    assert "s003-5-uint8: power" in text
    assert "s003-6-amp: memory" in text
    assert "tensor activity did not rise with AMP" in text
    assert "PCIe bytes per sample did not rise" in text
    assert "s002-h2d-copy: no GPM SM activity" in text
    assert "s002-h2d-copy: utilisation" in text
    assert len(failures) == 6


def test_gpm_is_required_only_where_the_gpu_has_it():
    assert check([result("x", sm=None, gpu_name="Tesla V100-SXM2-16GB")]) == []


def test_mfu_must_rise_up_the_ladder_and_be_there():
    failures = check([result("s003-5-uint8", mfu=0.1), result("s003-6-amp", tensor=0.3, mfu=0.15),
                      result("s003-7-compile", tensor=0.3, mfu=0.14)])
    assert failures == ["MFU did not rise from s003-6-amp to s003-7-compile: 0.150 -> 0.140"]
    failures = check([result("s003-5-uint8", mfu=None), result("s003-6-amp", tensor=0.3)])
    assert failures == ["s003-5-uint8: no MFU (FLOPs, elapsed time or the GPU's peak missing)"]


def test_a_cuda_profile_must_see_the_gpu():
    step = {"seconds": 0.1, "data_loading": 0.0, "forward": 0.03, "backward": 0.05,
            "optimizer": 0.01, "other": 0.01, "idle": 0.0, "gpu_busy": 0.09}
    good = {"state": "done", "device": "cuda", "step_parts": [step],
            "top_ops": [{"name": "sm90_xmma_gemm", "calls": 5, "self_cpu_seconds": 0.0,
                         "self_device_seconds": 0.2}]}
    assert check([{**result("a"), "profile": good}]) == []
    cpu_only = {**good, "device": "cpu", "step_parts": [{**step, "gpu_busy": 0.0}],
                "top_ops": [{**good["top_ops"][0], "self_device_seconds": 0.0}]}
    text = "\n".join(check([{**result("b"), "profile": cpu_only},
                            {**result("c"), "profile": {"state": "expired",
                                                        "error": "no step ended"}}]))
    assert "b: the profile recorded no CUDA activity" in text
    assert "b: profiled step 1: GPU busy 0.0 s" in text
    assert "b: no top operator has GPU time" in text
    assert "c: the profile did not finish: expired no step ended" in text
