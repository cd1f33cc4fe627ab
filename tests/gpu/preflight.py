"""What this machine's GPU path is before any scenario runs: the driver and NVML version, which
NVML calls answer (and with what), ``/dev/shm``, and each NVML call's real latency as the
exporter's sampler makes it, cycle after cycle (the sampler cycle's real cost per GPU).

    python3 tests/gpu/preflight.py --out preflight.json [--cycles 20]
    python3 tests/gpu/preflight.py --out preflight.json --fake     # no GPU: the fake driver

It drives the exporter's own NVML backend (``exporter/reading/gpu_backends.py``) through a
timing wrapper of the binding, so the calls timed are the ones the daemon makes, with their
arguments. ``--fake`` puts the real binding over ``tests/fake_nvml.py`` (an H100 with a
process), so CI runs the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


class TimedBinding:
    """A pynvml module whose ``nvml*`` functions are timed: per function, its calls, the
    seconds they took and what they last answered (a value or the NVML error's name)."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: dict[str, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if not name.startswith("nvml") or not callable(value) or isinstance(value, type):
            return value

        def timed(*args: Any, **kwargs: Any) -> Any:
            entry = self.calls.setdefault(name, {"calls": 0, "seconds": 0.0,
                                                 "max_seconds": 0.0, "answer": ""})
            started = time.perf_counter()
            try:
                result = value(*args, **kwargs)
                entry["answer"] = "ok"
                return result
            except Exception as exc:
                code = getattr(exc, "value", None)
                entry["answer"] = f"error {code}: {exc}" if code is not None else repr(exc)
                raise
            finally:
                took = time.perf_counter() - started
                entry["calls"] += 1
                entry["seconds"] += took
                entry["max_seconds"] = max(entry["max_seconds"], took)

        return timed


def shm() -> dict[str, Any]:
    """/dev/shm's size and what is free, bytes (the DataLoader's workers pass batches there)."""
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError as exc:
        return {"error": str(exc)}
    return {"total_bytes": usage.total, "free_bytes": usage.free}


def preflight(cycles: int = 20, interval: float = 0.2, fake: bool = False) -> dict[str, Any]:
    """The preflight document (see the module's docstring)."""
    from exporter.reading.gpu_backends import BackendUnavailable, NvmlBackend
    from exporter.reading.nvml import Nvml

    doc: dict[str, Any] = {"python": platform.python_version(), "machine": platform.node(),
                           "cpus": os.cpu_count(), "shm": shm(), "fake_driver": fake}
    try:
        import torch

        doc["torch"] = torch.__version__
        doc["cuda_available"] = torch.cuda.is_available()
        doc["torch_cuda"] = torch.version.cuda
    except ImportError:
        doc["torch"] = None
    if fake:
        from fake_nvml import FakeDriver, h100_sxm

        driver = FakeDriver([h100_sxm(0, processes=[(os.getpid(), 2**30)],
                                      process_samples=[(1_000, os.getpid(), 50, 20)])])
        module: Any = driver.binding
    else:
        try:
            import pynvml as module
        except ImportError as exc:
            doc["error"] = f"nvidia-ml-py is not installed: {exc}"
            return doc
    binding = TimedBinding(module)
    backend = NvmlBackend(Nvml(binding))
    try:
        gpus = backend.start()
    except BackendUnavailable as exc:
        doc["error"] = str(exc)
        return doc
    doc["driver_version"] = backend.driver_version
    doc["nvml_version"] = backend.nvml.nvml_version
    doc["gpus"] = [{"index": g.index, "uuid": g.uuid, "name": g.name, "parent": g.parent}
                   for g in gpus]
    started = {name: dict(v) for name, v in binding.calls.items()}  # discovery's calls
    per_gpu: dict[str, list[float]] = {g.index: [] for g in gpus}
    for _ in range(cycles):
        for g in gpus:
            t = time.perf_counter()
            try:
                backend.sample(g)
            except Exception as exc:  # a lost GPU: recorded, the others carry on
                doc.setdefault("sample_errors", []).append(f"GPU {g.index}: {exc}")
            per_gpu[g.index].append(time.perf_counter() - t)
        time.sleep(interval)
    backend.close()
    calls = {}
    for name, v in sorted(binding.calls.items()):
        before = started.get(name, {"calls": 0, "seconds": 0.0})
        n = v["calls"] - before["calls"]
        calls[name] = {"calls_per_cycle": n / cycles if cycles else 0.0,
                       "mean_ms": 1000 * (v["seconds"] - before["seconds"]) / n if n else None,
                       "max_ms": 1000 * v["max_seconds"], "answer": v["answer"]}
    doc["calls"] = calls
    doc["answering"] = sorted(n for n, v in calls.items() if v["answer"] == "ok")
    doc["refused"] = {n: v["answer"] for n, v in calls.items() if v["answer"] != "ok"}
    doc["cycle_ms"] = {index: {"mean": 1000 * sum(ts) / len(ts), "max": 1000 * max(ts)}
                       for index, ts in per_gpu.items() if ts}
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    p.add_argument("--cycles", type=int, default=20, help="sampler cycles to time")
    p.add_argument("--fake", action="store_true", help="the fake driver (no GPU)")
    args = p.parse_args(argv)
    doc = preflight(args.cycles, fake=args.fake)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    slowest = sorted(((v["mean_ms"] or 0.0, n) for n, v in doc.get("calls", {}).items()),
                     reverse=True)[:5]
    print(f"preflight: driver {doc.get('driver_version')}, NVML {doc.get('nvml_version')}, "
          f"{len(doc.get('gpus', []))} GPU(s), /dev/shm {doc['shm']}, cycle "
          f"{doc.get('cycle_ms')}; slowest calls (ms): "
          + ", ".join(f"{n} {ms:.2f}" for ms, n in slowest)
          + (f"; error: {doc['error']}" if "error" in doc else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
