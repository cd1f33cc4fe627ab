"""diagnose's decision order (docs/diagnose.md), on the case studies' numbers. Its queries and exit
statuses against a real Prometheus are in test_alerting.py."""

from __future__ import annotations

import pytest

from exporter.heuristics.catalogue import BY_ALERT
from exporter.heuristics.diagnose import (
    GpuReading,
    RankReport,
    exit_status,
    judge,
    text_report,
    visibility,
)
from exporter.heuristics.rules import DEFAULTS

T = DEFAULTS["thresholds"]


def report(busy, wait, *, sm=None, tensor=None, memory=0.6, power=0.7, pcie=0.02,
           cpu=0.4, iowait=0.0, disk=0.05, net=0.05, phases=None, mfu=None) -> RankReport:
    rep = RankReport("gputrain", "n1:19400", "r", "0", steps_per_second=10, data_wait_ratio=wait,
                     phases=phases or {}, mfu=mfu)
    rep.gpus = [GpuReading("0", "GPU-0", busy, sm, tensor, memory, power, pcie)]
    rep.host = {"cpu_busy": cpu, "iowait": iowait, "disk_busy": disk, "network_rx_used": net}
    return rep


def judge_one(rep: RankReport, t: dict = T) -> RankReport:
    (judged,) = judge([rep], t)
    return judged


@pytest.mark.parametrize("case, rep, verdict", [
    ("PyTorch ladder num_workers=0", report(0.3165, 0.6, memory=0.056), "input-bound"),
    ("TensorFlow study, preprocessing overload", report(0.3, 0.7, cpu=0.96), "cpu-preprocessing"),
    ("TensorFlow study, network input", report(0.21, 0.778, net=0.92), "network-input"),
    ("profiler tricks, disk", report(0.3, 0.5, iowait=0.3), "disk-io"),
    ("TensorFlow study, host-to-device copy", report(0.75, 0.03, pcie=0.6), "host-to-device"),
    ("TensorFlow study, heavy post-processing", report(0.46, 0.02, phases={"postprocess": 0.53}),
     "host-overhead"),
    ("TensorFlow study, small batch", report(0.6, 0.02, memory=0.23), "small-batch"),
    ("idle GPU, data ready, nothing else", report(0.4, 0.01), "host-overhead"),
    ("PyTorch ladder before AMP", report(0.9751, 0.01, sm=0.7, tensor=0.0), "tensor-cores-idle"),
    ("busy but tiny kernels", report(0.95, 0.01, power=0.25), "launch-bound"),
    ("85 % busy at 30 % power: LaunchBound fires", report(0.85, 0.01, power=0.3),
     "launch-bound"),
    ("PyTorch ladder after AMP", report(0.95, 0.01, sm=0.7, tensor=0.263), "gpu-bound"),
    ("busy at 12 % MFU", report(0.95, 0.01, sm=0.7, tensor=0.3, mfu=0.12), "low-mfu"),
    ("busy at 38 % MFU (torchtitan's Llama 3.1 8B)", report(0.95, 0.01, mfu=0.38), "gpu-bound"),
    ("12 % MFU but 60 % busy: feed it first", report(0.6, 0.3, mfu=0.12), "input-bound"),
    ("TensorFlow study, inefficient GPU graph", report(0.97, 0.01, power=0.9), "gpu-bound"),
])
def test_decision_order(case, rep, verdict):
    judged = judge_one(rep)
    assert judged.verdict == verdict, f"{case}: {judged.reason}"
    assert judged.bottleneck == (verdict != "gpu-bound")
    assert judged.status == ("ok" if verdict == "gpu-bound" else "bottleneck")
    assert judged.advice and judged.reason


def test_the_advice_is_the_catalogues():
    judged = judge_one(report(0.3, 0.6))
    assert judged.advice == BY_ALERT["GpuTrainInputBound"].advice


