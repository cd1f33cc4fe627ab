"""Prometheus recording and alerting rules for the bottleneck heuristics, from thresholds.

`gputrain-exporter rules [--config my-thresholds.yml] [--level node|global]` prints the rule
file; the shipped `alerts/gputrain.rules.yml` is that output with the defaults (a test keeps
them identical). Every threshold, `for` duration, the scrape-job selector and the labels that
identify a run come from :data:`DEFAULTS`, overridable key by key; the thresholds, `for`
durations, summaries, advice and the level each alert is evaluated at are those of
:mod:`exporter.heuristics.catalogue`.

Levels: the recording rules and the ``node`` alerts need one node's raw series, so they run
where the node is scraped (one Prometheus, or each shard); the ``global`` alerts compare the
ranks of a run, so they run where every shard is seen (vmalert over VictoriaMetrics, a
federating Prometheus, Thanos or Mimir ruler). ``all`` (the default) is both, for a single
Prometheus.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from exporter.client.monitor import OUTSIDE_STEP_PHASES
from exporter.heuristics.catalogue import BY_ALERT, CATALOGUE, LEVELS, defaults

RUNBOOK = "https://github.com/gputrain/gputrain-exporter/blob/main/alerts/runbook.md"

DEFAULTS: dict[str, Any] = {
    "selector": 'job=~"gputrain.*"',
    # the labels that identify a run across nodes: `run`, plus any label that tells clusters
    # apart (an external label such as `cluster`); never `job`, so a run spans scrape jobs
    "run_labels": ["run"],
    "runbook_url": RUNBOOK,
    "recording_interval": "30s",
    "thresholds": defaults(),
    "for": {e.alert: e.for_ for e in CATALOGUE},
}

# the phases that are part of a step (evaluation, checkpoint saves and start-up are not)
IN_STEP = 'phase!~"' + "|".join(sorted(OUTSIDE_STEP_PHASES)) + '"'
OUTSIDE_STEP = 'phase=~"' + "|".join(sorted(OUTSIDE_STEP_PHASES)) + '"'
# badput causes beside the phases: what the rank's wall time went to when not stepping
DATA_WAIT_CAUSE, OUTSIDE_STEPS_CAUSE = "data_wait", "outside_steps"
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# the clock-event reasons that are throttling (sync boost is not: it aligns clocks on purpose)
THROTTLE_REASONS = ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown")


class Identity:
    """The label lists the rules group and join by, from the ``run_labels`` setting.

    A run is ``run_labels`` (default ``run``); a node is the run labels other than ``run``
    (``cluster``) with ``job, instance``; a rank is a node's labels with ``run, rank``."""

    def __init__(self, run_labels: list[str] | tuple[str, ...] = ("run",)) -> None:
        self.extra = tuple(x for x in run_labels if x != "run")  # what tells runs apart
        self.node_tuple = tuple(dict.fromkeys([*self.extra, "job", "instance"]))
        self.rank_tuple = (*self.node_tuple, "run", "rank")
        # as PromQL label lists
        self.run = ", ".join(run_labels)
        self.node = ", ".join(self.node_tuple)
        self.rank = ", ".join(self.rank_tuple)
        self.gpu = f"{self.node}, gpu, uuid"


def check_run_labels(value: Any) -> list[str]:
    """``run_labels`` as a checked list; ValueError says what is wrong."""
    if isinstance(value, str):
        value = [x.strip() for x in value.split(",") if x.strip()]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"'run_labels' must be a list of label names, got {value!r}")
    bad = [x for x in value if not LABEL_NAME.fullmatch(x)]
    if bad:
        raise ValueError(f"'run_labels': {bad[0]!r} is not a label name")
    if "run" not in value:
        raise ValueError("'run_labels' must include 'run'")
    for x in ("instance", "rank"):
        if x in value:
            raise ValueError(f"'run_labels' must not include '{x}': a run spans many of them")
    return list(dict.fromkeys(value))


def identity(cfg: dict) -> Identity:
    """The grouping labels of a merged configuration."""
    return Identity(cfg["run_labels"])


