"""The PromQL the heuristics are written in: the labels rules group and join by, the recording
rules (each reading of :mod:`exporter.heuristics.readings` as a series), and the context an
alert's condition is written with (:class:`Q`).

Every range comes from :data:`~exporter.heuristics.readings.WINDOWS`; ``diagnose`` asks for the
same expressions over another rate window (``recording_rules(..., rate="15m")``) rather than
rewriting them. The record names keep ``rate5m``, ``p99_30m``: they are the shipped names.
"""

from __future__ import annotations

import re
from typing import Any

from exporter.config import parse_duration
from exporter.heuristics.readings import WINDOWS, window_seconds
from exporter.protocol import OUTSIDE_STEP_PHASES

# the phases that are part of a step (evaluation, checkpoint saves and start-up are not)
IN_STEP = 'phase!~"' + "|".join(sorted(OUTSIDE_STEP_PHASES)) + '"'
OUTSIDE_STEP = 'phase=~"' + "|".join(sorted(OUTSIDE_STEP_PHASES)) + '"'
# badput causes beside the phases: what the rank's wall time went to when not stepping
DATA_WAIT_CAUSE, OUTSIDE_STEPS_CAUSE = "data_wait", "outside_steps"
# the clock-event reasons that are throttling (sync boost is not: it aligns clocks on purpose)
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
THROTTLE_REASONS = ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown")


class Identity:
    """The label lists the rules group and join by, from the ``run_labels`` setting.

    A run is ``run_labels`` (default ``run``); a node is the run labels other than ``run``
    (``cluster``) with ``job, instance``; a rank is a node's labels with ``run, rank``."""

    def __init__(self, run_labels: list[str] | tuple[str, ...] = ("run",)) -> None:
        self.run_labels = tuple(run_labels)
        self.extra = tuple(x for x in run_labels if x != "run")  # what tells runs apart
        self.node_tuple = tuple(dict.fromkeys([*self.extra, "job", "instance"]))
        self.rank_tuple = (*self.node_tuple, "run", "rank")
        # as PromQL label lists
        self.run = ", ".join(run_labels)
        self.node = ", ".join(self.node_tuple)
        self.rank = ", ".join(self.rank_tuple)
        self.gpu = f"{self.node}, gpu, uuid"
        self.run_gpu = ", ".join(dict.fromkeys([*run_labels, *self.node_tuple, "gpu", "uuid"]))


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


def new_errors(counter: str, window: str) -> str:
    """The errors of ``counter`` (a selector) new in ``window``: its increase, or the count of
    a series that appeared in it (a counter's first sample is no increase; the exporter writes
    an Xid code's series at its first error, and finds the driver's ECC count when it starts)."""
    return (f"(increase({counter}[{window}]) > 0) "
            f"or ({counter} > 0 unless {counter} offset {window})")


def restarts(selector: str, ids: Identity, window: str) -> str:
    """Of each rank, how often its process was replaced in ``window``: the resets of the
    counters each new process starts again from 0, its steps and its process tree's CPU
    seconds (the most either saw: a process that dies before its first step resets only the
    CPU). Its wall time does not reset: the daemon carries it across processes."""
    parts = [f'label_replace(resets({name}{{{selector}}}[{window}]), "counter", "{short}", "", "")'
             for name, short in (("gputrain_training_steps_total", "steps"),
                                 ("gputrain_training_process_cpu_seconds_total", "cpu"))]
    return f"max by ({ids.rank}) ({' or '.join(parts)})"


def tree_growth(pss: str, rss: str, window: str, offset: str = "") -> str:
    """Of each rank's series, how fast its process tree's memory grows over ``window`` (bytes
    per second): its proportional set size where the client pushes it, else its resident
    memory (which counts a page shared by its DataLoader workers once per worker, and misses
    the copies they make of it)."""
    off = f" offset {offset}" if offset else ""
    return f"(deriv({pss}[{window}]{off}) or deriv({rss}[{window}]{off}))"