def test_evaluation_and_checkpoint_are_no_phase_of_the_step():
    judged = judge_one(report(0.95, 0.01, phases={"evaluation": 0.7, "checkpoint": 0.05}))
    assert judged.status == "ok" and judged.findings() == []
    # a recurring cost is its share of the wall time over the periodic window
    for periodic, found in (({"checkpoint": 0.2}, ["step-time-stalls"]),
                            ({"evaluation": 0.3}, ["step-time-stalls"]),
                            ({"evaluation": 0.1, "checkpoint": 0.05}, [])):
        rep = report(0.95, 0.01)
        rep.periodic = periodic
        assert judge_one(rep).findings() == found, periodic


@pytest.mark.parametrize(("typical", "open_s", "stalled"), [
    (0.1, 700.0, True),  # it stepped before: 10 minutes
    (None, 700.0, False), (None, 1700.0, False),  # its first step: 30 minutes (compiling)
    (None, 1900.0, True)])
def test_a_live_rank_whose_step_is_open_past_its_limit_while_a_peer_steps_is_stalled(
        typical, open_s, stalled):
    stuck, peer = report(0.95, 0.01), report(0.95, 0.01)
    peer.rank = "1"
    for r in (stuck, peer):
        r.steps_per_second, r.seconds_since_push = 0.0, 3.0
        r.typical_step_seconds = 0.1
    stuck.typical_step_seconds = typical
    stuck.step_in_progress, peer.step_in_progress = open_s, 0.01
    judged = {r.rank: r for r in judge([stuck, peer], T)}
    assert (judged["0"].verdict == "stalled") is stalled, judged["0"]
    assert judged["0"].bottleneck or not stalled, judged["0"]
    assert judged["1"].verdict != "stalled"


def test_a_dead_rank_with_an_old_open_step_is_never_stalled_nor_hung():
    rep = report(0.0, None)
    rep.steps_per_second, rep.step_in_progress, rep.seconds_since_push = 0.0, 700.0, 700.0
    assert judge_one(rep).verdict not in ("stalled", "hung")


def test_a_lone_rank_whose_step_is_open_past_its_limit_is_hung_and_nothing_else():
    rep = report(0.3, 0.6)  # input-bound over the window, until its step stopped ending
    rep.typical_step_seconds, rep.seconds_since_push, rep.step_in_progress = 0.1, 2.0, 70.0
    judged = judge_one(rep)
    assert (judged.verdict, judged.status, judged.also) == ("hung", "hung", [])
    rep = report(0.95, 0.01)
    rep.typical_step_seconds, rep.seconds_since_push, rep.step_in_progress = 0.1, 2.0, 50.0
    assert judge_one(rep).status == "ok"  # under the floor: a slow step, no hang


def test_a_rank_without_gpu_data():
    rep = report(0.5, 0.3)
    rep.gpus = []
    assert judge_one(rep).verdict == "input-bound"
    rep = report(0.5, 0.01)
    rep.gpus = []
    judged = judge_one(rep)
    assert judged.status == judged.verdict == "no-gpu-data" and not judged.bottleneck
    assert exit_status([judged]) == 3
    assert exit_status([judged, judge_one(report(0.3, 0.6))]) == 1
    assert exit_status([judge_one(report(0.95, 0.01))]) == 0


def test_a_rank_that_just_started_is_warming_up_not_blind():
    """Seconds after a run (or its Prometheus) starts, its GPU is known but neither the steps
    nor the GPU's busy time has two samples for a rate: diagnose says so and exits 0, not
    "the exporter knows no GPU" (what it said before, exit 3)."""
    rep = report(None, None, sm=0.8, memory=0.75)
    rep.steps_per_second = None
    judged = judge_one(rep)
    assert (judged.status, judged.verdict) == ("ok", "warming-up"), judged.reason
    assert "too few samples" in judged.reason and not judged.bottleneck
    assert exit_status([judged]) == 0
    # once it steps, a GPU with no busy time at all is still blind
    rep = report(None, 0.01)
    judged = judge_one(rep)
    assert judged.verdict == "no-gpu-data" and "no busy time" in judged.reason
    assert exit_status([judged]) == 3