def merge(base: dict, override: dict, path: str = "") -> dict:
    """``base`` with ``override``'s keys replaced; an unknown key is an error naming it."""
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if key not in base:
            raise ValueError(f"unknown key '{path}{key}' (known: {', '.join(base)})")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"'{path}{key}' must be a mapping")
            out[key] = merge(base[key], value, f"{path}{key}.")
        elif key == "run_labels":
            out[key] = check_run_labels(value)
        elif isinstance(base[key], (int, float)) and not isinstance(base[key], bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"'{path}{key}' must be a number, got {value!r}")
            out[key] = value
        else:
            out[key] = str(value)
    return out


def rank_gpu_join(selector: str, per_gpu: str, ids: Identity) -> str:
    """``per_gpu`` (a recording rule name) for the GPUs each rank uses, joined through
    ``gputrain_training_gpu_info``: a rank's labels and gpu, uuid."""
    return (f"max by ({ids.rank}, gpu, uuid) (gputrain_training_gpu_info{{{selector}}}) "
            f"* on ({ids.gpu}) group_left {per_gpu}")


def recording_rules(selector: str, ids: Identity | None = None) -> dict[str, str]:
    """The recording rules' expressions by record name."""
    return {r["record"]: r["expr"] for r in _recording(selector, ids or Identity())}


# "group_left name" must not become "group_left (expr)": the parser reads a label list there
_BARE_GROUPING = re.compile(r"\b(group_left|group_right) (?=[a-z_]+:)")


def inline(expr: str, records: dict[str, str]) -> str:
    """``expr`` with every recording rule it names replaced by the rule's expression, so it
    runs on a Prometheus that does not evaluate the rules (diagnose, a backfilled replay)."""
    pattern = re.compile("(?<![\\w:])(" + "|".join(map(re.escape, records)) + ")(?![\\w:])")
    for _ in range(10):  # recording rules built on recording rules
        expr = _BARE_GROUPING.sub(r"\1 () ", expr)
        expr, n = pattern.subn(lambda m: f"({records[m.group(1)]})", expr)
        if not n:
            return expr
    raise ValueError(f"recording rules nested too deep in {expr!r}")


