"""GPU backends: where per-GPU readings come from.

Two backends stand behind one small protocol: :class:`NvmlBackend` reads real GPUs through
:mod:`exporter.reading.nvml`, and :class:`DemoBackend` simulates plausible H100-like GPUs so the
whole bundle can be tried (and tested end to end) on a machine without one. The sampler only
ever sees :class:`GpuIdentity` and :class:`GpuSample`.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from exporter.reading.nvml import VALUE_MEMBER, GpuLostError, Nvml, NvmlUnavailable

log = logging.getLogger(__name__)

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

# Cumulative clock-event (throttle) counters, in nanoseconds, by the `reason` label.
CLOCK_EVENT_FIELDS = {
    "sw_power_cap": "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP",
    "sync_boost": "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST",
    "sw_thermal_slowdown": "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN",
    "hw_thermal_slowdown": "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN",
    "hw_power_brake_slowdown": "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN",
}
# Older drivers: the (deprecated) violation counters, also in nanoseconds.
VIOLATION_POLICIES = {
    "sw_power_cap": "NVML_PERF_POLICY_POWER",
    "sw_thermal_slowdown": "NVML_PERF_POLICY_THERMAL",
    "sync_boost": "NVML_PERF_POLICY_SYNC_BOOST",
}

GPM_METRICS = {
    "sm_active": "NVML_GPM_METRIC_SM_UTIL",
    "sm_occupancy": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "tensor_active": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "dram_active": "NVML_GPM_METRIC_DRAM_BW_UTIL",
    "pcie_tx_mib_per_second": "NVML_GPM_METRIC_PCIE_TX_PER_SEC",
    "pcie_rx_mib_per_second": "NVML_GPM_METRIC_PCIE_RX_PER_SEC",
    "nvlink_rx_mib_per_second": "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC",
    "nvlink_tx_mib_per_second": "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC",
}
MIB = 1024 * 1024
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1  # usedGpuMemory where the driver cannot tell (WDDM, MIG)
# NVLink through field values: data (not raw) KiB counters summed over every link (scope
# UINT_MAX), the active link count and the common per-link speed (MB/s)
NVLINK_ALL_LINKS = 0xFFFFFFFF
NVLINK_FIELDS = {"rx": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
                 "tx": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"}
# ECC error counts by the `type` label: nvmlMemoryErrorType_t
ECC_TYPES = {"corrected": "NVML_MEMORY_ERROR_TYPE_CORRECTED",
             "uncorrected": "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"}
# retired pages (pre-Ampere) by the `cause` label: nvmlPageRetirementCause_t
RETIREMENT_CAUSES = {
    "multiple_single_bit_ecc": "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
    "double_bit_ecc": "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"}
REMAP_STATES = ("correctable", "uncorrectable", "pending", "failed")
# newest first (see Nvml.call_versioned); older drivers lack the later ones
COMPUTE_PROCESS_VARIANTS = (("nvmlDeviceGetComputeRunningProcesses_v3", {}),
                            ("nvmlDeviceGetComputeRunningProcesses_v2", {}),
                            ("nvmlDeviceGetComputeRunningProcesses", {}))


_MIG_PROFILE = re.compile(r"\bMIG (\d+g\.\d+gb(?:\+\w+)*)", re.IGNORECASE)


class BackendUnavailable(RuntimeError):
    """The backend cannot read any GPU on this machine; the reason is the message."""


@dataclass(frozen=True)
class GpuIdentity:
    """What names a GPU in every series: its `gpu` index label and its UUID."""

    index: str
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    parent: str = ""  # for a MIG device: the index of its physical GPU
    profile: str = ""  # for a MIG device: its profile, such as 1g.10gb


@dataclass
class GpuSample:
    """One reading of one GPU. None means "not available": the metric is left out.

    Units: ratios 0-1, bytes, watts, joules, hertz, degrees Celsius, seconds.
    Cumulative values (energy, PCIe bytes, clock-event seconds) are the source's own counters;
    the sampler turns their deltas into the exported counters.
    """

    timestamp: float
    utilization: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    pcie_rx_bytes: float | None = None
    pcie_tx_bytes: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_link_max_bytes_per_second: float | None = None
    temperature_celsius: float | None = None
    clocks_hertz: dict[str, float] = field(default_factory=dict)
    clock_event_seconds: dict[str, float] = field(default_factory=dict)
    pids: tuple[int, ...] = ()
    process_memory: dict[int, float] = field(default_factory=dict)  # pid -> bytes it holds
    nvlink_rx_bytes: float | None = None  # cumulative, all links (field values)
    nvlink_tx_bytes: float | None = None
    nvlink_rx_bytes_per_second: float | None = None  # or rates (GPM)
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_links: int | None = None  # active links; None (and no NVLink series) without any
    nvlink_link_max_bytes_per_second: float | None = None  # per link and direction
    ecc_errors: dict[str, float] = field(default_factory=dict)  # volatile counts, by type
    remapped_rows: dict[str, float] = field(default_factory=dict)  # by REMAP_STATES
    retired_pages: dict[str, float] = field(default_factory=dict)  # by cause (pre-Ampere)
    retired_pages_pending: float | None = None


class GpuBackend(Protocol):
    """The seam between the sampler and a source of GPU readings."""

    name: str
    driver_version: str

    def start(self) -> list[GpuIdentity]:
        """Open the backend and list its GPUs; raise BackendUnavailable with the reason."""

    def sample(self, gpu: GpuIdentity) -> GpuSample:
        """Read one GPU; raise GpuLostError when it stopped answering."""

    def reopen(self, gpu: GpuIdentity) -> bool:
        """Try to reach a lost GPU again; True when it answers."""

    def wait_xid(self, timeout_s: float) -> list[tuple[str, int]]:
        """Block up to timeout_s for Xid events; returns (gpu index, xid) pairs."""

    def close(self) -> None: ...


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else max(0.0, min(1.0, float(percent) / 100.0))


class _NvmlDevice:
    """Per-GPU state the NVML backend keeps between readings."""

    def __init__(self, identity: GpuIdentity, handle: Any, parent_handle: Any = None,
                 gpu_instance_id: int | None = None) -> None:
        self.identity = identity
        self.handle = handle
        self.parent_handle = parent_handle
        self.gpu_instance_id = gpu_instance_id
        self.last_sample_timestamp_us = 0
        self.gpm_samples: list[Any] = []
        self.gpm_primed = False
        self.gpm_supported: bool | None = None
        self.gpm_has_pcie: bool | None = None  # None until GPM's first metrics


class NvmlBackend:
    """Real GPUs through NVML (the ``nvidia-ml-py`` package's ``pynvml`` module)."""

    name = "nvml"

    def __init__(self, nvml: Nvml | None = None, clock: Callable[[], float] = time.monotonic):
        self.nvml = nvml or Nvml()
        self.driver_version = ""
        self._clock = clock
        self._devices: dict[str, _NvmlDevice] = {}
        self._event_set: Any = None
        self._event_lock = threading.Lock()
        self._memory_variants: tuple[tuple[str, dict], ...] = (("nvmlDeviceGetMemoryInfo", {}),)

    # -- discovery -------------------------------------------------------------------------

    def start(self) -> list[GpuIdentity]:
        try:
            self.nvml.init()
        except NvmlUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc
        nv = self.nvml
        v2 = getattr(nv.lib, "nvmlMemory_v2", None)  # absent from old nvidia-ml-py
        self._memory_variants = ((("nvmlDeviceGetMemoryInfo", {"version": v2}),) if v2 else ()) \
            + (("nvmlDeviceGetMemoryInfo", {}),)
        self.driver_version = _text(nv.call("nvmlSystemGetDriverVersion") or "")
        count = nv.call("nvmlDeviceGetCount") or 0
        identities: list[GpuIdentity] = []
        for i in range(count):
            index = str(i)
            try:
                handle = nv.call("nvmlDeviceGetHandleByIndex", i, device=index)
                identity = self._identify(index, handle)
            except GpuLostError as exc:
                log.error("GPU %s is lost at start-up: %s", index, exc)
                handle, identity = None, GpuIdentity(index=index, uuid="")
            self._devices[index] = _NvmlDevice(identity, handle)
            identities.append(identity)
            if handle is not None:
                identities.extend(self._mig_devices(index, handle))
        return identities

    def _identify(self, index: str, handle: Any, parent: str = "") -> GpuIdentity:
        nv = self.nvml
        uuid = _text(nv.call("nvmlDeviceGetUUID", handle, device=index) or "")
        name = _text(nv.call("nvmlDeviceGetName", handle, device=index) or "")
        pci = nv.call("nvmlDeviceGetPciInfo", handle, device=index)
        bus_id = _text(getattr(pci, "busId", "") or "") if pci is not None else ""
        profile = ""
        if parent:  # NVML names a MIG device after its GPU and profile: "... MIG 1g.10gb"
            m = _MIG_PROFILE.search(name)
            profile = m.group(1) if m else ""
        return GpuIdentity(index=index, uuid=uuid, name=name, pci_bus_id=bus_id, parent=parent,
                           profile=profile)

    def _mig_devices(self, index: str, handle: Any) -> list[GpuIdentity]:
        nv = self.nvml
        mode = nv.call("nvmlDeviceGetMigMode", handle, device=index)
        if not mode or int(mode[0]) != 1:
            return []
        out = []
        for j in range(nv.call("nvmlDeviceGetMaxMigDeviceCount", handle, device=index) or 0):
            mig_index = f"{index}/{j}"
            mig = nv.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, j, device=mig_index)
            if mig is None:
                continue
            identity = self._identify(mig_index, mig, parent=index)
            gi = nv.call("nvmlDeviceGetGpuInstanceId", mig, device=mig_index)
            self._devices[mig_index] = _NvmlDevice(identity, mig, handle, gi)
            out.append(identity)
        return out

    # -- one reading -----------------------------------------------------------------------

    def sample(self, gpu: GpuIdentity) -> GpuSample:
        dev = self._devices[gpu.index]
        if dev.handle is None:
            raise GpuLostError(f"GPU {gpu.index} has no handle")
        nv, lib, h, key = self.nvml, self.nvml.lib, dev.handle, gpu.index
        s = GpuSample(timestamp=self._clock())
        s.utilization = self._utilization(dev)
        # v2 first: its "used" leaves out the driver's reserved memory, as nvidia-smi does
        mem = nv.call_versioned(self._memory_variants, h, device=key)
        if mem is not None:
            s.memory_used_bytes, s.memory_total_bytes = float(mem.used), float(mem.total)
        power_mw = nv.call("nvmlDeviceGetPowerUsage", h, device=key)
        s.power_watts = None if power_mw is None else power_mw / 1000.0
        limit_mw = nv.call("nvmlDeviceGetEnforcedPowerLimit", h, device=key)
        s.power_limit_watts = None if limit_mw is None else limit_mw / 1000.0
        energy_mj = nv.call("nvmlDeviceGetTotalEnergyConsumption", h, device=key)
        s.energy_joules = None if energy_mj is None else energy_mj / 1000.0
        s.temperature_celsius = _float(
            nv.call("nvmlDeviceGetTemperature", h, lib.NVML_TEMPERATURE_GPU, device=key))
        for clock, const in (("sm", "NVML_CLOCK_SM"), ("memory", "NVML_CLOCK_MEM")):
            mhz = nv.call("nvmlDeviceGetClockInfo", h, getattr(lib, const), device=key)
            if mhz is not None:
                s.clocks_hertz[clock] = float(mhz) * 1e6
        gen = nv.call("nvmlDeviceGetCurrPcieLinkGeneration", h, device=key)
        width = nv.call("nvmlDeviceGetCurrPcieLinkWidth", h, device=key)
        if gen in PCIE_LANE_BYTES_PER_SECOND and width:
            s.pcie_link_max_bytes_per_second = PCIE_LANE_BYTES_PER_SECOND[gen] * int(width)
        self._fields(dev, s)
        self._gpm(dev, s)
        self._pcie_fallback(dev, s)
        self._memory_health(dev, s)
        procs = nv.call_versioned(COMPUTE_PROCESS_VARIANTS, h, device=key)
        if procs:
            s.pids = tuple(int(p.pid) for p in procs)
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                if used is not None and used < NVML_VALUE_NOT_AVAILABLE:
                    s.process_memory[int(p.pid)] = s.process_memory.get(int(p.pid), 0.0) + used
        return s

    def _utilization(self, dev: _NvmlDevice) -> float | None:
        """Mean of NVML's utilisation sample buffer since the last reading, as a ratio."""
        nv, lib, key = self.nvml, self.nvml.lib, dev.identity.index
        got = nv.call("nvmlDeviceGetSamples", dev.handle, lib.NVML_GPU_UTILIZATION_SAMPLES,
                      dev.last_sample_timestamp_us, device=key, query="samples")
        if got:
            value_type, samples = got
            fresh = [x for x in samples if x.timeStamp > dev.last_sample_timestamp_us]
            if fresh:
                member = VALUE_MEMBER.get(value_type, "uiVal")
                dev.last_sample_timestamp_us = max(x.timeStamp for x in fresh)
                values = [getattr(x.sampleValue, member) for x in fresh]
                return _ratio(sum(values) / len(values))
        rates = nv.call("nvmlDeviceGetUtilizationRates", dev.handle, device=key)
        return None if rates is None else _ratio(rates.gpu)

    def _fields(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """Clock events, PCIe and NVLink from one nvmlDeviceGetFieldValues call."""
        nv, lib, key = self.nvml, self.nvml.lib, dev.identity.index
        ids: dict[int, str] = {}
        for label, const in CLOCK_EVENT_FIELDS.items():
            if hasattr(lib, const):
                ids[getattr(lib, const)] = label
        rx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None)
        tx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None)
        nvlink = self._nvlink_fields(dev)
        wanted = list(ids) + [f for f in (rx_id, tx_id) if f is not None] + \
            [f for f in nvlink.values() if f is not None]
        values = nv.field_values(dev.handle, wanted, device=key)
        for fid, label in ids.items():
            if fid in values:
                s.clock_event_seconds[label] = float(values[fid]) / 1e9
        if rx_id in values and tx_id in values:
            s.pcie_rx_bytes, s.pcie_tx_bytes = float(values[rx_id]), float(values[tx_id])
        if nvlink:
            self._nvlink(dev, s, nvlink, values)
        if not s.clock_event_seconds:
            for label, const in VIOLATION_POLICIES.items():
                if not hasattr(lib, const):
                    continue
                v = nv.call("nvmlDeviceGetViolationStatus", dev.handle, getattr(lib, const),
                            device=key)
                if v is not None:
                    s.clock_event_seconds[label] = float(v.violationTime) / 1e9

    def _nvlink_fields(self, dev: _NvmlDevice) -> dict[str, Any]:
        """The NVLink field ids to ask (the byte counters with scope all links), or none on a
        GPU known to have no active link."""
        lib = self.nvml.lib
        count_id = getattr(lib, "NVML_FI_DEV_NVLINK_LINK_COUNT", None)
        if count_id is None or self.nvml.is_unsupported(dev.identity.index, "nvlink"):
            return {}
        return {"count": count_id,
                "speed": getattr(lib, "NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON", None),
                **{d: (getattr(lib, c), NVLINK_ALL_LINKS) for d, c in NVLINK_FIELDS.items()
                   if hasattr(lib, c)}}

    def _nvlink(self, dev: _NvmlDevice, s: GpuSample, ids: dict[str, Any],
                values: dict) -> None:
        """Active links and their speed; the byte counters where the driver has them (else
        GPM's rates fill them in). A GPU with no active link reports nothing."""
        links = int(values.get(ids["count"], 0) or 0)
        if links <= 0:
            self.nvml.mark_unsupported(dev.identity.index, "nvlink")  # not asked again
            return
        s.nvlink_links = links
        if values.get(ids["speed"]):
            s.nvlink_link_max_bytes_per_second = float(values[ids["speed"]]) * 1e6
        if ids.get("rx") in values and ids.get("tx") in values:  # KiB
            s.nvlink_rx_bytes = float(values[ids["rx"]]) * 1024
            s.nvlink_tx_bytes = float(values[ids["tx"]]) * 1024

    def _memory_health(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """ECC error counts (volatile: since the driver loaded), row remapping (Ampere and
        newer) or retired pages (older GPUs)."""
        nv, lib, h, key = self.nvml, self.nvml.lib, dev.handle, dev.identity.index
        volatile = getattr(lib, "NVML_VOLATILE_ECC", None)
        for label, const in ECC_TYPES.items():
            if volatile is None or not hasattr(lib, const):
                continue
            n = nv.call("nvmlDeviceGetTotalEccErrors", h, getattr(lib, const), volatile,
                        device=key, query=("ecc", label))
            if n is not None:
                s.ecc_errors[label] = float(n)
        rows = nv.call("nvmlDeviceGetRemappedRows", h, device=key)
        if rows is not None:
            s.remapped_rows = {state: float(v) for state, v in zip(REMAP_STATES, rows,
                                                                   strict=True)}
            return  # a GPU that remaps rows retires no pages
        for label, const in RETIREMENT_CAUSES.items():
            if not hasattr(lib, const):
                continue
            pages = nv.call("nvmlDeviceGetRetiredPages", h, getattr(lib, const), device=key,
                            query=("retired", label))
            if pages is not None:
                s.retired_pages[label] = float(len(pages))
        if s.retired_pages:
            pending = nv.call("nvmlDeviceGetRetiredPagesPendingStatus", h, device=key)
            s.retired_pages_pending = None if pending is None else float(int(pending))

    def _gpm(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """GPM metrics between this reading and the last (Hopper and newer)."""
        nv, lib, key = self.nvml, self.nvml.lib, dev.identity.index
        if dev.gpm_supported is None:
            support_handle = dev.parent_handle or dev.handle
            support = nv.call("nvmlGpmQueryDeviceSupport", support_handle, device=key)
            dev.gpm_supported = bool(support is not None and support.isSupportedDevice)
            if dev.gpm_supported:
                a = nv.call("nvmlGpmSampleAlloc", device=key)
                b = nv.call("nvmlGpmSampleAlloc", device=key)
                dev.gpm_supported = a is not None and b is not None
                dev.gpm_samples = [a, b]
        if not dev.gpm_supported:
            return
        prev, cur = dev.gpm_samples
        if dev.parent_handle is not None:
            got = nv.call("nvmlGpmMigSampleGet", dev.parent_handle, dev.gpu_instance_id, cur,
                          device=key, query="gpm_sample")
        else:
            got = nv.call("nvmlGpmSampleGet", dev.handle, cur, device=key, query="gpm_sample")
        if got is None:
            return
        dev.gpm_samples = [cur, prev]
        if not dev.gpm_primed:
            dev.gpm_primed = True
            return
        names = [n for n, const in GPM_METRICS.items() if hasattr(lib, const)]
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(names)
        request.sample1, request.sample2 = prev, cur
        for i, n in enumerate(names):
            request.metrics[i].metricId = getattr(lib, GPM_METRICS[n])
        result = nv.call("nvmlGpmMetricsGet", request, device=key, query="gpm_metrics")
        if result is None:
            return
        values = {}
        for i, n in enumerate(names):
            m = result.metrics[i]
            if m.nvmlReturn == 0 and not math.isnan(m.value):
                values[n] = float(m.value)
        for n in ("sm_active", "sm_occupancy", "tensor_active", "dram_active"):
            if n in values:
                setattr(s, n, _ratio(values[n]))
        if s.nvlink_links and s.nvlink_rx_bytes is None and "nvlink_rx_mib_per_second" in values:
            s.nvlink_rx_bytes_per_second = values["nvlink_rx_mib_per_second"] * MIB
            s.nvlink_tx_bytes_per_second = values.get("nvlink_tx_mib_per_second", 0.0) * MIB
        dev.gpm_has_pcie = "pcie_rx_mib_per_second" in values
        if dev.gpm_has_pcie and "pcie_tx_mib_per_second" in values:
            s.pcie_rx_bytes_per_second = values["pcie_rx_mib_per_second"] * MIB
            s.pcie_tx_bytes_per_second = values["pcie_tx_mib_per_second"] * MIB

    def _pcie_fallback(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """The throughput call, last: it blocks ~20 ms per direction (its sampling window)."""
        if s.pcie_rx_bytes is not None or s.pcie_rx_bytes_per_second is not None:
            return
        if dev.gpm_supported and dev.gpm_has_pcie is not False:
            return  # GPM gives the rates (from its second reading on)
        nv, lib, key = self.nvml, self.nvml.lib, dev.identity.index
        rx = nv.call("nvmlDeviceGetPcieThroughput", dev.handle, lib.NVML_PCIE_UTIL_RX_BYTES,
                     device=key)
        tx = nv.call("nvmlDeviceGetPcieThroughput", dev.handle, lib.NVML_PCIE_UTIL_TX_BYTES,
                     device=key)
        if rx is not None and tx is not None:  # KB/s
            s.pcie_rx_bytes_per_second, s.pcie_tx_bytes_per_second = rx * 1000.0, tx * 1000.0

    # -- recovery and events ---------------------------------------------------------------

    def reopen(self, gpu: GpuIdentity) -> bool:
        if gpu.parent:
            return False  # a MIG device comes back with its parent's restart
        nv = self.nvml
        try:
            handle = nv.call("nvmlDeviceGetHandleByIndex", int(gpu.index), device=gpu.index,
                             query="reopen")
            if handle is None:
                return False
            uuid = _text(nv.call("nvmlDeviceGetUUID", handle, device=gpu.index) or "")
        except GpuLostError:
            return False
        if gpu.uuid and uuid != gpu.uuid:
            log.warning("GPU %s came back with another UUID (%s, was %s)", gpu.index, uuid,
                        gpu.uuid)
        dev = self._devices[gpu.index]
        dev.handle = handle
        dev.gpm_supported, dev.gpm_primed, dev.gpm_has_pcie = None, False, None
        return True

    def wait_xid(self, timeout_s: float) -> list[tuple[str, int]]:
        nv, lib = self.nvml, self.nvml.lib
        with self._event_lock:
            if self._event_set is None:
                self._event_set = nv.call("nvmlEventSetCreate", query="xid")
                if self._event_set is None:
                    return []
                for index, dev in self._devices.items():
                    if dev.handle is not None and not dev.identity.parent:
                        nv.call("nvmlDeviceRegisterEvents", dev.handle,
                                lib.nvmlEventTypeXidCriticalError, self._event_set,
                                device=index, query="xid")
        data = nv.call("nvmlEventSetWait_v2", self._event_set, int(timeout_s * 1000),
                       query="xid_wait")
        if data is None:
            return []
        uuid = _text(nv.call("nvmlDeviceGetUUID", data.device, query="xid_uuid") or "")
        for index, dev in self._devices.items():
            if dev.identity.uuid == uuid:
                return [(index, int(data.eventData))]
        return []

    def close(self) -> None:
        for dev in self._devices.values():
            for sample in dev.gpm_samples:
                if sample is not None:
                    self.nvml.call("nvmlGpmSampleFree", sample, query="gpm_free")
        if self._event_set is not None:
            self.nvml.call("nvmlEventSetFree", self._event_set, query="xid_free")
        self.nvml.shutdown()


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


class DemoBackend:
    """Simulated H100-like GPUs whose load moves over time (or is pinned with ``load``).

    Every value stays within what a real H100 SXM reports, so dashboards and alerts behave as
    they would on hardware. ``load`` in 0-1 pins every GPU at that busy ratio; None lets each
    GPU follow its own slow wave.
    """

    name = "demo"
    driver_version = "demo"
    MEMORY_TOTAL = 80 * 1024**3
    POWER_LIMIT = 700.0
    IDLE_POWER = 70.0

    NVLINK_LINKS = 18  # H100 SXM: NVLink 4, 18 links of 26.5625 GB/s per direction
    NVLINK_LINK_SPEED = 26.5625e9
    ECC_EVERY_SECONDS = 600.0  # the last demo GPU corrects one ECC error this often

    def __init__(self, gpus: int = 8, load: float | None = None,
                 clock: Callable[[], float] = time.monotonic, host: str | None = None,
                 memory_fault: bool = False) -> None:
        if load is not None and not 0.0 <= load <= 1.0:
            raise ValueError(f"demo load must be between 0 and 1, got {load}")
        self.gpus = gpus
        self.load = load
        self._clock = clock
        self._start = clock()
        self._last: dict[str, float] = {}
        self._energy: dict[str, float] = {}
        self._pcie: dict[str, list[float]] = {}
        self._nvlink: dict[str, list[float]] = {}
        self.memory_fault = memory_fault  # the last GPU: an uncorrectable error, a remap pending
        self._host = host or socket.gethostname()  # demo UUIDs differ between nodes
        self._ranks: Callable[[], Iterable[Any]] | None = None
        self._rates: dict[tuple, tuple[float, float, float]] = {}  # rank -> (at, compute, busy)
        self._work: tuple[float, dict[str, tuple[tuple[int, ...], float]]] = (-1.0, {})
        self._work_lock = threading.Lock()

    def follow(self, ranks: Callable[[], Iterable[Any]]) -> None:
        """Attach the training processes that push to this daemon to demo GPUs, as NVML
        lists a process on the GPU it uses, and let each such GPU's load follow its ranks.

        ``ranks`` returns the ingest's live rank states. A rank that names demo GPUs (index
        or UUID) uses those; any other rank with a pid uses GPU ``rank % gpus`` (rank 0 on
        GPU 0). The load is the share of wall time the rank spent in steps but not waiting
        for data, from its last two pushes; a rank that stopped pushing leaves its GPU idle
        but held. A pinned ``load`` still wins."""
        self._ranks = ranks
        # what a rank may name a demo GPU by -> its index
        self._refs = {**{str(i): str(i) for i in range(self.gpus)},
                      **{self._uuid(i): str(i) for i in range(self.gpus)}}

    def start(self) -> list[GpuIdentity]:
        return [
            GpuIdentity(
                index=str(i),
                uuid=self._uuid(i),
                name="NVIDIA H100 80GB HBM3 (demo)",
                pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            )
            for i in range(self.gpus)
        ]

    def load_of(self, index: int, t: float) -> float:
        """The simulated busy ratio of GPU ``index`` at ``t`` seconds after start."""
        if self.load is not None:
            return self.load
        return 0.55 + 0.4 * math.sin(t / 60.0 + index * 0.7)

    def _workload(self, now: float) -> dict[str, tuple[tuple[int, ...], float]]:
        """GPU index -> (pids, summed busy share) of the ranks followed, once per cycle."""
        with self._work_lock:
            at, work = self._work
            if now - at < 0.2 or self._ranks is None:
                return work
            refs = self._refs
            pids: dict[str, list[int]] = {}
            busy: dict[str, float] = {}
            rates = {}
            for st in self._ranks():
                if st.pid is None:
                    continue
                mine = [refs[r] for r in st.gpus if r in refs]
                if not mine:
                    n = int(st.rank) if st.rank.isdigit() else sum(map(ord, st.rank))
                    mine = [str(n % self.gpus)]
                key = (st.run, st.rank, st.run_id)
                rates[key] = share = self._busy_share(key, st, now)
                for index in mine:
                    pids.setdefault(index, []).append(st.pid)
                    busy[index] = busy.get(index, 0.0) + share[2] / len(mine)
            self._rates = rates
            work = {i: (tuple(p), min(1.0, busy[i])) for i, p in pids.items()}
            self._work = (now, work)
            return work

    def _busy_share(self, key: tuple, st: Any, now: float) -> tuple[float, float, float]:
        compute = max(0.0, st.step_seconds - st.data_wait_seconds)
        prev = self._rates.get(key)
        if now - st.received_at > 15.0:  # three push intervals of silence: stopped
            return (st.received_at, compute, 0.0)
        if prev is None:  # its first push: the share of step time not spent waiting
            return (st.received_at, compute,
                    compute / st.step_seconds if st.step_seconds > 0 else 0.0)
        if st.received_at <= prev[0]:  # no push since the last cycle
            return prev
        return (st.received_at, compute,
                min(1.0, (compute - prev[1]) / (st.received_at - prev[0])))

    def _uuid(self, i: int) -> str:
        return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{self._host}.demo.{i}"))

    def sample(self, gpu: GpuIdentity) -> GpuSample:
        now = self._clock()
        i = int(gpu.index)
        load = self.load_of(i, now - self._start)
        pids, followed = self._workload(now).get(gpu.index, ((), None))
        if followed is not None and self.load is None:
            load = followed
        dt = now - self._last.get(gpu.index, now)
        self._last[gpu.index] = now
        power = self.IDLE_POWER + (self.POWER_LIMIT * 0.9 - self.IDLE_POWER) * load
        self._energy[gpu.index] = self._energy.get(gpu.index, 0.0) + power * dt
        link = PCIE_LANE_BYTES_PER_SECOND[5] * 16
        rx_rate, tx_rate = 0.08 * link * load, 0.01 * link * load
        pcie = self._pcie.setdefault(gpu.index, [0.0, 0.0])
        pcie[0] += rx_rate * dt
        pcie[1] += tx_rate * dt
        # gradients all-reduced over NVLink while busy: a third of the links' bandwidth at full load
        nvlink_rate = 0.33 * self.NVLINK_LINKS * self.NVLINK_LINK_SPEED * load
        nvlink = self._nvlink.setdefault(gpu.index, [0.0, 0.0])
        nvlink[0] += nvlink_rate * dt
        nvlink[1] += nvlink_rate * dt
        # the last GPU has remapped a row and corrects an ECC error now and then; with
        # memory_fault it has an uncorrectable error and a remap waiting for a reset
        last = i == self.gpus - 1
        fault = last and self.memory_fault
        ecc = {"corrected": float(int((now - self._start) / self.ECC_EVERY_SECONDS)) if last
               else 0.0, "uncorrected": 1.0 if fault else 0.0}
        remapped = {"correctable": 1.0 if last else 0.0, "uncorrectable": 1.0 if fault else 0.0,
                    "pending": 1.0 if fault else 0.0, "failed": 0.0}
        return GpuSample(
            timestamp=now,
            nvlink_rx_bytes=nvlink[0],
            nvlink_tx_bytes=nvlink[1],
            nvlink_links=self.NVLINK_LINKS,
            nvlink_link_max_bytes_per_second=self.NVLINK_LINK_SPEED,
            ecc_errors=ecc,
            remapped_rows=remapped,
            utilization=load,
            sm_active=0.85 * load,
            sm_occupancy=0.45 * load,
            tensor_active=0.35 * load,
            dram_active=0.5 * load,
            memory_used_bytes=self.MEMORY_TOTAL * (0.05 + 0.7 * min(1.0, load * 1.5)),
            memory_total_bytes=float(self.MEMORY_TOTAL),
            power_watts=power,
            power_limit_watts=self.POWER_LIMIT,
            energy_joules=self._energy[gpu.index],
            pcie_rx_bytes=pcie[0],
            pcie_tx_bytes=pcie[1],
            pcie_link_max_bytes_per_second=link,
            temperature_celsius=32.0 + 40.0 * load,
            clocks_hertz={"sm": (1155 + 825 * load) * 1e6, "memory": 2619e6},
            clock_event_seconds={"sw_power_cap": 0.0, "hw_thermal_slowdown": 0.0},
            pids=pids,
            # the ranks on it hold what the simulated GPU uses, less a context's 512 MiB
            process_memory={pid: max(0.0, self.MEMORY_TOTAL * (0.05 + 0.7 * min(1.0, load * 1.5))
                                     - 512 * MIB) / len(pids) for pid in pids},
        )

    def reopen(self, gpu: GpuIdentity) -> bool:
        return True

    def wait_xid(self, timeout_s: float) -> list[tuple[str, int]]:
        time.sleep(timeout_s)
        return []

    def close(self) -> None:
        pass
