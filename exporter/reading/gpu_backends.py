"""GPU backends: where per-GPU readings come from.

Two backends stand behind one small protocol: :class:`NvmlBackend` reads real GPUs through
:mod:`exporter.reading.nvml`, and :class:`DemoBackend` simulates plausible H100-like GPUs so the
whole bundle can be tried (and tested end to end) on a machine without one. The sampler only
ever sees :class:`GpuIdentity` and :class:`GpuSample`.
"""

from __future__ import annotations

import itertools
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

from exporter.reading import nvml as fi
from exporter.reading.gpu_metrics import DEMO_GAUGES, MIB, ONE_CALL, PCIE_LANE_BYTES_PER_SECOND
from exporter.reading.host_processes import HostProcess, find_host_pid, read_process
from exporter.reading.nvml import (
    VALUE_MEMBER,
    VALUE_TYPE_MODULUS,
    VALUE_TYPE_ULONGLONG,
    GpuLostError,
    Nvml,
    NvmlUnavailable,
    StaleHandleError,
    clock_event_fields,
)

log = logging.getLogger(__name__)

# Cumulative clock-event (throttle) counters, in nanoseconds, by the `reason` label: fields
# whose number never moved; the others from nvml.clock_event_fields, by the driver.
STABLE_CLOCK_EVENT_FIELDS = {"sw_power_cap": fi.FI_PERF_POLICY_POWER,
                             "sync_boost": fi.FI_PERF_POLICY_SYNC_BOOST}
# Where a reason has no field: the (deprecated in 13.0) violation counters, also in ns.
VIOLATION_POLICIES = {
    "sw_power_cap": fi.PERF_POLICY_POWER,
    "sw_thermal_slowdown": fi.PERF_POLICY_THERMAL,
    "sync_boost": fi.PERF_POLICY_SYNC_BOOST,
}
# The current clock-event reasons bitmask (nvmlDeviceGetCurrentClocksEventReasons, before 535
# nvmlDeviceGetCurrentClocksThrottleReasons: nvmlClocksEventReason* of nvml.h), read where a
# reason has no counter (the per-reason fields came with driver 575): each reading's interval is
# counted to the reasons set at its end, as the busy time is sampled. HW_SLOWDOWN (0x8) is set
# with HW_THERMAL and HW_POWER_BRAKE too: alone, it is "hw_slowdown" (another hardware reason)
CLOCK_EVENT_BITS = {"sw_power_cap": 0x4, "sw_thermal_slowdown": 0x20,
                    "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80}
HW_SLOWDOWN_BIT = 0x8
CLOCK_EVENT_REASONS_CALLS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("nvmlDeviceGetCurrentClocksEventReasons", {}),
    ("nvmlDeviceGetCurrentClocksThrottleReasons", {}))
# A throttle counter cannot grow faster than the wall clock: this much slack (ns a second, and
# ns flat) covers the driver's and our timestamps disagreeing.
THROTTLE_SLACK = (1.05, 50e6)
# nvml.h: GPM samples must be over 100 ms apart; the 10 ms more cover the calls' own latency
GPM_MIN_INTERVAL_SECONDS = 0.11
NO_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId when it is no MIG device's
MIG_RESCAN_SECONDS = 60.0  # MIG devices created without a handle going stale are found so

GPM_METRICS = {
    "busy": "NVML_GPM_METRIC_GRAPHICS_UTIL",
    "sm_active": "NVML_GPM_METRIC_SM_UTIL",
    "sm_occupancy": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "tensor_active": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "dram_active": "NVML_GPM_METRIC_DRAM_BW_UTIL",
    "pcie_tx_mib_per_second": "NVML_GPM_METRIC_PCIE_TX_PER_SEC",
    "pcie_rx_mib_per_second": "NVML_GPM_METRIC_PCIE_RX_PER_SEC",
    "nvlink_rx_mib_per_second": "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC",
    "nvlink_tx_mib_per_second": "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC",
}
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1  # usedGpuMemory where the driver cannot tell (WDDM, MIG)
# NVLink through field values: data (not raw) KiB counters summed over every link (scope
# UINT_MAX), the links present and the common per-link speed (MB/s)
NVLINK_ALL_LINKS = 0xFFFFFFFF
NVLINK_FIELDS = {"rx": fi.FI_NVLINK_THROUGHPUT_DATA_RX, "tx": fi.FI_NVLINK_THROUGHPUT_DATA_TX}
NVML_FEATURE_ENABLED = 1  # nvmlDeviceGetNvLinkState: the link is active
# ECC error counts by the `type` label: nvmlMemoryErrorType_t
ECC_TYPES = {"corrected": "NVML_MEMORY_ERROR_TYPE_CORRECTED",
             "uncorrected": "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"}
# retired pages (pre-Ampere) by the `cause` label: nvmlPageRetirementCause_t
RETIREMENT_CAUSES = {
    "multiple_single_bit_ecc": "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
    "double_bit_ecc": "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"}
REMAP_STATES = ("correctable", "uncorrectable", "pending", "failed")
# newest first (see Nvml.call_versioned); older drivers lack the later ones
Variants = tuple[tuple[str, dict[str, Any]], ...]  # (NVML function, keyword arguments)
COMPUTE_PROCESS_VARIANTS: Variants = (("nvmlDeviceGetComputeRunningProcesses_v3", {}),
                                      ("nvmlDeviceGetComputeRunningProcesses_v2", {}),
                                      ("nvmlDeviceGetComputeRunningProcesses", {}))
# newest first: nvmlDeviceGetProcessesUtilizationInfo is in the 12.4 header (driver 550, go-nvml
# f7ceebd) and nvidia-ml-py 12.550 on; both take the last seen timestamp (CPU microseconds)
PROCESS_UTILIZATION_VARIANTS: Variants = (("nvmlDeviceGetProcessesUtilizationInfo", {}),
                                          ("nvmlDeviceGetProcessUtilization", {}))
# the GPU's own best generation (the 12.0 header, driver 525): a second opinion, not missed
GPU_MAX_PCIE_GENERATION: Variants = (("nvmlDeviceGetGpuMaxPcieLinkGeneration", {}),)


