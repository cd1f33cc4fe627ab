"""A fake NVML *driver* under the real nvidia-ml-py binding: the one stand-in for a GPU in the
test suite.

The binding (``pynvml``) loads ``libnvidia-ml.so.1`` with ``ctypes.CDLL`` and looks each C symbol
up on it (``_nvmlGetFunctionPointer``: a missing symbol is ``NVML_ERROR_FUNCTION_NOT_FOUND``).
:class:`FakeDriver` stands at that seam: :attr:`FakeDriver.binding` is a fresh copy of the
installed ``pynvml`` module whose ``CDLL`` returns this driver's symbol table, so every NVML test
runs the binding's own code (its ctypes structs, versioned calls, two-pass list calls, field-value
unions, error classes) against C functions that answer as the headers say. The driver writes its
answers through the C layouts of ``nvml.h`` (the ``_C*`` structs below), never through the
binding's Python structs: a binding whose struct disagrees with the header reads what a real
driver's bytes would give it.

The driver has a version (``"575.51.03"``): it decides which symbols exist (:data:`SYMBOL_SINCE`)
and what each field ID means (:func:`field_meaning`), both taken from the history of ``nvml.h``
(NVIDIA/go-nvml keeps every header; the commit of each version is named below). Devices are
:class:`FakeGpu` records in NVML's own units; :func:`h100_sxm`, :func:`a100_sxm4_mig`, :func:`l4`
and :func:`v100_sxm2` script the four models with the fixed values of public ``nvidia-smi -q``
outputs (each cites its source).
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from ctypes import (
    Structure,
    Union,
    addressof,
    c_char,
    c_char_p,
    c_double,
    c_int,
    c_longlong,
    c_uint,
    c_ulonglong,
    c_void_p,
    sizeof,
)
from dataclasses import dataclass, field
from typing import Any

# -- return codes (nvml.h nvmlReturn_t, stable since NVML 1) ------------------------------------
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
NO_DATA = 21
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999

VALUE_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE (unsigned long long)

# nvmlValueType_t
DOUBLE, UINT, ULONG, ULONGLONG, SLONGLONG, SINT = 0, 1, 2, 3, 4, 5
_UNION_MEMBER = {DOUBLE: "dVal", UINT: "uiVal", ULONG: "ulVal", ULONGLONG: "ullVal",
                 SLONGLONG: "sllVal", SINT: "siVal"}

# -- which driver has which symbol -------------------------------------------------------------
# The driver branch of the nvml.h in which each versioned or newer symbol first appears (go-nvml
# commits: 11.1 7dce688 (455), 11.6 522ec68 / b09a8f3 (510), 11.8 9adb740 (520), 12.0 399f8e0
# (525), 12.8 f420a32 (570)). A fake driver older than the branch lacks the symbol, as a real
# one does: the binding then raises FUNCTION_NOT_FOUND.
SYMBOL_SINCE = {
    # before go-nvml's first header (11.1): assumed from 11.0 (450), the MIG release whose
    # gpuInstanceId the _v2 struct carries
    "nvmlDeviceGetComputeRunningProcesses_v2": 450,
    "nvmlDeviceGetComputeRunningProcesses_v3": 510,
    "nvmlDeviceGetMemoryInfo_v2": 510,
    "nvmlGpmQueryDeviceSupport": 520,
    "nvmlGpmSampleAlloc": 520,
    "nvmlGpmSampleFree": 520,
    "nvmlGpmSampleGet": 520,
    "nvmlGpmMetricsGet": 520,
    "nvmlGpmMigSampleGet": 525,
    "nvmlDeviceGetGpuMaxPcieLinkGeneration": 525,
    "nvmlDeviceGetTemperatureV": 570,
    "nvmlDeviceGetProcessesUtilizationInfo": 550,  # the 12.4 header, go-nvml f7ceebd
}

# -- what a field ID means, by driver version --------------------------------------------------
# (fieldId, meaning). The clock-event counters and the power-smoothing fields moved:
#   570 (12.8 header, go-nvml f420a32; nvidia-ml-py 12.570.172): 251-268 power smoothing, no
#       clock-event counters
#   575 (12.9 header, 62ce1e3; nvidia-ml-py 12.575.51) and 580.65 (13.0.39 header, 9da9e13;
#       nvidia-ml-py 13.580.65): 251-253 clock events, 256-273 power smoothing
#   580.82 (nvidia-ml-py 13.580.82, 13.580.126) and 590+ (13.1 header, 2a1f6c3; 13.2.1 2976179;
#       13.3 8b8585b): 251-268 power smoothing, 269-271 clock events
STABLE_FIELDS = {
    74: ("clock_event", "sw_power_cap"),  # NVML_FI_DEV_PERF_POLICY_POWER (11.1 on)
    75: ("perf_policy", "thermal"),  # NVML_FI_DEV_PERF_POLICY_THERMAL
    76: ("clock_event", "sync_boost"),  # NVML_FI_DEV_PERF_POLICY_SYNC_BOOST
    90: ("nvlink", "speed_mbps"),  # NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON
    91: ("nvlink", "present"),  # NVML_FI_DEV_NVLINK_LINK_COUNT: links present
    94: ("pcie_replay", "count"),  # NVML_FI_DEV_PCIE_REPLAY_COUNTER (an H200: unsigned int)
    138: ("nvlink", "tx_kib"),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    139: ("nvlink", "rx_kib"),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
}
PCIE_COUNTER_FIELDS = {197: ("pcie", "tx_bytes"), 198: ("pcie", "rx_bytes")}  # 12.5 header (555)
_POWER_SMOOTHING = ("enabled", "priv_lvl", "imm_ramp_down", "applied_tmp_ceil",
                    "applied_tmp_floor", "max_percent_tmp_floor", "min_percent_tmp_floor",
                    "hw_lifetime_percent", "max_presets", "profile_percent_tmp_floor",
                    "profile_ramp_up_rate", "profile_ramp_down_rate",
                    "profile_ramp_down_hyst", "active_preset", "admin_percent_tmp_floor",
                    "admin_ramp_up_rate", "admin_ramp_down_rate", "admin_ramp_down_hyst")
_CLOCK_EVENTS = ("sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")


def field_meaning(driver: tuple[int, ...], field_id: int) -> tuple[str, str] | None:
    """What ``field_id`` means to a driver of version ``driver`` (branch, minor, ...)."""
    if field_id in STABLE_FIELDS:
        return STABLE_FIELDS[field_id]
    if field_id in PCIE_COUNTER_FIELDS:
        return PCIE_COUNTER_FIELDS[field_id] if driver >= (555,) else None
    if driver >= (575,) and driver < (580, 82):
        if 251 <= field_id <= 253:
            return ("clock_event", _CLOCK_EVENTS[field_id - 251])
        if 256 <= field_id <= 273:
            return ("power_smoothing", _POWER_SMOOTHING[field_id - 256])
    elif driver >= (570,):
        if 251 <= field_id <= 268:
            return ("power_smoothing", _POWER_SMOOTHING[field_id - 251])
        if driver >= (580, 82) and 269 <= field_id <= 271:
            return ("clock_event", _CLOCK_EVENTS[field_id - 269])
    return None


# -- C layouts of the structs the driver writes (nvml.h) ---------------------------------------
class _CValue(Union):
    _fields_ = [("dVal", c_double), ("uiVal", c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", c_ulonglong), ("sllVal", c_longlong), ("siVal", c_int),
                ("usVal", ctypes.c_ushort)]


class _CFieldValue(Structure):
    _fields_ = [("fieldId", c_uint), ("scopeId", c_uint), ("timestamp", c_longlong),
                ("latencyUsec", c_longlong), ("valueType", c_uint), ("nvmlReturn", c_uint),
                ("value", _CValue)]


class _CSample(Structure):
    _fields_ = [("timeStamp", c_ulonglong), ("sampleValue", _CValue)]


class _CMemory(Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class _CMemoryV2(Structure):
    _fields_ = [("version", c_uint), ("total", c_ulonglong), ("reserved", c_ulonglong),
                ("free", c_ulonglong), ("used", c_ulonglong)]


MEMORY_V2 = sizeof(_CMemoryV2) | (2 << 24)  # NVML_STRUCT_VERSION(Memory, 2)


class _CUtilization(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class _CPciInfo(Structure):  # nvmlPciInfo_t (v3)
    _fields_ = [("busIdLegacy", c_char * 16), ("domain", c_uint), ("bus", c_uint),
                ("device", c_uint), ("pciDeviceId", c_uint), ("pciSubSystemId", c_uint),
                ("busId", c_char * 32)]


class _CProcessInfo(Structure):  # nvmlProcessInfo_t = nvmlProcessInfo_v2_t (12.2 header on)
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong), ("gpuInstanceId", c_uint),
                ("computeInstanceId", c_uint)]


class _CProcessUtilizationSample(Structure):  # nvmlProcessUtilizationSample_t
    _fields_ = [("pid", c_uint), ("timeStamp", c_ulonglong), ("smUtil", c_uint),
                ("memUtil", c_uint), ("encUtil", c_uint), ("decUtil", c_uint)]


class _CProcessUtilizationInfoV1(Structure):  # nvmlProcessUtilizationInfo_v1_t
    _fields_ = [("timeStamp", c_ulonglong), ("pid", c_uint), ("smUtil", c_uint),
                ("memUtil", c_uint), ("encUtil", c_uint), ("decUtil", c_uint),
                ("jpgUtil", c_uint), ("ofaUtil", c_uint)]


class _CProcessesUtilizationInfoV1(Structure):  # nvmlProcessesUtilizationInfo_v1_t
    _fields_ = [("version", c_uint), ("processSamplesCount", c_uint),
                ("lastSeenTimeStamp", c_ulonglong), ("procUtilArray", c_void_p)]


# NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1) = 0x01000018
PROCESSES_UTILIZATION_V1 = sizeof(_CProcessesUtilizationInfoV1) | (1 << 24)


class _CViolationTime(Structure):
    _fields_ = [("referenceTime", c_ulonglong), ("violationTime", c_ulonglong)]


class _CEventData(Structure):
    _fields_ = [("device", c_void_p), ("eventType", c_ulonglong), ("eventData", c_ulonglong),
                ("gpuInstanceId", c_uint), ("computeInstanceId", c_uint)]


class _CGpmSupport(Structure):
    _fields_ = [("version", c_uint), ("isSupportedDevice", c_uint)]


class _CTemperatureV1(Structure):
    _fields_ = [("version", c_uint), ("sensorType", c_uint), ("temperature", c_int)]


TEMPERATURE_V1 = sizeof(_CTemperatureV1) | (1 << 24)


class _CGpmMetric(Structure):
    _fields_ = [("metricId", c_uint), ("nvmlReturn", c_uint), ("value", c_double),
                ("shortName", c_char_p), ("longName", c_char_p), ("unit", c_char_p)]


class _CGpmMetricsGetHead(Structure):  # nvmlGpmMetricsGet_t without its metrics[] array
    _fields_ = [("version", c_uint), ("numMetrics", c_uint), ("sample1", c_void_p),
                ("sample2", c_void_p)]


# GPM metric IDs (nvmlGpmMetricId_t, unchanged since the 11.8 header) -> FakeGpu.gpm key
GPM_METRICS = {1: "graphics_util", 2: "sm_util", 3: "sm_occupancy", 5: "tensor_util",
               10: "dram_bw_util", 20: "pcie_tx_mib_s", 21: "pcie_rx_mib_s",
               60: "nvlink_rx_mib_s", 61: "nvlink_tx_mib_s"}
GPM_MIN_INTERVAL_S = 0.1  # nvml.h: two nvmlGpmSampleGet() calls should be over 100 ms apart

# nvmlPerfPolicyType_t -> FakeGpu.violation_ns key
PERF_POLICIES = {0: "sw_power_cap", 1: "sw_thermal_slowdown", 2: "sync_boost"}
CLOCK_SM, CLOCK_MEM = 1, 2
PCIE_UTIL_TX, PCIE_UTIL_RX = 0, 1
XID_EVENT = 8  # nvmlEventTypeXidCriticalError
# functions a MIG device handle answers; the rest say NOT_SUPPORTED on it (volatile ECC
# included: nvml.h's ECC calls take the GPU's handle). GPM answers on a MIG device handle from
# the 12.x headers on (nvmlGpmQueryDeviceSupport, nvmlGpmSampleGet: the GPU instance's counters)
MIG_DEVICE_CALLS = {"nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo_v3",
                    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2",
                    "nvmlDeviceGetComputeRunningProcesses_v3",
                    "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGpuInstanceId",
                    "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleGet"}
# what NVML refuses on a GPU in MIG mode (nvml.h: "On MIG-enabled GPUs, querying device
# utilization rates is not currently supported", and the same of process utilisation)
MIG_PARENT_REFUSES = {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetSamples",
                      "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetProcessesUtilizationInfo"}


@dataclass
class FakeGpu:
    """One scripted device, in NVML's own units (mW, mJ, MHz, KB/s, KiB, ns, percent)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = "00000000:18:00.0"
    util_samples: list[tuple[int, int]] = field(default_factory=list)  # (timestamp us, %)
    util_rate: int = 50
    # the driver's own sample buffer: a sample at util_rate every this many us (None: only
    # util_samples, as scripted)
    util_sample_period_us: int | None = None
    memory_used: int = 10 * 1024**3
    memory_total: int = 81559 * 1024**2
    memory_reserved: int = 512 * 1024**2  # the driver's; v1's "used" counts it, v2's does not
    power_mw: int = 350_000
    power_limit_mw: int = 700_000
    energy_mj: int = 1_000_000
    temperature: int = 55
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    pcie_gen: int = 5  # current link: trains down when idle
    pcie_width: int = 16
    pcie_gen_max: int = 5  # GPU and system
    pcie_gen_gpu_max: int = 5  # the GPU alone
    pcie_width_max: int = 16
    pcie_rx_bytes: int = 0
    pcie_tx_bytes: int = 0
    pcie_counter_type: int = ULONGLONG  # UINT: a 32-bit counter that wraps
    pcie_replays: int = 0
    pcie_rx_kbs: int = 1000
    pcie_tx_kbs: int = 500
    clock_events_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("sw_power_cap", "sync_boost", *_CLOCK_EVENTS), 0))
    violation_ns: dict[str, int] = field(default_factory=dict)
    # nvmlDeviceGetCurrentClocksEventReasons' bitmask (nvmlClocksEventReason*), None: not
    # supported
    clock_event_reasons: int | None = None
    # power smoothing (Blackwell-era field values): preset number, percent, mW/s
    power_smoothing: dict[str, int] = field(default_factory=lambda: {
        "enabled": 1, "active_preset": 2, "admin_percent_tmp_floor": 40,
        "admin_ramp_up_rate": 5000, "priv_lvl": 0, "imm_ramp_down": 1})
    gpm: dict[str, float] | None = None  # None: GPM not supported (before Hopper)
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes|None)
    # the driver's per-process utilisation samples: (timestamp us, pid, SM %, memory %)
    process_samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    process_samples_stale: bool = False  # also answers samples not newer than asked (nvtop#110)
    errors: dict[str, int] = field(default_factory=dict)  # C function -> return code
    field_errors: dict[int, int] = field(default_factory=dict)
    lost: bool = False  # every call answers GPU_IS_LOST
    reset_required: bool = False  # every call answers RESET_REQUIRED
    delay_s: float = 0.0  # every call on this GPU blocks this long (a slow GPU)
    hold: threading.Event | None = None  # every call on this GPU waits for it (a hung GPU)
    mig: list[FakeGpu] | None = None  # MIG devices while MIG mode is on
    nvlink_present: int = 0  # NVML_FI_DEV_NVLINK_LINK_COUNT
    nvlink_down: set[int] = field(default_factory=set)  # present links not active
    nvlink_speed_mbps: int = 26_562
    nvlink_rx_kib: int | None = 0  # None: the throughput fields are not supported
    nvlink_tx_kib: int | None = 0
    ecc_volatile: dict[int, int] | None = field(default_factory=lambda: {0: 0, 1: 0})
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # None: pre-Ampere
    retired_pages: dict[int, list[int]] | None = None  # None: Ampere and newer
    retired_pending: int = 0
    pstate: int = 0  # nvmlPstates_t: 0 (P0) to 15, 32 NVML_PSTATE_UNKNOWN
    gpu_instance_id: int = 0
    parent: FakeGpu | None = None

    @property
    def pids(self) -> list[int]:
        return [p for p, _ in self.processes]


