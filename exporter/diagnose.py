"""`gputrain-exporter diagnose`: ask Prometheus what starves each run's GPUs.

For every (run, rank) it reads samples/s, step time, data-wait ratio, phases, the busy / SM /
tensor / memory / power / PCIe ratios of the rank's GPUs (joined through
``gputrain_training_gpu_info``) and the node's CPU, disk and network, then follows the decision
order of HEURISTICS.md to one verdict with its advice. It queries the raw metrics, so it works
whether or not the recording rules are loaded; thresholds come from the same file as
``gputrain-exporter rules --config``.

Exit status: 0 no bottleneck, 1 a bottleneck found, 2 Prometheus unreachable or without
gputrain data.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from exporter.client.monitor import OUTSIDE_STEP_PHASES
from exporter.rules import (
    DEFAULTS,
    inline,
    load_overrides,
    merge,
    rank_gpu_join,
    recording_rules,
)

RANK = ("job", "instance", "run", "rank")
ADVICE = {
    "gpu-bound": "The GPU is the bottleneck, as it should be. To make each GPU-second count, "
                 "profile the heaviest kernels.",
    "tensor-cores-idle": "Train with automatic mixed precision (torch.autocast) or bf16 so the "
                         "tensor cores do the matrix work.",
    "launch-bound": "The GPU is busy with kernels too small to load it: use a larger batch, "
                    "CUDA graphs or torch.compile, and fuse small ops.",
    "small-batch": "The GPU's memory is mostly unused: raise the batch size (and re-tune the "
                   "learning rate).",
    "cpu-preprocessing": "Input-bound with the CPUs saturated: move augmentation to the GPU "
                         "(DALI, GPU transforms), pre-process offline, or get more cores.",
    "disk-io": "Input-bound on the disks: cache the data set in memory, use faster storage, "
               "larger sequential reads or more reader threads.",
    "network-input": "Input-bound on the network: compress or shrink the raw data, stream it, "
                     "or use a higher-bandwidth node.",
    "input-bound": "Waiting on the data loader with CPU, disk and network to spare: use more "
                   "DataLoader workers (num_workers), pin_memory=True and prefetching.",
    "host-to-device": "Host-to-device copies fill the PCIe link: send uint8 and normalise on "
                      "the GPU, use pin_memory and non_blocking copies, defer casts to the GPU.",
    "phase": "A phase of the step keeps the GPU idle: move it to a background thread, run it "
             "every N steps, keep metrics on the GPU.",
    "host-overhead": "The GPU idles although data is ready: look for host-side work in the "
                     "step (Python overhead, .item() or other synchronisation, logging).",
    "stalled": "The rank made no step in the window although it still reports: look for a hang "
               "in a collective, a dead worker or a deadlock.",
    "no-gpu-data": "No GPU of this rank is known to the exporter: check that the client reports "
                   "its GPU (CUDA_VISIBLE_DEVICES or torch.cuda) and that the exporter sees it.",
}
NO_BOTTLENECK = {"gpu-bound", "no-gpu-data"}
# Step 5 of the decision order: findings beside the verdict, across ranks and across time.
ALSO_ADVICE = {
    "straggler": "This rank lags its run's other ranks: check its node's input, thermal "
                 "throttling, a slower GPU or link.",
    "step-time-stalls": "Periodic stalls (typically checkpoints): checkpoint asynchronously "
                        "or less often, write to local disk and upload later.",
    "throttling": "The GPU's clocks are held down by power or temperature: check cooling and "
                  "the power limit (nvidia-smi -q -d PERFORMANCE).",
    "memory-leak": "The training process's memory keeps growing: look for tensors kept "
                   "across steps (losses without .item()) and growing caches.",
}


class PrometheusError(Exception):
    """Prometheus could not be reached or answered with an error."""


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
    rss_bytes_in_horizon: float | None = None  # predicted resident memory at the horizon
    rss_growing: bool = False
    verdict: str = ""
    reason: str = ""
    advice: str = ""
    also: list[Finding] = field(default_factory=list)

    @property
    def bottleneck(self) -> bool:
        return self.verdict not in NO_BOTTLENECK or bool(self.also)


class Prometheus:
    """The few calls of the HTTP API this command needs."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        try:
            r = self.session.get(f"{self.url}/api/v1/query", params={"query": expr},
                                 timeout=self.timeout)
        except requests.RequestException as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {exc}") from None
        try:
            body = r.json()
        except ValueError:
            raise PrometheusError(f"{self.url} answered HTTP {r.status_code} without JSON: "
                                  "is it a Prometheus server?") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus rejected the query {expr!r}: "
                                  f"{body.get('error', body)}")
        out = []
        for item in body["data"]["result"]:
            value = float(item["value"][1])
            if value == value:  # NaN (0/0) means "no activity", not a reading
                out.append((item["metric"], value))
        return out