def memory_outside(available: str, growth: str, ids: Identity, window: str,
                   offset: str = "") -> str:
    """Of each node, how fast its available memory falls (bytes per second) beyond what the
    training process trees' own memory explains: ``growth`` (of each rank, as
    :func:`tree_growth` writes it) summed over the node. A page a DataLoader worker copies on
    access, shared memory, a process no client reports: the memory lost outside the trees."""
    off = f" offset {offset}" if offset else ""
    node = ids.node
    return (f"-(max by ({node}) (deriv({available}[{window}]{off})) + (sum by ({node}) "
            f"({growth}) or max by ({node}) ({available}) * 0))")


def collector_age(selector: str, ids: Identity) -> str:
    """Of each collector, how old its last success was when Prometheus last scraped it, in
    the exporter's sampler intervals (scrape time less the success time: no clock but the
    exporter's own matters, and a frozen page ages at every scrape)."""
    last = f"gputrain_collector_last_success_timestamp_seconds{{{selector}}}"
    return (f"(timestamp({last}) - {last}) / on ({ids.node}) group_left "
            f"max by ({ids.node}) (gputrain_sampler_interval_seconds{{{selector}}})")


def rank_gpu_join(selector: str, per_gpu: str, ids: Identity) -> str:
    """``per_gpu`` (a recording rule name) for the GPUs each rank uses, joined through
    ``gputrain_training_gpu_info``: a rank's labels and gpu, uuid."""
    return (f"max by ({ids.rank}, gpu, uuid) (gputrain_training_gpu_info{{{selector}}}) "
            f"* on ({ids.gpu}) group_left {per_gpu}")


def recording_rules(selector: str, ids: Identity | None = None,
                    rate: str = WINDOWS["rate"]) -> dict[str, str]:
    """The recording rules' expressions by record name; ``rate`` is the range of their ratios
    and means (the shipped rules': the rate window)."""
    return {r["record"]: r["expr"] for r in recording(selector, ids or Identity(), rate)}


# "group_left name" must not become "group_left (expr)": the parser reads a label list there
_BARE_GROUPING = re.compile(r"\b(group_left|group_right) (?=[a-z_]+:)")


def inline(expr: str, records: dict[str, str]) -> str:
    """``expr`` with every recording rule it names replaced by the rule's expression, so it
    runs on a Prometheus that does not evaluate the rules (diagnose, a backfilled replay)."""
    pattern = re.compile("(?<![\\w:])(" + "|".join(map(re.escape, records))
                         + ")(?![\\w:])(\\[\\w+\\])?")

    def written(m: re.Match) -> str:
        # a recorded series over a range becomes a subquery of its expression
        return f"({records[m.group(1)]})" + (f"{m.group(2)[:-1]}:]" if m.group(2) else "")

    for _ in range(10):  # recording rules built on recording rules
        expr = _BARE_GROUPING.sub(r"\1 () ", expr)
        expr, n = pattern.subn(written, expr)
        if not n:
            return expr
    raise ValueError(f"recording rules nested too deep in {expr!r}")


# A rank's regime (exporter.heuristics.regime): where it began, and its age while the rank is
# read over the regime window instead of the rate window (absent otherwise)
REGIME_START = "run_rank:gputrain_training_regime_start_timestamp_seconds:max"
REGIME_SHORT = "run_rank:gputrain_training_regime_age_seconds:short_window"
GPU_BUSY, GPU_BUSY_REGIME = "gpu:gputrain_gpu_busy_ratio:rate5m", "gpu:gputrain_gpu_busy_ratio:rate1m"
RANK_GPU_BUSY = "run_rank_gpu:gputrain_gpu_busy_ratio:rate5m"
# over the rate window whatever the regime: whether the window straddles a restart
_NOT_SELECTED = ("run_rank:gputrain_training_restarts:resets5m",)


