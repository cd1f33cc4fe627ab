"""The one place that calls NVML.

Every NVML call of the project goes through :class:`Nvml`. It turns NVML's errors into
"not available" (``None``) values, remembers what a device does not support so it is never
asked again, logs a missing driver function once, and raises :class:`GpuLostError` when a GPU
has fallen off the bus so the caller can mark that GPU down and carry on with the others.

The ``pynvml`` module (from the ``nvidia-ml-py`` package) is imported lazily by :meth:`Nvml.init`:
importing this module does no NVML work. Tests pass a scripted pynvml-shaped fake instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# NVML return codes (stable across driver versions; duplicated here so that this module needs
# no pynvml import to classify an error).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
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


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine (no driver, no library, no permission)."""


class GpuLostError(RuntimeError):
    """A GPU stopped answering (NVML_ERROR_GPU_IS_LOST): mark it down, retry it later."""


def error_code(exc: BaseException) -> int | None:
    """The NVML return code carried by a pynvml ``NVMLError``, or None for other exceptions."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class Nvml:
    """A thread-safe wrapper over a pynvml-shaped module.

    ``call(name, handle, *args, device=...)`` returns the function's result, or None when the
    value is not available. ``device`` is a stable key (index or UUID) under which
    NOT_SUPPORTED answers are cached, so that each (device, query) pair is asked once.
    """

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._module = module
        self._lib: Any = None
        self._lock = threading.Lock()
        self._unsupported: set[Hashable] = set()
        self._missing_functions: set[str] = set()
        self._logged: set[Hashable] = set()
        self.initialized = False

    @property
    def lib(self) -> Any:
        """The underlying pynvml module (after :meth:`init`), for its constants and structs."""
        return self._lib

    def init(self) -> None:
        """Load pynvml and initialise NVML; raise :class:`NvmlUnavailable` with the reason."""
        if self.initialized:
            return
        lib = self._module
        if lib is None:
            try:
                import pynvml as lib  # nvidia-ml-py
            except ImportError as exc:  # pragma: no cover - a dependency of the package
                raise NvmlUnavailable(f"the nvidia-ml-py package is not installed: {exc}") from exc
        try:
            lib.nvmlInit()
        except Exception as exc:
            code = error_code(exc)
            reason = _NO_DRIVER.get(code) if code is not None else None
            raise NvmlUnavailable(reason or f"nvmlInit failed: {exc}") from exc
        self._lib = lib
        self.initialized = True

    def shutdown(self) -> None:
        """Release NVML; safe to call twice."""
        if self.initialized:
            self.initialized = False
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

    def call(
        self, name: str, *args: Any, device: Hashable = None, query: Hashable = None,
        kwargs: dict[str, Any] | None = None, _variant: bool = False,
    ) -> Any:
        """Call ``pynvml.<name>(*args)``; None where the value is not available.

        Raises :class:`GpuLostError` when the GPU is lost. ``query`` defaults to the function
        name and its arguments after the handle, which is what the NOT_SUPPORTED cache is keyed
        on together with ``device``.
        """
        if query is None:
            query = (name, *args[1:]) if args else name
        key = (device, query)
        if key in self._unsupported or name in self._missing_functions:
            return None
        fn = getattr(self._lib, name, None)
        if fn is None:
            if _variant:  # an older binding: the next variant may exist
                self.mark_unsupported(device, query)
            else:
                self._function_missing(name)
            return None
        try:
            return fn(*args, **(kwargs or {}))
        except Exception as exc:
            code = error_code(exc)
            if code is None:
                raise
            if _variant and code in (NVML_ERROR_FUNCTION_NOT_FOUND,
                                     NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                self.mark_unsupported(device, query)  # an older driver: try the next variant
                return None
            self._classify(code, exc, name, device, key)
            return None

    def call_versioned(self, variants: Sequence[tuple[str, dict[str, Any]]], *args: Any,
                       device: Hashable = None) -> Any:
        """The newest variant of a call that this driver and binding answer.

        ``variants`` are (function name, keyword arguments), newest first, as nvitop's
        libnvml does it: a variant the binding or the driver lacks (no such function,
        FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH) or that answers NOT_SUPPORTED is not
        asked again on this device, and the next one is. None when none answers.
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

    def field_values(self, handle: Any, field_ids: Iterable[int], device: Hashable) -> dict:
        """Read NVML field values; returns {field_id: number} for those available.

        A field that answers NOT_SUPPORTED is cached and left out of later requests.
        """
        wanted = [f for f in field_ids if not self.is_unsupported(device, ("field", f))]
        if not wanted:
            return {}
        values = self.call("nvmlDeviceGetFieldValues", handle, wanted, device=device,
                           query="nvmlDeviceGetFieldValues")
        if values is None:
            return {}
        out: dict[int, float] = {}
        for field_id, fv in zip(wanted, values, strict=False):
            ret = getattr(fv, "nvmlReturn", NVML_SUCCESS)
            if ret == NVML_ERROR_NOT_SUPPORTED:
                self.mark_unsupported(device, ("field", field_id))
                continue
            if ret == NVML_ERROR_GPU_IS_LOST:
                raise GpuLostError(f"GPU {device} is lost (field {field_id})")
            if ret != NVML_SUCCESS:
                continue
            member = VALUE_MEMBER.get(getattr(fv, "valueType", 3), "ullVal")
            out[field_id] = getattr(fv.value, member)
        return out