def queries(selector: str, window: str, horizon: float = 14400) -> dict[str, str]:
    """The PromQL this command runs, by name: the recording rules' own expressions written
    inline (over ``window`` instead of 5m), so it needs no rules loaded in Prometheus."""
    records = recording_rules(selector)

    def rule(name: str) -> str:
        return inline(name, records).replace("[5m]", f"[{window}]")

    s, w, r = selector, window, ", ".join(RANK)
    per_gpu = {"busy": "gputrain_gpu_busy_ratio:rate5m",
               "sm_active": "gputrain_gpu_sm_active_ratio:avg5m",
               "tensor_active": "gputrain_gpu_tensor_active_ratio:avg5m",
               "memory_used": "gputrain_gpu_memory_used:ratio",
               "power_used": "gputrain_gpu_power_limit_used:ratio_avg5m",
               "pcie_rx_used": "gputrain_gpu_pcie_rx_link_used:ratio_rate5m"}
    return {
        "steps": f"sum by ({r}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[{w}]))",
        "samples_per_second": rule("run_rank:gputrain_training_samples_per_second:rate5m"),
        "step_seconds": rule("run_rank:gputrain_training_step_seconds:mean5m"),
        "data_wait_ratio": rule("run_rank:gputrain_training_data_wait_ratio:rate5m"),
        "phases": rule("run_rank_phase:gputrain_training_phase_ratio:rate5m"),
        **{name: rule(f"run_rank_gpu:{record}") for name, record in per_gpu.items()},
        "throttled": rule(rank_gpu_join(s, "gpu:gputrain_gpu_clock_event_throttle:ratio_rate5m")),
        "step_p50_seconds": rule("run_rank:gputrain_training_step_seconds:p50_30m"),
        "step_p99_seconds": rule("run_rank:gputrain_training_step_seconds:p99_30m"),
        "rss_bytes_in_horizon": f"sum by ({r}) (predict_linear(gputrain_training_process_resident_memory_bytes{{{s}}}[1h], {horizon}))",  # noqa: E501
        "rss_growing": f"sum by ({r}) (deriv(gputrain_training_process_resident_memory_bytes{{{s}}}[1h])) > 0",  # noqa: E501
        "memory_total": f"sum by (job, instance) (gputrain_host_memory_total_bytes{{{s}}})",
        "cpu_busy": rule("instance:gputrain_host_cpu_busy:ratio_rate5m"),
        "iowait": rule("instance:gputrain_host_cpu_iowait:ratio_rate5m"),
        "disk_busy": rule("instance:gputrain_host_disk_busy:max_rate5m"),
        "network_rx_used":
            rule("instance:gputrain_host_network_receive_link_used:max_ratio_rate5m"),
    }


def _rank_key(labels: dict[str, str]) -> tuple[str, ...]:
    return tuple(labels.get(k, "") for k in RANK)