def test_an_underused_gpu_with_no_stage_to_blame_is_not_ok():
    judged = judge_one(report(0.85, 0.01))
    assert judged.status == judged.verdict == "underutilized" and judged.bottleneck
    assert judge_one(report(0.85, 0.01), {**T, "gpu_busy_target": 0.8}).status == "ok"


def ranks(*waits_and_steps, run="ddp"):
    out = []
    for i, (wait, step) in enumerate(waits_and_steps):
        rep = report(0.95, wait)
        rep.run, rep.rank, rep.step_seconds = run, str(i), step
        out.append(rep)
    return judge(out, T)


def names(rep: RankReport) -> list[str]:
    return rep.findings()


def test_a_rank_that_waits_more_than_twice_its_runs_median_is_a_straggler():
    reps = ranks((0.02, 0.1), (0.02, 0.1), (0.03, 0.1), (0.3, 0.1))
    assert [names(r) for r in reps] == [[], [], [], ["input-bound", "straggler"]]
    assert reps[3].bottleneck and "30.0%" in reps[3].also[0].reason


def test_a_rank_that_computes_over_1_2x_its_runs_median_is_a_straggler():
    reps = ranks((0.0, 1.0), (0.0, 1.0), (0.0, 1.5))
    assert [names(r) for r in reps] == [[], [], ["straggler"]]


def with_comm(*waits_and_comms, step=1.0, run="sync"):
    """Ranks of one synchronous run, each (data wait, exposed communication) of its step."""
    out = []
    for i, (wait, comm) in enumerate(waits_and_comms):
        rep = report(0.95, wait)
        rep.run, rep.rank, rep.step_seconds = run, str(i), step
        rep.comm_exposed_ratio, rep.comm_ratio = comm, 2 * comm
        out.append(rep)
    return judge(out, T)


def test_the_rank_the_others_wait_for_in_the_all_reduce_is_the_only_straggler():
    """Principle 8: rank 2 computes longer; ranks 0, 1 and 3 wait 40 % of each step for it in
    the gradient all-reduce. Rank 2 is the straggler; the ranks that wait never are, and
    their wait is no communication-bound verdict either."""
    reps = with_comm((0.01, 0.4), (0.01, 0.4), (0.01, 0.02), (0.01, 0.38))
    assert [("straggler" in names(r)) for r in reps] == [False, False, True, False]
    assert reps[2].verdict == "straggler" and "the others wait for it" in reps[2].reason
    # their wait is for rank 2, not for the link: the run's least wait (2 %) is the link's
    assert not any("communication-bound" in names(r) for r in reps)


def test_ranks_that_all_wait_alike_for_communication_have_no_straggler():
    reps = with_comm((0.01, 0.3), (0.01, 0.3), (0.01, 0.28))
    assert not any("straggler" in names(r) for r in reps)
    assert all(r.verdict == "communication-bound" for r in reps)
    assert "bucket_cap_mb" in reps[0].advice and "NCCL_DEBUG=INFO" in reps[0].advice


def test_a_fast_rank_waiting_for_a_slow_ones_input_is_never_a_straggler():
    """No communication measured: rank 1 waits 50 % for data; rank 0's step less its data wait
    is its wait for rank 1 in the all-reduce, not compute, and it is no straggler."""
    reps = ranks((0.0, 1.0), (0.5, 1.0))
    assert "straggler" not in names(reps[0])
    assert names(reps[1])[0] == "input-bound"


def test_an_overlapped_all_reduce_is_not_communication_bound():
    (rep,) = with_comm((0.01, 0.1))
    assert rep.verdict != "communication-bound"


def test_a_nic_saturated_both_ways_with_no_data_wait_is_inferred_communication_bound():
    rep = report(0.95, 0.01)
    rep.host["network_duplex_used"] = 0.9
    judge_one(rep)
    assert rep.verdict == "communication-bound" and rep.reason.startswith("inferred")
    near = report(0.95, 0.01)
    near.host["network_duplex_used"] = 0.9
    near.comm_exposed_ratio = 0.05  # measured, and low: the measure wins
    assert judge_one(near).verdict != "communication-bound"


