"""What the heuristics judge: one window's readings of a rank, its GPUs and its node.

They come from Prometheus (``diagnose`` queries the recording rules' values) or from the
daemon's own history (:mod:`exporter.serving.history`, for ``/``, ``/api/v1/status`` and
``top``); :mod:`exporter.heuristics.verdict` judges either with the catalogue's conditions. The
windows every reading is taken over are one table, :data:`WINDOWS`, that the rules, the
history and ``diagnose`` read; the readings themselves are another, :data:`READINGS`: one
:class:`Reading` a row, its name, scope, recorded series and the PromQL it is recorded from,
from which the recording rules (:mod:`exporter.heuristics.promql`) and ``diagnose``'s queries
follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from exporter.heuristics.expr import (
    Aggregate,
    Expr,
    Fragment,
    Gauge,
    Number,
    Quantile,
    Rate,
    Series,
)
from exporter.protocol import OUTSIDE_STEP_PHASES

# The ranges the readings are taken over, as PromQL writes them (seconds: window_seconds())
WINDOWS = {
    "rate": "5m",  # every ratio of counters and mean of gauges
    "quantile": "30m",  # the step-time percentiles of the stall rule
    "leak": "1h",  # the leak rule's long range ...
    "leak_recent": "15m",  # ... and its recent one
    "fault": "10m",  # new Xid and uncorrectable ECC errors, a fresh exporter's finds
    "recent": "2m",  # a vanished run's GPUs: idle since its ranks went silent
    "restart": "1h",  # a rank's process restarts counted for the crash-loop rule
    "regime": "1m",  # a rank whose run changed (exporter.heuristics.regime) is read over this
    # a refinement entered (its reading at its line) holds while the reading stays within the
    # margin below it and reached the line within this range: hysteresis, from the window
    "hold": "5m",
    # a cost that recurs for minutes at a time (a checkpoint, an evaluation, a DataLoader's
    # start each epoch) is judged by its share of the wall time over this: long enough to
    # hold several occurrences, none of which lasts an alert's `for:`
    "periodic": "1h",
}


# the leak rule's three spans of a sustained slope, as (range, offset) by the suffix of the
# readings taken over them: the long range, the recent one and the recent one before it
LEAK_SPANS = {"1h": (WINDOWS["leak"], ""), "15m": (WINDOWS["leak_recent"], ""),
              "15m_before": (WINDOWS["leak_recent"], WINDOWS["leak_recent"])}


def window_seconds(name: str) -> float:
    """A window of :data:`WINDOWS` in seconds."""
    return duration_seconds(WINDOWS[name])


def duration_seconds(text: str) -> float:
    """A PromQL duration of one unit ('15m') in seconds; '' is 0."""
    return float(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]] if text else 0.0


Scope = Literal["rank", "rank_gpu", "run_gpu", "node"]


@dataclass(frozen=True)
class Reading:
    """One reading the heuristics judge, as one row: what it is called, what it is of, the
    recorded series that holds it and the PromQL that series is recorded from.

    ``field``: the :class:`RankReport` field (scope ``rank``), :class:`GpuReading` field
    (``rank_gpu``, ``run_gpu``) or key of a report's ``host`` (``node``) it fills.
    ``scope``: what it is of: a rank; a GPU as a rank uses it (recorded per GPU as the ``gpu:``
    series :attr:`gpu_record` names, and for each rank's GPUs as ``record``, joined through
    ``gputrain_training_gpu_info``); a run's share of a GPU; a node.
    ``record``: the recorded series diagnose reads where only the rules' results arrive.
    ``window``: the :data:`WINDOWS` key it is taken over (``rate``: the rate window the rules
    are made with, ``diagnose --window`` included); None for a gauge read as it is.
    ``expr``: the recording rule's PromQL, a template :func:`exporter.heuristics.promql.recording`
    formats with the selector ``s``, the label lists ``rank``, ``gpu``, ``node``, ``run``,
    ``run_gpu``, the window's range ``w`` and the fragments its ``_fragments`` names; or, for a
    rank's or a node's reading, an expression tree (:mod:`exporter.heuristics.expr`) that
    renders that template and that the daemon evaluates over its own points (``tree``).
    ``by``: the label a reading of several values is keyed by (the field is a dict).
    ``since``: the series is a unix time; the reading is the seconds since it.
    ``refined``: a node reading that refines input-bound into a stage, judged with hysteresis
    (:data:`REFINED`).
    ``detail``: with ``by``, a second label kept beside it (in the field ``<field>_detail``):
    the function a rank is stuck in, the exception that ended it.
    ``of_node``: for scope ``rank_gpu``: read for every GPU of a node too, whoever uses it (the
    node's GPU findings: a throttle, a degraded link, a full memory of a GPU no rank names).

    The daemon's history (:mod:`exporter.serving.history`) reads a reading with a tree by
    evaluating the tree, and a rank's gauge read as it is (``max by ({rank})
    (family{{{s}}})``, or ``min``) from this row and the family's own sample
    (``history.read_gauges``), with nothing written for either; the rest it computes from its
    own samples, in Python. tests/test_agreement.py holds it to this table.
    """

    field: str
    scope: Scope
    record: str
    window: str | None
    expr: str | Expr
    by: str | None = None
    since: bool = False
    refined: bool = False
    detail: str | None = None
    of_node: bool = False
    tree: Expr | None = None  # the expression ``expr`` was rendered from, where it was

    def __post_init__(self) -> None:
        if isinstance(self.expr, Expr):
            object.__setattr__(self, "tree", self.expr)
            object.__setattr__(self, "expr", self.expr.template())

    @property
    def template(self) -> str:
        """The recording rule's PromQL template (``expr``, rendered where it was a tree)."""
        assert isinstance(self.expr, str)
        return self.expr

    @property
    def gpu_record(self) -> str:
        """For scope ``rank_gpu``: the per-GPU series the rank's is joined from."""
        return "gpu:" + self.record.split(":", 1)[1]

    @property
    def names(self) -> tuple[str, ...]:
        """The readings it gives: its field, or for the leak window one per span of
        :data:`LEAK_SPANS` (``rss_growth_1h``: the series' slope over that span)."""
        if self.window == "leak":
            return tuple(f"{self.field}_{span}" for span in LEAK_SPANS)
        return (self.field,)