def collect(prom: Prometheus, selector: str, window: str, run: str | None,
            horizon: float = 14400) -> list[RankReport]:
    """One report per (run, rank) active in the window, readings filled, no verdict yet."""
    q = queries(selector, window, horizon)
    reports: dict[tuple, RankReport] = {}
    for labels, steps in prom.query(q["steps"]):
        if run is not None and labels.get("run") != run:
            continue
        key = _rank_key(labels)
        reports[key] = RankReport(*key, steps_per_second=steps)
    for name in ("samples_per_second", "step_seconds", "data_wait_ratio", "step_p50_seconds",
                 "step_p99_seconds", "rss_bytes_in_horizon"):
        for labels, value in prom.query(q[name]):
            rep = reports.get(_rank_key(labels))
            if rep:
                setattr(rep, name, value)
    for labels, _ in prom.query(q["rss_growing"]):
        rep = reports.get(_rank_key(labels))
        if rep:
            rep.rss_growing = True
    for labels, value in prom.query(q["phases"]):
        rep = reports.get(_rank_key(labels))
        if rep:
            rep.phases[labels.get("phase", "")] = value
    for name in ("busy", "sm_active", "tensor_active", "memory_used", "power_used",
                 "pcie_rx_used", "throttled"):
        for labels, value in prom.query(q[name]):
            rep = reports.get(_rank_key(labels))
            if not rep:
                continue
            reading = next((x for x in rep.gpus if x.uuid == labels.get("uuid")
                            and x.gpu == labels.get("gpu")), None)
            if reading is None:
                reading = GpuReading(labels.get("gpu", ""), labels.get("uuid", ""))
                rep.gpus.append(reading)
            setattr(reading, name, value)
    for name in ("cpu_busy", "iowait", "disk_busy", "network_rx_used", "memory_total"):
        for labels, value in prom.query(q[name]):
            for rep in reports.values():
                if (rep.job, rep.instance) == (labels.get("job"), labels.get("instance")):
                    rep.host[name] = value
    for rep in reports.values():
        rep.gpus.sort(key=lambda x: (len(x.gpu), x.gpu))
    return sorted(reports.values(), key=lambda r: (r.run, r.instance, r.rank))


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def judge(rep: RankReport, t: dict[str, float]) -> RankReport:
    """Set the verdict, following HEURISTICS.md's decision order."""
    busy = _mean([x.busy for x in rep.gpus])
    sm = _mean([x.sm_active for x in rep.gpus])
    tensor = _mean([x.tensor_active for x in rep.gpus])
    memory = _mean([x.memory_used for x in rep.gpus])
    power = _mean([x.power_used for x in rep.gpus])
    pcie = max((x.pcie_rx_used for x in rep.gpus if x.pcie_rx_used is not None), default=None)
    wait = rep.data_wait_ratio or 0.0
    h = rep.host

    def verdict(name: str, reason: str) -> RankReport:
        rep.verdict, rep.reason, rep.advice = name, reason, ADVICE[name]
        return rep

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 100:.1f}%"

    if rep.steps_per_second <= 0:
        return verdict("stalled", "no step in the window")
    if busy is None:
        if wait >= t["input_bound"]:
            return verdict("input-bound", f"data wait {pct(wait)} of each step (no GPU data)")
        return verdict("no-gpu-data", "the exporter reports no GPU for this rank")
    if busy >= t["gpu_busy_target"]:
        # 4. the GPU is busy: is each GPU-second well spent?
        if sm is not None and tensor is not None and sm >= t["tensor_sm_active_above"] \
                and tensor < t["tensor_active_below"]:
            return verdict("tensor-cores-idle",
                           f"GPU busy {pct(busy)}, SM active {pct(sm)}, tensor active "
                           f"{pct(tensor)}")
        if busy >= t["launch_busy_above"] and (
                (power is not None and power < t["launch_power_below"])
                or (sm is not None and sm < t["launch_sm_active_below"])):
            return verdict("launch-bound", f"GPU busy {pct(busy)} but power {pct(power)} of "
                                           f"the limit, SM active {pct(sm)}")
        if memory is not None and memory < t["memory_underused"]:
            return verdict("small-batch", f"GPU busy {pct(busy)} with {pct(memory)} of its "
                                          "memory used")
        return verdict("gpu-bound", f"GPU busy {pct(busy)}")
    # 2. the GPU waits: on data?
    if wait >= t["input_bound"]:
        why = f"GPU busy {pct(busy)}, data wait {pct(wait)} of each step"
        if h.get("cpu_busy", 0) >= t["cpu_saturated"]:
            return verdict("cpu-preprocessing", f"{why}, CPUs {pct(h['cpu_busy'])} busy")
        if h.get("iowait", 0) >= t["iowait_high"] or h.get("disk_busy", 0) >= t["disk_busy_high"]:
            return verdict("disk-io", f"{why}, iowait {pct(h.get('iowait'))}, busiest disk "
                                      f"{pct(h.get('disk_busy'))}")
        if h.get("network_rx_used", 0) >= t["network_saturated"]:
            return verdict("network-input", f"{why}, network receive at "
                                            f"{pct(h['network_rx_used'])} of the link")
        return verdict("input-bound", f"{why}; CPU, disk and network have room")
    # 3. data is ready but the GPU idles
    why = f"GPU busy {pct(busy)}, data wait only {pct(wait)}"
    if pcie is not None and pcie >= t["pcie_rx_high"] and busy < t["h2d_gpu_busy_below"]:
        return verdict("host-to-device", f"{why}, PCIe RX at {pct(pcie)} of the link")
    dominating = t["phase_dominates"] / (1 + t["phase_dominates"])
    heavy = [(v, p) for p, v in rep.phases.items()
             if v > dominating and p not in OUTSIDE_STEP_PHASES]
    if heavy:
        ratio, phase = max(heavy)
        return verdict("phase", f"{why}, phase '{phase}' takes {pct(ratio)} of each step")
    if memory is not None and memory < t["memory_underused"]:
        return verdict("small-batch", f"{why}, {pct(memory)} of GPU memory used")
    return verdict("host-overhead", why)