def _recording(s: str, ids: Identity) -> list[dict]:
    """Recording rules: level:metric:operation. Ratios divide separately-summed counters."""
    rank, gpu, node = ids.rank, ids.gpu, ids.node

    return [
        # per (run, rank): the training client's signals
        _rec("run_rank:gputrain_training_data_wait_ratio:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_data_wait_seconds_total{{{s}}}[5m]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m]))"""),
        # samples per second of step time: the training loop's throughput, exact from a run's
        # first minute (a bare rate() over 5m reads low until the run is 5m old)
        _rec("run_rank:gputrain_training_samples_per_second:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_samples_total{{{s}}}[5m]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m]))"""),
        _rec("run_rank:gputrain_training_step_seconds:mean5m", f"""
            sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[5m]))"""),
        _rec("run_rank:gputrain_training_compute_seconds:mean5m", f"""
            (sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m]))
             - sum by ({rank}) (rate(gputrain_training_data_wait_seconds_total{{{s}}}[5m])))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[5m]))"""),
        _rec("run_rank:gputrain_training_step_seconds:p50_30m", f"""
            histogram_quantile(0.5, sum by ({rank}, le)
              (rate(gputrain_training_step_duration_seconds_bucket{{{s}}}[30m])))"""),
        _rec("run_rank:gputrain_training_step_seconds:p99_30m", f"""
            histogram_quantile(0.99, sum by ({rank}, le)
              (rate(gputrain_training_step_duration_seconds_bucket{{{s}}}[30m])))"""),
        _rec("run_rank_phase:gputrain_training_phase_ratio:rate5m", f"""
            sum by ({rank}, phase) (rate(gputrain_training_phase_seconds_total{{{s}}}[5m]))
            / on ({rank}) group_left
            sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m]))"""),
        _rec("run_rank:gputrain_training_step_phase_ratio:max_rate5m", f"""
            max by ({rank}) (
              sum by ({rank}, phase) (rate(gputrain_training_phase_seconds_total{{{s},{IN_STEP}}}[5m]))
              / on ({rank}) group_left
              sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m])))"""),
        _rec("run_rank:gputrain_training_checkpoint_ratio:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_phase_seconds_total{{{s},phase="checkpoint"}}[5m]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m]))"""),
        _rec("run_rank:gputrain_training_process_cpu_cores:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_process_cpu_seconds_total{{{s}}}[5m]))"""),
        # what diagnose reads where only the recorded series arrive (a global layer fed with
        # the recording rules' results): steps, the last step, the process tree's memory
        _rec("run_rank:gputrain_training_steps:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[5m]))"""),
        _rec("run_rank:gputrain_training_last_step_timestamp_seconds:max", f"""
            max by ({rank}) (gputrain_training_last_step_timestamp_seconds{{{s}}})"""),
        _rec("run_rank:gputrain_training_process_resident_memory_bytes:sum", f"""
            sum by ({rank}) (gputrain_training_process_resident_memory_bytes{{{s}}})"""),
        *_utilisation(s, ids),
        # per GPU
        # GPU ratios divide by the seconds the sampler watched: exact from the first scrapes
        # after an exporter (re)start, and blind time (a lost GPU) counts on neither side.
        _rec("gpu:gputrain_gpu_busy_ratio:rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_busy_seconds_total{{{s}}}[5m]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[5m]))"""),
        _rec("gpu:gputrain_gpu_memory_used:ratio", f"""
            sum by ({gpu}) (gputrain_gpu_memory_used_bytes{{{s}}})
            / sum by ({gpu}) (gputrain_gpu_memory_total_bytes{{{s}}})"""),
        _rec("gpu:gputrain_gpu_power_limit_used:ratio_avg5m", f"""
            sum by ({gpu}) (avg_over_time(gputrain_gpu_power_watts{{{s}}}[5m]))
            / sum by ({gpu}) (gputrain_gpu_power_limit_watts{{{s}}})"""),
        _rec("gpu:gputrain_gpu_pcie_rx_link_used:ratio_rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_pcie_received_bytes_total{{{s}}}[5m]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[5m]))
            / sum by ({gpu}) (gputrain_gpu_pcie_link_max_bytes_per_second{{{s}}})"""),
        _rec("gpu:gputrain_gpu_sm_active_ratio:avg5m",
            f"avg by ({gpu}) (avg_over_time(gputrain_gpu_sm_active_ratio{{{s}}}[5m]))"),
        _rec("gpu:gputrain_gpu_tensor_active_ratio:avg5m",
            f"avg by ({gpu}) (avg_over_time(gputrain_gpu_tensor_active_ratio{{{s}}}[5m]))"),
        # mean power from the energy counter: exact over the window, unlike sampled gauges
        _rec("gpu:gputrain_gpu_power_watts:rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_energy_joules_total{{{s}}}[5m]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[5m]))"""),
        _rec("gpu:gputrain_gpu_clock_event_throttle:ratio_rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_clock_event_seconds_total{{{s},
              reason=~"{'|'.join(THROTTLE_REASONS)}"}}[5m]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[5m]))"""),
        # a rank's GPUs, joined through gputrain_training_gpu_info
        *[_rec(f"run_rank_gpu:{name.split(':', 1)[1].rsplit(':', 1)[0]}:{name.rsplit(':', 1)[1]}",
              rank_gpu_join(s, name, ids))
          for name in ("gpu:gputrain_gpu_busy_ratio:rate5m",
                       "gpu:gputrain_gpu_memory_used:ratio",
                       "gpu:gputrain_gpu_power_limit_used:ratio_avg5m",
                       "gpu:gputrain_gpu_pcie_rx_link_used:ratio_rate5m",
                       "gpu:gputrain_gpu_sm_active_ratio:avg5m",
                       "gpu:gputrain_gpu_tensor_active_ratio:avg5m",
                       "gpu:gputrain_gpu_power_watts:rate5m",
                       "gpu:gputrain_gpu_clock_event_throttle:ratio_rate5m")],
        _rec("run_rank:gputrain_gpu_busy_ratio:avg5m",
            f"avg by ({rank}) (run_rank_gpu:gputrain_gpu_busy_ratio:rate5m)"),
        # joules per sample: the rank's GPUs' mean power over its samples per wall second
        # (each side over its own clock, so exact from a run's first minute)
        _rec("run_rank:gputrain_training_energy_joules_per_sample:rate5m", f"""
            sum by ({rank}) (run_rank_gpu:gputrain_gpu_power_watts:rate5m)
            / (sum by ({rank}) (rate(gputrain_training_samples_total{{{s}}}[5m]))
               / sum by ({rank}) (rate(gputrain_training_elapsed_seconds_total{{{s}}}[5m])))"""),
        # GPU-seconds per second that a run's GPUs sat idle while it held them (a GPU two
        # ranks share counts once); sum_over_time(...[range]) * the recording interval is
        # GPU-seconds over the range
        _rec("run:gputrain_gpu_wasted_seconds:rate5m", f"""
            sum by ({ids.run}) (max by ({ids.node}, run, gpu, uuid)
              (1 - run_rank_gpu:gputrain_gpu_busy_ratio:rate5m))"""),
        # per node
        _rec("instance:gputrain_host_cpu_busy:ratio_rate5m", f"""
            1 - sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s},mode=~"idle|iowait"}}[5m]))
            / sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s}}}[5m]))"""),
        _rec("instance:gputrain_host_memory_available_bytes:sum",
            f"sum by ({node}) (gputrain_host_memory_available_bytes{{{s}}})"),
        _rec("instance:gputrain_host_cpu_iowait:ratio_rate5m", f"""
            sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s},mode="iowait"}}[5m]))
            / sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s}}}[5m]))"""),
        _rec("instance:gputrain_host_disk_busy:max_rate5m", f"""
            max by ({node}) (rate(gputrain_host_disk_io_time_seconds_total{{{s}}}[5m]))"""),
        _rec("instance:gputrain_host_network_receive_link_used:max_ratio_rate5m", f"""
            max by ({node}) (
              rate(gputrain_host_network_received_bytes_total{{{s}}}[5m])
              / gputrain_host_network_speed_bytes_per_second{{{s}}})"""),
    ]


def _rec(name: str, expr: str) -> dict:
    """A recording rule, its expression on one line."""
    return {"record": name, "expr": " ".join(expr.split())}


def _utilisation(s: str, ids: Identity) -> list[dict]:
    """MFU, goodput and badput by cause. Each divides by the rank's wall seconds
    (``gputrain_training_elapsed_seconds_total``), so it is exact from a run's first minute
    and a restart's gap counts as time outside steps."""
    rank, gpu = ids.rank, ids.gpu
    wall = f"sum by ({rank}) (rate(gputrain_training_elapsed_seconds_total{{{s}}}[5m]))"
    steps = f"sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[5m]))"
    wait = f"sum by ({rank}) (rate(gputrain_training_data_wait_seconds_total{{{s}}}[5m]))"

    def phases(selector: str) -> str:
        # 0 where the rank has no such phase, rather than no result at all
        return (f"(sum by ({rank}) (rate(gputrain_training_phase_seconds_total{{{s},{selector}}}"
                f"[5m])) or 0 * {wall})")

    return [
        # the summed peak of a rank's GPUs at the precision it trains in
        _rec("run_rank:gputrain_gpu_peak_flops:sum", f"""
            sum by ({rank}) (
              max by ({rank}, gpu, uuid, precision) (gputrain_training_gpu_info{{{s}}})
              * on ({gpu}, precision) group_left
              max by ({gpu}, precision) (gputrain_gpu_peak_flops{{{s}}}))"""),
        _rec("run_rank:gputrain_training_mfu:ratio_rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_flops_total{{{s}}}[5m])) / {wall}
            / run_rank:gputrain_gpu_peak_flops:sum"""),
        # the wall time's parts: productive (step time less data wait and the phases inside
        # steps), data wait, each phase, and outside steps (the rest). A step straddling the
        # window's start counts whole at its end, so at a run's first and last pushes a raw
        # difference can go past the wall time by up to a step: the parts that would go
        # negative count 0, and goodput and badput are shares of the parts' sum, each within
        # [0, 1] and adding up to 1
        _rec("run_rank:gputrain_training_accounted_seconds:rate5m", f"""
            clamp_min({steps} - {wait} - {phases(IN_STEP)}, 0) + {wait} + {phases("phase!=''")}
            + clamp_min({wall} - {steps} - {phases(OUTSIDE_STEP)}, 0)"""),
        _rec("run_rank:gputrain_training_goodput:ratio_rate5m", f"""
            clamp_min({steps} - {wait} - {phases(IN_STEP)}, 0)
            / run_rank:gputrain_training_accounted_seconds:rate5m"""),
        _rec("run_rank_cause:gputrain_training_badput:ratio_rate5m", f"""
            (label_replace({wait}, "cause", "{DATA_WAIT_CAUSE}", "", "")
             or sum by ({rank}, cause) (label_replace(
                  rate(gputrain_training_phase_seconds_total{{{s}}}[5m]),
                  "cause", "$1", "phase", "(.+)"))
             or label_replace(clamp_min({wall} - {steps} - {phases(OUTSIDE_STEP)}, 0),
                  "cause", "{OUTSIDE_STEPS_CAUSE}", "", ""))
            / on ({rank}) group_left run_rank:gputrain_training_accounted_seconds:rate5m"""),
    ]


def _alert(name: str, expr: str, severity: str, situation: str, cfg: dict) -> dict:
    """An alerting rule; its summary and advice come from the catalogue."""
    entry = BY_ALERT[name]
    return {
        "alert": name,
        "expr": " ".join(expr.split()),
        "for": cfg["for"][name],
        "labels": {"severity": severity},
        "annotations": {
            "summary": entry.summary,
            "description": " ".join(f"{situation} {entry.advice}".split()),
            "runbook_url": f"{cfg['runbook_url']}#{name.lower()}",
        },
    }


def _alerts(cfg: dict) -> list[dict]:
    s, t, ids = cfg["selector"], cfg["thresholds"], identity(cfg)
    rank, run = ids.rank, ids.run
    wait = "run_rank:gputrain_training_data_wait_ratio:rate5m"
    busy = "run_rank_gpu:gputrain_gpu_busy_ratio:rate5m"
    # "on node-1 (cluster a)": the run labels beyond `run` name where the node is
    where = "{{ $labels.instance }}" + "".join(
        f" ({x} {{{{ $labels.{x} }}}})" for x in ids.extra if x != "job")
    who = f"Run {{{{ $labels.run }}}} rank {{{{ $labels.rank }}}} on {where}"
    gpu_who = f"GPU {{{{ $labels.gpu }}}} of {who[0].lower()}{who[1:]}"
    node_gpu = f"GPU {{{{ $labels.gpu }}}} on {where}"
    input_bound = f"{wait} >= {t['input_bound']}"
    on_node = f"on ({ids.node}) group_left"
    rss = f"gputrain_training_process_resident_memory_bytes{{{s}}}"
    # uncorrectable ECC errors: new ones, and those since the driver loaded that an exporter
    # (re)started in the last 10m finds (a counter's first sample is no increase)
    ecc = f'gputrain_gpu_ecc_errors_total{{{s},type="uncorrected"}}'
    a = _alert
    return [
        a("GpuTrainGPUUnderutilized", f"{busy} >= {t['gpu_busy_low']} < {t['gpu_busy_target']}",
          "info", f"""{gpu_who} was busy {{{{ $value | humanizePercentage }}}} of the time over
          5m, below the {t['gpu_busy_target']} a well-fed GPU reaches.""", cfg),
        a("GpuTrainGPUUnderutilized", f"{busy} < {t['gpu_busy_low']}", "warning",
          f"""{gpu_who} was busy {{{{ $value | humanizePercentage }}}} of the time over 5m
          (threshold {t['gpu_busy_low']}).""", cfg),
        a("GpuTrainInputBound", f"{input_bound} < {t['input_bound_high']}", "info",
          f"""{who} spends {{{{ $value | humanizePercentage }}}} of each step waiting for the
          data loader (moderately input-bound at {t['input_bound']}).""", cfg),
        a("GpuTrainInputBound", f"{wait} >= {t['input_bound_high']}", "warning",
          f"""{who} spends {{{{ $value | humanizePercentage }}}} of each step waiting for the
          data loader (highly input-bound at {t['input_bound_high']}).""", cfg),
        a("GpuTrainCPUPreprocessingBound",
          f"""({input_bound}) and on ({ids.node}) (instance:gputrain_host_cpu_busy:ratio_rate5m >=
          {t['cpu_saturated']})""", "warning",
          f"""{who} waits {{{{ $value | humanizePercentage }}}} of each step for data while the
          node's CPUs are {t['cpu_saturated']} or more busy: preprocessing is the
          bottleneck.""", cfg),
        a("GpuTrainDiskIOBound",
          f"""({input_bound})
          and on ({ids.node}) (instance:gputrain_host_cpu_iowait:ratio_rate5m >= {t['iowait_high']}
               or instance:gputrain_host_disk_busy:max_rate5m >= {t['disk_busy_high']})
          and on ({ids.node}) (instance:gputrain_host_cpu_busy:ratio_rate5m < {t['cpu_saturated']})""",
          "warning",
          f"""{who} waits {{{{ $value | humanizePercentage }}}} of each step for data while the
          node waits on its disks (iowait >= {t['iowait_high']} or a disk busy >=
          {t['disk_busy_high']}) and the CPUs are not saturated.""", cfg),
        a("GpuTrainNetworkInputBound",
          f"""({input_bound}) and on ({ids.node})
          (instance:gputrain_host_network_receive_link_used:max_ratio_rate5m >=
          {t['network_saturated']})""", "warning",
          f"""{who} waits {{{{ $value | humanizePercentage }}}} of each step for data while a
          network interface receives at {t['network_saturated']} or more of its speed.""",
          cfg),
        a("GpuTrainHostToDeviceBound",
          f"""run_rank_gpu:gputrain_gpu_pcie_rx_link_used:ratio_rate5m >= {t['pcie_rx_high']}
          and on ({rank}, gpu, uuid) {busy} < {t['h2d_gpu_busy_below']}""",
          "warning", f"""{gpu_who} receives {{{{ $value | humanizePercentage }}}} of its PCIe
          link's capacity while busy less than {t['h2d_gpu_busy_below']}.""", cfg),
        a("GpuTrainGPUMemoryUnderused",
          f"run_rank_gpu:gputrain_gpu_memory_used:ratio < {t['memory_underused']}", "info",
          f"""{gpu_who} uses {{{{ $value | humanizePercentage }}}} of its memory (threshold
          {t['memory_underused']}).""", cfg),
        a("GpuTrainLaunchBound",
          f"""{busy} >= {t['launch_busy_above']}
          and on ({rank}, gpu, uuid)
          (run_rank_gpu:gputrain_gpu_power_limit_used:ratio_avg5m < {t['launch_power_below']}
           or run_rank_gpu:gputrain_gpu_sm_active_ratio:avg5m < {t['launch_sm_active_below']})""",
          "info", f"""{gpu_who} is busy {{{{ $value | humanizePercentage }}}} of the time but
          draws less than {t['launch_power_below']} of its power limit (or its SMs are less
          than {t['launch_sm_active_below']} active).""", cfg),
        a("GpuTrainTensorCoresIdle",
          f"""run_rank_gpu:gputrain_gpu_sm_active_ratio:avg5m >= {t['tensor_sm_active_above']}
          and on ({rank}, gpu, uuid)
          run_rank_gpu:gputrain_gpu_tensor_active_ratio:avg5m < {t['tensor_active_below']}""",
          "info", f"""{gpu_who} has its SMs {{{{ $value | humanizePercentage }}}} active but
          its tensor cores below {t['tensor_active_below']}.""", cfg),
        a("GpuTrainLowMFU",
          f"""run_rank:gputrain_training_mfu:ratio_rate5m < {t['mfu_low']}
          and on ({rank}) run_rank:gputrain_gpu_busy_ratio:avg5m >= {t['mfu_busy_above']}""",
          "info", f"""{who} reaches {{{{ $value | humanizePercentage }}}} model FLOPs
          utilisation (under {t['mfu_low']}) while its GPUs are busy {t['mfu_busy_above']} or
          more of the time.""", cfg),
        a("GpuTrainHostOverheadBound",
          f"""(run_rank:gputrain_gpu_busy_ratio:avg5m < {t['gpu_busy_low']}
            and on ({rank}) {wait} < {t['input_bound']})
          or on ({rank}) (run_rank:gputrain_training_step_phase_ratio:max_rate5m
            > {t['phase_dominates']} / (1 + {t['phase_dominates']}))""", "warning",
          f"""{who}: its GPUs are idle although it barely waits for data, or a phase of the
          step (callbacks, logging) takes more than {t['phase_dominates']}x the rest of
          it.""", cfg),
        a("GpuTrainStepTimeStalls",
          f"""run_rank:gputrain_training_step_seconds:p99_30m
          > {t['stall_p99_over_p50']} * run_rank:gputrain_training_step_seconds:p50_30m
          or on ({rank}) (run_rank:gputrain_training_checkpoint_ratio:rate5m
            > {t['checkpoint_share']})""",
          "info", f"""{who}: the p99 step time is more than {t['stall_p99_over_p50']}x the
          median over 30m, or checkpoint saves take more than {t['checkpoint_share']} of the
          step time ({{{{ $value | printf "%.3g" }}}}).""", cfg),
        a("GpuTrainStragglerRank",
          f"""({wait} >= {t['input_bound']}
            and {wait} > on ({run}) group_left ()
              ({t['straggler_wait_factor']} * quantile by ({run}) (0.5, {wait})))
          or (run_rank:gputrain_training_compute_seconds:mean5m > on ({run}) group_left ()
              ({t['straggler_compute_factor']}
               * quantile by ({run}) (0.5, run_rank:gputrain_training_compute_seconds:mean5m)))""",
          "warning", f"""{who} lags its run's other ranks (it waits for data more than
          {t['straggler_wait_factor']}x their median, or computes more than
          {t['straggler_compute_factor']}x their median).""", cfg),
        a("GpuTrainHostMemoryLeak",
          f"""deriv({rss}[1h]) * {t['leak_horizon_seconds']}
            > {on_node} gputrain_host_memory_available_bytes{{{s}}}
          and deriv({rss}[15m]) * {t['leak_horizon_seconds']}
            > {on_node} gputrain_host_memory_available_bytes{{{s}}}""", "warning",
          f"""{who}: its resident memory grows fast enough to use up the node's available
          memory within {{{{ {t['leak_horizon_seconds']} | humanizeDuration }}}}.""", cfg),
        a("GpuTrainGPUMemoryNearLimit",
          f"gpu:gputrain_gpu_memory_used:ratio > {t['memory_near_limit']}", "warning",
          f"""{node_gpu} uses {{{{ $value | humanizePercentage }}}} of its memory.""", cfg),
        a("GpuTrainThrottling",
          f"gpu:gputrain_gpu_clock_event_throttle:ratio_rate5m > {t['throttle_ratio']}",
          "warning", f"""{node_gpu} was throttled {{{{ $value | humanizePercentage }}}} of the
          time (power cap, thermal slowdown or power brake).""", cfg),
        a("GpuTrainStalled",
          f"""time() - gputrain_training_last_step_timestamp_seconds{{{s}}} >
          {t['stalled_seconds']}""", "critical",
          f"""{who} made no step for {{{{ $value | humanizeDuration }}}} although it still
          reports.""", cfg),
        a("GpuTrainGPULost", f"gputrain_gpu_up{{{s}}} == 0", "critical",
          f"""GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {where} does not
          answer NVML (fallen off the bus).""", cfg),
        a("GpuTrainXidErrors", f"increase(gputrain_gpu_xid_errors_total{{{s}}}[10m]) > 0",
          "critical", f"""{node_gpu} reported Xid {{{{ $labels.xid }}}}
          {{{{ $value | printf "%.0f" }}}} time(s) in 10m.""", cfg),
        a("GpuTrainGPUMemoryFault",
          f"""increase({ecc}[10m]) > 0
          or ({ecc} > 0 unless {ecc} offset 10m)
          or gputrain_gpu_remapped_rows{{{s},state="failed"}} > 0""", "critical",
          f"""{node_gpu} has an uncorrectable memory error or a failed row remap.""", cfg),
        a("GpuTrainGPUMemoryFault",
          f"""gputrain_gpu_remapped_rows{{{s},state="pending"}} > 0
          or gputrain_gpu_retired_pages_pending{{{s}}} > 0""", "warning",
          f"""{node_gpu} has a memory row remap (or page retirement) waiting for a GPU
          reset.""", cfg),
        a("GpuTrainCollectorFailing", f"gputrain_collector_success{{{s}}} == 0", "warning",
          f"""The {{{{ $labels.collector }}}} collector on {where} has failed for a while;
          its metrics are missing.""", cfg),
        a("GpuTrainExporterDown", f"up{{{s}}} == 0", "critical",
          f"""{where} has not been scraped: its GPUs and runs are unmonitored.""", cfg),
    ]


HEADERS = {
    "all": "# Generated by `gputrain-exporter rules`: do not edit; change thresholds with\n"
           "# `gputrain-exporter rules --config my-thresholds.yml > gputrain.rules.yml`.\n"
           "# Everything, for a single Prometheus. Past one, load `--level node` on each shard\n"
           "# and `--level global` where all shards are seen.\n",
    "node": "# Generated by `gputrain-exporter rules --level node`: do not edit.\n"
            "# The recording rules and the alerts that need one node's raw series: load it on\n"
            "# every Prometheus that scrapes the exporters (each shard).\n",
    "global": "# Generated by `gputrain-exporter rules --level global`: do not edit.\n"
              "# The alerts that compare the ranks of a run across nodes: load it where every\n"
              "# shard's recorded series are seen (vmalert over VictoriaMetrics, a federating\n"
              "# Prometheus, Thanos or Mimir ruler). It needs no raw series and records nothing.\n",
}


def groups(overrides: dict | None = None, level: str = "all") -> list[dict]:
    """The rule groups for one level: ``node``, ``global`` or ``all`` (both)."""
    if level not in ("all", *LEVELS):
        raise ValueError(f"unknown level {level!r} (known: all, {', '.join(LEVELS)})")
    cfg = merge(DEFAULTS, overrides or {})
    alerts = _alerts(cfg)
    out = []
    if level in ("all", "node"):
        out.append({"name": "gputrain.recording", "interval": cfg["recording_interval"],
                    "rules": _recording(cfg["selector"], identity(cfg))})
        out.append({"name": "gputrain.alerts",
                    "rules": [a for a in alerts if BY_ALERT[a["alert"]].level == "node"]})
    if level in ("all", "global"):
        out.append({"name": "gputrain.global.alerts",
                    "rules": [a for a in alerts if BY_ALERT[a["alert"]].level == "global"]})
    return out


def render(overrides: dict | None = None, level: str = "all") -> str:
    """The rule file (YAML) for DEFAULTS with ``overrides`` applied, for one level."""
    doc = {"groups": groups(overrides, level)}
    return HEADERS[level] + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)