_MIG_PROFILE = re.compile(r"\bMIG (\d+g\.\d+gb(?:\+\w+)*)", re.IGNORECASE)


class BackendUnavailable(RuntimeError):
    """The backend cannot read any GPU on this machine; the reason is the message.
    ``no_driver``: the machine has no NVIDIA driver at all, which is no fault."""

    def __init__(self, reason: str, no_driver: bool = False) -> None:
        super().__init__(reason)
        self.no_driver = no_driver


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
    The ``*_counter_*`` fields and ``ecc_volatile_errors`` are the source's own cumulative
    counters (they may start anywhere, wrap or reset with the driver); the sampler turns their
    increases into the exported counters of GpuState, which has the name without ``counter``.
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
    energy_counter_joules: float | None = None
    pcie_rx_counter_bytes: float | None = None
    pcie_tx_counter_bytes: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_link_max_bytes_per_second: float | None = None  # the link at its best
    pcie_link_current_bytes_per_second: float | None = None  # as trained now (it trains down idle)
    temperature_celsius: float | None = None
    clocks_hertz: dict[str, float] = field(default_factory=dict)
    clock_event_counter_seconds: dict[str, float] = field(default_factory=dict)
    pids: tuple[int, ...] = ()
    process_memory: dict[int, float] = field(default_factory=dict)  # pid -> bytes it holds
    # pid -> (SM busy ratio, memory-bandwidth ratio or None): the means of the source's
    # per-process samples since the last reading; a pid without a new sample is absent. None
    # where the source gives no per-process samples at all (unsupported, MIG)
    process_utilization: dict[int, tuple[float, float | None]] | None = None
    # pid -> (SM busy, memory busy) seconds its samples since the last reading stand for,
    # each weighted by the driver's sample period (from their timestamps), not by the
    # sampler's cycle: NVML's period can be longer than a cycle. None: the sampler weights
    # process_utilization by the seconds between readings (the demo)
    process_seconds: dict[int, tuple[float, float]] | None = None
    nvlink_rx_counter_bytes: float | None = None  # cumulative, all links (field values)
    nvlink_tx_counter_bytes: float | None = None
    nvlink_rx_bytes_per_second: float | None = None  # or rates (GPM)
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_links: int | None = None  # active links; None (and no NVLink series) without any
    nvlink_link_max_bytes_per_second: float | None = None  # per link and direction
    ecc_volatile_errors: dict[str, float] = field(default_factory=dict)  # by type
    remapped_rows: dict[str, float] = field(default_factory=dict)  # by REMAP_STATES
    retired_pages: dict[str, float] = field(default_factory=dict)  # by cause (pre-Ampere)
    retired_pages_pending: float | None = None
    performance_state: float | None = None  # 0 (P0) to 15


class GpuBackend(Protocol):
    """The seam between the sampler and a source of GPU readings."""

    name: str
    driver_version: str

    def start(self) -> list[GpuIdentity]:
        """Open the backend and list its GPUs; raise BackendUnavailable with the reason."""

    def sample(self, gpu: GpuIdentity) -> GpuSample:
        """Read one GPU; raise GpuLostError when it stopped answering."""

    def rescan(self) -> list[GpuIdentity] | None:
        """The GPUs again when they changed (a MIG reconfiguration), else None."""

    def reopen(self, gpu: GpuIdentity) -> bool:
        """Try to reach a lost GPU again; True when it answers."""

    def wait_xid(self, timeout_s: float) -> list[tuple[str, int]]:
        """Block up to timeout_s for Xid events; returns (gpu index, xid) pairs."""

    def close(self) -> None: ...


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else _share(percent)


def _share(percent: float) -> float:
    """A percentage as a ratio, clamped to 0-1."""
    return max(0.0, min(1.0, float(percent) / 100.0))


class _NvmlDevice:
    """Per-GPU state the NVML backend keeps between readings."""

    def __init__(self, identity: GpuIdentity, handle: Any, parent_handle: Any = None,
                 gpu_instance_id: int | None = None) -> None:
        self.identity = identity
        self.handle = handle
        self.parent_handle = parent_handle
        self.gpu_instance_id = gpu_instance_id
        self.last_sample_timestamp_us = 0
        self.mig_mode: int | None = None  # NVML's current MIG mode, as last read
        self.reset()

    def reset(self) -> None:
        """Forget what the last readings left (a GPU reopened)."""
        self.gpm_supported: bool | None = None
        self.gpm_buffers: list[Any] = []  # the two samples allocated for this device
        self.gpm_base: tuple[int, float] | None = None  # (buffer index, taken at): window start
        self.gpm_values: dict[str, float] = {}  # the metrics of the last full window
        self.gpm_closed = False  # a window was closed (its metrics asked for)
        self.pcie_max: float | None = None  # bytes/s of the link at its best, once known
        self.pcie_counter: tuple[float, float, float] | None = None  # (at, rx, tx), 32-bit
        self.throttle: dict[str, tuple[float, float]] = {}  # reason -> (at, ns) from a field
        self.throttle_source: dict[str, str] = {}  # reason -> "field", "violation", "bitmask"
        # seconds counted from the reasons bitmask, by reason, and when it was last read
        self.bitmask_seconds: dict[str, float] = {}
        self.bitmask_at: float | None = None
        self.nvlink_present = 0
        self.process_seen_us = 0  # the newest per-process utilisation sample read
        self.process_last_us: dict[int, int] = {}  # pid -> its newest sample's timestamp
        # NVML's per-process sample period, microseconds: the shortest gap seen between two
        # samples of one process (a process busy in consecutive periods); None until seen
        self.process_period_us: int | None = None
        self.process_read_at: float | None = None  # when the samples were last read