def _median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def judge_across(reports: list[RankReport], t: dict[str, float]) -> list[RankReport]:
    """Step 5 of the decision order: stragglers across a run's ranks; stalls, throttling and
    leaks across time. Adds findings beside each rank's verdict."""
    def add(rep: RankReport, name: str, reason: str) -> None:
        rep.also.append(Finding(name, reason, ALSO_ADVICE[name]))

    runs: dict[tuple[str, str], list[RankReport]] = {}
    for rep in reports:
        runs.setdefault((rep.job, rep.run), []).append(rep)
    for ranks in runs.values():
        waits = [r.data_wait_ratio for r in ranks if r.data_wait_ratio is not None]
        computes = {id(r): r.step_seconds * (1 - (r.data_wait_ratio or 0))
                    for r in ranks if r.step_seconds is not None}
        if len(ranks) < 2:
            continue
        wait_median = _median(waits) if waits else None
        compute_median = _median(list(computes.values())) if computes else None
        for r in ranks:
            w = r.data_wait_ratio
            if w is not None and wait_median is not None and w >= t["input_bound"] \
                    and w > t["straggler_wait_factor"] * wait_median:
                add(r, "straggler", f"waits {w:.1%} of each step for data against its run's "
                                    f"median {wait_median:.1%}")
            c = computes.get(id(r))
            if c is not None and compute_median and c > t["straggler_compute_factor"] \
                    * compute_median:
                add(r, "straggler", f"computes {c * 1000:.1f} ms per step against its run's "
                                    f"median {compute_median * 1000:.1f} ms")
    for r in reports:
        if r.step_p50_seconds and r.step_p99_seconds and \
                r.step_p99_seconds > t["stall_p99_over_p50"] * r.step_p50_seconds:
            add(r, "step-time-stalls", f"p99 step time {r.step_p99_seconds:.3g} s is over "
                                       f"{t['stall_p99_over_p50']:g}x the median "
                                       f"{r.step_p50_seconds:.3g} s (30m)")
        elif r.phases.get("checkpoint", 0) > t["checkpoint_share"]:
            add(r, "step-time-stalls", f"checkpoint saves take {r.phases['checkpoint']:.1%} "
                                       "of the step time")
        hot = [x for x in r.gpus if x.throttled is not None and x.throttled > t["throttle_ratio"]]
        for x in hot:
            add(r, "throttling", f"GPU {x.gpu} throttled {x.throttled:.1%} of the time")
        total = r.host.get("memory_total")
        if r.rss_growing and total and r.rss_bytes_in_horizon and \
                r.rss_bytes_in_horizon > total:
            add(r, "memory-leak", f"resident memory predicted to pass the node's "
                                  f"{total / 2**30:.0f} GiB within "
                                  f"{t['leak_horizon_seconds'] / 3600:g} h")
    return reports


