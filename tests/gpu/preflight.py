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
import dataclasses
import json
import os
import platform
import shutil
import subprocess
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


def preflight(cycles: int = 20, interval: float = 0.2, fake: bool = False,
              model: str = "h100_sxm", child: bool = True) -> dict[str, Any]:
    """The preflight document (see the module's docstring). ``fake``: over the fake driver's
    ``model`` (a function of tests/fake_nvml.py) rather than the GPU; ``child``: start the
    matrix-product child (``cuda_child``)."""
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
        import fake_nvml

        make = getattr(fake_nvml, model)
        gpu = make(0) if model != "h100_sxm" else make(
            0, processes=[(os.getpid(), 2**30)], process_samples=[(1_000, os.getpid(), 50, 20)])
        driver = fake_nvml.FakeDriver([gpu], version=FAKE_VERSIONS.get(model, "590.48.01"))
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
    cycled = {name: dict(v) for name, v in binding.calls.items()}  # the cycles' calls
    doc["last_reading"] = {g.index: _jsonable(dataclasses.asdict(backend.sample(g)))
                           for g in gpus}
    doc["raw"] = raw_answers(module, 0)
    if child:
        doc["cuda_child"] = cuda_child(module, backend, gpus[0] if gpus else None)
    backend.close()
    calls = {}
    for name, v in sorted(cycled.items()):
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


# the driver each fake model was met with (h200_vm: the GPU proof's machine)
FAKE_VERSIONS = {"h200_vm": "580.159.04"}
# nvmlValueType_t: which member of the value union holds a field's value
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                 6: "usVal"}
CHILD = """
import sys, time, torch
dev = "cuda" if torch.cuda.is_available() else "cpu"
a = torch.randn(2048, 2048, device=dev)
(a @ a).sum().item()
print("ready", dev, flush=True)
end = time.monotonic() + 90
while time.monotonic() < end:
    for _ in range(20):
        b = a @ a
    b.sum().item()
"""


def _jsonable(value: Any) -> Any:
    """A reading or an NVML struct as JSON: ctypes structs by their fields, keys as strings."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    fields = getattr(value, "_fields_", None)
    if fields is not None:
        return {f[0]: _jsonable(getattr(value, f[0], None)) for f in fields}
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    if hasattr(value, "__dict__"):  # the binding's friendly objects
        return {k: _jsonable(v) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)


def _answer(call: Any) -> Any:
    """What one raw NVML call answers, or the error's code and name."""
    try:
        return {"ok": _jsonable(call())}
    except Exception as exc:
        return {"error": getattr(exc, "value", None), "message": str(exc)}


def raw_answers(nvml: Any, index: int) -> dict[str, Any]:
    """GPU ``index``'s raw answers to the calls the fake driver has to imitate: the reasons
    (supported and current bitmask), field values per field (each its own return code), NVLink
    state per link, GPM support, the compute processes and the per-process samples."""
    from exporter.reading.gpu_backends import STABLE_CLOCK_EVENT_FIELDS

    try:
        h = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        return {"error": str(exc)}
    out: dict[str, Any] = {}
    for name in ("nvmlDeviceGetSupportedClocksEventReasons",
                 "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetComputeRunningProcesses",
                 "nvmlGpmQueryDeviceSupport", "nvmlDeviceGetPerformanceState"):
        fn = getattr(nvml, name, None)
        out[name] = _answer(lambda fn=fn: fn(h)) if fn else {"missing": True}
    out["nvmlDeviceGetProcessUtilization"] = _answer(
        lambda: nvml.nvmlDeviceGetProcessUtilization(h, 0))
    # (NVLink throughput is asked for all links at once: the sampler's own calls time it)
    ids = {f"clock_event_{k}": v for k, v in STABLE_CLOCK_EVENT_FIELDS.items()}
    # the clock-event reason durations by ID (NVML 12.550+), where this binding names them
    for attr in dir(nvml):
        if attr.startswith("NVML_FI_DEV_CLOCKS_EVENT_REASON_"):
            ids[attr.removeprefix("NVML_FI_DEV_")] = getattr(nvml, attr)
    for attr in ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES",
                 "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_NVLINK_LINK_COUNT"):
        if hasattr(nvml, attr):
            ids[attr.removeprefix("NVML_FI_DEV_")] = getattr(nvml, attr)
    fields: dict[str, Any] = {}
    for label, fid in sorted(ids.items()):
        got = _answer(lambda fid=fid: nvml.nvmlDeviceGetFieldValues(h, [fid])[0])
        if "ok" in got:
            v = got["ok"]
            member = VALUE_MEMBERS.get(v.get("valueType"), "ullVal")
            got = {"return": v.get("nvmlReturn"), "valueType": v.get("valueType"),
                   "value": (v.get("value") or {}).get(member)}
        fields[f"{label} ({fid})"] = got
    out["field_values"] = fields
    out["nvlink_state"] = {str(link): _answer(lambda link=link: nvml.nvmlDeviceGetNvLinkState(
        h, link)) for link in range(18)}
    return out