def test_one_rank_is_never_a_straggler():
    (rep,) = ranks((0.3, 1.0))
    assert "straggler" not in names(rep)


def test_stalls_throttling_and_leaks_are_found_beside_the_verdict():
    rep = report(0.95, 0.01)
    rep.step_p50_seconds, rep.step_p99_seconds = 0.75, 17.8  # a 30 s checkpoint a minute
    rep.gpus[0].throttled = 0.25
    rep.rss_growth_1h = rep.rss_growth_15m = rep.rss_growth_15m_before = 300 * 2**20 / 60
    rep.host["memory_available"] = 40 * 2**30  # gone in about 2 h 15 min
    judged = judge_one(rep)
    assert judged.verdict == "step-time-stalls"
    assert names(judged) == ["step-time-stalls", "memory-leak", "throttling"]
    healthy = report(0.95, 0.01)
    healthy.step_p50_seconds, healthy.step_p99_seconds = 0.75, 1.0
    healthy.gpus[0].throttled = 0.05
    healthy.rss_growth_1h, healthy.rss_growth_15m = 300 * 2**20 / 60, 0.0  # warmed up
    healthy.rss_growth_15m_before = 300 * 2**20 / 60
    healthy.host["memory_available"] = 40 * 2**30
    judged = judge_one(healthy)
    assert names(judged) == [] and not judged.bottleneck


def test_same_named_runs_of_two_clusters_are_compared_apart():
    """With run_labels [cluster, run], a run of cluster b whose ranks all wait is no straggler
    against cluster a's run of the same name, and a's straggler is found among a's ranks."""
    a = ranks((0.0, 0.1), (0.0, 0.1), (0.0, 0.1), (0.5, 0.1))
    b = ranks((0.5, 0.1), (0.5, 0.1))
    for rep in a:
        rep.labels = {"cluster": "a"}
    for rep in b:
        rep.labels = {"cluster": "b"}
    judged = judge(a + b, T)
    stragglers = [(r.labels["cluster"], r.rank) for r in judged if "straggler" in names(r)]
    assert stragglers == [("a", "3")]


def test_a_run_spanning_two_jobs_is_one_run():
    reps = [report(0.95, w) for w in (0.02, 0.02, 0.02, 0.3)]
    for i, rep in enumerate(reps):
        rep.rank, rep.job = str(i), "gputrain-rack3" if i == 3 else "gputrain"
    assert "straggler" in names(judge(reps, T)[3])


def test_ranks_missing_below_the_highest_make_a_run_partly_visible():
    reps = [report(0.95, 0.01) for _ in range(3)]
    for rep, r in zip(reps, ("0", "1", "5"), strict=True):
        rep.rank = r
    visibility(reps)
    assert all(r.partial == "ranks 2-4 of 0-5 are not visible" for r in reps)
    whole = [report(0.95, 0.01) for _ in range(2)]
    whole[1].rank = "1"
    assert [r.partial for r in visibility(whole)] == ["", ""]
    shard = visibility(whole, "this server is one shard")
    assert shard[0].partial == "this server is one shard"


def test_text_report_says_a_run_is_partly_visible():
    reps = [report(0.95, 0.01) for _ in range(2)]
    reps[1].rank = "3"
    text = text_report(judge(visibility(reps), T))
    assert "== run r: 2 rank(s) visible" in text
    assert "partly visible: ranks 1-2 of 0-3 are not visible" in text


def test_every_recorded_series_diagnose_falls_back_to_is_a_shipped_recording_rule():
    from exporter.heuristics.diagnose import RECORDED
    from exporter.heuristics.promql import recording_rules

    assert set(RECORDED.values()) <= set(recording_rules(DEFAULTS["selector"]))