# Recorded series the readings' templates read that are not readings themselves (the rules
# beside them in exporter.heuristics.promql record them): each named here once, and written
# into a template as the fragment of its lower-case name (``{run_gpu_busy}``)
RUN_GPU_BUSY = "run_gpu:gputrain_training_gpu_busy:ratio_rate5m"
UNATTRIBUTED_BUSY = "gpu:gputrain_gpu_unattributed_busy:ratio_rate5m"
ACCOUNTED = "run_rank:gputrain_training_accounted_seconds:rate5m"  # the wall time's parts
PEAK_FLOPS = "run_rank:gputrain_gpu_peak_flops:sum"  # MFU's denominator
RECORDED_FRAGMENTS = {"run_gpu_busy": RUN_GPU_BUSY, "unattributed_busy": UNATTRIBUTED_BUSY,
                      "accounted": ACCOUNTED, "peak_flops": PEAK_FLOPS}


# A rank's counters the readings' trees rate (the page's families, named here once for them)
STEP = "gputrain_training_step_duration_seconds"  # the step histogram: its _sum, _count, _bucket
STEP_SECONDS = Rate(STEP + "_sum")
STEPS = Rate(STEP + "_count")
WAIT = Rate("gputrain_training_data_wait_seconds_total")
SLOW_SECONDS = Rate("gputrain_training_slow_step_seconds_total")
# the rank's wall seconds: what MFU, goodput and badput divide by (the fragment ``{wall}``)
WALL = Rate("gputrain_training_elapsed_seconds_total")
SAMPLES = Rate("gputrain_training_samples_total")
PHASE_SECONDS = Rate("gputrain_training_phase_seconds_total", by="phase")


# A node's families the readings' trees read
CPU = "gputrain_host_cpu_seconds_total"  # by mode
CPU_SECONDS = Aggregate("sum", Series(CPU, "mode"))
RECEIVED = Series("gputrain_host_network_received_bytes_total", "interface")
SENT = Series("gputrain_host_network_transmitted_bytes_total", "interface")
LINK_SPEED = Series("gputrain_host_network_speed_bytes_per_second", "interface", rate=False)
RX_USED, TX_USED = RECEIVED / LINK_SPEED, SENT / LINK_SPEED  # each interface against its link
DISK_READ = "gputrain_host_disk_read_bytes_total"  # by device, as the next
DISK_WRITTEN = "gputrain_host_disk_written_bytes_total"


