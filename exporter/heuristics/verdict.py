"""The decision order of HEURISTICS.md, once: readings of a window in, verdicts out.

A :class:`RankReport` holds one (run, rank)'s readings over a window: its training signals, its
GPUs' ratios and its node's. They come from Prometheus (``diagnose`` queries the recording
rules' values) or from the daemon's own history (:mod:`exporter.serving.history`, for ``/``,
``/api/v1/status`` and ``top``); :func:`judge` turns either into the same verdict and findings.
Every finding is the condition of one catalogue alert (:mod:`exporter.heuristics.catalogue`),
evaluated on the same values, so the verdict and the findings beside it are the bottleneck
alerts that fire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.client.monitor import OUTSIDE_STEP_PHASES
from exporter.heuristics.catalogue import BY_ALERT, BY_VERDICT

# Verdicts that are no alert of the catalogue: the good case and the blind one.
STATUS_ADVICE = {
    "gpu-bound": "The GPU is the bottleneck, as it should be. To make each GPU-second count, "
                 "profile the heaviest kernels.",
    "no-gpu-data": "No GPU of this rank is known to the exporter: check that the client reports "
                   "its GPU (CUDA_VISIBLE_DEVICES or torch.cuda) and that the exporter sees it.",
}
# The decision order of HEURISTICS.md: the first finding that holds is the verdict, the
# others are listed beside it. Each finding is the condition of one catalogue alert.
ORDER = ("stalled", "cpu-preprocessing", "disk-io", "network-input", "input-bound",
         "host-to-device", "host-overhead", "launch-bound", "tensor-cores-idle", "low-mfu",
         "small-batch",
         "step-time-stalls", "straggler", "memory-leak", "throttling")
UNDERUTILIZED = "underutilized"  # busy under the target, no stage to blame (the symptom alert)


# What the two verdicts that are no catalogue alert mean, in words (the others: the summary)
STATUS_SUMMARY = {
    "gpu-bound": "The GPUs are busy: the model's own work sets the pace.",
    "no-gpu-data": "The exporter knows no GPU of this rank.",
}


def summary(verdict: str) -> str:
    """A verdict in one sentence: the catalogue alert's summary, for the page and ``top``."""
    if verdict in STATUS_SUMMARY:
        return STATUS_SUMMARY[verdict]
    if verdict == UNDERUTILIZED:
        return BY_ALERT["GpuTrainGPUUnderutilized"].summary
    return BY_VERDICT[verdict].summary


def advice(verdict: str) -> str:
    """What to change for a verdict: the catalogue's advice, the same text the alert gives."""
    if verdict in STATUS_ADVICE:
        return STATUS_ADVICE[verdict]
    if verdict == UNDERUTILIZED:
        return BY_ALERT["GpuTrainGPUUnderutilized"].advice
    return BY_VERDICT[verdict].advice


@dataclass
class GpuReading:
    gpu: str
    uuid: str
    busy: float | None = None
    sm_active: float | None = None
    tensor_active: float | None = None
    memory_used: float | None = None
    power_used: float | None = None
    pcie_rx_used: float | None = None
    throttled: float | None = None


@dataclass
class Finding:
    name: str
    reason: str
    advice: str


@dataclass
class RankReport:
    job: str
    instance: str
    run: str
    rank: str
    steps_per_second: float = 0.0
    samples_per_second: float | None = None
    step_seconds: float | None = None
    data_wait_ratio: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    gpus: list[GpuReading] = field(default_factory=list)
    host: dict[str, float] = field(default_factory=dict)
    step_p50_seconds: float | None = None
    step_p99_seconds: float | None = None
    seconds_since_step: float | None = None
    rss_growth_1h: float | None = None  # bytes per second, over the last hour
    rss_growth_15m: float | None = None  # ... and over the last 15 minutes
    mfu: float | None = None  # model FLOPs utilisation, where the client reports FLOPs
    goodput: float | None = None  # productive share of the rank's wall time
    badput: dict[str, float] = field(default_factory=dict)  # the rest, by cause
    status: str = ""  # ok, bottleneck, underutilized or no-gpu-data
    verdict: str = ""
    reason: str = ""
    advice: str = ""
    also: list[Finding] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # run labels beyond `run` (cluster)
    source: str = "raw"  # "recorded" when read from the recording rules' results alone
    partial: str = ""  # why the run's ranks are only partly visible here, if they are

    @property
    def bottleneck(self) -> bool:
        """Something to act on."""
        return self.status in ("bottleneck", "underutilized")

    def findings(self) -> list[str]:
        """The verdict and every finding beside it: the bottleneck alerts that fire."""
        return ([self.verdict] if self.verdict in BY_VERDICT else []) + [
            f.name for f in self.also]

def rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 62, rank)


def run_key(rep: RankReport) -> tuple:
    """What identifies a report's run: ``run`` and the run labels beyond it."""
    return (rep.run, *sorted(rep.labels.items()))