def regime_rules(s: str, ids: Identity, r: str = WINDOWS["rate"]) -> list[dict]:
    """Where each rank's regime began, and the selector of the ranks read over the regime
    window: those whose regime fills it and is younger than ``r``
    (:func:`exporter.heuristics.regime.short_window` is the same condition)."""
    young, window = window_seconds("regime"), parse_duration(r)
    return [
        _rec(REGIME_START, f"""
            max by ({ids.rank}) (gputrain_training_regime_start_timestamp_seconds{{{s}}})"""),
        _rec(REGIME_SHORT, f"(time() - {REGIME_START}) >= {young:g} < {window:g}"),
    ]


def regime_selected(short: str, long: str, ids: Identity) -> str:
    """A rank's reading over the regime window (``short``) where its regime is young, over the
    rate window (``long``) elsewhere."""
    return (f"(({short}) and on ({ids.rank}) {REGIME_SHORT}) or "
            f"(({long}) unless on ({ids.rank}) {REGIME_SHORT})")


def recording(s: str, ids: Identity, r: str = WINDOWS["rate"]) -> list[dict]:
    """Recording rules: level:metric:operation. Ratios divide separately-summed counters over
    ``r``, or over the regime window for a rank whose run changed pace less than ``r`` ago
    (:mod:`exporter.heuristics.regime`); the step-time percentiles take the quantile window."""
    rules = _windowed(s, ids, r)
    short = {x["record"]: x["expr"] for x in _windowed(s, ids, WINDOWS["regime"])}
    short[RANK_GPU_BUSY] = " ".join(rank_gpu_join(s, GPU_BUSY_REGIME, ids).split())
    out = []
    for rule in rules:
        name, expr = rule["record"], rule["expr"]
        if name == GPU_BUSY:
            out.append(_rec(GPU_BUSY_REGIME, short[GPU_BUSY]))
        if name.startswith("run_rank") and not any(x["record"] == REGIME_SHORT for x in out):
            out.extend(regime_rules(s, ids, r))  # before the first rank rule reads them
        if name.startswith("run_rank") and name not in _NOT_SELECTED and short[name] != expr:
            rule = _rec(name, regime_selected(short[name], expr, ids))
        out.append(rule)
    return out