# Every reading, by scope; within one, in the order the rules are written (a rule that reads
# another's series comes after it anyway). Ratios of counters divide separately-summed rates
READINGS = (
    # per (run, rank): the training client's signals. Where its run changed pace less than a
    # rate window ago, a rate-window reading is read over the regime window (promql.recording)
    Reading("regime_changed_seconds", "rank",
            "run_rank:gputrain_training_regime_start_timestamp_seconds:max", None,
            "{regime_start}", since=True),
    Reading("data_wait_ratio", "rank", "run_rank:gputrain_training_data_wait_ratio:rate5m",
            "rate", WAIT / STEP_SECONDS),
    # samples per second of step time: the training loop's throughput, exact from a run's
    # first minute (a bare rate() over 5m reads low until the run is 5m old)
    # (the step in progress weighs in both once it runs longer than the mean step:
    # :func:`with_open_step`, the fragments open_part and open_count)
    Reading("samples_per_second", "rank",
            "run_rank:gputrain_training_samples_per_second:rate5m", "rate",
            SAMPLES / (STEP_SECONDS + Fragment("open_part"))),
    Reading("step_seconds", "rank", "run_rank:gputrain_training_step_seconds:mean5m", "rate",
            (STEP_SECONDS + Fragment("open_part")) / (STEPS + Fragment("open_count"))),
    # gradient communication, where the client measures it: the share of the step time it
    # ran, and the share the step waited for it (exposed)
    Reading("comm_ratio", "rank", "run_rank:gputrain_training_comm_ratio:rate5m", "rate",
            Rate("gputrain_training_comm_seconds_total") / STEP_SECONDS),
    Reading("comm_exposed_ratio", "rank", "run_rank:gputrain_training_comm_exposed_ratio:rate5m",
            "rate", Rate("gputrain_training_comm_exposed_seconds_total") / STEP_SECONDS),
    Reading("step_p50_seconds", "rank", "run_rank:gputrain_training_step_seconds:p50_30m",
            "quantile", Quantile(0.5, STEP)),
    Reading("step_p99_seconds", "rank", "run_rank:gputrain_training_step_seconds:p99_30m",
            "quantile", Quantile(0.99, STEP)),
    # of the wall time, the share in steps far above the rank's median (rare long stalls:
    # a DataLoader re-created each epoch, a checkpoint every few hundred steps)
    Reading("stall_share", "rank", "run_rank:gputrain_training_slow_step:ratio_rate30m",
            "quantile", SLOW_SECONDS / WALL),
    # of the steps, the share far above the median, and the data wait over those steps'
    # seconds, with the loader's workers: a DataLoader's period (one slow step in N, the
    # wait in it) tells its batches arriving in groups from a stall
    Reading("slow_step_ratio", "rank", "run_rank:gputrain_training_slow_steps:ratio_rate30m",
            "quantile", Rate("gputrain_training_slow_steps_total") / STEPS),
    Reading("slow_step_wait", "rank",
            "run_rank:gputrain_training_slow_step_data_wait:ratio_rate30m", "quantile",
            WAIT / SLOW_SECONDS),
    # of the wall time over the periodic window, the share in each phase outside the steps
    # (a checkpoint, an evaluation, a DataLoader's start): costs that recur for minutes
    Reading("periodic", "rank", "run_rank_phase:gputrain_training_outside_share:ratio_rate1h",
            "periodic", """
            sum by ({rank}, phase) (rate(gputrain_training_phase_seconds_total{{{s},{outside}}}[{w}]))
            / on ({rank}) group_left {wall}""", by="phase"),
    Reading("loader_workers", "rank", "run_rank:gputrain_training_loader_workers:max", None,
            Gauge("gputrain_training_loader_workers", "max")),
    Reading("collective_timeout", "rank",
            "run_rank:gputrain_training_collective_timeout_seconds:min", None,
            Gauge("gputrain_training_collective_timeout_seconds", "min")),
    Reading("phases", "rank", "run_rank_phase:gputrain_training_phase_ratio:rate5m", "rate",
            PHASE_SECONDS / STEP_SECONDS, by="phase"),
    # the process tree's CPU against what its cgroup allows, and the time it was throttled
    Reading("cpu_allowance_used", "rank",
            "run_rank:gputrain_training_cpu_allowance_used:ratio_rate5m", "rate",
            Rate("gputrain_training_process_cpu_seconds_total")
            / Gauge("gputrain_training_process_cpu_allowance_cores")),
    Reading("cpu_throttled", "rank", "run_rank:gputrain_training_cpu_throttled:ratio_rate5m",
            "rate", Rate("gputrain_training_process_cpu_throttled_seconds_total")),
    # what diagnose reads where only the recorded series arrive (a global layer fed with
    # the recording rules' results): steps, the last step, the process tree's memory
    Reading("steps_per_second", "rank", "run_rank:gputrain_training_steps:rate5m", "rate",
            STEPS),
    Reading("seconds_since_step", "rank",
            "run_rank:gputrain_training_last_step_timestamp_seconds:max", None,
            Gauge("gputrain_training_last_step_timestamp_seconds", "max"),
            since=True),
    # the tree's memory as the leak rule reads it: PSS where the client pushes it, else RSS
    Reading("rss_growth", "rank", "run_rank:gputrain_training_process_memory_bytes:sum", "leak",
            """
            sum by ({rank}) (gputrain_training_process_proportional_memory_bytes{{{s}}})
            or sum by ({rank}) (gputrain_training_process_resident_memory_bytes{{{s}}})"""),
    # whether a rank still runs: when it last pushed, whether it said goodbye, and its
    # busiest GPU over the recent window (a vanished run's GPUs go idle)
    Reading("seconds_since_push", "rank",
            "run_rank:gputrain_training_last_push_timestamp_seconds:max", None,
            "{last_push}", since=True),
    # the exporter of its node finds its process running: a silent rank that runs is frozen
    Reading("process_running", "rank", "run_rank:gputrain_training_process_running:max", None,
            Gauge("gputrain_training_process_running", "max")),
    Reading("finished", "rank", "run_rank:gputrain_training_finished:max", None,
            Gauge("gputrain_training_finished", "max")),
    # how a rank that said goodbye ended: a failure (an exception, a signal) is no finish
    Reading("failed", "rank", "run_rank:gputrain_training_failed:max", None,
            Gauge("gputrain_training_failed", "max")),
    Reading("exit", "rank", "run_rank_reason:gputrain_training_exit_info:max", None,
            "max by ({rank}, reason, detail) (gputrain_training_exit_info{{{s}}})",
            by="reason", detail="detail"),
    # the time: the step in progress and the outside-step phase in progress, aged by the
    # daemon's own clock, and the pace they are judged against (the mean step of the
    # rank's process so far: the rate window's empties while a rank hangs)
    Reading("step_in_progress", "rank", "run_rank:gputrain_training_step_in_progress_seconds:max",
            None, Gauge("gputrain_training_step_in_progress_seconds", "max")),
    Reading("phase_in_progress", "rank",
            "run_rank_phase:gputrain_training_phase_in_progress_seconds:max", None,
            "max by ({rank}, phase) (gputrain_training_phase_in_progress_seconds{{{s}}})",
            by="phase"),
    Reading("typical_step_seconds", "rank", "run_rank:gputrain_training_step_seconds:mean", None,
            Gauge(STEP + "_sum") / (Gauge(STEP + "_count") > Number(0))),
    # where a hung rank is: the daemon's classification of the dump it took
    Reading("location", "rank", "run_rank_location:gputrain_training_stack_location:max", None,
            "max by ({rank}, location, function) (gputrain_training_stack_location{{{s}}})",
            by="location", detail="function"),
    Reading("recent_busy", "rank", "run_rank:gputrain_gpu_busy_ratio:max_rate2m", "recent", """
            max by ({rank}) (
              max by ({rank}, gpu, uuid) (gputrain_training_gpu_info{{{s}}})
              * on ({gpu}) group_left ()
              (sum by ({gpu}) (rate(gputrain_gpu_busy_seconds_total{{{s}}}[{w}]))
               / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{w}]))))"""),
    # a rank's share of each of its GPUs: of the time that GPU's processes kept it busy, the
    # part the rank's own processes did (only where the driver gives per-process samples and
    # the GPU's processes did work in the window). A GPU it holds but does no work on (a stray
    # CUDA context: torch.load without map_location) reads 0; MFU's peak counts each GPU by it
    Reading("gpu_share", "rank", "run_rank_gpu:gputrain_training_gpu_share:ratio_rate5m", "rate",
            """
            (sum by ({rank}, gpu, uuid) (
               rate(gputrain_training_gpu_busy_seconds_total{{{s}}}[{w}])
               and gputrain_training_gpu_busy_seconds_total{{{s}}})
             / on ({gpu}) group_left
             sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{w}])))
            / on ({gpu}) group_left ()
            ((sum by ({gpu}) ({run_gpu_busy})
              + on ({gpu}) {unattributed_busy}) > 0)""",
            by="gpu"),
    # the GPU memory the rank's processes hold on each GPU (NVML's process list)
    Reading("gpu_memory_held", "rank", "run_rank_gpu:gputrain_training_gpu_memory:bytes", None,
            "max by ({rank}, gpu, uuid) (gputrain_training_gpu_memory_bytes{{{s}}})", by="gpu"),
    # MFU, goodput and badput by cause divide by the rank's wall seconds
    # (``gputrain_training_elapsed_seconds_total``, ``{wall}``), so they are exact from a
    # run's first minute and a restart's gap counts as time outside steps
    Reading("mfu", "rank", "run_rank:gputrain_training_mfu:ratio_rate5m", "rate",
            Rate("gputrain_training_flops_total") / WALL / Fragment("peak_flops")),
    # goodput and badput are shares of the wall time's parts (promql's accounted seconds)
    Reading("goodput", "rank", "run_rank:gputrain_training_goodput:ratio_rate5m", "rate", """
            {productive} / {accounted}"""),
    Reading("badput", "rank", "run_rank_cause:gputrain_training_badput:ratio_rate5m", "rate", """
            (label_replace({wait}, "cause", "{data_wait_cause}", "", "")
             or sum by ({rank}, cause) (label_replace(
                  rate(gputrain_training_phase_seconds_total{{{s}}}[{w}]),
                  "cause", "$1", "phase", "(.+)"))
             or label_replace({outside_steps}, "cause", "{outside_steps_cause}", "", ""))
            / on ({rank}) group_left {accounted}""",
            by="cause"),
    # per GPU. GPU ratios divide by the seconds the sampler watched: exact from the first
    # scrapes after an exporter (re)start, and blind time (a lost GPU) counts on neither side
    Reading("busy", "rank_gpu", "run_rank_gpu:gputrain_gpu_busy_ratio:rate5m", "rate", """
            sum by ({gpu}) (rate(gputrain_gpu_busy_seconds_total{{{s}}}[{w}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{w}]))""",
            of_node=True),
    # the memory used as most of the window saw it (its median): a GPU at its ceiling two
    # readings in three is at its ceiling, whatever the dips between
    Reading("memory_used", "rank_gpu", "run_rank_gpu:gputrain_gpu_memory_used:ratio", "rate",
            """
            sum by ({gpu}) (quantile_over_time(0.5, gputrain_gpu_memory_used_bytes{{{s}}}[{w}]))
            / sum by ({gpu}) (gputrain_gpu_memory_total_bytes{{{s}}})""", of_node=True),
    Reading("power_used", "rank_gpu", "run_rank_gpu:gputrain_gpu_power_limit_used:ratio_avg5m",
            "rate", """
            sum by ({gpu}) (avg_over_time(gputrain_gpu_power_watts{{{s}}}[{w}]))
            / sum by ({gpu}) (gputrain_gpu_power_limit_watts{{{s}}})"""),
    # host-to-device traffic, judged against the link as it ran (else at its best)
    Reading("pcie_rx_used", "rank_gpu", "run_rank_gpu:gputrain_gpu_pcie_rx_link_used:ratio_rate5m",
            "rate", """
            sum by ({gpu}) (rate(gputrain_gpu_pcie_received_bytes_total{{{s}}}[{w}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{w}]))
            / (gpu:gputrain_gpu_pcie_link_current:max5m or gpu:gputrain_gpu_pcie_link_max:max)"""),
    # the link as it ran in the window (its best: an idle link trains down between bursts)
    # and at its best
    Reading("pcie_link_now", "rank_gpu", "run_rank_gpu:gputrain_gpu_pcie_link_current:max5m",
            "rate", """
            max by ({gpu}) (max_over_time(
              gputrain_gpu_pcie_link_current_bytes_per_second{{{s}}}[{w}]))""", of_node=True),
    # and as it ran most of the window (the median reading: a link that flaps, down two
    # readings in three, is down, where its best reading would hide it)
    Reading("pcie_link_typical", "rank_gpu",
            "run_rank_gpu:gputrain_gpu_pcie_link_current:median5m", "rate", """
            max by ({gpu}) (quantile_over_time(0.5,
              gputrain_gpu_pcie_link_current_bytes_per_second{{{s}}}[{w}]))""", of_node=True),
    Reading("pcie_link_max", "rank_gpu", "run_rank_gpu:gputrain_gpu_pcie_link_max:max", None,
            "max by ({gpu}) (gputrain_gpu_pcie_link_max_bytes_per_second{{{s}}})", of_node=True),
    Reading("sm_active", "rank_gpu", "run_rank_gpu:gputrain_gpu_sm_active_ratio:avg5m", "rate",
            "avg by ({gpu}) (avg_over_time(gputrain_gpu_sm_active_ratio{{{s}}}[{w}]))"),
    Reading("tensor_active", "rank_gpu", "run_rank_gpu:gputrain_gpu_tensor_active_ratio:avg5m",
            "rate",
            "avg by ({gpu}) (avg_over_time(gputrain_gpu_tensor_active_ratio{{{s}}}[{w}]))"),
    # the GPU's SM clock over the window against the median of its node's GPUs of the same
    # model: a GPU at half its identical peers' clock is slowed, whatever reasons its driver
    # gives (or fails to give)
    Reading("sm_clock_vs_peers", "rank_gpu",
            "run_rank_gpu:gputrain_gpu_sm_clock_vs_peers:ratio_avg5m", "rate", """
            max by ({gpu}) (
              (avg by ({gpu}) (avg_over_time(gputrain_gpu_clock_hertz{{{s},clock="sm"}}[{w}]))
               * on ({gpu}) group_left (name) max by ({gpu}, name) (gputrain_gpu_info{{{s}}}))
              / on ({node}, name) group_left
              quantile by ({node}, name) (0.5,
                avg by ({gpu}) (avg_over_time(gputrain_gpu_clock_hertz{{{s},clock="sm"}}[{w}]))
                * on ({gpu}) group_left (name) max by ({gpu}, name) (gputrain_gpu_info{{{s}}})))""",
            of_node=True),
    Reading("throttled", "rank_gpu",
            "run_rank_gpu:gputrain_gpu_clock_event_throttle:ratio_rate5m", "rate", """
            sum by ({gpu}) (rate(gputrain_gpu_clock_event_seconds_total{{{s},
              reason=~"{throttle_reasons}"}}[{w}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{w}]))""",
            of_node=True),
    # what of a GPU's time a run does not own: busy with other runs' processes or with
    # processes no client reports (only where the driver gives per-process samples)
    Reading("foreign", "run_gpu", "run_gpu:gputrain_gpu_foreign_busy:ratio_rate5m", "rate", """
            ({unattributed_busy}
             + on ({gpu}) sum by ({gpu}) ({run_gpu_busy}))
            - on ({gpu}) group_right {run_gpu_busy}"""),
    # per node
    # the node's clock less Prometheus' at its scrapes (the exporter's wall clock at the
    # scrape, against the scrape's own time): the daemon cannot read it of itself
    Reading("clock_offset", "node", "instance:gputrain_exporter_clock_offset_seconds:max", None,
            "max by ({node}) (gputrain_exporter_time_seconds{{{s}}} - "
            "timestamp(gputrain_exporter_time_seconds{{{s}}}))"),
    Reading("cpu_busy", "node", "instance:gputrain_host_cpu_busy:ratio_rate5m", "rate",
            Number(1) - Aggregate("sum", Series(CPU, "mode", matcher='mode=~"idle|iowait"'))
            / CPU_SECONDS, refined=True),
    Reading("memory_available", "node", "instance:gputrain_host_memory_available_bytes:sum", None,
            Aggregate("sum", Series("gputrain_host_memory_available_bytes", rate=False))),
    # bytes a second swapped in and out: a node out of memory pages to disk, which reads as
    # iowait and a busy disk (memory pressure, not a slow data set)
    Reading("swap_rate", "node", "instance:gputrain_host_swap_bytes:rate5m", "rate",
            Aggregate("sum", Series("gputrain_host_swap_in_bytes_total"))
            + Aggregate("sum", Series("gputrain_host_swap_out_bytes_total"))),
    Reading("iowait", "node", "instance:gputrain_host_cpu_iowait:ratio_rate5m", "rate",
            Aggregate("sum", Series(CPU, "mode", matcher='mode="iowait"')) / CPU_SECONDS,
            refined=True),
    Reading("disk_busy", "node", "instance:gputrain_host_disk_busy:max_rate5m", "rate",
            Aggregate("max", Series("gputrain_host_disk_io_time_seconds_total", "device")),
            refined=True),
    Reading("network_rx_used", "node",
            "instance:gputrain_host_network_receive_link_used:max_ratio_rate5m", "rate",
            Aggregate("max", RX_USED), refined=True),
    # of the busiest interface, the lesser of its two directions against its speed: a
    # link saturated both ways (an all-reduce sends as much as it receives), not an input
    Reading("network_duplex_used", "node",
            "instance:gputrain_host_network_duplex_link_used:max_ratio_rate5m", "rate",
            Aggregate("max", (RX_USED < TX_USED).or_(TX_USED))),
)
BY_FIELD = {r.field: r for r in READINGS}


