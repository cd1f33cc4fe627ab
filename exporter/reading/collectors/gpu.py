"""Per-GPU metric families from a snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.reading.peak_flops import PeakTable
from exporter.reading.sampler import Snapshot

LABELS = ["gpu", "uuid"]

# (attribute of GpuSample, metric name, help). Gauges read from the latest sample.
SAMPLE_GAUGES = [
    ("utilization", "gputrain_gpu_utilization_ratio",
     "Fraction of the last sampling window in which any kernel ran (NVML utilization.gpu, "
     "averaged over NVML's sample buffer; on a MIG device, which NVML gives no utilisation, "
     "GPM GRAPHICS_UTIL of its GPU instance); 0-1."),
    ("sm_active", "gputrain_gpu_sm_active_ratio",
     "Fraction of SM cycles with at least one warp resident (NVML GPM SM_UTIL); 0-1."),
    ("sm_occupancy", "gputrain_gpu_sm_occupancy_ratio",
     "Resident warps over the maximum the SMs hold (NVML GPM SM_OCCUPANCY); 0-1."),
    ("tensor_active", "gputrain_gpu_tensor_active_ratio",
     "Fraction of cycles a tensor core pipe was active (NVML GPM ANY_TENSOR_UTIL); 0-1."),
    ("dram_active", "gputrain_gpu_dram_active_ratio",
     "Fraction of peak device-memory bandwidth used (NVML GPM DRAM_BW_UTIL); 0-1."),
    ("memory_used_bytes", "gputrain_gpu_memory_used_bytes",
     "Device memory in use, in bytes (nvmlDeviceGetMemoryInfo)."),
    ("memory_total_bytes", "gputrain_gpu_memory_total_bytes",
     "Device memory size, in bytes (nvmlDeviceGetMemoryInfo)."),
    ("power_watts", "gputrain_gpu_power_watts",
     "Board power draw, in watts (nvmlDeviceGetPowerUsage): a one-second average on Ampere "
     "and newer GPUs except the A100 (GA100), instantaneous on the A100 and older GPUs."),
    ("power_limit_watts", "gputrain_gpu_power_limit_watts",
     "Enforced power limit, in watts (nvmlDeviceGetEnforcedPowerLimit)."),
    ("pcie_link_max_bytes_per_second", "gputrain_gpu_pcie_link_max_bytes_per_second",
     "Usable bandwidth of the PCIe link per direction at the highest generation and width the "
     "GPU and its slot support (nvmlDeviceGetMaxPcieLinkGeneration, "
     "nvmlDeviceGetGpuMaxPcieLinkGeneration, nvmlDeviceGetMaxPcieLinkWidth), in bytes per "
     "second."),
    ("pcie_link_current_bytes_per_second", "gputrain_gpu_pcie_link_current_bytes_per_second",
     "Usable bandwidth of the PCIe link per direction as it is trained now (it trains down "
     "when idle; nvmlDeviceGetCurrPcieLinkGeneration and Width), in bytes per second."),
    ("temperature_celsius", "gputrain_gpu_temperature_celsius",
     "GPU die temperature, in degrees Celsius (nvmlDeviceGetTemperatureV, or "
     "nvmlDeviceGetTemperature on drivers before 570)."),
    ("nvlink_links", "gputrain_gpu_nvlink_links",
     "Active NVLink links (nvmlDeviceGetNvLinkState of each link NVML field NVLINK_LINK_COUNT "
     "says is present); absent on a GPU without NVLink."),
    ("nvlink_link_max_bytes_per_second", "gputrain_gpu_nvlink_link_max_bytes_per_second",
     "Bandwidth of one NVLink link per direction, in bytes per second (NVML field "
     "NVLINK_SPEED_MBPS_COMMON)."),
    ("retired_pages_pending", "gputrain_gpu_retired_pages_pending",
     "1 when a page retirement waits for the next driver reload or GPU reset (GPUs before "
     "Ampere; nvmlDeviceGetRetiredPagesPendingStatus)."),
]

# (attribute of GpuState, metric name, help). Counters integrated by the sampler.
STATE_COUNTERS = [
    ("sampled_seconds", "gputrain_gpu_sampled_seconds_total",
     "Seconds of wall time the sampler watched this GPU. Divide rate() of a *_seconds_total "
     "counter by rate() of this one for a ratio that is exact from the first scrapes."),
    ("busy_seconds", "gputrain_gpu_busy_seconds_total",
     "Seconds in which any kernel ran: utilisation integrated over time by the sampler. "
     "rate() of it is the exact mean utilisation over any window."),
    ("energy_joules", "gputrain_gpu_energy_joules_total",
     "Energy drawn since the exporter started, in joules "
     "(nvmlDeviceGetTotalEnergyConsumption deltas)."),
    ("pcie_rx_bytes", "gputrain_gpu_pcie_received_bytes_total",
     "Bytes the GPU received over PCIe (host-to-device), since the exporter started: GPM "
     "PCIE_RX_PER_SEC integrated where GPM works, else NVML field PCIE_COUNT_RX_BYTES (across "
     "its wraps), else nvmlDeviceGetPcieThroughput integrated."),
    ("pcie_tx_bytes", "gputrain_gpu_pcie_transmitted_bytes_total",
     "Bytes the GPU sent over PCIe (device-to-host), since the exporter started."),
    ("nvlink_rx_bytes", "gputrain_gpu_nvlink_received_bytes_total",
     "Data bytes the GPU received over all its NVLink links, since the exporter started "
     "(NVML field NVLINK_THROUGHPUT_DATA_RX, or GPM NVLINK_TOTAL_RX_PER_SEC integrated)."),
    ("nvlink_tx_bytes", "gputrain_gpu_nvlink_transmitted_bytes_total",
     "Data bytes the GPU sent over all its NVLink links, since the exporter started."),
]


class GpuCollector:
    """Renders every GPU of the latest snapshot; a down GPU exports only its info and up=0."""

    def __init__(self, snapshot: Callable[[], Snapshot], peaks: PeakTable | None = None) -> None:
        self._snapshot = snapshot
        self._peaks = peaks or PeakTable()

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[Metric, ...]:
        """Every family this collector can export, empty: info, up, the sample gauges, the
        integrated counters, clocks, clock events, Xid errors, memory health and peaks."""
        return (
            GaugeMetricFamily(
                "gputrain_gpu_info", "GPU identity; always 1.",
                labels=[*LABELS, "name", "pci_bus_id", "driver_version", "backend", "parent",
                        "profile"]),
            GaugeMetricFamily(
                "gputrain_gpu_up", "1 when the GPU answered the last sampling cycle, 0 when it "
                "is lost or unreadable.", labels=LABELS),
            *(GaugeMetricFamily(name, doc, labels=LABELS) for _, name, doc in SAMPLE_GAUGES),
            *(CounterMetricFamily(name, doc, labels=LABELS) for _, name, doc in STATE_COUNTERS),
            GaugeMetricFamily("gputrain_gpu_clock_hertz", "Current clock, in hertz.",
                              labels=[*LABELS, "clock"]),
            CounterMetricFamily(
                "gputrain_gpu_clock_event_seconds_total",
                "Seconds the clocks were held down, by reason (NVML clock-event counters, by the "
                "field numbering of the driver's NVML version; else nvmlDeviceGetViolationStatus). "
                "A reason the driver cannot be trusted to report is absent.",
                labels=[*LABELS, "reason"]),
            CounterMetricFamily("gputrain_gpu_xid_errors_total",
                                "Xid errors reported by the driver, by Xid code.",
                                labels=[*LABELS, "xid"]),
            CounterMetricFamily(
                "gputrain_gpu_ecc_errors_total",
                "Memory ECC errors by type (corrected, uncorrected): the driver's volatile "
                "count at the exporter's first reading, then its increases, so it never "
                "goes down (nvmlDeviceGetTotalEccErrors).", labels=[*LABELS, "type"]),
            GaugeMetricFamily(
                "gputrain_gpu_remapped_rows",
                "Memory rows remapped by state (Ampere and newer, nvmlDeviceGetRemappedRows): "
                "correctable and uncorrectable count rows; pending is 1 while a remap waits "
                "for a GPU reset, failed is 1 when a remap failed.",
                labels=[*LABELS, "state"]),
            GaugeMetricFamily(
                "gputrain_gpu_retired_pages",
                "Memory pages retired by cause (GPUs before Ampere, nvmlDeviceGetRetiredPages).",
                labels=[*LABELS, "cause"]),
            GaugeMetricFamily(
                "gputrain_gpu_peak_flops",
                "Dense peak FLOP/s of the GPU at a precision (the datasheet figure without "
                "sparsity; --gpu.peak-flops adds models). Absent for a GPU the table lacks.",
                labels=[*LABELS, "precision"]),
        )

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if not snap.gpus:
            return
        families = self._families()
        info, up = families[:2]
        n, m = len(SAMPLE_GAUGES), len(STATE_COUNTERS)
        gauges = {attr: f for (attr, _, _), f in zip(SAMPLE_GAUGES, families[2:2 + n],
                                                     strict=True)}
        counters = {attr: f for (attr, _, _), f in zip(STATE_COUNTERS, families[2 + n:2 + n + m],
                                                       strict=True)}
        clocks, events, xids, ecc, remapped, retired, peak = families[2 + n + m:]
        for g in snap.gpus:
            ident = g.identity
            labels = [ident.index, ident.uuid]
            info.add_metric([*labels, ident.name, ident.pci_bus_id, snap.driver_version,
                             snap.backend, ident.parent, ident.profile], 1)
            up.add_metric(labels, 1 if g.up else 0)
            for xid, count in sorted(g.xid_errors.items()):
                xids.add_metric([*labels, str(xid)], count)
            if not g.up or g.sample is None:
                continue
            s = g.sample
            for attr, family in gauges.items():
                value = getattr(s, attr)
                if value is not None:
                    family.add_metric(labels, value)
            for attr, family in counters.items():
                value = getattr(g, attr)
                if value is not None:
                    family.add_metric(labels, value)
            for clock, hz in sorted(s.clocks_hertz.items()):
                clocks.add_metric([*labels, clock], hz)
            for reason, seconds in sorted(g.clock_event_seconds.items()):
                events.add_metric([*labels, reason], seconds)
            for kind, count in sorted(g.ecc_errors.items()):
                ecc.add_metric([*labels, kind], count)
            for state, rows in s.remapped_rows.items():
                remapped.add_metric([*labels, state], rows)
            for cause, pages in sorted(s.retired_pages.items()):
                retired.add_metric([*labels, cause], pages)
            if not ident.parent:  # a MIG slice's share of the peak depends on its profile
                for precision, flops in sorted(self._peaks.peaks(ident.name).items()):
                    peak.add_metric([*labels, precision], flops)
        yield info
        yield up
        for family in (*gauges.values(), *counters.values(), clocks, events, xids, ecc,
                       remapped, retired, peak):
            if family.samples:
                yield family
