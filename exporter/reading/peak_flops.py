"""Dense peak FLOP/s of each GPU model by precision: the denominator of MFU.

Keyed by the NVML device name (``nvmlDeviceGetName``), compared without case, without a
leading ``NVIDIA `` (older drivers leave it out) and with runs of spaces as one. A name that is
not in the table exports nothing: a wrong peak would make every MFU figure wrong, so we never
guess from a similar name. ``--gpu.peak-flops`` (or the ``gpu.peak-flops`` config key) adds or
replaces entries. MIG slices export nothing either: their share of the peak depends on the
profile.

The figures are NVIDIA's datasheet values *without* 2:4 structured sparsity (the datasheets
print the sparse figure for tensor precisions, marked with an asterisk; dense is half of it).
``fp32`` is the non-tensor FP32 rate; ``tf32`` is TF32 on tensor cores.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exporter.protocol import PRECISIONS


@dataclass(frozen=True)
class Peak:
    """One GPU model: FLOP/s by precision (dense), and where the figures come from."""

    flops: Mapping[str, float]
    source: str


_H100_SXM = Peak({"fp8": 1978.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12,
                  "fp32": 66.9e12},
                 "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
                 "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)")
_H100_NVL = Peak({"fp8": 1670.5e12, "bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12,
                  "fp32": 60e12},
                 "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column (per GPU)")
_A100 = Peak({"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
             "NVIDIA A100 Tensor Core GPU datasheet (40 GB and 80 GB, SXM and PCIe: the same "
             "peaks; no FP8) (https://www.nvidia.com/en-us/data-center/a100/)")

# normalised NVML name -> peak
PEAKS: dict[str, Peak] = {
    "h100 80gb hbm3": _H100_SXM,
    "h100 pcie": Peak({"fp8": 1513e12, "bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12,
                       "fp32": 51e12},
                      "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column"),
    "h100 nvl": _H100_NVL,
    # the H200 is the H100's GH100 with more and faster memory: the same compute peaks
    "h200": Peak(_H100_SXM.flops, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column "
                                  "(https://www.nvidia.com/en-us/data-center/h200/)"),
    "h200 nvl": Peak(_H100_NVL.flops, "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column"),
    "a100-sxm4-40gb": _A100,
    "a100-sxm4-80gb": _A100,
    "a100-pcie-40gb": _A100,
    "a100 80gb pcie": _A100,
    "l4": Peak({"fp8": 242.5e12, "bf16": 121e12, "fp16": 121e12, "tf32": 60e12,
                "fp32": 30.3e12},
               "NVIDIA L4 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/l4/)"),
    "l40s": Peak({"fp8": 733e12, "bf16": 366.5e12, "fp16": 366.5e12, "tf32": 183e12,
                  "fp32": 91.6e12},
                 "NVIDIA L40S GPU datasheet (https://www.nvidia.com/en-us/data-center/l40s/)"),
    "b200": Peak({"fp8": 4500e12, "bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12,
                  "fp32": 75e12},
                 "NVIDIA Blackwell datasheet, HGX B200 per-GPU column "
                 "(https://www.nvidia.com/en-us/data-center/hgx/)"),
    # the demo backend's GPUs are H100 SXMs, so MFU can be tried on a laptop
    "h100 80gb hbm3 (demo)": Peak(_H100_SXM.flops, "the H100 SXM row (demo backend)"),
}

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kKmMgGtTpP]?)\s*$")


def normalise(name: str) -> str:
    """An NVML device name as the table keys it."""
    text = " ".join(name.split()).lower()
    return text[len("nvidia "):] if text.startswith("nvidia ") else text


def parse_flops(value: Any) -> float:
    """A FLOP/s figure: a number, or '989.4T', '1.98P', '312e12' -> FLOP/s (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"expected FLOP/s such as 989.4T, got {value!r}")
    if isinstance(value, (int, float)):
        flops = float(value)
    else:
        m = _QUANTITY.match(str(value))
        if not m:
            raise ValueError(f"expected FLOP/s such as 989.4T or 312e12, got {value!r}")
        flops = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not flops > 0 or flops == float("inf"):
        raise ValueError(f"FLOP/s must be a positive number, got {value!r}")
    return flops


def _precisions(name: str, value: Any) -> dict[str, float]:
    if isinstance(value, str):  # the flag's form: bf16=989.4T,fp8=1979T
        pairs = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            precision, sep, flops = part.partition("=")
            if not sep:
                raise ValueError(f"{name!r}: expected precision=FLOPS, got {part!r}")
            pairs.append((precision.strip(), flops.strip()))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        raise ValueError(f"{name!r}: expected a mapping of precision to FLOP/s, got {value!r}")
    if not pairs:
        raise ValueError(f"{name!r}: no precision given")
    out = {}
    for precision, flops in pairs:
        if precision not in PRECISIONS:
            raise ValueError(f"{name!r}: unknown precision {precision!r} (known: "
                             f"{', '.join(PRECISIONS)})")
        try:
            out[precision] = parse_flops(flops)
        except ValueError as exc:
            raise ValueError(f"{name!r} {precision}: {exc}") from None
    return out


def parse_peak_overrides(value: Any) -> dict[str, dict[str, float]]:
    """The ``gpu.peak-flops`` setting -> {normalised device name: {precision: FLOP/s}}.

    YAML: ``{"NVIDIA RTX 6000 Ada Generation": {bf16: 364.2T, fp32: 91.1T}}``; the flag:
    ``'NVIDIA RTX 6000 Ada Generation:bf16=364.2T,fp32=91.1T;NVIDIA L40:bf16=181T'``."""
    if value is None:
        return {}
    if isinstance(value, str):
        entries = []
        for part in filter(None, (p.strip() for p in value.split(";"))):
            name, sep, rest = part.rpartition(":")
            if not sep or not name.strip():
                raise ValueError(f"expected 'DEVICE NAME:bf16=989T,...', got {part!r}")
            entries.append((name.strip(), rest))
    elif isinstance(value, Mapping):
        entries = list(value.items())
    else:
        raise ValueError(f"expected a mapping of device name to peaks, got {value!r}")
    return {normalise(str(name)): _precisions(str(name), peaks) for name, peaks in entries}


class PeakTable:
    """The shipped table with the user's entries on top; :meth:`peaks` answers per device."""

    def __init__(self, overrides: Mapping[str, Mapping[str, float]] | None = None) -> None:
        self._table = {name: dict(p.flops) for name, p in PEAKS.items()}
        for name, peaks in (overrides or {}).items():
            # an override replaces the precisions it names and keeps the others
            self._table[normalise(name)] = {**self._table.get(normalise(name), {}), **peaks}

    def peaks(self, device_name: str) -> dict[str, float]:
        """FLOP/s by precision for an NVML device name; empty when the name is unknown."""
        return dict(self._table.get(normalise(device_name), {}))
