"""The bottleneck catalogue: the one place each heuristic is written down.

Every threshold (its default, unit and source), every alert's `for`, severity, summary, advice,
runbook text, README row and confirming dashboard panel is here. The rule file
(:mod:`exporter.heuristics.rules`), ``diagnose``'s advice, the dashboards' threshold lines, the
runbook and the README's alert table are generated from it (``gputrain-exporter generate``); a
test fails when a committed copy is stale. HEURISTICS.md is the specification these entries
encode.

Texts may name thresholds as ``{name}`` (shown in the threshold's unit: ``5 %``, ``2x``,
``10 m``) and the alert's own ``for`` as ``{for}``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    default: float
    unit: str  # "ratio" (shown as a percentage), "factor" (2x) or "seconds"
    source: str


THRESHOLDS: dict[str, Threshold] = {
    "gpu_busy_low": Threshold(0.5, "ratio", "seed 001 (SM use under 50 %), PyTorch profiler "
                                            "plugin"),
    "gpu_busy_target": Threshold(0.9, "ratio", "seed 002: under 90 % is wasted money"),
    "input_bound": Threshold(0.05, "ratio", "TF Profiler input-pipeline analysis: moderately"),
    "input_bound_high": Threshold(0.20, "ratio", "TF Profiler input-pipeline analysis: highly"),
    "cpu_saturated": Threshold(0.9, "ratio", "seed 002 preprocessing case (CPU 66 % -> 96 %)"),
    "iowait_high": Threshold(0.2, "ratio", "seed 001: high disk I/O with low CPU use"),
    "disk_busy_high": Threshold(0.9, "ratio", "seed 001"),
    "network_saturated": Threshold(0.8, "ratio", "seed 002 network case, of the link speed"),
    "pcie_rx_high": Threshold(0.5, "ratio", "seed 002 host-to-device case, of the PCIe link"),
    "h2d_gpu_busy_below": Threshold(0.8, "ratio", "seed 002 host-to-device case"),
    "memory_underused": Threshold(0.25, "ratio", "seed 003: under 1 GB of 16 GB"),
    "launch_busy_above": Threshold(0.8, "ratio", "seeds 000, 001: busy but low power"),
    "launch_power_below": Threshold(0.4, "ratio", "seeds 000, 001, of the enforced limit"),
    "launch_sm_active_below": Threshold(0.3, "ratio", "GPM SM activity"),
    "tensor_sm_active_above": Threshold(0.5, "ratio", "seed 003 optimisation 6"),
    "tensor_active_below": Threshold(0.01, "ratio", "seed 003 optimisation 6 (0 % tensor "
                                                    "cores)"),
    "mfu_busy_above": Threshold(0.9, "ratio", "HEURISTICS.md: a GPU busy enough that its "
                                              "work, not its feeding, is the question"),
    "mfu_low": Threshold(0.2, "ratio", "torchtitan: 33-39 % MFU for Llama 3.1 8B on H100 "
                                       "(bf16, against the 989 TFLOP/s dense peak)"),
    "phase_dominates": Threshold(1.0, "factor", "Keras: a callback slow compared to the batch "
                                                "time"),
    "stall_p99_over_p50": Threshold(5.0, "factor", "seed 002: periodic stalls hurt the "
                                                   "average"),
    "checkpoint_share": Threshold(0.1, "ratio", "seed 002: checkpoint saves, a phase outside "
                                                "the steps"),
    "straggler_wait_factor": Threshold(2.0, "factor", "HTA straggler analysis"),
    "straggler_compute_factor": Threshold(1.2, "factor", "HTA straggler analysis"),
    "memory_near_limit": Threshold(0.95, "ratio", "PyTorch profiler plugin (> 90 % peak)"),
    "throttle_ratio": Threshold(0.1, "ratio", "NVML clock-event reasons"),
    "stalled_seconds": Threshold(600, "seconds", "HEURISTICS.md: no step for 10 m"),
    "leak_horizon_seconds": Threshold(14400, "seconds", "seed 002: rising memory; exhausts "
                                                        "the node within 4 h"),
}


@dataclass(frozen=True)
class Entry:
    """One row of the catalogue: an alert and what it means."""

    alert: str
    kind: str  # "bottleneck" (diagnose names it), "symptom" or "health"
    severity: str  # "warning", or "info / warning" where two rules share the name
    for_: str
    summary: str  # the alert's static summary
    advice: str  # what to change: the alert's description, diagnose and the runbook say this
    fires_when: str  # the README's one-line condition
    why: str  # the runbook's explanation, with the seeds' evidence
    confirm: tuple[str, ...]  # the series that confirm it
    panel: str  # where to see it on the dashboards (quoted titles are checked to exist)
    verdict: str | None = None  # diagnose's name for it (kind "bottleneck")
    # where its rule is evaluated: "node" needs one node's raw series, so it runs where the
    # node is scraped (each shard); "global" compares the ranks of a run across nodes, so it
    # runs where every shard is seen (a single Prometheus, vmalert over VictoriaMetrics)
    level: str = "node"
    # a firing alert of a rank asks the daemon for a profile of it (Alertmanager's webhook):
    # None means every bottleneck; a profile cannot explain a leak, a throttle or a stall
    profile: bool | None = None

    @property
    def profiled(self) -> bool:
        """Whether this alert, firing for a rank, triggers a profile of it."""
        return self.kind == "bottleneck" if self.profile is None else self.profile


CATALOGUE: tuple[Entry, ...] = (
    Entry("GpuTrainGPUUnderutilized", "symptom", "info / warning", "10m",
          "A training run leaves its GPU mostly idle.",
          "Find the stage that starves it: the other GpuTrain alerts for this run say which.",
          "a rank's GPU busy < {gpu_busy_target} / < {gpu_busy_low} for {for}",
          "A GPU that a run uses was busy (any kernel running) less than {gpu_busy_low} of the "
          "time over 5 m (warning), or between {gpu_busy_low} and {gpu_busy_target} (info). "
          "Seed 001 calls SM use under 50 % a sure sign the GPU is not used well; seed 002 "
          "calls anything under 90 % wasted money. This is the symptom: the other GpuTrain "
          "alerts on the same run say which stage starves the GPU.",
          ("run_rank_gpu:gputrain_gpu_busy_ratio:rate5m",),
          'GpuTrain / Overview, the Runs table sorted by GPU busy; then GpuTrain / Run, panel '
          '"GPU busy" ({gpu_busy_low} and {gpu_busy_target} lines), and the panels below it for '
          'the stage.'),
    Entry("GpuTrainInputBound", "bottleneck", "info / warning", "10m",
          "A training run waits on its data loader.",
          "Use more DataLoader workers (num_workers), pin_memory=True and prefetching, or cache "
          "or pre-process the data set offline (DALI).",
          "data-wait ratio >= {input_bound} / >= {input_bound_high} for {for}",
          "The run spends {input_bound} (info) or {input_bound_high} (warning) of each step "
          "blocked fetching its next batch (the TensorFlow profiler's input-pipeline "
          "thresholds), with CPU, disk and network to spare. Seed 003 went from 31.65 % to "
          "97.51 % GPU use mostly through this.",
          ("run_rank:gputrain_training_data_wait_ratio:rate5m",),
          'GpuTrain / Run, panel "Data wait" ({input_bound} and {input_bound_high} lines).',
          "input-bound"),
    Entry("GpuTrainCPUPreprocessingBound", "bottleneck", "warning", "10m",
          "A training run is input-bound because the CPUs are saturated.",
          "Move augmentation to the GPU (DALI, GPU transforms), pre-process offline, or get "
          "more cores.",
          "input-bound and host CPU busy >= {cpu_saturated}",
          "Input-bound while the node's CPUs are at least {cpu_saturated} busy: preprocessing "
          "cannot keep up (seed 002: CPU 66 % -> 96 %, GPU at most 36 %, 25 samples/s).",
          ("instance:gputrain_host_cpu_busy:ratio_rate5m",),
          'GpuTrain / Run, "Data wait" and the node\'s "CPU by mode" (user + system near '
          '100 %), "Training processes" (the cores the DataLoader workers use).',
          "cpu-preprocessing"),
    Entry("GpuTrainDiskIOBound", "bottleneck", "warning", "10m",
          "A training run is input-bound on disk I/O.",
          "Cache the data set in memory or on local NVMe, use larger sequential reads or more "
          "reader threads.",
          "input-bound, iowait >= {iowait_high} or a disk busy >= {disk_busy_high}, CPU not "
          "saturated",
          "Input-bound while the CPUs wait on I/O (iowait >= {iowait_high}) or a disk is "
          "{disk_busy_high} busy, and the CPUs are not saturated (seed 001: high disk I/O with "
          "low CPU use).",
          ("instance:gputrain_host_cpu_iowait:ratio_rate5m",
           "instance:gputrain_host_disk_busy:max_rate5m"),
          'GpuTrain / Run, "CPU by mode" (iowait band) and "Disk I/O"; GpuTrain / Node, '
          '"Disk busy" ({disk_busy_high} line).',
          "disk-io"),
    Entry("GpuTrainNetworkInputBound", "bottleneck", "warning", "10m",
          "A training run is input-bound on network input.",
          "Compress or shrink the raw data, stream it, or use a node with more bandwidth.",
          "input-bound and a NIC receiving >= {network_saturated} of its speed",
          "Input-bound while a network interface receives at {network_saturated} or more of "
          "its speed (seed 002: 77.8 % of step time waiting, 22 samples/s).",
          ("instance:gputrain_host_network_receive_link_used:max_ratio_rate5m",),
          'GpuTrain / Run, "Network receive against link speed" ({network_saturated} line). A '
          'NIC whose driver reports no speed needs `--host.netdev-speed`.',
          "network-input"),
    Entry("GpuTrainHostToDeviceBound", "bottleneck", "warning", "10m",
          "Host-to-device copies saturate the PCIe link and the GPU waits.",
          "Send uint8 and normalise on the GPU (4x less data), use pin_memory with "
          "non_blocking copies, defer one_hot and casts to the GPU.",
          "PCIe RX >= {pcie_rx_high} of the link and GPU busy < {h2d_gpu_busy_below}",
          "The GPU receives at least {pcie_rx_high} of its PCIe link's capacity while busy "
          "less than {h2d_gpu_busy_below} (seed 002's host-to-device case; seed 003 "
          "optimisation 4).",
          ("run_rank_gpu:gputrain_gpu_pcie_rx_link_used:ratio_rate5m",),
          'GpuTrain / Run, "PCIe host-to-device against the link" ({pcie_rx_high} line) beside '
          '"GPU busy".',
          "host-to-device"),
    Entry("GpuTrainGPUMemoryUnderused", "bottleneck", "info", "30m",
          "A training run uses little of its GPU's memory: the batch may be too small.",
          "Raise the batch size (and re-tune the learning rate).",
          "GPU memory used < {memory_underused} for {for}",
          "The run uses less than {memory_underused} of its GPU's memory (seed 003: under 1 GB "
          "of 16 GB; seed 002: 23 %). Seed 003 went from 1200 to 1584 samples/s with a larger "
          "batch.",
          ("run_rank_gpu:gputrain_gpu_memory_used:ratio",),
          'GpuTrain / Run, "GPU memory used" ({memory_underused} line).',
          "small-batch"),
    Entry("GpuTrainLaunchBound", "bottleneck", "info", "15m",
          "A GPU is busy but does little work: kernels are too small.",
          "Use a larger batch, CUDA graphs or torch.compile, and fuse small ops.",
          "busy >= {launch_busy_above} but power < {launch_power_below} of the limit or SM "
          "active < {launch_sm_active_below}, {for}",
          "The GPU is busy at least {launch_busy_above} of the time but draws under "
          "{launch_power_below} of its power limit, or its SMs are under "
          "{launch_sm_active_below} active: many small kernels (seeds 000, 001; seed 002's "
          "small batch). torch.compile gave seed 003 +32 %.",
          ("run_rank_gpu:gputrain_gpu_power_limit_used:ratio_avg5m",
           "run_rank_gpu:gputrain_gpu_sm_active_ratio:avg5m"),
          'GpuTrain / Run, "Power against the limit" ({launch_power_below} line) and "SM and '
          'tensor activity" ({launch_sm_active_below} line) while "GPU busy" is high.',
          "launch-bound"),
    Entry("GpuTrainTensorCoresIdle", "bottleneck", "info", "15m",
          "A busy GPU never uses its tensor cores.",
          "Train with automatic mixed precision (torch.autocast) or bf16 so the tensor cores "
          "do the matrix work.",
          "SM active >= {tensor_sm_active_above} and tensor active < {tensor_active_below}, "
          "{for}",
          "SMs at least {tensor_sm_active_above} active but tensor cores under "
          "{tensor_active_below} (GPM, Hopper and newer). Seed 003: +50 % throughput from AMP.",
          ("run_rank_gpu:gputrain_gpu_tensor_active_ratio:avg5m",),
          'GpuTrain / Run, "SM and tensor activity": the tensor series flat at zero.',
          "tensor-cores-idle"),
    Entry("GpuTrainLowMFU", "bottleneck", "info", "15m",
          "A busy GPU does little useful math: low model FLOPs utilisation.",
          "Train in bf16 or with AMP (torch.autocast), raise the batch size, torch.compile the "
          "model, use fused kernels (FlashAttention, fused optimizers) and fewer small ops.",
          "busy >= {mfu_busy_above} and MFU < {mfu_low}, where the client reports FLOPs, "
          "{for}",
          "The rank's GPUs are busy at least {mfu_busy_above} of the time, yet its model's "
          "FLOPs per second are under {mfu_low} of their dense peak at the precision it "
          "trains in: the kernels run, but slowly (small or unfused ops, FP32 where bf16 would "
          "do, memory-bound work). torchtitan reaches 33-39 % for Llama 3.1 8B on H100s; seed "
          "003 gained 50 % from AMP and 32 % from torch.compile. Only ranks that report FLOPs "
          "(flops_per_sample) on GPUs whose peak is known are judged.",
          ("run_rank:gputrain_training_mfu:ratio_rate5m", "run_rank:gputrain_gpu_busy_ratio:avg5m"),
          'GpuTrain / Run, "Model FLOPs utilisation" ({mfu_low} line) beside "SM and tensor '
          'activity".',
          "low-mfu"),
    Entry("GpuTrainHostOverheadBound", "bottleneck", "warning", "10m",
          "A training run's GPUs idle on host-side work, not on data.",
          "Move post-processing to a background thread, do it every N steps, keep metrics on "
          "the GPU, avoid .item() or other synchronisation in every step.",
          "GPU busy < {gpu_busy_low} with data wait < {input_bound}, or a phase of the step "
          "(not evaluation, checkpoint, start-up) > {phase_dominates} the rest of it",
          "The GPUs idle although the run barely waits for data, or a phase of the step "
          "(callbacks, logging) takes more than {phase_dominates} the rest of it (seed 002's "
          "post-processing case: GPU 46 %, 43 samples/s; Keras warns at 1.0x). Evaluation, "
          "checkpoint saves and DataLoader start-up are not part of any step and never count "
          "here.",
          ("run_rank:gputrain_training_step_phase_ratio:max_rate5m",
           "run_rank_phase:gputrain_training_phase_ratio:rate5m"),
          'GpuTrain / Run, "Phases" (50 % line) and "Data wait" low while "GPU busy" is low.',
          "host-overhead"),
    Entry("GpuTrainStepTimeStalls", "bottleneck", "info", "15m",
          "A training run stalls periodically.",
          "Checkpoint asynchronously or less often, write to local disk and upload later.",
          "p99 step time > {stall_p99_over_p50} the median over 30m, or checkpoint saves > "
          "{checkpoint_share} of the step time",
          "The p99 step time is more than {stall_p99_over_p50} the median over 30 m, or "
          "checkpoint saves (the phase `checkpoint`, which the client keeps out of step time) "
          "take more than {checkpoint_share} of the step time: periodic stalls, usually "
          "checkpoints (seed 002: even periodic bottlenecks hurt the average).",
          ("run_rank:gputrain_training_step_seconds:p99_30m",
           "run_rank:gputrain_training_checkpoint_ratio:rate5m"),
          'GpuTrain / Run, "Step time": the max far above p50, in periodic spikes; "Phases" '
          'shows `checkpoint` if the client marks it.',
          "step-time-stalls"),
    Entry("GpuTrainStragglerRank", "bottleneck", "warning", "15m",
          "One rank of a run is slower than the others.",
          "Check that rank's node: its input, thermal throttling, a slower GPU or link.",
          "data wait > {straggler_wait_factor} the run's median (and >= {input_bound}), or "
          "compute time > {straggler_compute_factor}",
          "In synchronous data-parallel training every rank shares the step time, so a "
          "straggler shows in what it does differently: it waits for data more than "
          "{straggler_wait_factor} its run's median, or computes {straggler_compute_factor} "
          "longer (HTA's straggler analysis). Compare the series below across the run's ranks.",
          ("run_rank:gputrain_training_data_wait_ratio:rate5m",
           "run_rank:gputrain_training_compute_seconds:mean5m"),
          'GpuTrain / Run with all ranks selected: the rank whose "Data wait" or step time '
          'stands out; then GpuTrain / Node for its node.',
          "straggler", level="global"),
    Entry("GpuTrainHostMemoryLeak", "bottleneck", "warning", "30m",
          "A training process's memory keeps growing.",
          "Look for tensors kept across steps (losses appended without .item()) and growing "
          "caches.",
          "process RSS growing (over 1h and 15m) fast enough to use up the node's available "
          "memory within {leak_horizon_seconds}",
          "The training process tree's RSS grows, over the last hour and still over the last "
          "15 minutes, fast enough to use up the memory the node still has available within "
          "{leak_horizon_seconds} (seed 002: rising memory may mean a leak). A high but flat "
          "RSS, or one that grew during warm-up and then levelled off, does not fire.",
          ("gputrain_training_process_resident_memory_bytes",
           "gputrain_host_memory_available_bytes"),
          'GpuTrain / Run, "Training process memory" rising steadily.',
          "memory-leak", profile=False),
    Entry("GpuTrainGPUMemoryNearLimit", "health", "warning", "5m",
          "A GPU's memory is nearly full.",
          "Use activation checkpointing, AMP, or a smaller micro-batch with gradient "
          "accumulation.",
          "GPU memory used > {memory_near_limit} for {for}",
          "A GPU's memory is over {memory_near_limit} used: the next larger batch or sequence "
          "will fail.",
          ("gpu:gputrain_gpu_memory_used:ratio",),
          'GpuTrain / Node, "GPU memory" (used against total); GpuTrain / Run, "GPU memory '
          'used" ({memory_near_limit} line).'),
    Entry("GpuTrainThrottling", "bottleneck", "warning", "10m",
          "A GPU's clocks are held down by power or temperature.",
          "Check cooling and the power limit: nvidia-smi -q -d PERFORMANCE.",
          "power/thermal clock events > {throttle_ratio} of the time for {for}",
          "Power-cap, thermal or power-brake clock events for more than {throttle_ratio} of "
          "the time.",
          ("gpu:gputrain_gpu_clock_event_throttle:ratio_rate5m",
           "gputrain_gpu_temperature_celsius"),
          'GpuTrain / Run, "SM clock" and "Throttled time" ({throttle_ratio} line); GpuTrain / '
          'Node, "Temperature" and "Power".',
          "throttling", profile=False),
    Entry("GpuTrainStalled", "bottleneck", "critical", "1m",
          "A training run stopped making steps while its process lives.",
          "Look for a hang in a collective, a dead DataLoader worker or a deadlock "
          "(py-spy dump --pid).",
          "no step for {stalled_seconds} while the rank still reports",
          "A rank still reports but made no step for {stalled_seconds}.",
          ("gputrain_training_last_step_timestamp_seconds",),
          'GpuTrain / Run, "Samples per second" at zero while the rank is still listed.',
          "stalled", profile=False),
    Entry("GpuTrainGPULost", "health", "critical", "1m",
          "A GPU stopped answering.",
          "Drain the node; check dmesg for Xid 79.",
          "`gputrain_gpu_up == 0` for {for}",
          "NVML says the GPU is lost (fallen off the bus); the exporter retries it every 10 s.",
          ("gputrain_gpu_up",),
          'GpuTrain / Node, table "GPU health" (up 0).'),
    Entry("GpuTrainXidErrors", "health", "critical", "0m",
          "A GPU reported Xid errors.",
          "Check the driver log for the Xid's meaning; drain the node if it repeats.",
          "any Xid error in 10m",
          "The driver reported Xid errors.",
          ("gputrain_gpu_xid_errors_total",),
          'GpuTrain / Node, table "GPU health" (Xid errors in the last hour).'),
    Entry("GpuTrainGPUMemoryFault", "health", "warning / critical", "0m",
          "A GPU's memory has a fault: drain it, or reset it when the job ends.",
          "Critical (an uncorrectable ECC error or a failed row remap): drain the node and "
          "have the GPU checked. Warning (a row remap or page retirement pending): reset the "
          "GPU (nvidia-smi -r, or reboot) when the job ends, so the remap takes effect.",
          "an uncorrectable ECC error in 10m (or found by an exporter started in the last "
          "10m) or a failed remap (critical); a remap or page retirement pending (warning)",
          "NVML's row remapper (Ampere and newer) replaces a faulty memory row at the next GPU "
          "reset: until then the remap is pending, and a failed remap means the GPU cannot "
          "heal itself. An uncorrectable ECC error can crash the job (Xid 48, 63, 94, 95). "
          "GPUs before Ampere retire pages instead, also at the next reset.",
          ("gputrain_gpu_ecc_errors_total", "gputrain_gpu_remapped_rows",
           "gputrain_gpu_retired_pages_pending"),
          'GpuTrain / Node, table "GPU health" (uncorrected ECC, remap pending and failed).'),
    Entry("GpuTrainCollectorFailing", "health", "warning", "10m",
          "A gputrain-exporter collector fails.",
          "See the exporter's log; for gpu fix the driver or the container's GPU access "
          "(NVIDIA_VISIBLE_DEVICES=all).",
          "a collector failing for {for}",
          "A collector has failed for {for}; its metrics are missing. For `gpu`, usually no "
          "driver or no access to `/dev/nvidia*` (see the exporter's log line).",
          ("gputrain_collector_success",),
          'GpuTrain / Node: the failing collector\'s panels are empty; '
          '`gputrain_collector_success` in Prometheus says which.'),
    Entry("GpuTrainExporterDown", "health", "critical", "5m",
          "Prometheus cannot scrape a gputrain-exporter.",
          "Check the service (systemctl status gputrain-exporter) and the network path to "
          "port 19400.",
          "`up == 0` for {for}",
          "Prometheus cannot scrape the exporter: its GPUs and runs are unmonitored.",
          ("up",),
          'GpuTrain / Overview: the node\'s runs and GPUs disappear; `up{{job=~"gputrain.*"}}` '
          'in Prometheus.'),
)

BY_ALERT: dict[str, Entry] = {e.alert: e for e in CATALOGUE}
LEVELS = ("node", "global")
BY_VERDICT: dict[str, Entry] = {e.verdict: e for e in CATALOGUE if e.verdict}
# the alerts whose firing for a rank asks for a profile of it (Alertmanager's webhook)
PROFILED_ALERTS: frozenset[str] = frozenset(e.alert for e in CATALOGUE if e.profiled)


def show(name: str, value: float) -> str:
    """A threshold as people read it: ``5 %``, ``2x``, ``10 m``, ``4 h``."""
    unit = THRESHOLDS[name].unit
    if unit == "ratio":
        return f"{value * 100:g} %"
    if unit == "factor":
        return f"{value:g}x"
    seconds = int(value)
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    return f"{seconds // 60} m" if seconds % 60 == 0 else f"{seconds} s"


def fill(text: str, thresholds: dict[str, float], for_: str = "") -> str:
    """``text`` with ``{name}`` replaced by the threshold shown in its unit, ``{for}`` by
    ``for_``."""
    values = {name: show(name, v) for name, v in thresholds.items()}
    return text.format(**values, **{"for": for_})


def defaults() -> dict[str, float]:
    """The default thresholds by name."""
    return {name: t.default for name, t in THRESHOLDS.items()}
