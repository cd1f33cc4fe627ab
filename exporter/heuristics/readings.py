"""What the heuristics judge: one window's readings of a rank, its GPUs and its node.

They come from Prometheus (``diagnose`` queries the recording rules' values) or from the
daemon's own history (:mod:`exporter.serving.history`, for ``/``, ``/api/v1/status`` and
``top``); :mod:`exporter.heuristics.verdict` judges either with the catalogue's conditions. The
windows every reading is taken over are one table, :data:`WINDOWS`, that the rules, the
history and ``diagnose`` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
}
# The node readings that refine input-bound into a stage (CPU preprocessing, disk, network),
# by their recorded series: each is judged with hysteresis (see WINDOWS["hold"]), its peak
# over the hold range read beside it as ``<name>_peak``
REFINED = {
    "cpu_busy": "instance:gputrain_host_cpu_busy:ratio_rate5m",
    "iowait": "instance:gputrain_host_cpu_iowait:ratio_rate5m",
    "disk_busy": "instance:gputrain_host_disk_busy:max_rate5m",
    "network_rx_used": "instance:gputrain_host_network_receive_link_used:max_ratio_rate5m",
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
    pcie_link_max: float | None = None  # ... and at its best at all (GPU and slot)
    throttled: float | None = None
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
    finished: bool = False  # it said goodbye (a clean close()): finished, never vanished
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
    def stepping(self) -> bool:
        """It made steps in the window (an unknown rate is no step)."""
        return (self.steps_per_second or 0.0) > 0

    @property
    def bottleneck(self) -> bool:
        """Something to act on."""
        return self.status in ("fault", "bottleneck", "underutilized")

    def findings(self) -> list[str]:
        """The verdict and every finding beside it: the catalogue alerts that fire for it."""
        first = [self.verdict] if self.status in ("fault", "bottleneck", "stopped") else []
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