def series_of(field: str) -> str:
    """The recorded series of the reading ``field``: what a rule or a query names it by."""
    return BY_FIELD[field].record


def gpu_series_of(field: str) -> str:
    """The per-GPU series of the ``rank_gpu`` reading ``field`` (:attr:`Reading.gpu_record`)."""
    return BY_FIELD[field].gpu_record


# The readings that say whether a rank lives and how long its step has been open: recorded in
# a group of their own every ``liveness_interval`` (shorter than the recording interval), so a
# hang is said within two minutes at the default settings
# ... with whether a rank's stacks show it waiting (location.WAITING), recorded beside them
STACK_WAITING = "run_rank:gputrain_training_stack_waiting:max"
# ... and the seconds of a rank's DataLoader start in progress (the phase_in_progress reading
# of that phase alone: a recorded series takes no matcher once inlined)
LOADER_START = "run_rank:gputrain_training_loader_start_in_progress_seconds:max"
LIVENESS = frozenset(BY_FIELD[f].record for f in (
    "seconds_since_push", "finished", "failed", "exit", "step_in_progress",
    "phase_in_progress", "typical_step_seconds", "location", "collective_timeout",
    "process_running")) | {
    STACK_WAITING, LOADER_START}


def of_scope(scope: Scope) -> tuple[Reading, ...]:
    """The readings of one scope, in the table's order."""
    return tuple(r for r in READINGS if r.scope == scope)