def _windowed(s: str, ids: Identity, r: str) -> list[dict]:
    """The recording rules with every ratio and mean over ``r``."""
    rank, gpu, node, q = ids.rank, ids.gpu, ids.node, WINDOWS["quantile"]
    recent = WINDOWS["recent"]

    return [
        # per (run, rank): the training client's signals
        _rec("run_rank:gputrain_training_data_wait_ratio:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_data_wait_seconds_total{{{s}}}[{r}]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))"""),
        # samples per second of step time: the training loop's throughput, exact from a run's
        # first minute (a bare rate() over 5m reads low until the run is 5m old)
        _rec("run_rank:gputrain_training_samples_per_second:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_samples_total{{{s}}}[{r}]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))"""),
        _rec("run_rank:gputrain_training_step_seconds:mean5m", f"""
            sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[{r}]))"""),
        # gradient communication, where the client measures it: the share of the step time it
        # ran, and the share the step waited for it (exposed)
        _rec("run_rank:gputrain_training_comm_ratio:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_comm_seconds_total{{{s}}}[{r}]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))"""),
        _rec("run_rank:gputrain_training_comm_exposed_ratio:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_comm_exposed_seconds_total{{{s}}}[{r}]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))"""),
        # how often each rank's process was replaced in the rate window: rates across a
        # restart are no bottleneck (recorded, so that global rules may read it too)
        _rec("run_rank:gputrain_training_restarts:resets5m", restarts(s, ids, r)),
        _rec("run_rank:gputrain_training_comm_bytes:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_comm_bytes_total{{{s}}}[{r}]))"""),
        # a step's compute: its time less the data wait and, where measured, the wait for
        # gradient communication (a fast rank waiting for a slow one computes no longer)
        _rec("run_rank:gputrain_training_compute_seconds:mean5m", f"""
            (sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))
             - sum by ({rank}) (rate(gputrain_training_data_wait_seconds_total{{{s}}}[{r}]))
             - (sum by ({rank}) (rate(gputrain_training_comm_exposed_seconds_total{{{s}}}[{r}]))
                or 0 * sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[{r}]))"""),
        _rec("run_rank:gputrain_training_step_seconds:p50_30m", f"""
            histogram_quantile(0.5, sum by ({rank}, le)
              (rate(gputrain_training_step_duration_seconds_bucket{{{s}}}[{q}])))"""),
        _rec("run_rank:gputrain_training_step_seconds:p99_30m", f"""
            histogram_quantile(0.99, sum by ({rank}, le)
              (rate(gputrain_training_step_duration_seconds_bucket{{{s}}}[{q}])))"""),
        # of the wall time, the share in steps far above the rank's median (rare long stalls:
        # a DataLoader re-created each epoch, a checkpoint every few hundred steps)
        _rec("run_rank:gputrain_training_slow_step:ratio_rate30m", f"""
            sum by ({rank}) (rate(gputrain_training_slow_step_seconds_total{{{s}}}[{q}]))
            / sum by ({rank}) (rate(gputrain_training_elapsed_seconds_total{{{s}}}[{q}]))"""),
        # of the steps, the share far above the median, and the data wait over those steps'
        # seconds, with the loader's workers: a DataLoader's period (one slow step in N, the
        # wait in it) tells its batches arriving in groups from a stall
        _rec("run_rank:gputrain_training_slow_steps:ratio_rate30m", f"""
            sum by ({rank}) (rate(gputrain_training_slow_steps_total{{{s}}}[{q}]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[{q}]))"""),
        _rec("run_rank:gputrain_training_slow_step_data_wait:ratio_rate30m", f"""
            sum by ({rank}) (rate(gputrain_training_data_wait_seconds_total{{{s}}}[{q}]))
            / sum by ({rank}) (rate(gputrain_training_slow_step_seconds_total{{{s}}}[{q}]))"""),
        _rec("run_rank:gputrain_training_loader_workers:max", f"""
            max by ({rank}) (gputrain_training_loader_workers{{{s}}})"""),
        _rec("run_rank_phase:gputrain_training_phase_ratio:rate5m", f"""
            sum by ({rank}, phase) (rate(gputrain_training_phase_seconds_total{{{s}}}[{r}]))
            / on ({rank}) group_left
            sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))"""),
        _rec("run_rank:gputrain_training_step_phase_ratio:max_rate5m", f"""
            max by ({rank}) (
              sum by ({rank}, phase) (rate(gputrain_training_phase_seconds_total{{{s},{IN_STEP}}}[{r}]))
              / on ({rank}) group_left
              sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}])))"""),
        _rec("run_rank:gputrain_training_checkpoint_ratio:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_phase_seconds_total{{{s},phase="checkpoint"}}[{r}]))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))"""),
        _rec("run_rank:gputrain_training_process_cpu_cores:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_process_cpu_seconds_total{{{s}}}[{r}]))"""),
        # the process tree's CPU against what its cgroup allows, and the time it was throttled
        _rec("run_rank:gputrain_training_cpu_allowance_used:ratio_rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_process_cpu_seconds_total{{{s}}}[{r}]))
            / sum by ({rank}) (gputrain_training_process_cpu_allowance_cores{{{s}}})"""),
        _rec("run_rank:gputrain_training_cpu_throttled:ratio_rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_process_cpu_throttled_seconds_total{{{s}}}[{r}]))"""),
        # what diagnose reads where only the recorded series arrive (a global layer fed with
        # the recording rules' results): steps, the last step, the process tree's memory
        _rec("run_rank:gputrain_training_steps:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[{r}]))"""),
        _rec("run_rank:gputrain_training_last_step_timestamp_seconds:max", f"""
            max by ({rank}) (gputrain_training_last_step_timestamp_seconds{{{s}}})"""),
        _rec("run_rank:gputrain_training_process_resident_memory_bytes:sum", f"""
            sum by ({rank}) (gputrain_training_process_resident_memory_bytes{{{s}}})"""),
        # the tree's memory as the leak rule reads it: PSS where the client pushes it, else RSS
        _rec("run_rank:gputrain_training_process_memory_bytes:sum", f"""
            sum by ({rank}) (gputrain_training_process_proportional_memory_bytes{{{s}}})
            or sum by ({rank}) (gputrain_training_process_resident_memory_bytes{{{s}}})"""),
        # whether a rank still runs: when it last pushed, whether it said goodbye, and its
        # busiest GPU over the recent window (a vanished run's GPUs go idle)
        _rec("run_rank:gputrain_training_last_push_timestamp_seconds:max", f"""
            max by ({rank}) (gputrain_training_last_push_timestamp_seconds{{{s}}})"""),
        _rec("run_rank:gputrain_training_finished:max", f"""
            max by ({rank}) (gputrain_training_finished{{{s}}})"""),
        _rec("run_rank:gputrain_gpu_busy_ratio:max_rate2m", f"""
            max by ({rank}) (
              max by ({rank}, gpu, uuid) (gputrain_training_gpu_info{{{s}}})
              * on ({gpu}) group_left ()
              (sum by ({gpu}) (rate(gputrain_gpu_busy_seconds_total{{{s}}}[{recent}]))
               / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{recent}]))))"""),
        *_utilisation(s, ids, r),
        # per GPU
        # GPU ratios divide by the seconds the sampler watched: exact from the first scrapes
        # after an exporter (re)start, and blind time (a lost GPU) counts on neither side.
        _rec("gpu:gputrain_gpu_busy_ratio:rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_busy_seconds_total{{{s}}}[{r}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        _rec("gpu:gputrain_gpu_memory_used:ratio", f"""
            sum by ({gpu}) (gputrain_gpu_memory_used_bytes{{{s}}})
            / sum by ({gpu}) (gputrain_gpu_memory_total_bytes{{{s}}})"""),
        _rec("gpu:gputrain_gpu_power_limit_used:ratio_avg5m", f"""
            sum by ({gpu}) (avg_over_time(gputrain_gpu_power_watts{{{s}}}[{r}]))
            / sum by ({gpu}) (gputrain_gpu_power_limit_watts{{{s}}})"""),
        # the link as it ran in the window (its best: an idle link trains down between
        # bursts) and at its best; host-to-device traffic is judged against the first
        _rec("gpu:gputrain_gpu_pcie_link_current:max5m", f"""
            max by ({gpu}) (max_over_time(
              gputrain_gpu_pcie_link_current_bytes_per_second{{{s}}}[{r}]))"""),
        _rec("gpu:gputrain_gpu_pcie_link_max:max",
            f"max by ({gpu}) (gputrain_gpu_pcie_link_max_bytes_per_second{{{s}}})"),
        _rec("gpu:gputrain_gpu_pcie_rx_link_used:ratio_rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_pcie_received_bytes_total{{{s}}}[{r}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))
            / (gpu:gputrain_gpu_pcie_link_current:max5m or gpu:gputrain_gpu_pcie_link_max:max)"""),
        _rec("gpu:gputrain_gpu_sm_active_ratio:avg5m",
            f"avg by ({gpu}) (avg_over_time(gputrain_gpu_sm_active_ratio{{{s}}}[{r}]))"),
        _rec("gpu:gputrain_gpu_tensor_active_ratio:avg5m",
            f"avg by ({gpu}) (avg_over_time(gputrain_gpu_tensor_active_ratio{{{s}}}[{r}]))"),
        # mean power from the energy counter: exact over the window, unlike sampled gauges
        _rec("gpu:gputrain_gpu_power_watts:rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_energy_joules_total{{{s}}}[{r}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        _rec("gpu:gputrain_gpu_clock_event_throttle:ratio_rate5m", f"""
            sum by ({gpu}) (rate(gputrain_gpu_clock_event_seconds_total{{{s},
              reason=~"{'|'.join(THROTTLE_REASONS)}"}}[{r}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        # a rank's GPUs, joined through gputrain_training_gpu_info
        *[_rec(f"run_rank_gpu:{name.split(':', 1)[1].rsplit(':', 1)[0]}:{name.rsplit(':', 1)[1]}",
              rank_gpu_join(s, name, ids))
          for name in ("gpu:gputrain_gpu_busy_ratio:rate5m",
                       "gpu:gputrain_gpu_memory_used:ratio",
                       "gpu:gputrain_gpu_power_limit_used:ratio_avg5m",
                       "gpu:gputrain_gpu_pcie_rx_link_used:ratio_rate5m",
                       "gpu:gputrain_gpu_pcie_link_current:max5m",
                       "gpu:gputrain_gpu_pcie_link_max:max",
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
            / (sum by ({rank}) (rate(gputrain_training_samples_total{{{s}}}[{r}]))
               / sum by ({rank}) (rate(gputrain_training_elapsed_seconds_total{{{s}}}[{r}])))"""),
        # GPU-seconds per second that a run's GPUs sat idle while it held them (a GPU two
        # ranks share counts once); sum_over_time(...[range]) * the recording interval is
        # GPU-seconds over the range
        _rec("run:gputrain_gpu_wasted_seconds:rate5m", f"""
            sum by ({ids.run}) (max by ({ids.node}, run, gpu, uuid)
              (1 - run_rank_gpu:gputrain_gpu_busy_ratio:rate5m))"""),
        # a GPU's shares: each run's (its ranks' processes) and no rank's, from the processes'
        # busy seconds; a run that holds the GPU but had no busy sample counts 0. A share
        # leaves with its processes: the exporter drops a rank's busy counter of a GPU once
        # none of its processes is on it (stale at once, where a range would hold it for the
        # window), and the unattributed share counts while a process no rank owns is there
        _rec("run_gpu:gputrain_training_gpu_busy:ratio_rate5m", f"""
            (sum by ({ids.run_gpu}) (rate(gputrain_training_gpu_busy_seconds_total{{{s}}}[{r}])
                                    and gputrain_training_gpu_busy_seconds_total{{{s}}})
             or 0 * max by ({ids.run_gpu}) (gputrain_training_gpu_info{{{s}}}))
            / on ({gpu}) group_left
            sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        _rec("gpu:gputrain_gpu_unattributed_busy:ratio_rate5m", f"""
            (sum by ({gpu}) (rate(gputrain_gpu_unattributed_busy_seconds_total{{{s}}}[{r}]))
               and on ({gpu}) (max by ({gpu}) (gputrain_gpu_unattributed_processes{{{s}}}) > 0)
             or 0 * sum by ({gpu}) (rate(gputrain_gpu_unattributed_busy_seconds_total{{{s}}}[{r}])))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        # what of a GPU's time a run does not own: busy with other runs' processes or with
        # processes no client reports (only where the driver gives per-process samples)
        _rec("run_gpu:gputrain_gpu_foreign_busy:ratio_rate5m", f"""
            (gpu:gputrain_gpu_unattributed_busy:ratio_rate5m
             + on ({gpu}) sum by ({gpu}) (run_gpu:gputrain_training_gpu_busy:ratio_rate5m))
            - on ({gpu}) group_right run_gpu:gputrain_training_gpu_busy:ratio_rate5m"""),
        # per node
        _rec("instance:gputrain_host_cpu_busy:ratio_rate5m", f"""
            1 - sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s},mode=~"idle|iowait"}}[{r}]))
            / sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s}}}[{r}]))"""),
        _rec("instance:gputrain_host_memory_available_bytes:sum",
            f"sum by ({node}) (gputrain_host_memory_available_bytes{{{s}}})"),
        _rec("instance:gputrain_host_cpu_iowait:ratio_rate5m", f"""
            sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s},mode="iowait"}}[{r}]))
            / sum by ({node}) (rate(gputrain_host_cpu_seconds_total{{{s}}}[{r}]))"""),
        _rec("instance:gputrain_host_disk_busy:max_rate5m", f"""
            max by ({node}) (rate(gputrain_host_disk_io_time_seconds_total{{{s}}}[{r}]))"""),
        _rec("instance:gputrain_host_network_receive_link_used:max_ratio_rate5m", f"""
            max by ({node}) (
              rate(gputrain_host_network_received_bytes_total{{{s}}}[{r}])
              / gputrain_host_network_speed_bytes_per_second{{{s}}})"""),
        # of the busiest interface, the lesser of its two directions against its speed: a
        # link saturated both ways (an all-reduce sends as much as it receives), not an input
        _rec("instance:gputrain_host_network_duplex_link_used:max_ratio_rate5m", f"""
            max by ({node}) (
              (rate(gputrain_host_network_received_bytes_total{{{s}}}[{r}])
               / gputrain_host_network_speed_bytes_per_second{{{s}}})
              < (rate(gputrain_host_network_transmitted_bytes_total{{{s}}}[{r}])
                 / gputrain_host_network_speed_bytes_per_second{{{s}}})
              or (rate(gputrain_host_network_transmitted_bytes_total{{{s}}}[{r}])
                  / gputrain_host_network_speed_bytes_per_second{{{s}}}))"""),
    ]


def _rec(name: str, expr: str) -> dict:
    """A recording rule, its expression on one line."""
    return {"record": name, "expr": " ".join(expr.split())}


def _utilisation(s: str, ids: Identity, r: str) -> list[dict]:
    """MFU, goodput and badput by cause. Each divides by the rank's wall seconds
    (``gputrain_training_elapsed_seconds_total``), so it is exact from a run's first minute
    and a restart's gap counts as time outside steps."""
    rank, gpu = ids.rank, ids.gpu
    wall = f"sum by ({rank}) (rate(gputrain_training_elapsed_seconds_total{{{s}}}[{r}]))"
    steps = f"sum by ({rank}) (rate(gputrain_training_step_duration_seconds_sum{{{s}}}[{r}]))"
    wait = f"sum by ({rank}) (rate(gputrain_training_data_wait_seconds_total{{{s}}}[{r}]))"

    def phases(selector: str) -> str:
        # 0 where the rank has no such phase, rather than no result at all
        return (f"(sum by ({rank}) (rate(gputrain_training_phase_seconds_total{{{s},{selector}}}"
                f"[{r}])) or 0 * {wall})")

    return [
        # the summed peak of a rank's GPUs at the precision it trains in
        _rec("run_rank:gputrain_gpu_peak_flops:sum", f"""
            sum by ({rank}) (
              max by ({rank}, gpu, uuid, precision) (gputrain_training_gpu_info{{{s}}})
              * on ({gpu}, precision) group_left
              max by ({gpu}, precision) (gputrain_gpu_peak_flops{{{s}}}))"""),
        _rec("run_rank:gputrain_training_mfu:ratio_rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_flops_total{{{s}}}[{r}])) / {wall}
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
                  rate(gputrain_training_phase_seconds_total{{{s}}}[{r}]),
                  "cause", "$1", "phase", "(.+)"))
             or label_replace(clamp_min({wall} - {steps} - {phases(OUTSIDE_STEP)}, 0),
                  "cause", "{OUTSIDE_STEPS_CAUSE}", "", ""))
            / on ({rank}) group_left run_rank:gputrain_training_accounted_seconds:rate5m"""),
    ]


class Q:
    """What an alert's condition is written with: the rule settings ``cfg`` (their scrape-job
    selector ``s`` and thresholds ``t``), the grouping labels, the recorded readings' names
    and the phrases its description names the rank, GPU or node with."""

    # the recorded readings an alert compares (their ranges are the rate window's)
    wait = "run_rank:gputrain_training_data_wait_ratio:rate5m"
    comm = "run_rank:gputrain_training_comm_exposed_ratio:rate5m"  # where it is measured
    busy = "run_rank_gpu:gputrain_gpu_busy_ratio:rate5m"  # each GPU of a rank
    rank_busy = "run_rank:gputrain_gpu_busy_ratio:avg5m"  # the mean over a rank's GPUs
    steps = "run_rank:gputrain_training_steps:rate5m"

    def __init__(self, cfg: dict, ids: Identity) -> None:
        self.cfg, self.s, self.t, self.ids = cfg, cfg["selector"], cfg["thresholds"], ids
        self.rank, self.run, self.node = ids.rank, ids.run, ids.node
        # "on node-1 (cluster a)": the run labels beyond `run` name where the node is
        self.where = "{{ $labels.instance }}" + "".join(
            f" ({x} {{{{ $labels.{x} }}}})" for x in ids.extra if x != "job")
        self.who = f"Run {{{{ $labels.run }}}} rank {{{{ $labels.rank }}}} on {self.where}"
        self.gpu_who = f"GPU {{{{ $labels.gpu }}}} of {self.who[0].lower()}{self.who[1:]}"
        self.node_gpu = f"GPU {{{{ $labels.gpu }}}} on {self.where}"
        self.on_node = f"on ({ids.node}) group_left"
        self.fault = WINDOWS["fault"]

    def stepping(self, expr: str) -> str:
        """``expr`` (of a rank, or of a rank's GPUs) only while the rank steps, with one
        process over the rate window, and still runs: a run whose steps stopped while its GPUs
        spin is stalled, and nothing else holds for it; rates across a restart are no
        bottleneck; a rank that said goodbye, or went silent, left only history behind."""
        return (f"({expr}) and on ({self.rank}) ({self.steps} > 0) unless on ({self.rank}) "
                f"(run_rank:gputrain_training_finished:max > 0 or time() - "
                f"run_rank:gputrain_training_last_push_timestamp_seconds:max > "
                f"{self.t['vanished_seconds']} or "
                f"run_rank:gputrain_training_restarts:resets5m > 0)")

    def refined(self, record: str, threshold: str) -> str:
        """A refinement's reading (a recorded node series) at ``threshold``, with hysteresis:
        at or over the line within the hold range, and not since below it less the margin
        (as :func:`exporter.heuristics.catalogue.refined` judges a window's readings)."""
        line = self.t[threshold]
        low = round(line - self.t["refinement_margin"], 6)
        return (f"({record} >= {low} and max_over_time({record}[{WINDOWS['hold']}]) "
                f">= {line})")

    def unrefined(self, record: str, threshold: str) -> str:
        """The reading where it is known and the refinement does not hold."""
        return f"({record} unless {self.refined(record, threshold)})"

    def fresh(self, expr: str) -> str:
        """``expr`` only where no collector of its node is stale: nothing but a fault is
        judged on frozen readings."""
        return (f"({expr}) unless on ({self.node}) (max by ({self.node}) "
                f"({collector_age(self.s, self.ids)}) > {self.t['stale_intervals']})")

    def outside_steps(self) -> str:
        """Of each rank, the seconds a second in phases outside steps (an evaluation, a
        checkpoint). Raw, as recorded readings cannot take a selector once inlined; it is
        above 0 where the badput of those phases is, as every client that pushes a phase in
        progress also pushes its wall time."""
        return (f"sum by ({self.rank}) (rate(gputrain_training_phase_seconds_total"
                f"{{{self.s},{OUTSIDE_STEP}}}[{WINDOWS['rate']}]))")

    def metric(self, name: str, matchers: str = "") -> str:
        """A raw series under the selector (``matchers`` added inside the braces)."""
        return f"{name}{{{self.s}{',' + matchers if matchers else ''}}}"