# -- the four models, from public nvidia-smi -q outputs ----------------------------------------

def h100_sxm(i: int = 0, **kw: Any) -> FakeGpu:
    """An H100 SXM5 80GB on NVLink 4. Name, 700 W limit, 81559 MiB and P0 (idle too): the
    nvidia-smi table in NVIDIA/nccl#1264 (driver 550.54.15); max clocks SM 1980 MHz, memory
    2619 MHz: nvidia-smi -q in NVIDIA/DCGM#120; 18 NVLinks (NV18): nvidia-smi topo -m in
    bytedance/flux#14, 26.562 GB/s a link and direction (nvidia-smi nvlink -s); PCIe Gen5 x16
    (the SXM5 board's host link)."""
    values: dict[str, Any] = dict(
        uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd", name="NVIDIA H100 80GB HBM3",
        bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", power_limit_mw=700_000,
        memory_total=81559 * 1024**2, sm_clock_mhz=1980, mem_clock_mhz=2619, pcie_gen=5,
        pcie_width=16, pcie_gen_max=5, pcie_gen_gpu_max=5, pcie_width_max=16,
        nvlink_present=18, nvlink_speed_mbps=26_562, remapped_rows=(0, 0, 0, 0),
        gpm={"graphics_util": 71.0, "sm_util": 62.0, "sm_occupancy": 31.0, "tensor_util": 12.5,
             "dram_bw_util": 40.0, "pcie_rx_mib_s": 100.0, "pcie_tx_mib_s": 10.0,
             "nvlink_rx_mib_s": 2048.0, "nvlink_tx_mib_s": 1024.0})
    values.update(kw)
    return FakeGpu(**values)