# A rank's GPU readings taken over a window: where its regime is young (it came, restarted or
# changed pace less than the rate window ago), over the regime's span as its own rates are
# (promql.recording records each per GPU over the regime window too)
REGIME_GPU = tuple(x.field for x in of_scope("rank_gpu") if x.window == "rate")


# The node readings that refine input-bound into a stage (CPU preprocessing, disk, network),
# by their recorded series: each is judged with hysteresis (see WINDOWS["hold"]), its peak
# over the hold range read beside it as ``<name>_peak``
REFINED = {r.field: r.record for r in READINGS if r.refined}


@dataclass
class GpuReading:
    """One GPU over the window: ratios 0-1; counts of errors in the fault window."""

    gpu: str
    uuid: str
    busy: float | None = None
    sm_active: float | None = None
    tensor_active: float | None = None
    memory_used: float | None = None
    power_used: float | None = None
    pcie_rx_used: float | None = None
    pcie_link_now: float | None = None  # bytes/s: the link at its best in the window ...
    pcie_link_typical: float | None = None  # ... as it ran most of the window (the median) ...
    pcie_link_max: float | None = None  # ... and at its best at all (GPU and slot)
    throttled: float | None = None
    # its SM clock over the window against its node's identical GPUs' median (1: as theirs)
    sm_clock_vs_peers: float | None = None
    up: bool | None = None  # False: NVML says the GPU is lost
    xid_errors: float | None = None  # Xid errors in the fault window
    # uncorrectable ECC errors new in the fault window, or found by an exporter that started
    # in it (a counter's first sample is no increase)
    ecc_uncorrected: float | None = None
    remap_failed: bool | None = None  # a row remap failed: the GPU cannot heal itself
    remap_pending: bool | None = None  # a row remap or page retirement waits for a reset
    # of the window, the share busy with processes no rank of the report's run owns: other
    # runs', and those no client reports (only where the driver gives per-process samples)
    foreign: float | None = None
    # of the window, the share each (run, rank)'s processes kept the GPU busy, and the share
    # no rank's did (empty, and unattributed None, where the driver gives no per-process samples)
    shares: dict[tuple[str, str], float] = field(default_factory=dict)
    unattributed: float | None = None


