"""The one place that calls NVML.

Every NVML call of the project goes through :class:`Nvml`. It turns NVML's errors into
"not available" (``None``) values, remembers what a device does not support so it is never
asked again, logs a missing driver function once, and raises :class:`GpuLostError` when a GPU
has fallen off the bus so the caller can mark that GPU down and carry on with the others.

The ``pynvml`` module (from the ``nvidia-ml-py`` package) is imported lazily by :meth:`Nvml.init`:
importing this module does no NVML work. Tests pass the real binding loaded over a fake driver.

What a field ID means is asked of the *driver* (its NVML version), never of the binding's
constants: NVIDIA renumbered fields between NVML versions, and a binding newer or older than the
driver would ask for another quantity (:func:`clock_event_fields`).
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

# NVML return codes (stable across driver versions; duplicated here so that this module needs
# no pynvml import to classify an error).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_NO_DATA = 21

_NO_DRIVER = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "the NVML library (libnvidia-ml.so.1) was not found",
    NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "the NVML library and the kernel driver versions differ "
    "(reboot or reload the driver after an upgrade)",
    NVML_ERROR_NO_PERMISSION: "no permission to open /dev/nvidia* devices",
}
_LOST = {NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED}
# Errors that mean "nothing to report right now", not a fault worth a log line.
_QUIET = {NVML_ERROR_NOT_FOUND, NVML_ERROR_NO_DATA, NVML_ERROR_TIMEOUT}

# nvmlValueType_t -> the member of the c_nvmlValue_t union that holds it.
VALUE_MEMBER = {
    0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal",
}
VALUE_TYPE_UINT = 1  # NVML_VALUE_TYPE_UNSIGNED_INT: 32 bits
VALUE_TYPE_ULONGLONG = 3  # NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: 64 bits
# the width of an unsigned value type: where a counter of it wraps
VALUE_TYPE_MODULUS = {VALUE_TYPE_UINT: 2**32, VALUE_TYPE_ULONGLONG: 2**64, 6: 2**16}

# Field IDs whose meaning never moved (nvml.h from the 11.1 header, go-nvml 7dce688, to 13.3,
# 8b8585b); asked by number so that an old binding without the constant still gets them.
FI_PERF_POLICY_POWER = 74  # = NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP, ns
FI_PERF_POLICY_SYNC_BOOST = 76  # = NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST, ns
FI_NVLINK_SPEED_MBPS_COMMON = 90  # MB/s of each active link, per direction
FI_NVLINK_LINK_COUNT = 91  # links *present* on the device (not necessarily active)
FI_NVLINK_THROUGHPUT_DATA_TX = 138  # KiB, scope UINT_MAX: all links
FI_NVLINK_THROUGHPUT_DATA_RX = 139
FI_PCIE_COUNT_TX_BYTES = 197  # from the 12.5 header (driver 555): "Value can be wrapped"
FI_PCIE_COUNT_RX_BYTES = 198
# nvmlPerfPolicyType_t for nvmlDeviceGetViolationStatus, stable since NVML 4; the 12.9 header
# translates POWER to ..._SW_POWER_CAP, THERMAL to ..._SW_THERM_SLOWDOWN, SYNC_BOOST to
# ..._SYNC_BOOST.
PERF_POLICY_POWER, PERF_POLICY_THERMAL, PERF_POLICY_SYNC_BOOST = 0, 1, 2

# The clock-event counters NVIDIA numbered differently from one NVML version to the next, by
# the driver version (branch, minor) from which a numbering holds; None: not known to hold.
#   - before 575 (12.8 header, go-nvml f420a32; nvidia-ml-py 12.570.x): no such fields, and
#     251-268 are power-smoothing settings
#   - 575 (12.9 header, 62ce1e3; nvidia-ml-py 12.575.51) and 580.65 (13.0.39 header, 9da9e13;
#     nvidia-ml-py 13.580.65): SW thermal 251, HW thermal 252, HW power brake 253; 269-271 are
#     the power-smoothing preset, TMP floor percentage and ramp-up rate
#   - 580.66 to 580.81: no header or binding of these drivers was seen, so not trusted
#   - 580.82 (nvidia-ml-py 13.580.82 and 13.580.126) and 590 on (13.1 header, 2a1f6c3; 13.2.1,
#     2976179; 13.3, 8b8585b): 269, 270, 271, and 251-268 power smoothing again
CLOCK_EVENT_NUMBERING: tuple[tuple[tuple[int, ...], dict[str, int] | None], ...] = (
    ((0,), None),
    ((575,), {"sw_thermal_slowdown": 251, "hw_thermal_slowdown": 252,
              "hw_power_brake_slowdown": 253}),
    ((580, 66), None),
    ((580, 82), {"sw_thermal_slowdown": 269, "hw_thermal_slowdown": 270,
                 "hw_power_brake_slowdown": 271}),
)
SHUTDOWN_DRAIN_SECONDS = 5.0  # how long nvmlShutdown waits for calls still in the driver


def clock_event_fields(driver: tuple[int, ...] | None) -> dict[str, int]:
    """{reason label: field ID} of the version-dependent clock-event counters (nanoseconds) for
    a driver of version ``driver``; empty where the numbering is unknown or uncertain."""
    if not driver:
        return {}
    chosen: dict[str, int] | None = None
    for since, numbering in CLOCK_EVENT_NUMBERING:
        if driver >= since:
            chosen = numbering
    return dict(chosen or {})


def parse_driver_version(nvml_version: str, driver_version: str = "") -> tuple[int, ...] | None:
    """The driver's version as numbers from nvmlSystemGetNVMLVersion ("12.575.51.03": the CUDA
    major, then the driver version), else from nvmlSystemGetDriverVersion ("575.51.03")."""
    for text, skip in ((nvml_version, 1), (driver_version, 0)):
        parts = [int(p) for p in re.findall(r"\d+", text or "")]
        if skip and len(parts) >= 3 and parts[0] < 100:
            parts = parts[1:]
        elif skip:
            continue
        if parts and parts[0] >= 100:
            return tuple(parts)
    return None


class FieldValue(NamedTuple):
    """One NVML field's answer: the number and its nvmlValueType_t."""

    value: float
    value_type: int


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine (no driver, no library, no permission).
    ``no_driver``: there is no NVIDIA driver at all (a CPU node, by design), rather than one
    that fails."""

    def __init__(self, reason: str, no_driver: bool = False) -> None:
        super().__init__(reason)
        self.no_driver = no_driver


class GpuLostError(RuntimeError):
    """A GPU stopped answering (NVML_ERROR_GPU_IS_LOST): mark it down, retry it later."""


class StaleHandleError(GpuLostError):
    """NVML no longer knows a device handle (INVALID_ARGUMENT): a MIG device destroyed by a
    reconfiguration. The backend lists the MIG devices again."""


def error_code(exc: BaseException) -> int | None:
    """The NVML return code carried by a pynvml ``NVMLError``, or None for other exceptions."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class _TemperatureV1(ctypes.Structure):
    """nvmlTemperature_v1_t (the 12.8 header on), for bindings older than the call."""

    _fields_ = [("version", ctypes.c_uint), ("sensorType", ctypes.c_uint),
                ("temperature", ctypes.c_int)]


