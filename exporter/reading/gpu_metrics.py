"""Every per-GPU metric of the GPU collector, one descriptor each (as dcgm-exporter's counters
file or node_exporter's ``registerCollector`` line).

A :class:`GpuMetric` writes once what a family is: its name, type, unit, help, and where its
value comes from in words (docs/metrics.md's source column); for a plain family, the
GpuSample field (a gauge) or GpuState field (a counter) it exports; where the NVML reading is
one call, that call (:class:`NvmlRead`); and the demo backend's value. From this table follow:

- the GPU collector's families, in this order on /metrics (``collectors/gpu.py``);
- the NVML backend's one-call readings (``NvmlBackend._one_call_readings``);
- the demo backend's gauges (``DemoBackend.sample``);
- the GPU table of docs/metrics.md (``scripts/generate.py``).

A reading that is not one call (GPM, field values, NVML's sample buffer, a link computed from
two calls, a counter the sampler integrates, a labelled family) has its source in words here
and its code in ``gpu_backends.py`` or ``sampler.py``.

A new gauge read by one NVML call: its descriptor here (with ``nvml`` and ``demo``), its
GpuSample field in ``gpu_backends.py``, ``scripts/generate.py``, and a test over the
fake driver (``tests/fake_nvml.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

LABELS = ("gpu", "uuid")  # every GPU series has them
MIB = 1024 * 1024

# Usable bytes per second per lane, by PCIe generation (after line encoding:
# 8b/10b for gen 1-2, 128b/130b for gen 3-5, FLIT for gen 6).
PCIE_LANE_BYTES_PER_SECOND = {
    1: 250e6,
    2: 500e6,
    3: 984.6e6,
    4: 1969.2e6,
    5: 3938.5e6,
    6: 7563.0e6,
}

# The demo's fixed figures are what NVML reports on an H100 SXM5 80GB (tests/fake_nvml.py's
# h100_sxm names the public nvidia-smi outputs they come from).
H100_MEMORY_BYTES = 81559 * MIB  # what NVML reports of the 80 GB of HBM3
H100_POWER_LIMIT_WATTS = 700.0
H100_IDLE_WATTS = 70.0


@dataclass(frozen=True)
class NvmlRead:
    """A reading that is one NVML call on the device's handle: the first of ``functions``
    (newest first) that the driver and the binding answer, with ``args`` after the handle;
    the answer divided by ``per`` (NVML's units in one exported unit: 1000 mW in a watt).
    An answer equal to ``unknown`` (an enum's UNKNOWN) is left out."""

    functions: tuple[str, ...]
    args: tuple[int, ...] = ()
    per: float = 1.0
    unknown: int | None = None


@dataclass(frozen=True)
class GpuMetric:
    """One per-GPU family (see the module's docstring).

    ``labels``: the labels after ``gpu`` and ``uuid``, each with the values it takes (empty
    when they are open). ``attr``: for a plain family, the GpuSample field a gauge exports or
    the GpuState field a counter exports; None where the collector fills the family itself.
    ``demo``: the demo backend's value of a plain gauge, a figure or a function of the demo
    GPU's busy ratio (0-1); None where the demo leaves it out or computes it itself.
    """

    name: str
    type: Literal["gauge", "counter"]
    unit: str
    help: str
    source: str
    attr: str | None = None
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    nvml: NvmlRead | None = None
    demo: float | Callable[[float], float] | None = None

    def demo_value(self, load: float) -> float:
        """The demo's value at busy ratio ``load`` (0-1)."""
        if self.demo is None:
            raise ValueError(f"{self.name} has no demo value")
        return float(self.demo(load) if callable(self.demo) else self.demo)

    def doc_row(self) -> str:
        """Its row in docs/metrics.md's table (name | type | unit | labels | source)."""
        labels = ", ".join([*LABELS, *(
            f"{name} ({', '.join(f'`{v}`' for v in values)})" if values else name
            for name, values in self.labels.items())])
        return f"| `{self.name}` | {self.type} | {self.unit} | {labels} | {self.source} |"


INFO = GpuMetric(
    "gputrain_gpu_info", "gauge", "1", "GPU identity; always 1.",
    "`nvmlDeviceGetName`, `nvmlDeviceGetPciInfo`, `nvmlSystemGetDriverVersion`; for a MIG "
    "device `parent` is its GPU's index and `profile` its MIG profile (`1g.10gb`, from the "
    "name NVML gives it)",
    labels=dict.fromkeys(("name", "pci_bus_id", "driver_version", "backend", "parent",
                          "profile"), ()))
UP = GpuMetric(
    "gputrain_gpu_up", "gauge", "1/0",
    "1 when the GPU answered the last sampling cycle, 0 when it is lost or unreadable.",
    "0 when NVML says GPU_IS_LOST or the GPU stops answering")
CLOCKS = GpuMetric(
    "gputrain_gpu_clock_hertz", "gauge", "hertz", "Current clock, in hertz.",
    "`nvmlDeviceGetClockInfo`", labels={"clock": ("sm", "memory")})
CLOCK_EVENTS = GpuMetric(
    "gputrain_gpu_clock_event_seconds_total", "counter", "seconds",
    "Seconds the clocks were held down, by reason (NVML clock-event counters, by the field "
    "numbering of the driver's NVML version; else nvmlDeviceGetViolationStatus; else sampled "
    "from the current clock-event reasons bitmask). A reason no source reports is absent.",
    "`sw_power_cap` and `sync_boost`: fields 74 and 76; `sw_thermal_slowdown`, "
    "`hw_thermal_slowdown`, `hw_power_brake_slowdown`: the clock-event fields by the driver's "
    "own numbering (see [GPU metrics across drivers]"
    "(#gpu-metrics-across-drivers-and-nvidia-ml-py-releases)), else "
    "`nvmlDeviceGetViolationStatus` for `sw_thermal_slowdown`; where no counter reports a "
    "reason, each reading's interval counted to the reasons set in "
    "`nvmlDeviceGetCurrentClocksEventReasons` (before the 535 binding "
    "`...ThrottleReasons`), and `hw_slowdown` for HW_SLOWDOWN without the thermal or power "
    "brake bit; a reason no source reports is absent",
    labels={"reason": ()})
XID_ERRORS = GpuMetric(
    "gputrain_gpu_xid_errors_total", "counter", "errors",
    "Xid errors reported by the driver, by Xid code.",
    "`nvmlEventSetWait_v2` on `nvmlEventTypeXidCriticalError`, in its own thread",
    labels={"xid": ()})
ECC_ERRORS = GpuMetric(
    "gputrain_gpu_ecc_errors_total", "counter", "errors",
    "Memory ECC errors by type (corrected, uncorrected): the driver's volatile count at the "
    "exporter's first reading, then its increases, so it never goes down "
    "(nvmlDeviceGetTotalEccErrors).",
    "`nvmlDeviceGetTotalEccErrors(..., NVML_VOLATILE_ECC)`: the count since the driver loaded "
    "at the first reading, then its increases, so it never goes down across a driver reload",
    labels={"type": ("corrected", "uncorrected")})
REMAPPED_ROWS = GpuMetric(
    "gputrain_gpu_remapped_rows", "gauge", "rows, 1/0",
    "Memory rows remapped by state (Ampere and newer, nvmlDeviceGetRemappedRows): correctable "
    "and uncorrectable count rows; pending is 1 while a remap waits for a GPU reset, failed is "
    "1 when a remap failed.",
    "`nvmlDeviceGetRemappedRows` (Ampere and newer): rows remapped; pending 1 until the GPU is "
    "reset, failed 1 when a remap failed",
    labels={"state": ("correctable", "uncorrectable", "pending", "failed")})
RETIRED_PAGES = GpuMetric(
    "gputrain_gpu_retired_pages", "gauge", "pages",
    "Memory pages retired by cause (GPUs before Ampere, nvmlDeviceGetRetiredPages).",
    "`nvmlDeviceGetRetiredPages` (GPUs before Ampere, which have no row remapper)",
    labels={"cause": ("multiple_single_bit_ecc", "double_bit_ecc")})
PEAK_FLOPS = GpuMetric(
    "gputrain_gpu_peak_flops", "gauge", "FLOP/s",
    "Dense peak FLOP/s of the GPU at a precision (the datasheet figure without sparsity; "
    "--gpu.peak-flops adds models). Absent for a GPU the table lacks.",
    "the datasheet's dense peak for the `nvmlDeviceGetName` model "
    "([table](../exporter/reading/peak_flops.py), `--gpu.peak-flops`); absent for unknown "
    "models and MIG slices",
    labels={"precision": ()})

# In the order of the /metrics page.
GPU_METRICS: tuple[GpuMetric, ...] = (
    INFO,
    UP,
    GpuMetric(
        "gputrain_gpu_utilization_ratio", "gauge", "ratio",
        "Fraction of the last sampling window in which any kernel ran (NVML utilization.gpu, "
        "averaged over NVML's sample buffer; on a MIG device, which NVML gives no "
        "utilisation, GPM GRAPHICS_UTIL of its GPU instance); 0-1.",
        "mean of `nvmlDeviceGetSamples(GPU_UTILIZATION_SAMPLES)` since the last cycle, else "
        "`nvmlDeviceGetUtilizationRates`; on a MIG device (and a GPU in MIG mode), where NVML "
        "answers no utilisation, GPM `GRAPHICS_UTIL` of its GPU instance (Hopper and newer; "
        "absent on an A100 in MIG mode)",
        attr="utilization", demo=lambda load: load),
    GpuMetric(
        "gputrain_gpu_sm_active_ratio", "gauge", "ratio",
        "Fraction of SM cycles with at least one warp resident (NVML GPM SM_UTIL); 0-1.",
        "GPM `SM_UTIL` (Hopper and newer)", attr="sm_active", demo=lambda load: 0.85 * load),
    GpuMetric(
        "gputrain_gpu_sm_occupancy_ratio", "gauge", "ratio",
        "Resident warps over the maximum the SMs hold (NVML GPM SM_OCCUPANCY); 0-1.",
        "GPM `SM_OCCUPANCY`", attr="sm_occupancy", demo=lambda load: 0.45 * load),
    GpuMetric(
        "gputrain_gpu_tensor_active_ratio", "gauge", "ratio",
        "Fraction of cycles a tensor core pipe was active (NVML GPM ANY_TENSOR_UTIL); 0-1.",
        "GPM `ANY_TENSOR_UTIL`", attr="tensor_active", demo=lambda load: 0.35 * load),
    GpuMetric(
        "gputrain_gpu_dram_active_ratio", "gauge", "ratio",
        "Fraction of peak device-memory bandwidth used (NVML GPM DRAM_BW_UTIL); 0-1.",
        "GPM `DRAM_BW_UTIL`", attr="dram_active", demo=lambda load: 0.5 * load),
    GpuMetric(
        "gputrain_gpu_memory_used_bytes", "gauge", "bytes",
        "Device memory in use, in bytes (nvmlDeviceGetMemoryInfo).",
        "`nvmlDeviceGetMemoryInfo` v2 `.used` (what `nvidia-smi` shows: the driver's reserved "
        "memory left out), v1 on older drivers",
        attr="memory_used_bytes",
        demo=lambda load: H100_MEMORY_BYTES * (0.05 + 0.7 * min(1.0, load * 1.5))),
    GpuMetric(
        "gputrain_gpu_memory_total_bytes", "gauge", "bytes",
        "Device memory size, in bytes (nvmlDeviceGetMemoryInfo).",
        "`nvmlDeviceGetMemoryInfo().total`", attr="memory_total_bytes", demo=H100_MEMORY_BYTES),
    GpuMetric(
        "gputrain_gpu_power_watts", "gauge", "watts",
        "Board power draw, in watts (nvmlDeviceGetPowerUsage): a one-second average on Ampere "
        "and newer GPUs except the A100 (GA100), instantaneous on the A100 and older GPUs.",
        "`nvmlDeviceGetPowerUsage`: a one-second average on Ampere and newer GPUs except the "
        "A100 (GA100), instantaneous on the A100 and older GPUs; absent on a MIG device",
        attr="power_watts", nvml=NvmlRead(("nvmlDeviceGetPowerUsage",), per=1000.0),
        # idle, up to 90 % of the limit at full load
        demo=lambda load: H100_IDLE_WATTS + (H100_POWER_LIMIT_WATTS * 0.9 - H100_IDLE_WATTS)
        * load),
    GpuMetric(
        "gputrain_gpu_power_limit_watts", "gauge", "watts",
        "Enforced power limit, in watts (nvmlDeviceGetEnforcedPowerLimit).",
        "`nvmlDeviceGetEnforcedPowerLimit`", attr="power_limit_watts",
        nvml=NvmlRead(("nvmlDeviceGetEnforcedPowerLimit",), per=1000.0),
        demo=H100_POWER_LIMIT_WATTS),
    GpuMetric(
        "gputrain_gpu_pcie_link_max_bytes_per_second", "gauge", "bytes/s",
        "Usable bandwidth of the PCIe link per direction at the highest generation and width "
        "the GPU and its slot support (nvmlDeviceGetMaxPcieLinkGeneration, "
        "nvmlDeviceGetGpuMaxPcieLinkGeneration, nvmlDeviceGetMaxPcieLinkWidth), in bytes per "
        "second.",
        "the link at its best: the lower of `nvmlDeviceGetMaxPcieLinkGeneration` (GPU and "
        "slot) and `nvmlDeviceGetGpuMaxPcieLinkGeneration`, times "
        "`nvmlDeviceGetMaxPcieLinkWidth`; it does not follow the link training down when idle",
        attr="pcie_link_max_bytes_per_second", demo=PCIE_LANE_BYTES_PER_SECOND[5] * 16),
    GpuMetric(
        "gputrain_gpu_pcie_link_current_bytes_per_second", "gauge", "bytes/s",
        "Usable bandwidth of the PCIe link per direction as it is trained now (it trains down "
        "when idle; nvmlDeviceGetCurrPcieLinkGeneration and Width), in bytes per second.",
        "the link as trained now: `nvmlDeviceGetCurrPcieLinkGeneration` x `...Width` (lower "
        "than the max while idle)",
        attr="pcie_link_current_bytes_per_second", demo=PCIE_LANE_BYTES_PER_SECOND[5] * 16),
    GpuMetric(
        "gputrain_gpu_temperature_celsius", "gauge", "°C",
        "GPU die temperature, in degrees Celsius (nvmlDeviceGetTemperatureV, or "
        "nvmlDeviceGetTemperature on drivers before 570).",
        "`nvmlDeviceGetTemperatureV(GPU)` (driver 570 and newer), else the deprecated "
        "`nvmlDeviceGetTemperature`",
        attr="temperature_celsius",
        # sensor 0: NVML_TEMPERATURE_GPU. nvmlDeviceGetTemperature is deprecated in the 13.0
        # header; V is from the 12.8 header (driver 570)
        nvml=NvmlRead(("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), args=(0,)),
        demo=lambda load: 32.0 + 40.0 * load),
    GpuMetric(
        "gputrain_gpu_nvlink_links", "gauge", "links",
        "Active NVLink links (nvmlDeviceGetNvLinkState of each link NVML field "
        "NVLINK_LINK_COUNT says is present); absent on a GPU without NVLink.",
        "active links: `nvmlDeviceGetNvLinkState` of each link field "
        "`NVML_FI_DEV_NVLINK_LINK_COUNT` says is present (0 when all are down); a GPU with no "
        "link present exports no NVLink series and is not asked again",
        attr="nvlink_links", demo=18),  # NVLink 4: 18 links of 26,562 MB/s (NVML's figure)
    GpuMetric(
        "gputrain_gpu_nvlink_link_max_bytes_per_second", "gauge", "bytes/s",
        "Bandwidth of one NVLink link per direction, in bytes per second (NVML field "
        "NVLINK_SPEED_MBPS_COMMON).",
        "field `NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON` (one link, one direction)",
        attr="nvlink_link_max_bytes_per_second", demo=26_562e6),
    GpuMetric(
        "gputrain_gpu_retired_pages_pending", "gauge", "1/0",
        "1 when a page retirement waits for the next driver reload or GPU reset (GPUs before "
        "Ampere; nvmlDeviceGetRetiredPagesPendingStatus).",
        "`nvmlDeviceGetRetiredPagesPendingStatus`", attr="retired_pages_pending"),
    GpuMetric(
        "gputrain_gpu_performance_state", "gauge", "P-state",
        "Performance state: 0 is P0, the highest performance, up to 15, the lowest "
        "(nvmlDeviceGetPerformanceState); a busy GPU above P0 runs at lower clocks.",
        "`nvmlDeviceGetPerformanceState`: 0 = P0 (maximum performance) ... 15 (minimum); "
        "absent on a MIG device and where NVML answers `NVML_PSTATE_UNKNOWN`",
        attr="performance_state",
        nvml=NvmlRead(("nvmlDeviceGetPerformanceState",), unknown=32),  # NVML_PSTATE_UNKNOWN
        demo=0),  # an H100 SXM is at P0, idle or busy
    GpuMetric(
        "gputrain_gpu_sampled_seconds_total", "counter", "seconds",
        "Seconds of wall time the sampler watched this GPU. Divide rate() of a *_seconds_total "
        "counter by rate() of this one for a ratio that is exact from the first scrapes.",
        "wall time the sampler watched the GPU: the denominator of the GPU ratios",
        attr="sampled_seconds"),
    GpuMetric(
        "gputrain_gpu_busy_seconds_total", "counter", "seconds",
        "Seconds in which any kernel ran: utilisation integrated over time by the sampler. "
        "rate() of it is the exact mean utilisation over any window.",
        "utilisation integrated over time by the sampler", attr="busy_seconds"),
    GpuMetric(
        "gputrain_gpu_energy_joules_total", "counter", "joules",
        "Energy drawn since the exporter started, in joules "
        "(nvmlDeviceGetTotalEnergyConsumption deltas).",
        "deltas of `nvmlDeviceGetTotalEnergyConsumption` (else power x time)",
        attr="energy_joules"),
    GpuMetric(
        "gputrain_gpu_pcie_received_bytes_total", "counter", "bytes",
        "Bytes the GPU received over PCIe (host-to-device), since the exporter started: GPM "
        "PCIE_RX_PER_SEC integrated where GPM works, else NVML field PCIE_COUNT_RX_BYTES "
        "(across its wraps), else nvmlDeviceGetPcieThroughput integrated.",
        "host-to-device: GPM `PCIE_RX_PER_SEC` x time where GPM works (Hopper and newer), else "
        "field `NVML_FI_DEV_PCIE_COUNT_RX_BYTES` (driver 555 and newer; a 32-bit counter is "
        "followed across its wraps while the link cannot carry 4 GiB between two readings), "
        "else `nvmlDeviceGetPcieThroughput` (KiB/s) x time: one ~20 ms window a cycle, an "
        "estimate the log says it uses",
        attr="pcie_rx_bytes"),
    GpuMetric(
        "gputrain_gpu_pcie_transmitted_bytes_total", "counter", "bytes",
        "Bytes the GPU sent over PCIe (device-to-host), since the exporter started.",
        "device-to-host, same sources (TX)", attr="pcie_tx_bytes"),
    GpuMetric(
        "gputrain_gpu_nvlink_received_bytes_total", "counter", "bytes",
        "Data bytes the GPU received over all its NVLink links, since the exporter started "
        "(NVML field NVLINK_THROUGHPUT_DATA_RX, or GPM NVLINK_TOTAL_RX_PER_SEC integrated).",
        "data received over all NVLink links: field `NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX` "
        "(KiB, scope all links), else GPM `NVLINK_TOTAL_RX_PER_SEC` x time; absent without "
        "NVLink",
        attr="nvlink_rx_bytes"),
    GpuMetric(
        "gputrain_gpu_nvlink_transmitted_bytes_total", "counter", "bytes",
        "Data bytes the GPU sent over all its NVLink links, since the exporter started.",
        "the same, sent (`..._DATA_TX`, GPM `NVLINK_TOTAL_TX_PER_SEC`)", attr="nvlink_tx_bytes"),
    CLOCKS,
    CLOCK_EVENTS,
    XID_ERRORS,
    ECC_ERRORS,
    REMAPPED_ROWS,
    RETIRED_PAGES,
    PEAK_FLOPS,
)

ONE_CALL = tuple(m for m in GPU_METRICS if m.nvml is not None)  # read by the NVML backend
DEMO_GAUGES = tuple(m for m in GPU_METRICS if m.demo is not None)  # set by the demo backend
BY_NAME = {m.name: m for m in GPU_METRICS}


def doc_table() -> str:
    """The GPU metric table of docs/metrics.md."""
    rows = ["| name | type | unit | labels | source |", "| --- | --- | --- | --- | --- |"]
    return "\n".join([*rows, *(m.doc_row() for m in GPU_METRICS)]) + "\n"