@dataclass
class Finding:
    name: str
    reason: str
    advice: str


@dataclass
class RankReport:
    """One (run, rank) over the window, with its GPUs' and its node's readings."""

    job: str
    instance: str
    run: str
    rank: str
    steps_per_second: float | None = None  # None: too few samples in the window for a rate
    samples_per_second: float | None = None
    step_seconds: float | None = None
    data_wait_ratio: float | None = None
    # of the step time, the gradient communication that ran and the part the step waited for
    # (None where the client measures no communication)
    comm_ratio: float | None = None
    comm_exposed_ratio: float | None = None
    # the least exposed share among the ranks of its run that measure it: what communication
    # costs the rank the others wait for (the rest of a fast rank's wait is for that rank)
    run_comm_exposed_min: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    # of the wall time over the periodic window, the share in each phase outside the steps
    periodic: dict[str, float] = field(default_factory=dict)
    # by GPU index: the rank's share of the GPU's busy time (of what its processes did), and
    # the bytes its processes hold there
    gpu_share: dict[str, float] = field(default_factory=dict)
    gpu_memory_held: dict[str, float] = field(default_factory=dict)
    gpus: list[GpuReading] = field(default_factory=list)
    host: dict[str, float] = field(default_factory=dict)
    collectors_failing: list[str] = field(default_factory=list)  # on the rank's node
    # each collector of the rank's node: how long ago its last success was, in sampler
    # intervals, as the exporter's last page showed it
    collector_ages: dict[str, float] = field(default_factory=dict)
    restarts: float | None = None  # its process replaced this often in the restart window
    restarts_recent: float = 0.0  # ... and inside the rate window: its rates straddle one
    step_p50_seconds: float | None = None
    step_p99_seconds: float | None = None
    # the process tree's CPU over its cgroup's allowance, and the share of time throttled
    cpu_allowance_used: float | None = None
    cpu_throttled: float | None = None
    # of the wall time, the share spent in steps far above the median (rare long stalls)
    stall_share: float | None = None
    # of the steps, the share far above the median, and the data wait over those steps'
    # seconds (both over the quantile window): with the loader's workers, its period
    slow_step_ratio: float | None = None
    slow_step_wait: float | None = None
    loader_workers: float | None = None  # the DataLoader's num_workers, where pushed
    seconds_since_step: float | None = None
    seconds_since_push: float | None = None  # since the exporter last heard from the rank
    finished: bool = False  # it said goodbye at a clean end: finished, never vanished
    failed: bool = False  # it said goodbye at a failure (an exception, a signal)
    exit: dict[str, float] = field(default_factory=dict)  # how it ended: {reason: 1}
    exit_detail: str | None = None  # the exception's type or the signal's name
    # seconds its open step has run (outside-step phases excluded) and its outside-step
    # phase in progress, by name: the daemon's own clock
    step_in_progress: float | None = None
    phase_in_progress: dict[str, float] = field(default_factory=dict)
    typical_step_seconds: float | None = None  # its process's mean step so far
    # where its hang's capture found it: {location: 1} and the function that says so
    location: dict[str, float] = field(default_factory=dict)
    location_detail: str | None = None
    # its process is stopped (SIGSTOP): only the daemon of its node can see it
    stopped: bool = False
    # the exporter of its node finds its process running (not stopped) in its /proc
    process_running: bool = False
    world_size: float | None = None  # the ranks of its run, where its client says
    # its process groups' shortest collective timeout, seconds, where its client says
    collective_timeout: float | None = None
    recent_busy: float | None = None  # its busiest GPU over the recent window (0-1)
    # seconds since its steps changed pace (exporter.heuristics.regime), while that is inside
    # the rate window; None where they did not
    regime_changed_seconds: float | None = None
    # its process tree's memory growth, bytes per second: PSS where the client reads
    # /proc/<pid>/smaps_rollup, else RSS (``memory_measure`` says which)
    rss_growth_1h: float | None = None  # over the last hour
    rss_growth_15m: float | None = None  # ... and over the last 15 minutes
    rss_growth_15m_before: float | None = None  # ... and over the 15 minutes before those
    memory_measure: str | None = None  # "pss" or "rss" (PSS unreadable); None: neither pushed
    mfu: float | None = None  # model FLOPs utilisation, where the client reports FLOPs
    goodput: float | None = None  # productive share of the rank's wall time
    badput: dict[str, float] = field(default_factory=dict)  # the rest, by cause
    status: str = ""  # ok, fault, bottleneck, underutilized, no-gpu-data, stopped, finished
    verdict: str = ""
    reason: str = ""
    advice: str = ""
    also: list[Finding] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # run labels beyond `run` (cluster)
    source: str = "raw"  # "recorded" when read from the recording rules' results alone
    partial: str = ""  # why the run's ranks are only partly visible here, if they are

    @property
    def ended(self) -> bool:
        """It said goodbye: finished, failed, or exited without telling which."""
        return self.finished or self.failed or bool(self.exit)

    @property
    def stepping(self) -> bool:
        """It made steps in the window (an unknown rate is no step)."""
        return (self.steps_per_second or 0.0) > 0

    @property
    def bottleneck(self) -> bool:
        """Something to act on."""
        return self.status in ("fault", "bottleneck", "underutilized", "hung", "failed")

    def findings(self) -> list[str]:
        """The verdict and every finding beside it: the catalogue alerts that fire for it."""
        first = [self.verdict] if self.status in ("fault", "bottleneck", "stopped", "hung",
                                                  "failed") else []
        return first + [f.name for f in self.also]