def h200_vm(i: int = 0, **kw: Any) -> FakeGpu:
    """An H200 as the GPU proof met it in a lent VM (tests/data/gpu/preflight.json, driver
    580.159.04): "NVIDIA H200", 143771 MiB, 700 W, PCIe Gen5 x16 at 00:06.0, GPM; its PCIe byte
    counters are 32-bit (field valueType unsigned int: the sampler takes GPM's PCIe rates);
    no NVLink (the link-count field and every link's state answer NOT_SUPPORTED); the
    clock-event reasons bitmask answers (1, GPU_IDLE, at rest); the utilisation sample buffer
    always holds samples (the driver's ~1/6 s samples, idle ones too)."""
    values: dict[str, Any] = dict(
        uuid=f"GPU-{i:08x}-c5c5-549a-60f8-80f9b2155111", name="NVIDIA H200",
        bus_id=f"00000000:{0x06 + i:02X}:00.0", power_limit_mw=700_000, power_mw=78_473,
        memory_total=143771 * 1024**2, memory_used=3 * 1024**2, memory_reserved=0,
        util_rate=0, util_sample_period_us=166_667,
        temperature=33, sm_clock_mhz=1980, mem_clock_mhz=3201, pcie_gen=5, pcie_width=16,
        pcie_gen_max=5, pcie_gen_gpu_max=5, pcie_width_max=16, pcie_counter_type=UINT,
        nvlink_present=0, field_errors={91: NOT_SUPPORTED},
        errors={"nvmlDeviceGetNvLinkState": NOT_SUPPORTED}, clock_event_reasons=1,
        remapped_rows=(0, 0, 0, 0),
        gpm={"graphics_util": 0.0, "sm_util": 0.0, "sm_occupancy": 0.0, "tensor_util": 0.0,
             "dram_bw_util": 0.0, "pcie_rx_mib_s": 2.7, "pcie_tx_mib_s": 3.3,
             "nvlink_rx_mib_s": 0.0, "nvlink_tx_mib_s": 0.0})
    values.update(kw)
    return FakeGpu(**values)


def a100_sxm4_mig(i: int = 0, **kw: Any) -> FakeGpu:
    """An A100-SXM4-40GB in MIG mode as 3g.20gb + 2g.10gb + 1g.5gb. Name: nvidia-smi -a in
    NVIDIA/k8s-device-plugin#343; 400 W limit, max clocks SM 1410 MHz, memory 1215 MHz:
    nvidia-smi -q in NVIDIA/nvidia-docker#1648; 40536 MiB and utilisation N/A in MIG mode:
    nvidia-smi -q in NVIDIA/nvidia-docker#1473; PCIe Gen4 x16, 12 NVLink 3 links of 25 GB/s a
    direction (NVIDIA's A100 datasheet: 600 GB/s over 12 links). No GPM (Hopper and newer)."""
    parent_uuid = f"GPU-{i:08x}-a100-4000-8000-000000000000"
    profiles = [("3g.20gb", 1, 20 * 1024), ("2g.10gb", 5, 10 * 1024), ("1g.5gb", 13, 5 * 1024)]
    mig = [FakeGpu(uuid=f"MIG-{i:08x}-{gi:04x}-4000-8000-{n:012x}",
                   name=f"NVIDIA A100-SXM4-40GB MIG {profile}", gpu_instance_id=gi,
                   memory_total=mib * 1024**2, memory_used=mib * 1024**2 // 4,
                   memory_reserved=0)
           for n, (profile, gi, mib) in enumerate(profiles)]
    values: dict[str, Any] = dict(
        uuid=parent_uuid, name="NVIDIA A100-SXM4-40GB", bus_id=f"00000000:{0x07 + i:02X}:00.0",
        power_limit_mw=400_000, memory_total=40536 * 1024**2, sm_clock_mhz=1410,
        mem_clock_mhz=1215, pcie_gen=4, pcie_width=16, pcie_gen_max=4, pcie_gen_gpu_max=4,
        pcie_width_max=16, nvlink_present=12, nvlink_speed_mbps=25_000, mig=mig,
        remapped_rows=(0, 0, 0, 0))
    values.update(kw)
    return FakeGpu(**values)