def render_prometheusrule(overrides: dict | None = None, level: str = "all") -> str:
    """The same groups as :func:`render`, as a Prometheus Operator PrometheusRule."""
    name = "gputrain-exporter" + ("" if level == "all" else f"-{level}")
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": name,
                        "labels": {"app.kubernetes.io/name": "gputrain-exporter",
                                   "app.kubernetes.io/component": "rules"}},
           "spec": {"groups": groups(overrides, level)}}
    flag = "" if level == "all" else f" --level {level}"
    header = (f"# Generated by `gputrain-exporter rules --format prometheusrule{flag}`: do not "
              "edit.\n# Its groups are those of the rule file of the same level (a test keeps "
              "them equal).\n")
    return header + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rules", help="print the Prometheus rule file with your thresholds")
    p.add_argument("--config", metavar="FILE",
                   help="YAML with any of: selector, run_labels, runbook_url, "
                        "recording_interval, thresholds.<name>, for.<alert>")
    p.add_argument("--level", choices=("all", *LEVELS), default="all",
                   help="all (default: one Prometheus does everything); node (recording rules "
                        "and one-node alerts, for each shard); global (alerts comparing a "
                        "run's ranks, where every shard is seen)")
    p.add_argument("--defaults", action="store_true", help="print the default settings")
    p.add_argument("--format", choices=("rules", "prometheusrule"), default="rules",
                   help="a Prometheus rule file, or a Prometheus Operator PrometheusRule")
    p.set_defaults(func=main)


def load_overrides(path: str | None) -> dict:
    """The user's thresholds file as a checked overrides mapping; ValueError names the fault."""
    if not path:
        return {}
    try:
        overrides = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"{path}: expected a mapping of settings")
    try:
        merge(DEFAULTS, overrides)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return overrides


def main(ns: argparse.Namespace) -> int:
    if ns.defaults:
        sys.stdout.write(yaml.safe_dump(DEFAULTS, sort_keys=False))
        return 0
    try:
        overrides = load_overrides(ns.config)
        text = (render_prometheusrule(overrides, ns.level) if ns.format == "prometheusrule"
                else render(overrides, ns.level))
    except ValueError as exc:
        print(f"gputrain-exporter rules: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