@dataclass
class NodeReport:
    """One node (a job and instance) and every GPU it exports, for the faults no rank owns."""

    job: str
    instance: str
    labels: dict[str, str] = field(default_factory=dict)
    up: bool | None = None  # False: Prometheus cannot scrape its exporter
    gpus: list[GpuReading] = field(default_factory=list)
    host: dict[str, float] = field(default_factory=dict)
    collectors_failing: list[str] = field(default_factory=list)
    collector_ages: dict[str, float] = field(default_factory=dict)  # in sampler intervals
    findings: list[tuple[str, str, Finding]] = field(default_factory=list)  # (gpu, severity, f)


def with_open_step(r: RankReport, seconds: float) -> RankReport:
    """``r``'s mean step and throughput over a window of ``seconds`` with its step in
    progress weighed in, where that has run longer than the window's mean step (or the window
    holds none): its part inside the window as step time, and as one step more; as the
    readings' PromQL does (the fragments ``open_part`` and ``open_count``)."""
    open_s, mean = r.step_in_progress, r.step_seconds
    if open_s is None or seconds <= 0 or (mean is not None and open_s <= mean):
        return r
    steps = r.steps_per_second or 0.0
    step_rate = (mean or 0.0) * steps  # seconds of steps a second
    part = min(open_s, seconds) / seconds
    if r.samples_per_second is not None and step_rate > 0:
        r.samples_per_second *= step_rate / (step_rate + part)
    elif r.steps_per_second is not None:
        r.samples_per_second = 0.0
    if r.steps_per_second is not None:
        r.step_seconds = (step_rate + part) / (steps + 1 / seconds)
    return r


def outside_steps(r: RankReport) -> tuple[str, float] | None:
    """The phase outside steps (an evaluation, a checkpoint) that took the largest share of the
    window's wall time, and that share; None where none took any."""
    share, phase = max((r.badput.get(p, 0.0), p) for p in sorted(OUTSIDE_STEP_PHASES))
    return (phase, share) if share > 0 else None


def stale_collectors(ages: dict[str, float], limit: float) -> list[str]:
    """The collectors whose last success is more than ``limit`` sampler intervals old."""
    return sorted(name for name, age in ages.items() if age > limit)


def percent(x: float | None) -> str:
    """A 0-1 ratio in percent for people: one decimal, two significant digits under 0.1 % (a
    CPU run's MFU against an H100 is 0.011 %, not 0.0 %), "n/a" where unknown."""
    if x is None:
        return "n/a"
    v = x * 100
    return f"{v:.2g}%" if v and abs(v) < 0.1 else f"{v:.1f}%"


def mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 62, rank)


def run_key(rep: RankReport) -> tuple:
    """What identifies a report's run: ``run`` and the run labels beyond it."""
    return (rep.run, *sorted(rep.labels.items()))