def l4(i: int = 0, **kw: Any) -> FakeGpu:
    """An L4 on PCIe: max clocks SM 2040 MHz, memory 6251 MHz: dcgmi stats in NVIDIA/DCGM#268;
    72 W, 24 GB (23034 MiB usable), PCIe Gen4 x16, no NVLink: NVIDIA's L4 datasheet."""
    values: dict[str, Any] = dict(
        uuid=f"GPU-{i:08x}-1400-4000-8000-000000000000", name="NVIDIA L4",
        bus_id=f"00000000:{0x3B + i:02X}:00.0", power_limit_mw=72_000, power_mw=40_000,
        memory_total=23034 * 1024**2, sm_clock_mhz=2040, mem_clock_mhz=6251, pcie_gen=4,
        pcie_width=16, pcie_gen_max=4, pcie_gen_gpu_max=4, pcie_width_max=16,
        nvlink_present=0, remapped_rows=(0, 0, 0, 0))
    values.update(kw)
    return FakeGpu(**values)


def v100_sxm2(i: int = 0, **kw: Any) -> FakeGpu:
    """A Tesla V100-SXM2-32GB (Volta: retired pages, no row remapper, no GPM). Name, 300 W limit,
    max clocks SM 1530 MHz, memory 877 MHz: nvidia-smi -q in NVIDIA/nvidia-docker#1076; 32510 MiB,
    PCIe Gen3 x16, six NVLink 2 links of 25 GB/s a direction (open-mpi/hwloc#574)."""
    values: dict[str, Any] = dict(
        uuid=f"GPU-{i:08x}-0100-4000-8000-000000000000", name="Tesla V100-SXM2-32GB",
        bus_id=f"00000000:{0x1A + i:02X}:00.0", power_limit_mw=300_000, power_mw=56_580,
        memory_total=32510 * 1024**2, sm_clock_mhz=1530, mem_clock_mhz=877, pcie_gen=3,
        pcie_width=16, pcie_gen_max=3, pcie_gen_gpu_max=3, pcie_width_max=16,
        nvlink_present=6, nvlink_speed_mbps=25_000, remapped_rows=None,
        retired_pages={0: [], 1: []}, clock_events_ns={}, violation_ns={
            "sw_power_cap": 0, "sw_thermal_slowdown": 0, "sync_boost": 0})
    values.update(kw)
    return FakeGpu(**values)


# -- the driver --------------------------------------------------------------------------------

def _int(arg: Any) -> int:
    return int(arg) if isinstance(arg, int) else int(arg.value)


def _address(arg: Any) -> int:
    """The address a pointer argument points at (byref(x), pointer(x), an array, a handle)."""
    if arg is None:
        return 0
    obj = getattr(arg, "_obj", None)  # byref(x)
    if obj is not None:
        return addressof(obj)
    if isinstance(arg, ctypes._Pointer):
        return ctypes.cast(arg, c_void_p).value or 0
    if isinstance(arg, c_void_p):
        return arg.value or 0
    return addressof(arg)


def _write(arg: Any, cvalue: Any) -> None:
    """Write ``cvalue``'s bytes where ``arg`` points, as the C driver does."""
    ctypes.memmove(_address(arg), addressof(cvalue), sizeof(cvalue))


def _read(arg: Any, ctype: type) -> Any:
    return ctype.from_address(_address(arg))