def cuda_child(nvml: Any, backend: Any, gpu: Any) -> dict[str, Any]:
    """A child doing matrix products on the GPU (the CPU without one): whether NVML's process
    list holds its pid as this process sees it, what the per-process samples say of it (their
    period from their timestamps), what the sampler reads of it, and whether py-spy reads its
    stacks here."""
    from exporter.client.stacks import find_py_spy

    out: dict[str, Any] = {}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # "ready DEVICE" once its first product is done
        out["pid"] = child.pid
        out["ready"] = line.strip()
        if not line.startswith("ready"):
            out["error"] = child.stderr.read()[-2000:] if child.stderr else ""
            return out
        time.sleep(3)  # a few of NVML's per-process sample periods
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        procs = _answer(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(h))
        out["nvml_processes"] = procs
        out["pid_in_nvml_list"] = any(
            isinstance(p, dict) and p.get("pid") == child.pid for p in procs.get("ok") or [])
        samples = _answer(lambda: nvml.nvmlDeviceGetProcessUtilization(h, 0))
        out["process_samples"] = samples
        stamps = sorted(s["timeStamp"] for s in samples.get("ok") or []
                        if isinstance(s, dict) and s.get("pid") == child.pid)
        out["child_sample_stamps_us"] = stamps
        if gpu is not None:
            readings = []
            for _ in range(4):
                r = backend.sample(gpu)
                readings.append({"pids": list(r.pids), "process_utilization":
                                 _jsonable(r.process_utilization),
                                 "process_seconds": _jsonable(r.process_seconds),
                                 "utilization": r.utilization, "sm_active": r.sm_active})
                time.sleep(1)
            out["sampler_readings"] = readings
        spy = find_py_spy()
        out["py_spy"] = spy
        if spy:
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(child.pid)],
                                      capture_output=True, text=True, timeout=30)
                out["py_spy_dump"] = {"returncode": dump.returncode,
                                      "stdout": dump.stdout[:3000],
                                      "stderr": dump.stderr[-1500:]}
            except subprocess.TimeoutExpired:
                out["py_spy_dump"] = {"error": "timed out after 30 s"}
    finally:
        child.kill()
        child.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    p.add_argument("--cycles", type=int, default=20, help="sampler cycles to time")
    p.add_argument("--fake", action="store_true", help="the fake driver (no GPU)")
    p.add_argument("--model", default="h100_sxm", help="the fake driver's GPU model")
    args = p.parse_args(argv)
    doc = preflight(args.cycles, fake=args.fake, model=args.model)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    slowest = sorted(((v["mean_ms"] or 0.0, n) for n, v in doc.get("calls", {}).items()),
                     reverse=True)[:5]
    print(f"preflight: driver {doc.get('driver_version')}, NVML {doc.get('nvml_version')}, "
          f"{len(doc.get('gpus', []))} GPU(s), /dev/shm {doc['shm']}, cycle "
          f"{doc.get('cycle_ms')}; slowest calls (ms): "
          + ", ".join(f"{n} {ms:.2f}" for ms, n in slowest)
          + (f"; error: {doc['error']}" if "error" in doc else ""), flush=True)
    child = doc.get("cuda_child", {})
    print(f"preflight: child {child.get('ready')!r} pid {child.get('pid')} in NVML's list: "
          f"{child.get('pid_in_nvml_list')}; py-spy {child.get('py_spy')}: "
          f"{child.get('py_spy_dump', {}).get('returncode', child.get('py_spy_dump'))}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