def visibility(reports: list[RankReport], shard: str = "") -> list[RankReport]:
    """Mark the ranks of every run that is only partly visible, with why: ranks missing
    below the highest one seen, or ``shard`` (this server looks like one shard of several)."""
    runs: dict[tuple, list[RankReport]] = {}
    for rep in reports:
        runs.setdefault(run_key(rep), []).append(rep)
    for ranks in runs.values():
        numbers = {int(r.rank) for r in ranks if r.rank.isdigit()}
        missing = sorted(set(range(max(numbers) + 1)) - numbers) if numbers else []
        why = []
        if missing:
            why.append(f"ranks {_ranges(missing)} of 0-{max(numbers)} are not visible")
        if shard:
            why.append(shard)
        for r in ranks:
            r.partial = "; ".join(why)
    return reports


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def percent(x: float | None) -> str:
    """A 0-1 ratio in percent for people: one decimal, two significant digits under 0.1 % (a
    CPU run's MFU against an H100 is 0.011 %, not 0.0 %), "n/a" where unknown."""
    if x is None:
        return "n/a"
    v = x * 100
    return f"{v:.2g}%" if v and abs(v) < 0.1 else f"{v:.1f}%"


def rank_findings(rep: RankReport, t: dict[str, float]) -> dict[str, str]:
    """Every finding of one rank that holds, with its reason: each is the condition of the
    catalogue alert of that name, evaluated on the same recording-rule values (per GPU where
    the alert is per GPU)."""
    out: dict[str, str] = {}
    wait, h = rep.data_wait_ratio, rep.host
    if rep.seconds_since_step is not None and rep.seconds_since_step > t["stalled_seconds"]:
        out["stalled"] = f"no step for {rep.seconds_since_step:.0f} s"
    if wait is not None and wait >= t["input_bound"]:
        why = f"data wait {percent(wait)} of each step"
        cpu = h.get("cpu_busy")
        if cpu is not None and cpu >= t["cpu_saturated"]:
            out["cpu-preprocessing"] = f"{why}, CPUs {percent(cpu)} busy"
        iowait, disk = h.get("iowait"), h.get("disk_busy")
        if ((iowait is not None and iowait >= t["iowait_high"])
                or (disk is not None and disk >= t["disk_busy_high"])) \
                and cpu is not None and cpu < t["cpu_saturated"]:
            out["disk-io"] = f"{why}, iowait {percent(iowait)}, busiest disk {percent(disk)}"
        net = h.get("network_rx_used")
        if net is not None and net >= t["network_saturated"]:
            out["network-input"] = f"{why}, network receive at {percent(net)} of the link"
        out["input-bound"] = why
    for x in rep.gpus:
        if x.pcie_rx_used is not None and x.pcie_rx_used >= t["pcie_rx_high"] \
                and x.busy is not None and x.busy < t["h2d_gpu_busy_below"]:
            out.setdefault("host-to-device", f"GPU {x.gpu}: PCIe RX at {percent(x.pcie_rx_used)} "
                                             f"of the link, busy {percent(x.busy)}")
    busy = mean([x.busy for x in rep.gpus])
    in_step = {p: v for p, v in rep.phases.items() if p not in OUTSIDE_STEP_PHASES}
    heavy = max(in_step.items(), key=lambda kv: kv[1], default=None)
    dominating = t["phase_dominates"] / (1 + t["phase_dominates"])
    if heavy is not None and heavy[1] > dominating:
        out["host-overhead"] = f"phase '{heavy[0]}' takes {percent(heavy[1])} of each step"
    elif busy is not None and busy < t["gpu_busy_low"] and wait is not None \
            and wait < t["input_bound"]:
        out["host-overhead"] = f"GPU busy {percent(busy)}, data wait only {percent(wait)}"
    for x in rep.gpus:
        if x.busy is not None and x.busy >= t["launch_busy_above"] and (
                (x.power_used is not None and x.power_used < t["launch_power_below"])
                or (x.sm_active is not None and x.sm_active < t["launch_sm_active_below"])):
            out.setdefault("launch-bound", f"GPU {x.gpu} busy {percent(x.busy)} but power "
                                           f"{percent(x.power_used)} of the limit, SM active "
                                           f"{percent(x.sm_active)}")
    for x in rep.gpus:
        if x.sm_active is not None and x.tensor_active is not None \
                and x.sm_active >= t["tensor_sm_active_above"] \
                and x.tensor_active < t["tensor_active_below"]:
            out.setdefault("tensor-cores-idle", f"GPU {x.gpu} SM active {percent(x.sm_active)}, "
                                                f"tensor active {percent(x.tensor_active)}")
    if rep.mfu is not None and busy is not None and busy >= t["mfu_busy_above"] \
            and rep.mfu < t["mfu_low"]:
        out["low-mfu"] = f"MFU {percent(rep.mfu)} while the GPUs are busy {percent(busy)}"
    for x in rep.gpus:
        if x.memory_used is not None and x.memory_used < t["memory_underused"]:
            out.setdefault("small-batch", f"GPU {x.gpu}: {percent(x.memory_used)} of its memory "
                                          "used")
    p50, p99 = rep.step_p50_seconds, rep.step_p99_seconds
    checkpoint = rep.phases.get("checkpoint")
    if p50 and p99 and p99 > t["stall_p99_over_p50"] * p50:
        out["step-time-stalls"] = (f"p99 step time {p99:.3g} s is over "
                                   f"{t['stall_p99_over_p50']:g}x the median {p50:.3g} s (30m)")
    elif checkpoint is not None and checkpoint > t["checkpoint_share"]:
        out["step-time-stalls"] = f"checkpoint saves take {percent(checkpoint)} of the step time"
    available = h.get("memory_available")
    horizon = t["leak_horizon_seconds"]
    if available is not None and rep.rss_growth_1h is not None \
            and rep.rss_growth_15m is not None \
            and min(rep.rss_growth_1h, rep.rss_growth_15m) * horizon > available:
        out["memory-leak"] = (f"resident memory grows {rep.rss_growth_15m * 60 / 2**20:.0f} "
                              f"MiB/min: the node's {available / 2**30:.1f} GiB available "
                              f"last about {available / rep.rss_growth_15m / 3600:.1f} h")
    for x in rep.gpus:
        if x.throttled is not None and x.throttled > t["throttle_ratio"]:
            out.setdefault("throttling", f"GPU {x.gpu} throttled {percent(x.throttled)} of the "
                                         "time")
    return out