def _fmt(x: float | None, scale: float = 100, unit: str = "%", digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}{unit}"


def text_report(reports: list[RankReport]) -> str:
    lines = []
    for rep in reports:
        flag = "BOTTLENECK" if rep.bottleneck else "ok"
        lines.append(f"run {rep.run} rank {rep.rank} on {rep.instance} (job {rep.job}): {flag}")
        lines.append(f"  samples/s {_fmt(rep.samples_per_second, 1, '', 1)}   step time "
                     f"{_fmt(rep.step_seconds, 1000, ' ms', 1)}   data wait "
                     f"{_fmt(rep.data_wait_ratio)}")
        for p, v in sorted(rep.phases.items()):
            lines.append(f"  phase {p}: {_fmt(v)} of each step")
        for x in rep.gpus:
            lines.append(f"  GPU {x.gpu} ({x.uuid}): busy {_fmt(x.busy)}  SM {_fmt(x.sm_active)}"
                         f"  tensor {_fmt(x.tensor_active)}  memory {_fmt(x.memory_used)}  "
                         f"power {_fmt(x.power_used)} of limit  PCIe RX "
                         f"{_fmt(x.pcie_rx_used)} of link")
        h = rep.host
        lines.append(f"  node: CPU {_fmt(h.get('cpu_busy'))} busy, iowait "
                     f"{_fmt(h.get('iowait'))}, busiest disk {_fmt(h.get('disk_busy'))}, "
                     f"network RX {_fmt(h.get('network_rx_used'))} of link")
        lines.append(f"  verdict: {rep.verdict} ({rep.reason})")
        lines.append(f"  advice: {rep.advice}")
        for f in rep.also:
            lines.append(f"  also: {f.name} ({f.reason})")
            lines.append(f"    advice: {f.advice}")
        lines.append("")
    return "\n".join(lines)


def diagnose(url: str, run: str | None = None, window: str = "5m",
             overrides: dict[str, Any] | None = None) -> list[RankReport]:
    """Reports with verdicts for every active (run, rank); raises PrometheusError."""
    cfg = merge(DEFAULTS, overrides or {})
    prom = Prometheus(url)
    prom.query("vector(1)")  # reachable and a Prometheus at all
    t = cfg["thresholds"]
    reports = collect(prom, cfg["selector"], window, run, t["leak_horizon_seconds"])
    return judge_across([judge(r, t) for r in reports], t)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="say what starves each run's GPUs, from Prometheus")
    p.add_argument("--prometheus", metavar="URL", default="http://localhost:9090",
                   help="the Prometheus server that scrapes the exporters "
                        "(default http://localhost:9090)")
    p.add_argument("--run", metavar="NAME", help="only this run")
    p.add_argument("--window", default="5m", help="the range the ratios average over (5m)")
    p.add_argument("--config", metavar="FILE", help="thresholds file, as for `rules --config`")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    try:
        reports = diagnose(ns.prometheus, ns.run, ns.window, load_overrides(ns.config))
    except (PrometheusError, ValueError) as exc:
        print(f"gputrain-exporter diagnose: {exc}", file=sys.stderr)
        return 2
    if not reports:
        what = f"run '{ns.run}'" if ns.run else "gputrain training data"
        print(f"gputrain-exporter diagnose: Prometheus at {ns.prometheus} holds no {what} in "
              f"the last {ns.window} (no rate of gputrain_training_step_duration_seconds_count). "
              "Is it scraping the exporter, and is a training client pushing to it?",
              file=sys.stderr)
        return 2
    if ns.json:
        out = [{**asdict(r), "bottleneck": r.bottleneck} for r in reports]
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text_report(reports))
    return 1 if any(r.bottleneck for r in reports) else 0