def test_each_reading_of_the_table_is_a_rule_a_field_and_a_query():
    """Issue 36: a reading is one row of readings.READINGS; its recording rule, the report
    field it fills and diagnose's raw and recorded queries of it all follow from that row."""
    from dataclasses import fields

    from exporter.heuristics.diagnose import HOST_READINGS, queries, recorded_queries
    from exporter.heuristics.promql import inline, recording_rules
    from exporter.heuristics.readings import READINGS, WINDOWS, GpuReading, RankReport

    s = DEFAULTS["selector"]
    rules, raw, recorded = recording_rules(s), queries(s, "5m"), recorded_queries(s)
    slots = {"rank": {f.name for f in fields(RankReport)},
             "rank_gpu": {f.name for f in fields(GpuReading)},
             "run_gpu": {f.name for f in fields(GpuReading)}, "node": set(HOST_READINGS)}
    assert len({x.field for x in READINGS}) == len({x.record for x in READINGS}) == len(READINGS)
    for x in READINGS:
        # its rule, with the table's template over the window the row names
        record = x.gpu_record if x.scope == "rank_gpu" else x.record
        assert record in rules and x.record in rules, x.field
        # over the window it names: the rate window's follow diagnose --window, others not
        # (but the quantile window's, which read the rate window while a regime is young)
        assert x.window is None or x.window in WINDOWS, x.field
        written = [inline(record, recording_rules(s, rate=w)) for w in ("5m", "15m")]
        assert (written[0] != written[1]) == (x.window in ("rate", "quantile")), x.field
        if x.window in ("quantile", "recent"):
            assert f"[{WINDOWS[x.window]}]" in written[0], x.field
        for name in x.names:
            assert name in slots[x.scope], f"{name}: no {x.scope} reading of that name"
            assert name in raw and name in recorded, name
            assert x.record in recorded[name] or "deriv" in recorded[name], name


def test_text_report_gives_each_runs_mfu_goodput_and_wasted_gpu_hours():
    reps = [report(0.75, 0.01, mfu=0.3) for _ in range(2)]
    reps[1].rank = "1"
    reps[1].gpus[0] = GpuReading("1", "GPU-1", 0.25)
    for r, good in zip(reps, (0.8, 0.6), strict=True):
        r.goodput = good
        r.badput = {"data_wait": 0.05, "checkpoint": 1 - good - 0.05}
    text = text_report(judge(reps, T), window_seconds=3600)
    # two GPUs idle 25 % and 75 % of an hour: one GPU-hour
    assert "   MFU 30.0%   goodput 70.0%   wasted 1 GPU-hours over the window (1.00 GPUs " \
           "idle on average)" in text
    assert "goodput 60.0% of wall time; lost to checkpoint 35.0%, data_wait 5.0%" in text


def on_gpus(busy: list[float], wait: float) -> RankReport:
    """One process driving several GPUs (pipeline stages, device_map="auto")."""
    rep = report(busy[0], wait)
    rep.gpus = [GpuReading(str(i), f"GPU-{i}", b, None, None, 0.6, 0.7, 0.02)
                for i, b in enumerate(busy)]
    return rep


def test_a_pipeline_over_four_gpus_is_not_host_overhead():
    """One of four GPUs busy at every moment (25 % each, data ready): a pipeline, judged
    under-utilised GPU by GPU, never host overhead; the near miss, two GPUs 20 % busy each
    (40 % added up) with the data ready, is host overhead."""
    pipeline = judge_one(on_gpus([0.25] * 4, 0.01))
    assert pipeline.verdict != "host-overhead" and pipeline.bottleneck
    assert pipeline.verdict == "underutilized"
    split = judge_one(on_gpus([0.2, 0.2], 0.01))
    assert split.verdict == "host-overhead"
    assert "2 GPUs busy, added up, 40.0%" in split.reason