def _put_string(arg: Any, length: Any, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > _int(length):
        return INSUFFICIENT_SIZE
    ctypes.memmove(_address(arg), data + b"\0", len(data) + 1)
    return SUCCESS


class _Symbol:
    """A C function of the fake library; the binding may set restype/argtypes on it."""

    def __init__(self, driver: FakeDriver, name: str, impl: Callable[..., int]) -> None:
        self.driver, self.__name__, self.impl = driver, name, impl
        self.restype: Any = c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        return self.driver._enter(self.__name__, self.impl, args)


class _Library:
    """What ``CDLL("libnvidia-ml.so.1")`` returns: the symbols this driver version has."""

    def __init__(self, driver: FakeDriver) -> None:
        self._driver = driver

    def __getattr__(self, name: str) -> _Symbol:
        if name.startswith("_") or not self._driver.has_symbol(name):
            raise AttributeError(name)
        return _Symbol(self._driver, name, getattr(self._driver, "_c_" + name))


_binding_ids = itertools.count()


def load_binding(library: Any) -> Any:
    """A fresh copy of the installed ``pynvml`` module whose library load returns ``library``:
    its own module state, so drivers of several tests never share a loaded library."""
    origin = importlib.util.find_spec("pynvml").origin
    name = f"_pynvml_under_fake_driver_{next(_binding_ids)}"
    spec = importlib.util.spec_from_file_location(name, origin)
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[name] = module  # its error classes are built from sys.modules[__name__]
    spec.loader.exec_module(module)
    module.CDLL = lambda path, *args, **kwargs: library
    return module


def install(driver: FakeDriver, module: Any) -> None:
    """Put ``driver`` under an already imported ``pynvml`` module (the global one): its library
    load returns the driver and its function-pointer cache is emptied. Tests undo it with
    monkeypatch."""
    module.CDLL = lambda path, *args, **kwargs: driver.library
    module.nvmlLib = None
    module._nvmlGetFunctionPointer_cache.clear()


class FakeDriver:
    """An NVML driver of a given version over scripted devices; ``binding`` is the real pynvml
    module loaded over it.

    ``calls`` counts the C calls per symbol (a two-pass list call counts once). ``missing`` takes
    symbols away from this driver, ``init_error`` makes nvmlInit fail with that code. ``clock``
    (seconds) stamps GPM samples. ``privileged`` is a caller with the privileges nvml.h asks for
    the aggregated process list of a GPU in MIG mode. An Xid event (``events``: a GPU or a MIG
    device, and the Xid) reaches a waiting caller only where its GPU is registered now
    (:meth:`reset` drops a GPU's registrations, as a GPU reset does).
    """

    def __init__(self, gpus: list[FakeGpu], version: str = "590.48.01",
                 clock: Callable[[], float] = time.monotonic, init_error: int | None = None,
                 missing: tuple[str, ...] = (), privileged: bool = True) -> None:
        self.gpus = gpus
        self.privileged = privileged
        self.xid_registered: set[int] = set()  # id() of the GPUs registered for Xid events
        self.version = version
        self.branch = tuple(int(p) for p in version.split("."))
        self.clock = clock
        self.init_error = init_error
        self.missing = set(missing)
        self.calls: Counter[str] = Counter()
        self.events: queue.Queue[tuple[FakeGpu, int]] = queue.Queue()
        self.initialized = False
        self.in_flight = 0
        self.shutdown_while_busy: list[str] = []  # calls in flight when nvmlShutdown came
        self.gpm_allocated: set[int] = set()
        self._lock = threading.Lock()
        self._handles: dict[int, FakeGpu] = {}
        self._handle_of: dict[int, Any] = {}  # id(FakeGpu) -> its handle buffer
        self._gpm_samples: dict[int, tuple[ctypes.Array, dict | None, float]] = {}
        self._event_sets: dict[int, ctypes.Array] = {}
        for g in gpus:
            for m in g.mig or []:
                m.parent = g
        self.library = _Library(self)
        self.binding = load_binding(self.library)

    # -- the driver's identity -----------------------------------------------------------------
    @property
    def nvml_version(self) -> str:
        """What nvmlSystemGetNVMLVersion answers: the CUDA major, then the driver version."""
        return f"{13 if self.branch >= (580,) else 12}.{self.version}"

    def has_symbol(self, name: str) -> bool:
        if name in self.missing or not hasattr(self, "_c_" + name):
            return False
        return self.branch >= (SYMBOL_SINCE.get(name, 0),)

    # -- bookkeeping ---------------------------------------------------------------------------
    def handle(self, gpu: FakeGpu) -> int:
        """The address of ``gpu``'s opaque handle (stable until a MIG reconfiguration)."""
        key = id(gpu)
        if key not in self._handle_of:
            buf = ctypes.create_string_buffer(8)
            self._handle_of[key] = buf
            self._handles[addressof(buf)] = gpu
        return addressof(self._handle_of[key])

    def reconfigure_mig(self, parent: FakeGpu, instances: list[FakeGpu] | None) -> None:
        """Destroy ``parent``'s MIG devices and create ``instances``: the old handles go stale
        (INVALID_ARGUMENT), as after nvidia-smi mig -dci/-dgi/-cgi."""
        for old in parent.mig or []:
            buf = self._handle_of.pop(id(old), None)
            if buf is not None:
                self._handles.pop(addressof(buf), None)
        parent.mig = instances
        for m in instances or []:
            m.parent = parent

    def reset(self, gpu: FakeGpu) -> None:
        """``nvidia-smi -r``: the GPU's event registrations are gone."""
        self.xid_registered.discard(id(gpu))

    def _enter(self, name: str, impl: Callable[..., int], args: tuple) -> int:
        with self._lock:
            self.in_flight += 1
        try:
            return impl(*args)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def _dev(self, name: str, handle: Any) -> FakeGpu | int:
        """The device behind ``handle`` or the return code the call answers."""
        self._count(name)
        if not self.initialized:
            return UNINITIALIZED
        gpu = self._handles.get(_address(handle) if not isinstance(handle, int) else handle)
        if gpu is None:
            return INVALID_ARGUMENT  # a stale MIG handle, or garbage
        if gpu.delay_s:
            time.sleep(gpu.delay_s)
        if gpu.hold is not None:
            gpu.hold.wait(60.0)
        root = gpu.parent or gpu
        if root.lost or gpu.lost:
            return GPU_IS_LOST
        if root.reset_required:
            return RESET_REQUIRED
        if name in gpu.errors:
            return gpu.errors[name]
        if gpu.parent is not None and name not in MIG_DEVICE_CALLS:
            return NOT_SUPPORTED
        if gpu.mig is not None and name in MIG_PARENT_REFUSES:
            return NOT_SUPPORTED
        return gpu

    # -- library -------------------------------------------------------------------------------
    def _c_nvmlInitWithFlags(self, flags: Any) -> int:
        self._count("nvmlInit")
        if self.init_error is not None:
            return self.init_error
        self.initialized = True
        return SUCCESS

    def _c_nvmlInit_v2(self) -> int:
        return self._c_nvmlInitWithFlags(0)

    def _c_nvmlShutdown(self) -> int:
        self._count("nvmlShutdown")
        with self._lock:
            if self.in_flight > 1:  # this call is one of them
                self.shutdown_while_busy.append(f"{self.in_flight - 1} call(s)")
        self.initialized = False
        return SUCCESS

    def _c_nvmlErrorString(self, code: Any) -> bytes:
        return f"fake NVML error {_int(code)}".encode()

    def _c_nvmlSystemGetDriverVersion(self, buf: Any, length: Any) -> int:
        self._count("nvmlSystemGetDriverVersion")
        return _put_string(buf, length, self.version) if self.initialized else UNINITIALIZED

    def _c_nvmlSystemGetNVMLVersion(self, buf: Any, length: Any) -> int:
        self._count("nvmlSystemGetNVMLVersion")
        return _put_string(buf, length, self.nvml_version) if self.initialized \
            else UNINITIALIZED

    def _c_nvmlDeviceGetCount_v2(self, count: Any) -> int:
        self._count("nvmlDeviceGetCount")
        if not self.initialized:
            return UNINITIALIZED
        _write(count, c_uint(len(self.gpus)))
        return SUCCESS

    def _c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, out: Any) -> int:
        self._count("nvmlDeviceGetHandleByIndex")
        if not self.initialized:
            return UNINITIALIZED
        i = _int(index)
        if i >= len(self.gpus):
            return INVALID_ARGUMENT
        gpu = self.gpus[i]
        if gpu.lost:
            return GPU_IS_LOST
        _write(out, c_void_p(self.handle(gpu)))
        return SUCCESS

    # -- identity ------------------------------------------------------------------------------
    def _c_nvmlDeviceGetUUID(self, handle: Any, buf: Any, length: Any) -> int:
        g = self._dev("nvmlDeviceGetUUID", handle)
        return g if isinstance(g, int) else _put_string(buf, length, g.uuid)

    def _c_nvmlDeviceGetName(self, handle: Any, buf: Any, length: Any) -> int:
        g = self._dev("nvmlDeviceGetName", handle)
        return g if isinstance(g, int) else _put_string(buf, length, g.name)

    def _c_nvmlDeviceGetPciInfo_v3(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetPciInfo_v3", handle)
        if isinstance(g, int):
            return g
        root = g.parent or g
        info = _CPciInfo(busIdLegacy=root.bus_id[-12:].encode(), busId=root.bus_id.encode(),
                         pciDeviceId=0x233010DE)
        _write(out, info)
        return SUCCESS

    def _c_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        g = self._dev("nvmlDeviceGetMigMode", handle)
        if isinstance(g, int):
            return g
        if g.mig is None and g.name.startswith(("Tesla V100", "NVIDIA L4")):
            return NOT_SUPPORTED  # no MIG on Volta or Ada
        mode = 1 if g.mig is not None else 0
        _write(current, c_uint(mode))
        _write(pending, c_uint(mode))
        return SUCCESS

    def _c_nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetMaxMigDeviceCount", handle)
        if isinstance(g, int):
            return g
        _write(out, c_uint(7 if g.mig is not None else 0))
        return SUCCESS

    def _c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if isinstance(g, int):
            return g
        j = _int(index)
        if g.mig is None:
            return INVALID_ARGUMENT
        if j >= len(g.mig):
            return NOT_FOUND
        _write(out, c_void_p(self.handle(g.mig[j])))
        return SUCCESS

    def _c_nvmlDeviceGetGpuInstanceId(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetGpuInstanceId", handle)
        if isinstance(g, int):
            return g
        if g.parent is None:
            return INVALID_ARGUMENT  # not a MIG device handle
        _write(out, c_uint(g.gpu_instance_id))
        return SUCCESS

    # -- readings ------------------------------------------------------------------------------
    def _util_samples(self, g: FakeGpu) -> list[tuple[int, int]]:
        """The scripted samples, or with ``util_sample_period_us`` the driver's buffer as a real
        one keeps it: a sample at ``util_rate`` every period up to now, the last 100."""
        if not g.util_sample_period_us:
            return g.util_samples
        period, now = g.util_sample_period_us, int(self.clock() * 1e6)
        last = now - now % period
        return [(last - k * period, g.util_rate) for k in range(99, -1, -1)]

    def _c_nvmlDeviceGetSamples(self, handle: Any, kind: Any, last: Any, value_type: Any,
                                count: Any, samples: Any) -> int:
        name = "nvmlDeviceGetSamples"
        g = self._dev(name, handle) if samples is None else self._handles.get(_address(handle))
        if samples is not None:
            pass  # the fill pass of one binding call: counted once
        if isinstance(g, int) or g is None:
            return g if isinstance(g, int) else INVALID_ARGUMENT
        fresh = [(ts, v) for ts, v in self._util_samples(g) if ts > _int(last)]
        if not fresh:
            return NOT_FOUND
        _write(value_type, c_uint(UINT))
        if samples is None:
            _write(count, c_uint(len(fresh)))
            return SUCCESS
        room = _read(count, c_uint).value
        base = _address(samples)
        for n, (ts, v) in enumerate(fresh[:room]):
            s = _CSample(timeStamp=ts)
            s.sampleValue.uiVal = v
            ctypes.memmove(base + n * sizeof(_CSample), addressof(s), sizeof(_CSample))
        _write(count, c_uint(min(room, len(fresh))))
        return SUCCESS

    def _c_nvmlDeviceGetUtilizationRates(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetUtilizationRates", handle)
        if isinstance(g, int):
            return g
        _write(out, _CUtilization(gpu=g.util_rate, memory=g.util_rate // 2))
        return SUCCESS

    def _c_nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetMemoryInfo", handle)
        if isinstance(g, int):
            return g
        used = g.memory_used + g.memory_reserved
        _write(out, _CMemory(total=g.memory_total, free=g.memory_total - used, used=used))
        return SUCCESS

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetMemoryInfo_v2", handle)
        if isinstance(g, int):
            return g
        if _read(out, c_uint).value != MEMORY_V2:
            return ARGUMENT_VERSION_MISMATCH
        _write(out, _CMemoryV2(version=MEMORY_V2, total=g.memory_total, used=g.memory_used,
                               reserved=g.memory_reserved,
                               free=g.memory_total - g.memory_used - g.memory_reserved))
        return SUCCESS

    def _uint_out(self, name: str, handle: Any, out: Any, read: Callable[[FakeGpu], int | None],
                  ctype: type = c_uint) -> int:
        g = self._dev(name, handle)
        if isinstance(g, int):
            return g
        value = read(g)
        if value is None:
            return NOT_SUPPORTED
        _write(out, ctype(value))
        return SUCCESS

    def _c_nvmlDeviceGetPowerUsage(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetPowerUsage", handle, out, lambda g: g.power_mw)

    def _c_nvmlDeviceGetPerformanceState(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetPerformanceState", handle, out, lambda g: g.pstate)

    def _c_nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetEnforcedPowerLimit", handle, out,
                              lambda g: g.power_limit_mw)

    def _c_nvmlDeviceGetTotalEnergyConsumption(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetTotalEnergyConsumption", handle, out,
                              lambda g: g.energy_mj, c_ulonglong)

    def _c_nvmlDeviceGetTemperature(self, handle: Any, sensor: Any, out: Any) -> int:
        if _int(sensor) != 0:
            self._count("nvmlDeviceGetTemperature")
            return INVALID_ARGUMENT
        return self._uint_out("nvmlDeviceGetTemperature", handle, out, lambda g: g.temperature)

    def _c_nvmlDeviceGetTemperatureV(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetTemperatureV", handle)
        if isinstance(g, int):
            return g
        request = _read(out, _CTemperatureV1)
        if request.version != TEMPERATURE_V1:
            return ARGUMENT_VERSION_MISMATCH
        if request.sensorType != 0:
            return INVALID_ARGUMENT
        _write(out, _CTemperatureV1(version=TEMPERATURE_V1, sensorType=0,
                                    temperature=g.temperature))
        return SUCCESS

    def _c_nvmlDeviceGetClockInfo(self, handle: Any, clock: Any, out: Any) -> int:
        kind = _int(clock)
        return self._uint_out("nvmlDeviceGetClockInfo", handle, out,
                              lambda g: g.sm_clock_mhz if kind == CLOCK_SM else g.mem_clock_mhz)

    def _c_nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetCurrPcieLinkGeneration", handle, out,
                              lambda g: g.pcie_gen)

    def _c_nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetCurrPcieLinkWidth", handle, out,
                              lambda g: g.pcie_width)

    def _c_nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetMaxPcieLinkGeneration", handle, out,
                              lambda g: g.pcie_gen_max)

    def _c_nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetGpuMaxPcieLinkGeneration", handle, out,
                              lambda g: g.pcie_gen_gpu_max)

    def _c_nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetMaxPcieLinkWidth", handle, out,
                              lambda g: g.pcie_width_max)

    def _c_nvmlDeviceGetPcieThroughput(self, handle: Any, counter: Any, out: Any) -> int:
        rx = _int(counter) == PCIE_UTIL_RX
        return self._uint_out("nvmlDeviceGetPcieThroughput", handle, out,
                              lambda g: g.pcie_rx_kbs if rx else g.pcie_tx_kbs)

    def _c_nvmlDeviceGetNvLinkState(self, handle: Any, link: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetNvLinkState", handle)
        if isinstance(g, int):
            return g
        n = _int(link)
        if g.nvlink_present == 0:
            return NOT_SUPPORTED
        if n >= g.nvlink_present:
            return INVALID_ARGUMENT
        _write(out, c_uint(0 if n in g.nvlink_down else 1))  # nvmlEnableState_t
        return SUCCESS

    def _field(self, g: FakeGpu, fid: int, scope: int) -> tuple[int, int, float]:
        """(return code, value type, value) of one field for device ``g``."""
        if fid in g.field_errors:
            return g.field_errors[fid], ULONGLONG, 0
        meaning = field_meaning(self.branch, fid)
        if meaning is None:
            return INVALID_ARGUMENT, ULONGLONG, 0
        kind, key = meaning
        value: float | None = None
        vtype = ULONGLONG
        if kind == "clock_event":
            value = g.clock_events_ns.get(key)
        elif kind == "perf_policy":
            value = g.violation_ns.get("sw_thermal_slowdown")
        elif kind == "pcie":
            raw = g.pcie_rx_bytes if key == "rx_bytes" else g.pcie_tx_bytes
            vtype = g.pcie_counter_type
            value = raw % (2**32) if vtype == UINT else raw
        elif kind == "pcie_replay":
            value, vtype = g.pcie_replays, UINT
        elif kind == "power_smoothing":
            value, vtype = g.power_smoothing.get(key), UINT
        elif kind == "nvlink":
            if g.nvlink_present == 0:
                value = 0 if key == "present" else None
            elif key == "present":
                value, vtype = g.nvlink_present, UINT
            elif key == "speed_mbps":
                value, vtype = g.nvlink_speed_mbps, UINT
            else:
                assert scope == 0xFFFFFFFF, "the throughput counters are asked for all links"
                value = g.nvlink_rx_kib if key == "rx_kib" else g.nvlink_tx_kib
        if value is None:
            return NOT_SUPPORTED, vtype, 0
        return SUCCESS, vtype, value

    def _c_nvmlDeviceGetFieldValues(self, handle: Any, count: Any, values: Any) -> int:
        g = self._dev("nvmlDeviceGetFieldValues", handle)
        if isinstance(g, int):
            return g
        base = _address(values)
        now_us = int(self.clock() * 1e6)
        for n in range(_int(count)):
            fv = _CFieldValue.from_address(base + n * sizeof(_CFieldValue))
            self.calls[f"field:{fv.fieldId}"] += 1
            ret, vtype, value = self._field(g, fv.fieldId, fv.scopeId)
            fv.nvmlReturn, fv.valueType, fv.timestamp, fv.latencyUsec = ret, vtype, now_us, 0
            if ret == SUCCESS:
                setattr(fv.value, _UNION_MEMBER[vtype], value)
        return SUCCESS

    def _c_nvmlDeviceGetTotalEccErrors(self, handle: Any, kind: Any, counter: Any,
                                       out: Any) -> int:
        assert _int(counter) == 0, "volatile counts are asked"
        t = _int(kind)
        return self._uint_out("nvmlDeviceGetTotalEccErrors", handle, out,
                              lambda g: None if g.ecc_volatile is None else g.ecc_volatile[t],
                              c_ulonglong)

    def _c_nvmlDeviceGetRemappedRows(self, handle: Any, *outs: Any) -> int:
        g = self._dev("nvmlDeviceGetRemappedRows", handle)
        if isinstance(g, int):
            return g
        if g.remapped_rows is None:
            return NOT_SUPPORTED
        for out, value in zip(outs, g.remapped_rows, strict=True):
            _write(out, c_uint(value))
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPages(self, handle: Any, cause: Any, count: Any,
                                     addresses: Any) -> int:
        g = self._dev("nvmlDeviceGetRetiredPages", handle) if addresses is None \
            else self._handles.get(_address(handle))
        if isinstance(g, int) or g is None:
            return g if isinstance(g, int) else INVALID_ARGUMENT
        if g.retired_pages is None:
            return NOT_SUPPORTED
        pages = g.retired_pages.get(_int(cause), [])
        room = _read(count, c_uint).value
        _write(count, c_uint(len(pages)))
        if addresses is None or room < len(pages):
            return SUCCESS if not pages else INSUFFICIENT_SIZE
        base = _address(addresses)
        for n, page in enumerate(pages):
            c_ulonglong.from_address(base + 8 * n).value = page
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetRetiredPagesPendingStatus", handle, out,
                              lambda g: None if g.retired_pages is None else g.retired_pending)

    def _c_nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetCurrentClocksEventReasons", handle, out,
                              lambda g: g.clock_event_reasons, ctype=c_ulonglong)

    def _c_nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any, out: Any) -> int:
        return self._uint_out("nvmlDeviceGetCurrentClocksThrottleReasons", handle, out,
                              lambda g: g.clock_event_reasons, ctype=c_ulonglong)

    def _c_nvmlDeviceGetViolationStatus(self, handle: Any, policy: Any, out: Any) -> int:
        g = self._dev("nvmlDeviceGetViolationStatus", handle)
        if isinstance(g, int):
            return g
        key = PERF_POLICIES.get(_int(policy))
        if key not in g.violation_ns:
            return NOT_SUPPORTED
        _write(out, _CViolationTime(referenceTime=int(self.clock() * 1e6),
                                    violationTime=g.violation_ns[key]))
        return SUCCESS

    def _processes(self, name: str, handle: Any, count: Any, infos: Any) -> int:
        g = self._dev(name, handle) if infos is None else self._handles.get(_address(handle))
        if isinstance(g, int) or g is None:
            return g if isinstance(g, int) else INVALID_ARGUMENT
        if g.mig is not None and not self.privileged:
            return NO_PERMISSION  # nvml.h: a MIG-mode GPU's aggregate only with privileges
        owners = [(p, used, m.gpu_instance_id) for m in (g.mig or []) for p, used in m.processes]
        procs = [(p, used, g.gpu_instance_id if g.parent else 0xFFFFFFFF)
                 for p, used in g.processes] + owners
        room = _read(count, c_uint).value
        _write(count, c_uint(len(procs)))
        if not procs:
            return SUCCESS
        if infos is None or room < len(procs):
            return INSUFFICIENT_SIZE
        base = _address(infos)
        for n, (pid, used, gi) in enumerate(procs):
            info = _CProcessInfo(pid=pid, usedGpuMemory=VALUE_NOT_AVAILABLE if used is None
                                 else used, gpuInstanceId=gi,
                                 computeInstanceId=0 if gi != 0xFFFFFFFF else gi)
            ctypes.memmove(base + n * sizeof(_CProcessInfo), addressof(info), sizeof(info))
        return SUCCESS

    def _c_nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any,
                                                   infos: Any) -> int:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", handle, count, infos)

    def _c_nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any, count: Any,
                                                   infos: Any) -> int:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle, count, infos)

    def _process_samples(self, g: FakeGpu, last_seen: int) -> list[tuple[int, int, int, int]]:
        return [x for x in g.process_samples if x[0] > last_seen or g.process_samples_stale]

    def _c_nvmlDeviceGetProcessUtilization(self, handle: Any, utilization: Any, count: Any,
                                           last_seen: Any) -> int:
        name = "nvmlDeviceGetProcessUtilization"  # the fill pass of one binding call: not counted
        g = self._dev(name, handle) if utilization is None \
            else self._handles.get(_address(handle))
        if isinstance(g, int) or g is None:
            return g if isinstance(g, int) else INVALID_ARGUMENT
        fresh = self._process_samples(g, _int(last_seen))
        if not fresh:
            return NOT_FOUND  # nvml.h: "If no valid sample entries are found"
        if utilization is None:
            _write(count, c_uint(len(fresh)))
            return INSUFFICIENT_SIZE
        written = fresh[:_read(count, c_uint).value]
        base = _address(utilization)
        for n, (ts, pid, sm, mem) in enumerate(written):
            x = _CProcessUtilizationSample(pid=pid, timeStamp=ts, smUtil=sm, memUtil=mem)
            ctypes.memmove(base + n * sizeof(x), addressof(x), sizeof(x))
        _write(count, c_uint(len(written)))
        return SUCCESS

    def _c_nvmlDeviceGetProcessesUtilizationInfo(self, handle: Any, info: Any) -> int:
        head = _read(info, _CProcessesUtilizationInfoV1)
        name = "nvmlDeviceGetProcessesUtilizationInfo"
        g = self._dev(name, handle) if not head.procUtilArray \
            else self._handles.get(_address(handle))
        if isinstance(g, int) or g is None:
            return g if isinstance(g, int) else INVALID_ARGUMENT
        if head.version != PROCESSES_UTILIZATION_V1:
            return ARGUMENT_VERSION_MISMATCH
        fresh = self._process_samples(g, head.lastSeenTimeStamp)
        if not head.procUtilArray:  # the sizing call: INSUFFICIENT_SIZE, with or without any
            head.processSamplesCount = len(fresh)
            return INSUFFICIENT_SIZE
        if not fresh:
            return NOT_FOUND
        if head.processSamplesCount < len(fresh):
            head.processSamplesCount = len(fresh)  # the minimum array size
            return INSUFFICIENT_SIZE
        for n, (ts, pid, sm, mem) in enumerate(fresh):
            x = _CProcessUtilizationInfoV1(timeStamp=ts, pid=pid, smUtil=sm, memUtil=mem)
            ctypes.memmove(head.procUtilArray + n * sizeof(x), addressof(x), sizeof(x))
        head.processSamplesCount = len(fresh)
        return SUCCESS

    # -- GPM -----------------------------------------------------------------------------------
    def _c_nvmlGpmQueryDeviceSupport(self, handle: Any, out: Any) -> int:
        g = self._dev("nvmlGpmQueryDeviceSupport", handle)
        if isinstance(g, int):
            return g
        if _read(out, _CGpmSupport).version != 1:  # NVML_GPM_SUPPORT_VERSION
            return ARGUMENT_VERSION_MISMATCH
        supported = (g.parent or g).gpm is not None  # a MIG device: its GPU's answer
        _write(out, _CGpmSupport(version=1, isSupportedDevice=int(supported)))
        return SUCCESS

    def _c_nvmlGpmSampleAlloc(self, out: Any) -> int:
        self._count("nvmlGpmSampleAlloc")
        if not self.initialized:
            return UNINITIALIZED
        buf = ctypes.create_string_buffer(16)
        self._gpm_samples[addressof(buf)] = (buf, None, 0.0)
        self.gpm_allocated.add(addressof(buf))
        _write(out, c_void_p(addressof(buf)))
        return SUCCESS

    def _c_nvmlGpmSampleFree(self, sample: Any) -> int:
        self._count("nvmlGpmSampleFree")
        address = _address(sample)
        if address not in self.gpm_allocated:
            return INVALID_ARGUMENT
        self.gpm_allocated.discard(address)
        return SUCCESS

    def _take_sample(self, sample: Any, values: dict | None) -> int:
        address = _address(sample)
        if address not in self.gpm_allocated:
            return INVALID_ARGUMENT
        buf = self._gpm_samples[address][0]
        self._gpm_samples[address] = (buf, dict(values or {}), self.clock())
        return SUCCESS

    def _c_nvmlGpmSampleGet(self, handle: Any, sample: Any) -> int:
        g = self._dev("nvmlGpmSampleGet", handle)
        if isinstance(g, int):
            return g
        if g.parent is not None and g.parent.gpm is None:
            return NOT_SUPPORTED  # a MIG device of a GPU without GPM (an A100)
        if g.gpm is None:
            return NOT_SUPPORTED
        return self._take_sample(sample, g.gpm)

    def _c_nvmlGpmMigSampleGet(self, handle: Any, gpu_instance: Any, sample: Any) -> int:
        g = self._dev("nvmlGpmMigSampleGet", handle)
        if isinstance(g, int):
            return g
        if g.gpm is None:
            return NOT_SUPPORTED
        gi = _int(gpu_instance)
        mig = next((m for m in g.mig or [] if m.gpu_instance_id == gi), None)
        if mig is None:
            return INVALID_ARGUMENT
        return self._take_sample(sample, mig.gpm)

    def _c_nvmlGpmMetricsGet(self, request: Any) -> int:
        self._count("nvmlGpmMetricsGet")
        head = _read(request, _CGpmMetricsGetHead)
        if head.version != 1:  # NVML_GPM_METRICS_GET_VERSION
            return ARGUMENT_VERSION_MISMATCH
        first = self._gpm_samples.get(head.sample1 or 0)
        second = self._gpm_samples.get(head.sample2 or 0)
        if first is None or second is None or first[1] is None or second[1] is None:
            return INVALID_ARGUMENT
        if abs(second[2] - first[2]) < GPM_MIN_INTERVAL_S:
            return INVALID_ARGUMENT  # the hardware counters have not moved far enough
        base = _address(request) + sizeof(_CGpmMetricsGetHead)
        for n in range(head.numMetrics):
            m = _CGpmMetric.from_address(base + n * sizeof(_CGpmMetric))
            key = GPM_METRICS.get(m.metricId)
            if key in second[1]:
                m.nvmlReturn, m.value = SUCCESS, float(second[1][key])
            else:
                m.nvmlReturn = NOT_SUPPORTED
        return SUCCESS

    # -- events --------------------------------------------------------------------------------
    def _c_nvmlEventSetCreate(self, out: Any) -> int:
        self._count("nvmlEventSetCreate")
        buf = ctypes.create_string_buffer(8)
        self._event_sets[addressof(buf)] = buf
        _write(out, c_void_p(addressof(buf)))
        return SUCCESS

    def _c_nvmlDeviceRegisterEvents(self, handle: Any, types: Any, event_set: Any) -> int:
        g = self._dev("nvmlDeviceRegisterEvents", handle)
        if isinstance(g, int):
            return g
        if g.parent is not None:
            return NOT_SUPPORTED  # events are the GPU's, with the GPU instance in their data
        self.xid_registered.add(id(g))
        return SUCCESS

    def _c_nvmlEventSetWait_v2(self, event_set: Any, out: Any, timeout_ms: Any) -> int:
        self._count("nvmlEventSetWait_v2")
        deadline = time.monotonic() + _int(timeout_ms) / 1000.0
        while True:
            try:
                gpu, xid = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return TIMEOUT
            root = gpu.parent or gpu
            if id(root) in self.xid_registered:
                break  # an event of a GPU not registered now is never delivered
        gi = gpu.gpu_instance_id if gpu.parent is not None else 0xFFFFFFFF
        _write(out, _CEventData(device=self.handle(root), eventType=XID_EVENT, eventData=xid,
                                gpuInstanceId=gi, computeInstanceId=0 if gpu.parent else gi))
        return SUCCESS

    def _c_nvmlEventSetFree(self, event_set: Any) -> int:
        self._count("nvmlEventSetFree")
        return SUCCESS if self._event_sets.pop(_address(event_set), None) is not None \
            else INVALID_ARGUMENT

