"""diagnose's decision order (HEURISTICS.md), on the seeds' numbers. Its queries and exit
statuses against a real Prometheus are in test_alerting.py."""

from __future__ import annotations

import pytest

from exporter.diagnose import GpuReading, RankReport, judge, judge_across
from exporter.rules import DEFAULTS

T = DEFAULTS["thresholds"]


def report(busy, wait, *, sm=None, tensor=None, memory=0.6, power=0.7, pcie=0.02,
           cpu=0.4, iowait=0.0, disk=0.05, net=0.05, phases=None) -> RankReport:
    rep = RankReport("gputrain", "n1:19400", "r", "0", steps_per_second=10, data_wait_ratio=wait,
                     phases=phases or {})
    rep.gpus = [GpuReading("0", "GPU-0", busy, sm, tensor, memory, power, pcie)]
    rep.host = {"cpu_busy": cpu, "iowait": iowait, "disk_busy": disk, "network_rx_used": net}
    return rep


@pytest.mark.parametrize("case, rep, verdict", [
    ("seed 003 num_workers=0", report(0.3165, 0.6, memory=0.056), "input-bound"),
    ("seed 002 preprocessing overload", report(0.3, 0.7, cpu=0.96), "cpu-preprocessing"),
    ("seed 002 network input", report(0.21, 0.778, net=0.92), "network-input"),
    ("seed 001 disk", report(0.3, 0.5, iowait=0.3), "disk-io"),
    ("seed 002 host-to-device copy", report(0.75, 0.03, pcie=0.6), "host-to-device"),
    ("seed 002 heavy post-processing", report(0.46, 0.02, phases={"postprocess": 0.53}),
     "phase"),
    ("seed 002 small batch", report(0.6, 0.02, memory=0.23), "small-batch"),
    ("idle GPU, data ready, nothing else", report(0.4, 0.01), "host-overhead"),
    ("seed 003 before AMP", report(0.9751, 0.01, sm=0.7, tensor=0.0), "tensor-cores-idle"),
    ("busy but tiny kernels", report(0.95, 0.01, power=0.25), "launch-bound"),
    ("seed 003 after AMP", report(0.95, 0.01, sm=0.7, tensor=0.263), "gpu-bound"),
    ("seed 002 inefficient GPU graph", report(0.97, 0.01, power=0.9), "gpu-bound"),
])
def test_decision_order(case, rep, verdict):
    judged = judge(rep, T)
    assert judged.verdict == verdict, f"{case}: {judged.reason}"
    assert judged.bottleneck == (verdict != "gpu-bound")
    assert judged.advice and judged.reason


def test_a_rank_that_makes_no_steps_is_stalled():
    rep = report(0.0, 0.0)
    rep.steps_per_second = 0.0
    judged = judge(rep, T)
    assert judged.verdict == "stalled" and judged.bottleneck


def test_a_rank_without_gpu_data_is_judged_on_its_data_wait_alone():
    rep = report(0.5, 0.3)
    rep.gpus = []
    assert judge(rep, T).verdict == "input-bound"
    rep = report(0.5, 0.01)
    rep.gpus = []
    judged = judge(rep, T)
    assert judged.verdict == "no-gpu-data" and not judged.bottleneck


def test_thresholds_from_the_users_file_change_the_verdict():
    rep = report(0.85, 0.01)
    assert judge(rep, T).verdict == "host-overhead"
    assert judge(report(0.85, 0.01), {**T, "gpu_busy_target": 0.8}).verdict == "gpu-bound"


def ranks(*waits_and_steps, run="ddp"):
    out = []
    for i, (wait, step) in enumerate(waits_and_steps):
        rep = report(0.95, wait)
        rep.run, rep.rank, rep.step_seconds = run, str(i), step
        out.append(judge(rep, T))
    return out


def names(rep: RankReport) -> list[str]:
    return [f.name for f in rep.also]


def test_a_rank_that_waits_more_than_twice_its_runs_median_is_a_straggler():
    reps = judge_across(ranks((0.02, 0.1), (0.02, 0.1), (0.03, 0.1), (0.3, 0.1)), T)
    assert [names(r) for r in reps] == [[], [], [], ["straggler"]]
    assert reps[3].bottleneck and "30.0%" in reps[3].also[0].reason


def test_a_rank_that_computes_over_1_2x_its_runs_median_is_a_straggler():
    reps = judge_across(ranks((0.0, 1.0), (0.0, 1.0), (0.0, 1.5)), T)
    assert [names(r) for r in reps] == [[], [], ["straggler"]]


def test_one_rank_is_never_a_straggler():
    (rep,) = judge_across(ranks((0.3, 1.0)), T)
    assert "straggler" not in names(rep)


def test_stalls_throttling_and_leaks_are_found_beside_the_verdict():
    rep = report(0.95, 0.01)
    rep.step_p50_seconds, rep.step_p99_seconds = 0.75, 17.8  # a 30 s checkpoint a minute
    rep.gpus[0].throttled = 0.25
    rep.rss_growing, rep.rss_bytes_in_horizon = True, 40e9
    rep.host["memory_total"] = 32e9
    (judged,) = judge_across([judge(rep, T)], T)
    assert judged.verdict == "gpu-bound"
    assert names(judged) == ["step-time-stalls", "throttling", "memory-leak"]
    assert judged.bottleneck
    healthy = report(0.95, 0.01)
    healthy.step_p50_seconds, healthy.step_p99_seconds = 0.75, 1.0
    healthy.gpus[0].throttled = 0.05
    healthy.rss_growing, healthy.rss_bytes_in_horizon = True, 20e9
    healthy.host["memory_total"] = 32e9
    (judged,) = judge_across([judge(healthy, T)], T)
    assert names(judged) == [] and not judged.bottleneck