def test_a_run_whose_every_rank_went_silent_without_a_goodbye_is_stopped_not_a_bottleneck():
    """Both ranks silent 5 minutes, no goodbye, GPUs idle: vanished, status stopped, nothing
    else judged of their stale window (data wait 80 %), exit 1. Near misses: one rank still
    pushing (the other is judged as before), a GPU still busy, a rank that said goodbye."""
    def rank(r: str, silent: float, busy: float = 0.0, finished: bool = False) -> RankReport:
        rep = report(0.2, 0.8)
        rep.rank, rep.seconds_since_push, rep.recent_busy = r, silent, busy
        rep.finished = finished
        return rep

    gone = judge([rank("0", 300), rank("1", 290)], T)
    assert [(r.status, r.verdict, r.also) for r in gone] == [("stopped", "vanished", [])] * 2
    assert gone[0].reason.startswith("stopped without finishing 5 min ago")
    assert exit_status(gone) == 1
    partly = judge([rank("0", 300), rank("1", 2)], T)
    assert [(r.status, r.verdict) for r in partly] == [("ok", "paused"),
                                                       ("bottleneck", "input-bound")]
    assert "vanished" not in {f for r in partly for f in r.findings()}
    spinning = judge([rank("0", 300, busy=0.9)], T)
    assert spinning[0].verdict != "vanished"
    done = judge([rank("0", 300, finished=True)], T)
    assert (done[0].status, done[0].verdict) == ("finished", "finished")
    assert exit_status(done) == 0


@pytest.mark.parametrize("sm, power, launch_bound", [
    (0.2, 0.85, True),  # GPM says the SMs idle, whatever the power
    (None, 0.2, True),  # no GPM: power is the proxy
    (0.8, 0.25, False),  # held at half its clock: little power, every SM busy
    (0.35, 0.3, False),
])
def test_launch_bound_reads_gpm_before_power(sm, power, launch_bound):
    found = judge_one(report(0.95, 0.01, sm=sm, tensor=0.5, power=power)).findings()
    assert ("launch-bound" in found) == launch_bound, found


@pytest.mark.parametrize("share, p50, p99, stalls", [
    (0.0, 0.58, 9.3, False),  # a gradient-accumulation boundary: wide buckets, no slow step
    (None, 0.58, 9.3, True),  # no count pushed: the quantiles are all there is
    (0.2, 0.5, 0.99, True),  # rare long stalls the p99 never sees
])
def test_the_exact_slow_step_count_wins_over_the_quantiles(share, p50, p99, stalls):
    rep = report(0.95, 0.01)
    rep.stall_share, rep.step_p50_seconds, rep.step_p99_seconds = share, p50, p99
    assert ("step-time-stalls" in judge_one(rep).findings()) == stalls


def test_a_nodes_clock_off_is_said_of_the_node_and_acts_only_with_fresh_readings():
    """A node whose clock is off Prometheus' is said of the node itself, whether or not a rank
    runs on it (as GpuTrainClockOffset fires for it), and diagnose exits 0 for that note
    alone; a lost GPU on it exits 1. With a collector stale its readings are not judged (the
    rule's freshness guard), so no offset is said either."""
    from exporter.heuristics.readings import GpuReading, NodeReport
    from exporter.heuristics.verdict import node_findings

    t = DEFAULTS["thresholds"]
    node = node_findings(NodeReport("gputrain", "n1:19400", host={"clock_offset": -600.0},
                                    gpus=[GpuReading("0", "GPU-a", up=True)]), t)
    assert [(gpu, f.name) for gpu, _, f in node.findings] == [("", "clock-offset")]
    assert "600 s behind" in node.findings[0][2].reason
    assert exit_status([], [node]) == 0
    lost = node_findings(NodeReport("gputrain", "n1:19400", host={"clock_offset": -600.0},
                                    gpus=[GpuReading("0", "GPU-a", up=False)]), t)
    assert {f.name for _, _, f in lost.findings} == {"clock-offset", "gpu-lost"}
    assert exit_status([], [lost]) == 1
    stale = node_findings(NodeReport("gputrain", "n1:19400", host={"clock_offset": -600.0},
                                     collector_ages={"gpu": 600.0}), t)
    assert [f.name for _, _, f in stale.findings] == [BY_ALERT["GpuTrainCollectorStale"].verdict]