def _temperature_v(lib: Any) -> Any:
    """nvmlDeviceGetTemperatureV for a binding that lacks it (before nvidia-ml-py 12.570),
    through the binding's own symbol lookup: a driver without it raises FUNCTION_NOT_FOUND."""

    def call(handle: Any, sensor: int) -> int:
        request = _TemperatureV1(version=ctypes.sizeof(_TemperatureV1) | (1 << 24),
                                 sensorType=sensor)
        fn = lib._nvmlGetFunctionPointer("nvmlDeviceGetTemperatureV")
        ret = fn(handle, ctypes.byref(request))
        if ret != NVML_SUCCESS:
            raise lib.NVMLError(ret)
        return int(request.temperature)

    return call


# calls the exporter makes itself where the installed binding has no wrapper for them
_SHIMS = {"nvmlDeviceGetTemperatureV": _temperature_v}


class Nvml:
    """A thread-safe wrapper over a pynvml-shaped module.

    ``call(name, handle, *args, device=...)`` returns the function's result, or None when the
    value is not available. ``device`` is a stable key (index or UUID) under which
    NOT_SUPPORTED answers are cached, so that each (device, query) pair is asked once. Calls in
    flight are counted so that :meth:`shutdown` releases NVML only once they have returned.
    """

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._module = module
        self._lib: Any = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closing = False
        self._unsupported: set[Hashable] = set()
        self._missing_functions: set[str] = set()
        self._logged: set[Hashable] = set()
        self.initialized = False
        self.nvml_version = ""
        self.driver: tuple[int, ...] | None = None  # the driver's version, as numbers

    @property
    def lib(self) -> Any:
        """The underlying pynvml module (after :meth:`init`), for its constants and structs."""
        return self._lib

    def init(self) -> None:
        """Load pynvml and initialise NVML; raise :class:`NvmlUnavailable` with the reason."""
        if self.initialized:
            return
        lib: Any = self._module
        if lib is None:
            try:
                import pynvml  # nvidia-ml-py
                lib = pynvml
            except ImportError as exc:  # pragma: no cover - a dependency of the package
                raise NvmlUnavailable(f"the nvidia-ml-py package is not installed: {exc}") from exc
        try:
            lib.nvmlInit()
        except Exception as exc:
            code = error_code(exc)
            reason = _NO_DRIVER.get(code) if code is not None else None
            raise NvmlUnavailable(reason or f"nvmlInit failed: {exc}", no_driver=code in (
                NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED)) from exc
        self._lib = lib
        self._closing = False
        self.initialized = True
        self.nvml_version = _text(self.call("nvmlSystemGetNVMLVersion") or "")
        driver = _text(self.call("nvmlSystemGetDriverVersion") or "")
        self.driver = parse_driver_version(self.nvml_version, driver)
        log.debug("NVML %s, driver %s", self.nvml_version, driver)

    def shutdown(self, drain_seconds: float = SHUTDOWN_DRAIN_SECONDS) -> None:
        """Release NVML once the calls in flight have returned; safe to call twice.

        New calls are refused from here on. A call still inside the driver after
        ``drain_seconds`` (a hung GPU) keeps NVML loaded: shutting it down under that call is
        undefined behaviour in the driver, and the process is exiting anyway.
        """
        if not self.initialized:
            return
        deadline = time.monotonic() + drain_seconds
        with self._idle:
            self._closing = True
            while self._in_flight and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            busy = self._in_flight
            self.initialized = False
        if busy:
            log.warning("%d NVML call(s) still running after %.0fs: leaving NVML loaded", busy,
                        drain_seconds)
            return
        try:
            self._lib.nvmlShutdown()
        except Exception as exc:  # shutting down: nothing useful to do with the error
            log.debug("nvmlShutdown failed: %s", exc)

    def _log_once(self, key: Hashable, level: int, msg: str, *args: object) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.log(level, msg, *args)

    def is_unsupported(self, device: Hashable, query: Hashable) -> bool:
        """True when (device, query) already answered NOT_SUPPORTED."""
        return (device, query) in self._unsupported

    def mark_unsupported(self, device: Hashable, query: Hashable) -> None:
        with self._lock:
            self._unsupported.add((device, query))

    def forget(self, device: Hashable) -> None:
        """Drop what ``device`` answered NOT_SUPPORTED (a GPU reopened or a MIG device that
        is another one now)."""
        with self._lock:
            self._unsupported = {k for k in self._unsupported
                                 if not (isinstance(k, tuple) and k[0] == device)}

    def _function(self, name: str) -> Any:
        fn = getattr(self._lib, name, None)
        if fn is None and name in _SHIMS and hasattr(self._lib, "_nvmlGetFunctionPointer"):
            return _SHIMS[name](self._lib)
        return fn

    def _is_mismatch(self, exc: BaseException) -> bool:
        """The binding's NVMLLibraryMismatchError: an unversioned wrapper whose versioned C
        function this driver lacks (not an NVMLError, so it carries no code)."""
        cls = getattr(self._lib, "NVMLLibraryMismatchError", None)
        return isinstance(cls, type) and isinstance(exc, cls)

    def call(
        self, name: str, *args: Any, device: Hashable = None, query: Hashable = None,
        kwargs: dict[str, Any] | None = None, _variant: bool = False,
        check_handle: bool = False,
    ) -> Any:
        """Call ``pynvml.<name>(*args)``; None where the value is not available.

        Raises :class:`GpuLostError` when the GPU is lost (or needs a reset) and, with
        ``check_handle``, :class:`StaleHandleError` when NVML no longer knows the handle
        (INVALID_ARGUMENT, as a MIG device's after a reconfiguration). ``query`` defaults to
        the function name and
        its arguments after the handle, which is what the NOT_SUPPORTED cache is keyed on
        together with ``device``.
        """
        if query is None:
            query = (name, *args[1:]) if args else name
        key = (device, query)
        if key in self._unsupported or name in self._missing_functions:
            return None
        fn = self._function(name)
        if fn is None:
            if _variant:  # an older binding: the next variant may exist
                self.mark_unsupported(device, query)
            else:
                self._function_missing(name)
            return None
        with self._lock:
            if self._closing or not self.initialized:
                return None
            self._in_flight += 1
        try:
            return fn(*args, **(kwargs or {}))
        except Exception as exc:
            code = error_code(exc)
            if code is None and self._is_mismatch(exc):
                code = NVML_ERROR_FUNCTION_NOT_FOUND
            if code is None:
                raise
            if _variant and code in (NVML_ERROR_FUNCTION_NOT_FOUND,
                                     NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                self.mark_unsupported(device, query)  # an older driver: try the next variant
                return None
            if code == NVML_ERROR_INVALID_ARGUMENT and check_handle:
                raise StaleHandleError(f"NVML does not know GPU {device}'s handle ({name}: "
                                       f"{exc})") from exc
            self._classify(code, exc, name, device, key)
            return None
        finally:
            with self._idle:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.notify_all()

    def call_versioned(self, variants: Sequence[tuple[str, dict[str, Any]]], *args: Any,
                       device: Hashable = None) -> Any:
        """The newest variant of a call that this driver and binding answer.

        ``variants`` are (function name, keyword arguments), newest first, as nvitop's
        libnvml does it: a variant the binding or the driver lacks (no such function,
        FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH, NVMLLibraryMismatchError) or that
        answers NOT_SUPPORTED is not asked again on this device, and the next one is. None
        when none answers.
        """
        for name, kwargs in variants:
            query = (name, *sorted(kwargs.items()))
            if self.is_unsupported(device, query):
                continue
            value = self.call(name, *args, device=device, query=query, kwargs=kwargs,
                              _variant=True)
            if value is not None or not self.is_unsupported(device, query):
                return value
        return None

    def none_answers(self, variants: Sequence[tuple[str, dict[str, Any]]],
                     device: Hashable = None) -> bool:
        """True when every variant of a call is known not to answer on ``device`` (a
        :meth:`call_versioned` that returned None for good, not for want of data)."""
        return all(self.is_unsupported(device, (name, *sorted(kwargs.items())))
                   or name in self._missing_functions for name, kwargs in variants)

    def _function_missing(self, name: str) -> None:
        with self._lock:
            self._missing_functions.add(name)
        self._log_once(
            ("missing", name),
            logging.WARNING,
            "NVML function %s is not in this driver; its metrics are left out "
            "(upgrade the driver to get them)",
            name,
        )

    def _classify(self, code: int, exc: Exception, name: str, device: Hashable, key: Hashable):
        if code == NVML_ERROR_NOT_SUPPORTED:
            with self._lock:
                self._unsupported.add(key)
            log.debug("%s not supported on GPU %s", name, device)
        elif code == NVML_ERROR_FUNCTION_NOT_FOUND:
            self._function_missing(name)
        elif code in _LOST:
            raise GpuLostError(f"GPU {device} is lost ({name}: {exc})") from exc
        elif code in _QUIET:
            log.debug("%s on GPU %s: %s", name, device, exc)
        else:
            self._log_once(
                ("error", name, code),
                logging.WARNING,
                "NVML %s failed on GPU %s: %s (this error is logged once)",
                name,
                device,
                exc,
            )

    def field_values(self, handle: Any, field_ids: Iterable[Any],
                     device: Hashable) -> dict[Any, FieldValue]:
        """Read NVML field values: {field ID (or (ID, scope)): FieldValue} for those available.

        A field that answers NOT_SUPPORTED, or that this driver does not know
        (INVALID_ARGUMENT), is cached and left out of later requests.
        """
        wanted = [f for f in field_ids if not self.is_unsupported(device, ("field", f))]
        if not wanted:
            return {}
        values = self.call("nvmlDeviceGetFieldValues", handle, wanted, device=device,
                           query="nvmlDeviceGetFieldValues")
        if values is None:
            return {}
        out: dict[Any, FieldValue] = {}
        for field_id, fv in zip(wanted, values, strict=False):
            ret = getattr(fv, "nvmlReturn", NVML_SUCCESS)
            if ret in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                self.mark_unsupported(device, ("field", field_id))
                continue
            if ret in _LOST:
                raise GpuLostError(f"GPU {device} is lost (field {field_id})")
            if ret != NVML_SUCCESS:
                continue
            value_type = int(getattr(fv, "valueType", VALUE_TYPE_ULONGLONG))
            member = VALUE_MEMBER.get(value_type, "ullVal")
            out[field_id] = FieldValue(getattr(fv.value, member), value_type)
        return out

    def forget_field(self, device: Hashable, field_id: Any) -> None:
        """Stop asking ``device`` for ``field_id`` (its answers cannot be trusted)."""
        self.mark_unsupported(device, ("field", field_id))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