def _link(gen: Any, width: Any) -> float | None:
    """Usable bytes per second per direction of a PCIe link of ``gen`` and ``width`` lanes."""
    if gen in PCIE_LANE_BYTES_PER_SECOND and width:
        return PCIE_LANE_BYTES_PER_SECOND[gen] * int(width)
    return None


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
        self._xid_registered: dict[str, Any] = {}  # GPU index -> the handle registered
        self._memory_variants: tuple[tuple[str, dict], ...] = (("nvmlDeviceGetMemoryInfo", {}),)
        self._mig_stale = False
        self._next_mig_scan = 0.0

    # -- discovery -------------------------------------------------------------------------

    def start(self) -> list[GpuIdentity]:
        try:
            self.nvml.init()
        except NvmlUnavailable as exc:
            raise BackendUnavailable(str(exc), exc.no_driver) from exc
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
                identities.extend(d.identity for d in self._mig_devices(index, handle))
        self._next_mig_scan = self._clock() + MIG_RESCAN_SECONDS
        return identities

    def _identify(self, index: str, handle: Any, parent: str = "") -> GpuIdentity:
        nv = self.nvml
        check = bool(parent)  # a MIG device may vanish between listing and identifying
        uuid = _text(nv.call("nvmlDeviceGetUUID", handle, device=index, check_handle=check)
                     or "")
        name = _text(nv.call("nvmlDeviceGetName", handle, device=index) or "")
        pci = nv.call("nvmlDeviceGetPciInfo", handle, device=index)
        bus_id = _text(getattr(pci, "busId", "") or "") if pci is not None else ""
        profile = ""
        if parent:  # NVML names a MIG device after its GPU and profile: "... MIG 1g.10gb"
            m = _MIG_PROFILE.search(name)
            profile = m.group(1) if m else ""
        return GpuIdentity(index=index, uuid=uuid, name=name, pci_bus_id=bus_id, parent=parent,
                           profile=profile)

    def _mig_devices(self, index: str, handle: Any) -> list[_NvmlDevice]:
        """List the MIG devices of GPU ``index`` as NVML has them now (not yet registered)."""
        nv = self.nvml
        mode = nv.call("nvmlDeviceGetMigMode", handle, device=index, query="mig_mode")
        current = None if not mode else int(mode[0])
        parent = self._devices.get(index)
        if parent is not None and current is not None and current != parent.mig_mode:
            if parent.mig_mode is not None:
                # what NVML refused in the old mode (utilisation, per-process samples, ECC in
                # MIG mode) may answer now, and what it answered may not
                log.info("GPU %s: MIG mode %s", index, "on" if current == 1 else "off")
                self._free_gpm(parent)
                parent.reset()
                nv.forget(index)
            parent.mig_mode = current
        if current != 1:
            return []
        out = []
        for j in range(nv.call("nvmlDeviceGetMaxMigDeviceCount", handle, device=index) or 0):
            mig_index = f"{index}/{j}"
            mig = nv.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, j, device=mig_index,
                          query="mig_handle")
            if mig is None:
                continue
            try:
                identity = self._identify(mig_index, mig, parent=index)
            except StaleHandleError:
                continue
            gi = nv.call("nvmlDeviceGetGpuInstanceId", mig, device=mig_index, query="mig_gi")
            out.append(_NvmlDevice(identity, mig, handle, gi))
        for dev in out:
            self._devices[dev.identity.index] = dev
        return out

    def rescan(self) -> list[GpuIdentity] | None:
        """Every GPU and MIG device again when the MIG devices changed since the last listing
        (a handle went stale, or the periodic look every MIG_RESCAN_SECONDS found others);
        None when nothing changed."""
        now = self._clock()
        if not self._mig_stale and now < self._next_mig_scan:
            return None
        self._mig_stale, self._next_mig_scan = False, now + MIG_RESCAN_SECONDS
        changed = False
        identities: list[GpuIdentity] = []
        for index, dev in [(i, d) for i, d in self._devices.items() if not d.identity.parent]:
            identities.append(dev.identity)
            old = [d for d in self._devices.values() if d.identity.parent == index]
            if dev.handle is None:
                identities.extend(d.identity for d in old)
                continue
            for d in old:  # listed again below; a kept one keeps its state
                del self._devices[d.identity.index]
            try:
                new = self._mig_devices(index, dev.handle)
            except GpuLostError:
                new = []
            same = {d.identity: d for d in old}
            for d in new:
                if d.identity in same:  # the same MIG device: keep its GPM samples, counters
                    kept = same.pop(d.identity)
                    kept.handle = d.handle
                    self._devices[d.identity.index] = kept
            if same or len(new) != len(old):
                changed = True
                log.info("GPU %s: MIG devices now %s", index,
                         ", ".join(f"{d.identity.index} {d.identity.profile}" for d in new)
                         or "none")
            for d in same.values():
                self._free_gpm(d)
                self.nvml.forget(d.identity.index)
            identities.extend(d.identity for d in new)
        return identities if changed else None

    # -- one reading -----------------------------------------------------------------------

    def sample(self, gpu: GpuIdentity) -> GpuSample:
        dev = self._devices.get(gpu.index)
        if dev is None or dev.identity != gpu:
            raise GpuLostError(f"GPU {gpu.index} ({gpu.uuid}) is no longer listed")
        if dev.handle is None:
            raise GpuLostError(f"GPU {gpu.index} has no handle")
        try:
            return self._read(dev)
        except StaleHandleError:
            self._mig_stale = True  # the next cycle lists the MIG devices again
            raise

    def _read(self, dev: _NvmlDevice) -> GpuSample:
        nv, lib, h, key = self.nvml, self.nvml.lib, dev.handle, dev.identity.index
        if dev.parent_handle is not None:  # still the MIG device we listed?
            uuid = _text(nv.call("nvmlDeviceGetUUID", h, device=key, query="probe",
                                 check_handle=True) or "")
            if uuid != dev.identity.uuid:
                raise StaleHandleError(f"MIG device {key} is now {uuid or 'gone'}")
        s = GpuSample(timestamp=self._clock())
        # v2 first: its "used" leaves out the driver's reserved memory, as nvidia-smi does
        mem = nv.call_versioned(self._memory_variants, h, device=key)
        if mem is not None:
            s.memory_used_bytes, s.memory_total_bytes = float(mem.used), float(mem.total)
        self._one_call_readings(dev, s)
        energy_mj = nv.call("nvmlDeviceGetTotalEnergyConsumption", h, device=key)
        s.energy_counter_joules = None if energy_mj is None else energy_mj / 1000.0
        for clock, const in (("sm", "NVML_CLOCK_SM"), ("memory", "NVML_CLOCK_MEM")):
            mhz = nv.call("nvmlDeviceGetClockInfo", h, getattr(lib, const), device=key)
            if mhz is not None:
                s.clocks_hertz[clock] = float(mhz) * 1e6
        self._pcie_link(dev, s)
        pcie_covered = self._fields(dev, s)
        busy = self._gpm(dev, s)
        s.utilization = self._utilization(dev)
        if s.utilization is None and busy is not None:  # MIG: NVML answers no utilisation
            s.utilization = _ratio(busy)
        if not pcie_covered:
            self._pcie_fallback(dev, s)
        self._memory_health(dev, s)
        procs = nv.call_versioned(COMPUTE_PROCESS_VARIANTS, h, device=key)
        if procs:
            s.pids = tuple(int(p.pid) for p in procs)
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                if used is not None and used < NVML_VALUE_NOT_AVAILABLE:
                    s.process_memory[int(p.pid)] = s.process_memory.get(int(p.pid), 0.0) + used
        s.process_utilization, s.process_seconds = self._process_utilization(dev, s.timestamp)
        return s

    def _one_call_readings(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """The gauges whose reading is one NVML call, as their descriptors say
        (gpu_metrics.NvmlRead): where the driver has several variants, the newest it
        answers."""
        nv, h, key = self.nvml, dev.handle, dev.identity.index
        for m in ONE_CALL:
            read, attr = m.nvml, m.attr
            assert read is not None and attr is not None  # ONE_CALL holds only these
            if len(read.functions) == 1:
                got = nv.call(read.functions[0], h, *read.args, device=key)
            else:
                got = nv.call_versioned([(f, {}) for f in read.functions], h, *read.args,
                                        device=key)
            if got is not None and got != read.unknown:
                setattr(s, attr, float(got) / read.per)

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

    def _process_utilization(self, dev: _NvmlDevice, now: float) -> tuple[
            dict[int, tuple[float, float | None]] | None, dict[int, tuple[float, float]] | None]:
        """pid -> (SM busy ratio, memory-bandwidth ratio): the means of NVML's per-process
        samples newer than the last one read (NVML gives one per sample period to a process
        that had some utilisation in it), and pid -> the busy seconds they stand for: each
        sample weighted by the sample period (the shortest gap between two samples of one
        process; the seconds since the last reading shared out while it is unknown). NOT_FOUND
        (no new sample) reads as no pid; an unsupported call (asked once) as None. Dropped, as
        nvtop drops them (its issue 110, real drivers): samples not newer than the timestamp
        asked for, values over 100 %, pid 0."""
        key = dev.identity.index
        got = self.nvml.call_versioned(PROCESS_UTILIZATION_VARIANTS, dev.handle,
                                       dev.process_seen_us, device=key)
        if got is None and self.nvml.none_answers(PROCESS_UTILIZATION_VARIANTS, device=key):
            return None, None
        since = dev.process_seen_us
        fresh: dict[int, list[tuple[int, float, float]]] = {}
        for x in got or ():
            if x.timeStamp > since and x.pid and x.smUtil <= 100 and x.memUtil <= 100:
                fresh.setdefault(int(x.pid), []).append((int(x.timeStamp), x.smUtil, x.memUtil))
                dev.process_seen_us = max(dev.process_seen_us, int(x.timeStamp))
        for pid, v in fresh.items():
            v.sort()
            last = dev.process_last_us.get(pid)
            stamps = [*([last] if last else []), *(t for t, _, _ in v)]
            gaps = [b - a for a, b in itertools.pairwise(stamps) if b > a]
            if gaps:
                shortest = min(gaps)
                dev.process_period_us = shortest if dev.process_period_us is None \
                    else min(dev.process_period_us, shortest)
            dev.process_last_us[pid] = v[-1][0]
        dt = 0.0 if dev.process_read_at is None else max(0.0, now - dev.process_read_at)
        dev.process_read_at = now
        dev.process_last_us = {p: t for p, t in dev.process_last_us.items()
                               if p in fresh or t > dev.process_seen_us - 60_000_000}
        seconds: dict[int, tuple[float, float]] = {}
        for pid, v in fresh.items():
            weight = dev.process_period_us / 1e6 if dev.process_period_us else dt / len(v)
            seconds[pid] = (sum(_share(sm) for _, sm, _ in v) * weight,
                            sum(_share(mem) for _, _, mem in v) * weight)
        means = {pid: (_share(sum(sm for _, sm, _ in v) / len(v)),
                       _ratio(sum(mem for _, _, mem in v) / len(v))) for pid, v in fresh.items()}
        return means, seconds

    def _pcie_link(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """The link's capacity at its best (the denominator of the host-to-device rule: a link
        trains down when idle) and as it is trained now."""
        nv, h, key = self.nvml, dev.handle, dev.identity.index
        if dev.pcie_max is None:
            # the GPU's and the system's best (an x16 Gen5 GPU in a Gen4 slot runs at Gen4)
            gens = [g for g in (nv.call("nvmlDeviceGetMaxPcieLinkGeneration", h, device=key),
                                nv.call_versioned(GPU_MAX_PCIE_GENERATION, h, device=key))
                    if g]
            width = nv.call("nvmlDeviceGetMaxPcieLinkWidth", h, device=key)
            dev.pcie_max = _link(min(gens), width) if gens else None
        s.pcie_link_max_bytes_per_second = dev.pcie_max
        s.pcie_link_current_bytes_per_second = _link(
            nv.call("nvmlDeviceGetCurrPcieLinkGeneration", h, device=key),
            nv.call("nvmlDeviceGetCurrPcieLinkWidth", h, device=key))

    def _fields(self, dev: _NvmlDevice, s: GpuSample) -> bool:
        """Clock events, PCIe and NVLink from one nvmlDeviceGetFieldValues call. True when the
        PCIe counters cover this reading (no throughput call needed)."""
        nv, key = self.nvml, dev.identity.index
        events = {**STABLE_CLOCK_EVENT_FIELDS, **clock_event_fields(nv.driver)}
        pcie = (fi.FI_PCIE_COUNT_RX_BYTES, fi.FI_PCIE_COUNT_TX_BYTES)
        nvlink = self._nvlink_fields(dev)
        values = nv.field_values(dev.handle, [*events.values(), *pcie, *nvlink.values()],
                                 device=key)
        for label, fid in events.items():
            if fid in values and self._throttle_trusted(dev, label, fid, values[fid],
                                                        s.timestamp):
                s.clock_event_counter_seconds[label] = float(values[fid].value) / 1e9
                dev.throttle_source[label] = "field"
        for label, policy in VIOLATION_POLICIES.items():
            if label in s.clock_event_counter_seconds or dev.throttle_source.get(label) == "field":
                continue
            v = nv.call("nvmlDeviceGetViolationStatus", dev.handle, policy, device=key)
            if v is not None:
                s.clock_event_counter_seconds[label] = float(v.violationTime) / 1e9
                dev.throttle_source[label] = "violation"
        self._bitmask(dev, s)
        if nvlink:
            self._nvlink(dev, s, nvlink, values)
        rx, tx = values.get(pcie[0]), values.get(pcie[1])
        if rx is None or tx is None:
            return False
        if rx.value_type == VALUE_TYPE_ULONGLONG:
            s.pcie_rx_counter_bytes, s.pcie_tx_counter_bytes = float(rx.value), float(tx.value)
            return True
        return self._pcie_wrapping(dev, s, rx.value, tx.value,
                                   VALUE_TYPE_MODULUS.get(rx.value_type))

    def _bitmask(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """The clock-event reasons no counter reports, from the current reasons bitmask: a
        driver before 575 has no hardware slowdown counter, and a GPU slowed by its hardware
        (thermal, power brake, another HW_SLOWDOWN) is no less slowed."""
        missing = [r for r in (*CLOCK_EVENT_BITS, "hw_slowdown")
                   if r not in s.clock_event_counter_seconds]
        if not missing:
            return
        bits = self.nvml.call_versioned(CLOCK_EVENT_REASONS_CALLS, dev.handle,
                                        device=dev.identity.index)
        if bits is None:
            return
        bits = int(bits)
        t = s.timestamp
        dt = 0.0 if dev.bitmask_at is None else max(0.0, t - dev.bitmask_at)
        dev.bitmask_at = t
        named = CLOCK_EVENT_BITS["hw_thermal_slowdown"] | \
            CLOCK_EVENT_BITS["hw_power_brake_slowdown"]
        hw_other = bool(bits & HW_SLOWDOWN_BIT) and not bits & named
        for label in missing:
            on = hw_other if label == "hw_slowdown" else bits & CLOCK_EVENT_BITS[label]
            seconds = dev.bitmask_seconds.get(label, 0.0) + (dt if on else 0.0)
            dev.bitmask_seconds[label] = seconds
            s.clock_event_counter_seconds[label] = seconds
            dev.throttle_source[label] = "bitmask"

    def _throttle_trusted(self, dev: _NvmlDevice, label: str, fid: int, got: fi.FieldValue,
                          now: float) -> bool:
        """Whether a clock-event field answers as a nanosecond counter should: 64-bit, never
        going down, never faster than the wall clock. A field that fails is not asked again."""
        prev = dev.throttle.get(label)
        dev.throttle[label] = (now, float(got.value))
        why = ""
        if got.value_type != VALUE_TYPE_ULONGLONG:
            why = f"a value of type {got.value_type}"
        elif prev is not None:
            grew, dt = float(got.value) - prev[1], now - prev[0]
            if grew < 0:
                why = "a decrease"
            elif grew > dt * 1e9 * THROTTLE_SLACK[0] + THROTTLE_SLACK[1]:
                why = f"{grew / 1e9:.3g} s of throttling in {dt:.3g} s"
        if not why:
            return True
        dev.throttle.pop(label, None)
        self.nvml.forget_field(dev.identity.index, fid)
        log.warning("GPU %s: NVML field %d (clock events, %s) answered %s: not a nanosecond "
                    "counter on driver %s; that reason is left out", dev.identity.index, fid,
                    label, why, self.driver_version)
        return False

    def _pcie_wrapping(self, dev: _NvmlDevice, s: GpuSample, rx: float, tx: float,
                       modulus: int | None) -> bool:
        """Rates from PCIe byte counters narrower than 64 bits ("Value can be wrapped"): the
        increase since the last reading modulo the counter's width, where the link cannot
        have carried a whole wrap in between (else the count of wraps is unknown)."""
        prev, dev.pcie_counter = dev.pcie_counter, (s.timestamp, rx, tx)
        if modulus is None:
            return False
        if prev is None:
            return True  # the first reading: nothing to integrate yet
        dt = s.timestamp - prev[0]
        link = s.pcie_link_max_bytes_per_second
        if dt <= 0 or link is None or link * dt >= modulus:
            self.nvml._log_once(("pcie_wrap", dev.identity.index), logging.INFO,
                                "GPU %s: its PCIe byte counters are %d-bit and can wrap more "
                                "than once in %.2fs; PCIe bytes come from the throughput "
                                "call", dev.identity.index, modulus.bit_length() - 1, dt)
            return False
        s.pcie_rx_bytes_per_second = ((rx - prev[1]) % modulus) / dt
        s.pcie_tx_bytes_per_second = ((tx - prev[2]) % modulus) / dt
        return True

    def _nvlink_fields(self, dev: _NvmlDevice) -> dict[str, Any]:
        """The NVLink field ids to ask (the byte counters with scope all links), or none on a
        GPU known to have no NVLink."""
        if self.nvml.is_unsupported(dev.identity.index, "nvlink"):
            return {}
        return {"present": fi.FI_NVLINK_LINK_COUNT, "speed": fi.FI_NVLINK_SPEED_MBPS_COMMON,
                **{d: (f, NVLINK_ALL_LINKS) for d, f in NVLINK_FIELDS.items()}}

    def _nvlink(self, dev: _NvmlDevice, s: GpuSample, ids: dict[str, Any],
                values: dict) -> None:
        """Active links (the field counts the links present) and their speed; the byte
        counters where the driver has them (else GPM's rates fill them in). A GPU without
        NVLink reports nothing."""
        nv, key = self.nvml, dev.identity.index
        present = int(values[ids["present"]].value) if ids["present"] in values else 0
        if present <= 0:
            nv.mark_unsupported(key, "nvlink")  # not asked again
            return
        dev.nvlink_present = present
        states = [nv.call("nvmlDeviceGetNvLinkState", dev.handle, link, device=key)
                  for link in range(present)]
        known = [state for state in states if state is not None]
        s.nvlink_links = sum(state == NVML_FEATURE_ENABLED for state in known) if known \
            else None
        speed = values.get(ids["speed"])
        if speed is not None and speed.value:
            s.nvlink_link_max_bytes_per_second = float(speed.value) * 1e6
        if ids["rx"] in values and ids["tx"] in values:  # KiB
            s.nvlink_rx_counter_bytes = float(values[ids["rx"]].value) * 1024
            s.nvlink_tx_counter_bytes = float(values[ids["tx"]].value) * 1024

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
                s.ecc_volatile_errors[label] = float(n)
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

    def _gpm(self, dev: _NvmlDevice, s: GpuSample) -> float | None:
        """GPM metrics over the window since the GPM sample the last full window ended with
        (Hopper and newer; per GPU instance on a MIG device). A window is closed only once it
        is over GPM_MIN_INTERVAL_SECONDS long, whatever the sampling interval: a reading in a
        younger window carries the last window's values. Returns GPM's busy percentage."""
        nv, key = self.nvml, dev.identity.index
        if dev.gpm_supported is None:
            support = nv.call("nvmlGpmQueryDeviceSupport", dev.parent_handle or dev.handle,
                              device=key)
            dev.gpm_supported = bool(support is not None and support.isSupportedDevice)
            if dev.gpm_supported:
                dev.gpm_buffers = [b for b in (nv.call("nvmlGpmSampleAlloc", device=key,
                                                       query=("gpm_alloc", n))
                                               for n in range(2)) if b is not None]
                dev.gpm_supported = len(dev.gpm_buffers) == 2
                if not dev.gpm_supported:
                    self._free_gpm(dev)
        if not dev.gpm_supported:
            return None
        base, now = dev.gpm_base, self._clock()  # when the sample is taken, not the reading
        if base is not None and now - base[1] <= GPM_MIN_INTERVAL_SECONDS:
            return self._apply_gpm(dev, s, dev.gpm_values)
        target = 0 if base is None else 1 - base[0]
        buffer = dev.gpm_buffers[target]
        if dev.parent_handle is not None:
            got = nv.call("nvmlGpmMigSampleGet", dev.parent_handle, dev.gpu_instance_id,
                          buffer, device=key, query="gpm_sample")
        else:
            got = nv.call("nvmlGpmSampleGet", dev.handle, buffer, device=key,
                          query="gpm_sample")
        if got is None:
            return None
        dev.gpm_base = (target, now)
        if base is None:
            return None  # the first sample opens the first window
        dev.gpm_values = self._gpm_metrics(dev, dev.gpm_buffers[base[0]], buffer)
        dev.gpm_closed = True
        return self._apply_gpm(dev, s, dev.gpm_values)

    def _gpm_metrics(self, dev: _NvmlDevice, first: Any, second: Any) -> dict[str, float]:
        lib = self.nvml.lib
        names = [n for n, const in GPM_METRICS.items() if hasattr(lib, const)]
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(names)
        request.sample1, request.sample2 = first, second
        for i, n in enumerate(names):
            request.metrics[i].metricId = getattr(lib, GPM_METRICS[n])
        result = self.nvml.call("nvmlGpmMetricsGet", request, device=dev.identity.index,
                                query="gpm_metrics")
        if result is None:
            return {}
        values = {}
        for i, n in enumerate(names):
            m = result.metrics[i]
            if m.nvmlReturn == 0 and not math.isnan(m.value):
                values[n] = float(m.value)
        return values

    def _apply_gpm(self, dev: _NvmlDevice, s: GpuSample, values: dict[str, float]
                   ) -> float | None:
        for n in ("sm_active", "sm_occupancy", "tensor_active", "dram_active"):
            if n in values:
                setattr(s, n, _ratio(values[n]))
        if dev.nvlink_present and s.nvlink_rx_counter_bytes is None \
                and "nvlink_rx_mib_per_second" in values:
            s.nvlink_rx_bytes_per_second = values["nvlink_rx_mib_per_second"] * MIB
            s.nvlink_tx_bytes_per_second = values.get("nvlink_tx_mib_per_second", 0.0) * MIB
        if "pcie_rx_mib_per_second" in values and "pcie_tx_mib_per_second" in values:
            # preferred to the byte counters: those may wrap (the sampler takes rates first)
            s.pcie_rx_bytes_per_second = values["pcie_rx_mib_per_second"] * MIB
            s.pcie_tx_bytes_per_second = values["pcie_tx_mib_per_second"] * MIB
        return values.get("busy")

    def _free_gpm(self, dev: _NvmlDevice) -> None:
        for sample in dev.gpm_buffers:
            self.nvml.call("nvmlGpmSampleFree", sample, query="gpm_free")
        dev.gpm_buffers, dev.gpm_base, dev.gpm_values = [], None, {}

    def _pcie_fallback(self, dev: _NvmlDevice, s: GpuSample) -> None:
        """The throughput call, last: it blocks ~20 ms per direction (its sampling window)."""
        if s.pcie_rx_counter_bytes is not None or s.pcie_rx_bytes_per_second is not None:
            return
        if dev.gpm_supported and not dev.gpm_closed:
            return  # GPM gives the rates from its first full window on
        nv, lib, key = self.nvml, self.nvml.lib, dev.identity.index
        rx = nv.call("nvmlDeviceGetPcieThroughput", dev.handle, lib.NVML_PCIE_UTIL_RX_BYTES,
                     device=key)
        tx = nv.call("nvmlDeviceGetPcieThroughput", dev.handle, lib.NVML_PCIE_UTIL_TX_BYTES,
                     device=key)
        if rx is not None and tx is not None:  # KB/s in nvml.h, KiB/s as nvitop reads it
            s.pcie_rx_bytes_per_second, s.pcie_tx_bytes_per_second = rx * 1024.0, tx * 1024.0
            nv._log_once(("pcie_throughput", key), logging.INFO,
                         "GPU %s: PCIe bytes are estimated from NVML's throughput call, a "
                         "~20 ms window taken once a cycle and counted for the whole cycle "
                         "(this driver has no PCIe byte counters or GPM)", key)

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
        self._free_gpm(dev)  # the samples of the old handle
        dev.handle = handle
        dev.reset()
        self.nvml.forget(gpu.index)  # a reset GPU may answer what it refused before
        self._mig_stale = True  # its MIG devices, if any, have new handles too
        return True

    def wait_xid(self, timeout_s: float) -> list[tuple[str, int]]:
        """Xid events of the GPUs, each registered again whenever its handle is new (a GPU
        that appeared later, reopened or reset: a reset drops the driver's registration); a
        MIG device's event (its GPU instance id) is counted on that MIG device."""
        nv, lib = self.nvml, self.nvml.lib
        with self._event_lock:
            if self._event_set is None:
                self._event_set = nv.call("nvmlEventSetCreate", query="xid")
                if self._event_set is None:
                    return []
            for index, dev in list(self._devices.items()):  # rescan() may change it
                if dev.handle is None or dev.identity.parent or \
                        self._xid_registered.get(index) is dev.handle:
                    continue
                nv.call("nvmlDeviceRegisterEvents", dev.handle,
                        lib.nvmlEventTypeXidCriticalError, self._event_set,
                        device=index, query="xid")
                self._xid_registered[index] = dev.handle
        data = nv.call("nvmlEventSetWait_v2", self._event_set, int(timeout_s * 1000),
                       query="xid_wait")
        if data is None:
            return []
        uuid = _text(nv.call("nvmlDeviceGetUUID", data.device, query="xid_uuid") or "")
        instance = getattr(data, "gpuInstanceId", NO_INSTANCE)
        devices = list(self._devices.items())
        parent = next((i for i, d in devices if d.identity.uuid == uuid), None)
        if parent is None:
            return []
        if instance != NO_INSTANCE:
            for index, dev in devices:
                if dev.identity.parent == parent and dev.gpu_instance_id == instance:
                    return [(index, int(data.eventData))]
        return [(parent, int(data.eventData))]

    def close(self) -> None:
        for dev in list(self._devices.values()):
            self._free_gpm(dev)
        if self._event_set is not None:
            self.nvml.call("nvmlEventSetFree", self._event_set, query="xid_free")
        self.nvml.shutdown()  # after the calls still in flight (the Xid wait, a slow GPU)


class TrainingProcess(Protocol):
    """What the demo GPUs read of a rank that pushes to the daemon (the ingest's rank state
    has these): who it is, its process, the GPUs it names and its step counters."""

    run: str
    rank: str
    run_id: str
    pid: int | None
    start_time: int | None
    gpus: tuple[str, ...]
    step_seconds: float
    data_wait_seconds: float
    received_at: float


class DemoBackend:
    """Simulated H100 SXM GPUs whose load moves over time (or is pinned with ``load``).

    Each gauge's value is its descriptor's (gpu_metrics: a figure of an H100 SXM5 80GB as NVML
    reports it, or a function of the GPU's busy ratio), so dashboards and alerts behave as they
    would on hardware; the counters, clocks and memory health are simulated here from those.
    ``load`` in 0-1 pins every GPU at that busy ratio; None lets each GPU follow its own slow
    wave, or the processes on it (:meth:`follow`, ``foreign_load``). ``foreign_load`` in 0-1
    puts a process no rank owns (:attr:`FOREIGN_PID`, holding :attr:`FOREIGN_MEMORY`) on GPU 0,
    busy that share of the time.
    """

    name = "demo"
    driver_version = "demo"
    SM_CLOCK_MAX, SM_CLOCK_IDLE, MEMORY_CLOCK = 1980e6, 1155e6, 2619e6
    ECC_EVERY_SECONDS = 600.0  # the last demo GPU corrects one ECC error this often
    FOREIGN_PID = 2**22 + 7  # over Linux's largest pid: no real process is it or its parent
    FOREIGN_MEMORY = 4 * 1024 * MIB

    def __init__(self, gpus: int = 8, load: float | None = None,
                 clock: Callable[[], float] = time.monotonic, host: str | None = None,
                 memory_fault: bool = False, foreign_load: float | None = None) -> None:
        for what, ratio in (("load", load), ("foreign load", foreign_load)):
            if ratio is not None and not 0.0 <= ratio <= 1.0:
                raise ValueError(f"demo {what} must be between 0 and 1, got {ratio}")
        self.gpus = gpus
        self.load = load
        self.foreign_load = foreign_load
        self._clock = clock
        self._start = clock()
        self._last: dict[str, float] = {}
        self._energy: dict[str, float] = {}
        self._pcie: dict[str, list[float]] = {}
        self._nvlink: dict[str, list[float]] = {}
        self.memory_fault = memory_fault  # the last GPU: an uncorrectable error, a remap pending
        self._host = host or socket.gethostname()  # demo UUIDs differ between nodes
        self._ranks: Callable[[], Iterable[TrainingProcess]] | None = None
        self._rates: dict[tuple, tuple[float, float, float]] = {}  # rank -> (at, compute, busy)
        self._work: tuple[float, dict[str, dict[int, float]]] = (-1.0, {})
        self._work_lock = threading.Lock()
        self._host_pids: dict[tuple[int, int], int] = {}  # (pushed pid, start) -> host pid

    def follow(self, ranks: Callable[[], Iterable[TrainingProcess]]) -> None:
        """Attach the training processes that push to this daemon to demo GPUs, as NVML
        lists a process on the GPU it uses, and let each such GPU's load follow its ranks.

        ``ranks`` returns the ranks as of the daemon's last cycle (its node view's). A rank
        that names demo GPUs (index or UUID) uses those; any other rank with a pid uses GPU
        ``rank % gpus`` (rank 0 on GPU 0). The load is the share of wall time the rank spent
        in steps but not waiting for data, from its last two pushes; a rank that stopped
        pushing leaves its GPU idle but held. A GPU's load is its processes' shares added up
        (at most 1); a pinned ``load`` still wins, the shares then scaled to it."""
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

    def _workload(self, now: float) -> dict[str, dict[int, float]]:
        """GPU index -> {pid: busy share} of the ranks followed, once per cycle."""
        with self._work_lock:
            at, work = self._work
            if now - at < 0.2 or self._ranks is None:
                return work
            refs = self._refs
            work = {}
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
                pid = self._host_pid(st.pid, st.start_time)
                for index in mine:
                    on = work.setdefault(index, {})
                    on[pid] = on.get(pid, 0.0) + share[2] / len(mine)
            self._rates = rates
            live = {(st.pid, st.start_time) for st in self._ranks()}
            self._host_pids = {k: v for k, v in self._host_pids.items() if k in live}
            self._work = (now, work)
            return work

    def _host_pid(self, pid: int, start_time: int | None) -> int:
        """The pid NVML would list for a rank: the host's, found from the pid the rank pushed
        (its own, inside its PID namespace) and its start time; the pushed pid where the
        host process cannot be found (no start time pushed, or not on this /proc)."""
        if start_time is None:
            return int(pid)
        ref = (int(pid), int(start_time))
        if ref not in self._host_pids:
            found = find_host_pid(*ref)
            if found is None:
                return ref[0]  # not cached: the process may show up by the next cycle
            self._host_pids[ref] = found
        return self._host_pids[ref]

    def host_process(self, pid: int) -> HostProcess | None:
        """The host process ``pid`` (see host_processes.read_process), and the demo's own
        process no rank owns, which exists only here."""
        if pid == self.FOREIGN_PID:
            return HostProcess(pid, pid, 0, None)
        return read_process(pid)

    def _busy_share(self, key: tuple, st: TrainingProcess, now: float) -> \
            tuple[float, float, float]:
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
        shares = dict(self._workload(now).get(gpu.index, {}))  # pid -> busy share
        ranks = tuple(shares)
        if i == 0 and self.foreign_load is not None:
            shares[self.FOREIGN_PID] = self.foreign_load
        busy = sum(shares.values())
        if shares and self.load is None:
            load = min(1.0, busy)
        scale = load / busy if busy > 0 else 0.0  # as a GPU shared in time: they add up
        dt = now - self._last.get(gpu.index, now)
        self._last[gpu.index] = now
        s = GpuSample(timestamp=now, pids=tuple(shares))
        g = {m.attr: m.demo_value(load) for m in DEMO_GAUGES if m.attr is not None}
        for attr, value in g.items():
            setattr(s, attr, value)
        # as NVML, only the processes busy in the window have a sample
        s.process_utilization = {pid: (share * scale, g["dram_active"] * share * scale / load)
                                 for pid, share in shares.items() if share * scale > 0}
        self._energy[gpu.index] = self._energy.get(gpu.index, 0.0) + g["power_watts"] * dt
        s.energy_counter_joules = self._energy[gpu.index]
        link = g["pcie_link_max_bytes_per_second"]
        rx_rate, tx_rate = 0.08 * link * load, 0.01 * link * load
        pcie = self._pcie.setdefault(gpu.index, [0.0, 0.0])
        pcie[0] += rx_rate * dt
        pcie[1] += tx_rate * dt
        s.pcie_rx_counter_bytes, s.pcie_tx_counter_bytes = pcie
        # gradients all-reduced over NVLink while busy: a third of the links' bandwidth at full load
        nvlink_rate = 0.33 * g["nvlink_links"] * g["nvlink_link_max_bytes_per_second"] * load
        nvlink = self._nvlink.setdefault(gpu.index, [0.0, 0.0])
        nvlink[0] += nvlink_rate * dt
        nvlink[1] += nvlink_rate * dt
        s.nvlink_rx_counter_bytes, s.nvlink_tx_counter_bytes = nvlink
        # the last GPU has remapped a row and corrects an ECC error now and then; with
        # memory_fault it has an uncorrectable error and a remap waiting for a reset
        last = i == self.gpus - 1
        fault = last and self.memory_fault
        s.ecc_volatile_errors = {
            "corrected": float(int((now - self._start) / self.ECC_EVERY_SECONDS)) if last
            else 0.0, "uncorrected": 1.0 if fault else 0.0}
        s.remapped_rows = {"correctable": 1.0 if last else 0.0,
                           "uncorrectable": 1.0 if fault else 0.0,
                           "pending": 1.0 if fault else 0.0, "failed": 0.0}
        s.clocks_hertz = {"sm": self.SM_CLOCK_IDLE + (self.SM_CLOCK_MAX - self.SM_CLOCK_IDLE)
                          * load, "memory": self.MEMORY_CLOCK}
        s.clock_event_counter_seconds = {"sw_power_cap": 0.0, "hw_thermal_slowdown": 0.0}
        # the ranks on it hold what the simulated GPU uses, less a context's 512 MiB
        s.process_memory = {pid: max(0.0, g["memory_used_bytes"] - 512 * MIB) / len(ranks)
                            for pid in ranks}
        if self.FOREIGN_PID in shares:
            s.process_memory[self.FOREIGN_PID] = float(self.FOREIGN_MEMORY)
            s.memory_used_bytes = min(g["memory_total_bytes"],
                                      g["memory_used_bytes"] + self.FOREIGN_MEMORY)
        return s

    def reopen(self, gpu: GpuIdentity) -> bool:
        return True

    def rescan(self) -> list[GpuIdentity] | None:
        return None  # the demo GPUs never change

    def wait_xid(self, timeout_s: float) -> list[tuple[str, int]]:
        time.sleep(timeout_s)
        return []

    def close(self) -> None:
        pass