def stragglers(reports: list[RankReport], t: dict[str, float]) -> dict[int, str]:
    """The ranks that lag their run's others (by ``id``), with the reason: the straggler
    alert's condition across each run (``run`` and the run labels beyond it, never ``job``)."""
    out: dict[int, str] = {}
    runs: dict[tuple, list[RankReport]] = {}
    for rep in reports:
        runs.setdefault(run_key(rep), []).append(rep)
    for ranks in runs.values():
        waits = [r.data_wait_ratio for r in ranks if r.data_wait_ratio is not None]
        computes = {id(r): r.step_seconds * (1 - (r.data_wait_ratio or 0))
                    for r in ranks if r.step_seconds is not None}
        wait_median = _median(waits) if waits else None
        compute_median = _median(list(computes.values())) if computes else None
        for r in ranks:
            w, c = r.data_wait_ratio, computes.get(id(r))
            if w is not None and wait_median is not None and w >= t["input_bound"] \
                    and w > t["straggler_wait_factor"] * wait_median:
                out[id(r)] = (f"waits {w:.1%} of each step for data against its run's median "
                              f"{wait_median:.1%}")
            elif c is not None and compute_median and \
                    c > t["straggler_compute_factor"] * compute_median:
                out[id(r)] = (f"computes {c * 1000:.1f} ms per step against its run's median "
                              f"{compute_median * 1000:.1f} ms")
    return out


def judge(reports: list[RankReport], t: dict[str, float]) -> list[RankReport]:
    """Set every rank's status, verdict and findings, in the decision order of
    HEURISTICS.md; the findings are exactly the bottleneck alerts that would fire."""
    lagging = stragglers(reports, t)
    for rep in reports:
        found = rank_findings(rep, t)
        if id(rep) in lagging:
            found["straggler"] = lagging[id(rep)]
        ordered = [name for name in ORDER if name in found]
        busy = mean([x.busy for x in rep.gpus])
        if ordered:
            rep.status, rep.verdict = "bottleneck", ordered[0]
            rep.reason = found[ordered[0]]
            rep.also = [Finding(n, found[n], advice(n)) for n in ordered[1:]]
        elif busy is None:
            rep.status = rep.verdict = "no-gpu-data"
            rep.reason = "the exporter reports no GPU for this rank"
        elif busy < t["gpu_busy_target"]:
            rep.status = rep.verdict = UNDERUTILIZED
            rep.reason = (f"GPU busy {percent(busy)}, under {percent(t['gpu_busy_target'])}, "
                          "and no stage of the pipeline stands out")
        else:
            rep.status, rep.verdict = "ok", "gpu-bound"
            rep.reason = f"GPU busy {percent(busy)}"
        rep.advice = advice(rep.verdict)
    return reports


def wasted_gpus(ranks: list[RankReport]) -> float | None:
    """GPU-seconds per second that the ranks' GPUs sat idle (1 - busy; a GPU that two ranks
    share counts once), as ``run:gputrain_gpu_wasted_seconds:rate5m`` records it."""
    idle = {(r.instance, x.gpu, x.uuid): 1 - x.busy
            for r in ranks for x in r.gpus if x.busy is not None}
    return sum(idle.values()) if idle else None

