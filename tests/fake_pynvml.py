"""A scripted, pynvml-shaped fake: the one stand-in for a GPU in the test suite.

It mimics the parts of nvidia-ml-py's ``pynvml`` module the exporter uses: the same function
names, arguments, return shapes (structs with the same attribute names), constants and
``NVMLError(value)`` exceptions. Each :class:`FakeGpu` holds scripted values; ``errors`` maps a
function name to the NVML return code it raises, ``lost`` makes every call raise GPU_IS_LOST.
``calls`` counts every call so tests can prove what was (not) asked.
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_GPU_UTILIZATION_SAMPLES = 1
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP = 74
NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST = 76
NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN = 269
NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN = 270
NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN = 271
NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1
NVML_PERF_POLICY_SYNC_BOOST = 2
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
NVML_GPM_METRIC_DRAM_BW_UTIL = 10
NVML_GPM_METRIC_PCIE_TX_PER_SEC = 20
NVML_GPM_METRIC_PCIE_RX_PER_SEC = 21
NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC = 60
NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC = 61
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_METRIC_MAX = 477
NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON = 90
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
ALL_LINKS = 0xFFFFFFFF
nvmlEventTypeXidCriticalError = 8
nvmlMemory_v2 = 0x2000028  # the struct version pynvml passes for nvmlDeviceGetMemoryInfo_v2

CLOCK_EVENT_FIELD_NAMES = {
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP: "sw_power_cap",
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST: "sync_boost",
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: "sw_thermal_slowdown",
    NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: "hw_thermal_slowdown",
    NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
}
GPM_NAMES = {
    NVML_GPM_METRIC_SM_UTIL: "sm_util",
    NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy",
    NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_util",
    NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_bw_util",
    NVML_GPM_METRIC_PCIE_TX_PER_SEC: "pcie_tx_mib_s",
    NVML_GPM_METRIC_PCIE_RX_PER_SEC: "pcie_rx_mib_s",
    NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: "nvlink_rx_mib_s",
    NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: "nvlink_tx_mib_s",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    """Scripted readings of one GPU, in NVML's own units (mW, mJ, MHz, KB/s, ns, percent)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = "00000000:18:00.0"
    util_samples: list[tuple[int, int]] = field(default_factory=list)  # (timestamp us, %)
    util_rate: int = 50
    memory_used: int = 10 * 1024**3
    memory_total: int = 80 * 1024**3
    memory_reserved: int = 512 * 1024**2  # the driver's; v1's "used" counts it, v2's does not
    memory_v2: bool = True  # False: a driver without nvmlDeviceGetMemoryInfo_v2
    power_mw: int = 350_000
    power_limit_mw: int = 700_000
    energy_mj: int = 1_000_000
    temperature: int = 55
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    pcie_gen: int = 5
    pcie_width: int = 16
    pcie_rx_bytes: int = 0
    pcie_tx_bytes: int = 0
    pcie_rx_kbs: int = 1000
    pcie_tx_kbs: int = 500
    clock_events_ns: dict[int, int] = field(default_factory=lambda: {
        k: 0 for k in CLOCK_EVENT_FIELD_NAMES})
    violation_ns: dict[int, int] = field(default_factory=dict)
    gpm: dict[str, float] | None = None  # None: GPM not supported
    pids: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    field_errors: dict[int, int] = field(default_factory=dict)
    lost: bool = False
    delay_s: float = 0.0  # every call on this GPU blocks this long (a hung GPU)
    mig: list[FakeGpu] | None = None  # MIG devices when MIG mode is on
    nvlink_links: int = 0  # active NVLink links (0: none, as on a PCIe card)
    nvlink_speed_mbps: int = 26_562  # per link and direction (H100 NVLink 4)
    nvlink_rx_kib: int | None = 0  # None: the throughput fields are not supported
    nvlink_tx_kib: int | None = 0
    # volatile ECC counts by nvmlMemoryErrorType_t; None: ECC not supported (or off)
    ecc_volatile: dict[int, int] | None = field(default_factory=lambda: {0: 0, 1: 0})
    # (correctable, uncorrectable, pending, failed); None: no row remapper (pre-Ampere)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    # retired page addresses by cause; None: not supported (Ampere and newer)
    retired_pages: dict[int, list[int]] | None = None
    retired_pending: int = 0
    gpu_instance_id: int = 0
    parent: FakeGpu | None = None


class _Sample:
    def __init__(self) -> None:
        self.values: dict[str, float] | None = None


class _Metric:
    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = NVML_SUCCESS
        self.value = 0.0


class c_nvmlGpmMetricsGet_t:
    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: _Sample | None = None
        self.sample2: _Sample | None = None
        self.metrics = [_Metric() for _ in range(NVML_GPM_METRIC_MAX)]


class FakePynvml:
    """Stands in for the pynvml module: ``Nvml(FakePynvml([...]))``."""

    NVMLError = NVMLError
    c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None,
                 driver: str = "570.86.15", missing: tuple[str, ...] = ()) -> None:
        self.gpus = gpus
        for g in gpus:
            for m in g.mig or []:
                m.parent = g
        self.init_error = init_error
        self.driver = driver
        self.missing = set(missing)
        self.calls: Counter[str] = Counter()
        self.events: queue.Queue[tuple[FakeGpu, int]] = queue.Queue()
        self.initialized = False
        for name, value in globals().items():
            if name.startswith(("NVML_", "nvmlEventType", "nvmlMemory_v")):
                setattr(self, name, value)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)  # an older nvidia-ml-py without this function
        return object.__getattribute__(self, name)

    def _dev(self, fn: str, handle: FakeGpu) -> FakeGpu:
        self.calls[fn] += 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle.delay_s:
            time.sleep(handle.delay_s)
        root = handle.parent or handle
        if root.lost or handle.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if fn in handle.errors:
            raise NVMLError(handle.errors[fn])
        return handle

    # -- library -----------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self.calls["nvmlSystemGetDriverVersion"] += 1
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self.calls["nvmlDeviceGetCount"] += 1
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self._dev("nvmlDeviceGetHandleByIndex", self.gpus[i])

    # -- identity ----------------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return self._dev("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return self._dev("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> Any:
        return SimpleNamespace(busId=self._dev("nvmlDeviceGetPciInfo", h).bus_id.encode())

    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        g = self._dev("nvmlDeviceGetMigMode", h)
        if g.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        return 7 if self._dev("nvmlDeviceGetMaxMigDeviceCount", h).mig is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, j: int) -> FakeGpu:
        g = self._dev("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if j >= len(g.mig or []):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return g.mig[j]

    def nvmlDeviceGetGpuInstanceId(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetGpuInstanceId", h).gpu_instance_id

    # -- readings ----------------------------------------------------------------------------
    def nvmlDeviceGetSamples(self, h: FakeGpu, kind: int, last_ts: int) -> tuple[int, list]:
        g = self._dev("nvmlDeviceGetSamples", h)
        fresh = [SimpleNamespace(timeStamp=ts, sampleValue=SimpleNamespace(uiVal=v))
                 for ts, v in g.util_samples if ts > last_ts]
        if not fresh:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return 1, fresh

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        g = self._dev("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=g.util_rate, memory=g.util_rate // 2)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None) -> Any:
        if not version:
            g = self._dev("nvmlDeviceGetMemoryInfo", handle)
            used = g.memory_used + g.memory_reserved
            return SimpleNamespace(used=used, total=g.memory_total, free=g.memory_total - used)
        g = self._dev("nvmlDeviceGetMemoryInfo_v2", handle)
        if not g.memory_v2:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        assert version == nvmlMemory_v2
        return SimpleNamespace(version=version, used=g.memory_used, reserved=g.memory_reserved,
                               total=g.memory_total,
                               free=g.memory_total - g.memory_used - g.memory_reserved)

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetEnforcedPowerLimit", h).power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetTotalEnergyConsumption", h).energy_mj

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        return self._dev("nvmlDeviceGetTemperature", h).temperature

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, clock: int) -> int:
        g = self._dev("nvmlDeviceGetClockInfo", h)
        return g.sm_clock_mhz if clock == NVML_CLOCK_SM else g.mem_clock_mhz

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetCurrPcieLinkGeneration", h).pcie_gen

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetCurrPcieLinkWidth", h).pcie_width

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, counter: int) -> int:
        g = self._dev("nvmlDeviceGetPcieThroughput", h)
        return g.pcie_rx_kbs if counter == NVML_PCIE_UTIL_RX_BYTES else g.pcie_tx_kbs

    def nvmlDeviceGetFieldValues(self, h: FakeGpu, field_ids: list) -> list:
        g = self._dev("nvmlDeviceGetFieldValues", h)
        out = []
        for ref in field_ids:
            fid, scope = ref if isinstance(ref, tuple) else (ref, 0)
            self.calls[f"field:{fid}"] += 1
            value: int | None = None
            nvlink = {NVML_FI_DEV_NVLINK_LINK_COUNT: g.nvlink_links,
                      NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON: g.nvlink_speed_mbps,
                      NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: g.nvlink_rx_kib,
                      NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: g.nvlink_tx_kib}
            if fid in nvlink:
                # a GPU without NVLink answers a link count of 0 and nothing else
                if fid == NVML_FI_DEV_NVLINK_LINK_COUNT or g.nvlink_links:
                    value = nvlink[fid]
                if fid in (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                           NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX):
                    assert scope == ALL_LINKS, "the throughput counters are asked for all links"
            elif fid == NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
                value = g.pcie_rx_bytes
            elif fid == NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
                value = g.pcie_tx_bytes
            elif fid in g.clock_events_ns:
                value = g.clock_events_ns[fid]
            ret = g.field_errors.get(fid, NVML_SUCCESS if value is not None
                                     else NVML_ERROR_NOT_SUPPORTED)
            out.append(SimpleNamespace(fieldId=fid, nvmlReturn=ret, valueType=3,
                                       value=SimpleNamespace(ullVal=value or 0)))
        return out

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, error_type: int, counter: int) -> int:
        g = self._dev("nvmlDeviceGetTotalEccErrors", h)
        assert counter == NVML_VOLATILE_ECC
        if g.ecc_volatile is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.ecc_volatile[error_type]

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu) -> tuple[int, int, int, int]:
        g = self._dev("nvmlDeviceGetRemappedRows", h)
        if g.remapped_rows is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.remapped_rows

    def nvmlDeviceGetRetiredPages(self, h: FakeGpu, cause: int) -> list[int]:
        g = self._dev("nvmlDeviceGetRetiredPages", h)
        if g.retired_pages is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return list(g.retired_pages.get(cause, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeGpu) -> int:
        g = self._dev("nvmlDeviceGetRetiredPagesPendingStatus", h)
        if g.retired_pages is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.retired_pending

    def nvmlDeviceGetViolationStatus(self, h: FakeGpu, policy: int) -> Any:
        g = self._dev("nvmlDeviceGetViolationStatus", h)
        if policy not in g.violation_ns:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(referenceTime=0, violationTime=g.violation_ns[policy])

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeGpu) -> list:
        g = self._dev("nvmlDeviceGetComputeRunningProcesses_v3", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for p in g.pids]

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeGpu) -> list:
        g = self._dev("nvmlDeviceGetComputeRunningProcesses_v2", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in g.pids]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list:
        g = self._dev("nvmlDeviceGetComputeRunningProcesses", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in g.pids]

    # -- GPM ---------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, h: FakeGpu) -> Any:
        g = self._dev("nvmlGpmQueryDeviceSupport", h)
        return SimpleNamespace(version=1, isSupportedDevice=int(g.gpm is not None))

    def nvmlGpmSampleAlloc(self) -> _Sample:
        self.calls["nvmlGpmSampleAlloc"] += 1
        return _Sample()

    def nvmlGpmSampleFree(self, sample: _Sample) -> None:
        self.calls["nvmlGpmSampleFree"] += 1

    def nvmlGpmSampleGet(self, h: FakeGpu, sample: _Sample) -> _Sample:
        g = self._dev("nvmlGpmSampleGet", h)
        sample.values = dict(g.gpm or {})
        return sample

    def nvmlGpmMigSampleGet(self, h: FakeGpu, gpu_instance_id: int, sample: _Sample) -> _Sample:
        g = self._dev("nvmlGpmMigSampleGet", h)
        mig = next(m for m in g.mig or [] if m.gpu_instance_id == gpu_instance_id)
        sample.values = dict(mig.gpm or {})
        return sample

    def nvmlGpmMetricsGet(self, request: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
        self.calls["nvmlGpmMetricsGet"] += 1
        assert request.version == NVML_GPM_METRICS_GET_VERSION
        assert request.sample1 is not None and request.sample2 is not None
        for m in request.metrics[: request.numMetrics]:
            name = GPM_NAMES.get(m.metricId)
            values = request.sample2.values or {}
            if name in values:
                m.nvmlReturn, m.value = NVML_SUCCESS, float(values[name])
            else:
                m.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return request

    # -- events ------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> str:
        self.calls["nvmlEventSetCreate"] += 1
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, types: int, event_set: str) -> None:
        self._dev("nvmlDeviceRegisterEvents", h)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self.calls["nvmlEventSetWait_v2"] += 1
        try:
            gpu, xid = self.events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None
        return SimpleNamespace(device=gpu, eventType=nvmlEventTypeXidCriticalError,
                               eventData=xid, gpuInstanceId=0, computeInstanceId=0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.calls["nvmlEventSetFree"] += 1
