"""Run the exporter on this machine's GPU and ``examples/pytorch_train.py`` through the
scenarios, scraping ``/metrics`` every second into a recording per scenario, and checking the
GPU metrics against ``nvidia-smi`` while the load runs.

    python3 tests/gpu/harness.py --out /tmp/gpu-run                  # every scenario, GPU
    python3 tests/gpu/harness.py --out /tmp/cpu --cpu-demo           # no GPU: demo backend

Writes ``<scenario>.prom.gz`` (each scrape as ``# SCRAPE <unix time>`` then the exposition
text), ``<scenario>.smi.csv.gz`` (nvidia-smi once a second), ``summary.json`` and
``summary.md``. Needs only python3 with torch, nvidia-ml-py, prometheus-client, psutil, pyyaml
and requests, run from the repository root. ``tests/gpu/replay.py`` turns a recording back
into Prometheus data and says which alerts fire.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from exporter.cli.profile import Failed, ask  # noqa: E402
from gpu.checks import check, flag_value, input_bytes  # noqa: E402
from gpu.scenarios import ALL, BY_NAME, CPU_BY_NAME, CPU_DEMO, Scenario  # noqa: E402

# the link's max beside its current state: the exporter's PCIe capacity is the max (issue 28)
# seconds a scenario takes beyond its training time: the trainer's start (torch, CUDA, the
# model), its last push and scrape; gpu-proof.sh's timing table measures it
SCENARIO_OVERHEAD_SECONDS = 25.0
SMI_FIELDS = ("timestamp", "index", "uuid", "utilization.gpu", "memory.used", "memory.total",
              "power.draw", "enforced.power.limit", "pcie.link.gen.current",
              "pcie.link.width.current", "pcie.link.gen.max", "pcie.link.width.max",
              "temperature.gpu", "clocks.sm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder(threading.Thread):
    """Scrapes ``url`` every ``interval`` seconds into a gzip file, each scrape headed by
    ``# SCRAPE <unix time>``."""

    def __init__(self, url: str, path: Path, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.interval = url, path, interval
        self.stop_event = threading.Event()
        self.scrapes = 0
        self.errors = 0

    def run(self) -> None:
        session = requests.Session()
        with gzip.open(self.path, "wt", encoding="utf-8") as out:
            next_at = time.time()
            while not self.stop_event.is_set():
                t = time.time()
                try:
                    text = session.get(self.url, timeout=5).text
                    out.write(f"# SCRAPE {t:.3f}\n{text}")
                    self.scrapes += 1
                except requests.RequestException:
                    self.errors += 1
                next_at += self.interval
                self.stop_event.wait(max(0.0, next_at - time.time()))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


class SmiSampler(threading.Thread):
    """``nvidia-smi --query-gpu`` once a second into a gzip CSV (unix time first)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.stop_event = threading.Event()

    def run(self) -> None:
        cmd = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
               "--format=csv,noheader,nounits"]
        with gzip.open(self.path, "wt", encoding="utf-8") as out:
            out.write("unix_time," + ",".join(SMI_FIELDS) + "\n")
            while not self.stop_event.is_set():
                t = time.time()
                try:
                    rows = subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                                          check=True).stdout
                except (OSError, subprocess.SubprocessError):
                    rows = ""
                for row in rows.strip().splitlines():
                    out.write(f"{t:.3f},{row}\n")
                self.stop_event.wait(1.0)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=15)


def read_recording(path: Path) -> list[tuple[float, dict[tuple[str, tuple], float]]]:
    """[(unix time, {(sample name, sorted labels): value})] for each scrape."""
    scrapes: list[tuple[float, dict]] = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        chunks = fh.read().split("# SCRAPE ")[1:]
    for chunk in chunks:
        header, _, text = chunk.partition("\n")
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        scrapes.append((float(header), samples))
    return scrapes


def _series(scrapes, name: str, **match: str) -> list[tuple[float, float]]:
    out = []
    for t, samples in scrapes:
        total, found = 0.0, False
        for (n, labels), v in samples.items():
            if n == name and all(dict(labels).get(k) == val for k, val in match.items()):
                total, found = total + v, True
        if found:
            out.append((t, total))
    return out


def _delta(series: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    inside = [v for t, v in series if t0 <= t <= t1]
    return inside[-1] - inside[0] if len(inside) >= 2 else None


def _mean(series: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    inside = [v for t, v in series if t0 <= t <= t1]
    return sum(inside) / len(inside) if inside else None


def summarize(scrapes, run: str, gpu: str, t0: float, t1: float) -> dict[str, Any]:
    """What the exporter measured for one run on one GPU over [t0, t1] (unix seconds)."""
    def ratio(num, den):
        return None if num is None or not den else num / den

    g = {"gpu": gpu}
    r = {"run": run}
    step_sum = _delta(_series(scrapes, "gputrain_training_step_duration_seconds_sum", **r),
                      t0, t1)
    mem_used = _mean(_series(scrapes, "gputrain_gpu_memory_used_bytes", **g), t0, t1)
    mem_total = _mean(_series(scrapes, "gputrain_gpu_memory_total_bytes", **g), t0, t1)
    power = _mean(_series(scrapes, "gputrain_gpu_power_watts", **g), t0, t1)
    limit = _mean(_series(scrapes, "gputrain_gpu_power_limit_watts", **g), t0, t1)
    sampled = _delta(_series(scrapes, "gputrain_gpu_sampled_seconds_total", **g), t0, t1)
    link = _mean(_series(scrapes, "gputrain_gpu_pcie_link_max_bytes_per_second", **g), t0, t1)
    rx = _delta(_series(scrapes, "gputrain_gpu_pcie_received_bytes_total", **g), t0, t1)
    # MFU: the run's FLOPs per second of its wall time over the GPU's peak at its precision
    precisions = {dict(labels).get("precision") for _, samples in scrapes[-1:]
                  for (n, labels) in samples if n == "gputrain_training_gpu_info"
                  and dict(labels).get("run") == run}
    precision = next(iter(precisions - {None}), None)
    peak = _mean(_series(scrapes, "gputrain_gpu_peak_flops", **g, precision=precision or ""),
                 t0, t1)
    flops = _delta(_series(scrapes, "gputrain_training_flops_total", **r), t0, t1)
    wall = _delta(_series(scrapes, "gputrain_training_elapsed_seconds_total", **r), t0, t1)
    samples = _delta(_series(scrapes, "gputrain_training_samples_total", **r), t0, t1)
    return {
        "gpu_busy": ratio(_delta(_series(scrapes, "gputrain_gpu_busy_seconds_total", **g),
                                 t0, t1), sampled),
        "sm_active": _mean(_series(scrapes, "gputrain_gpu_sm_active_ratio", **g), t0, t1),
        "tensor_active": _mean(_series(scrapes, "gputrain_gpu_tensor_active_ratio", **g),
                               t0, t1),
        "data_wait": ratio(_delta(_series(scrapes, "gputrain_training_data_wait_seconds_total",
                                          **r), t0, t1), step_sum),
        "samples_per_second": ratio(_delta(_series(scrapes, "gputrain_training_samples_total",
                                                   **r), t0, t1), step_sum),
        "memory_used": ratio(mem_used, mem_total),
        "power_used": ratio(power, limit),
        "pcie_rx_bytes_per_second": ratio(rx, sampled),
        "pcie_rx_link_used": ratio(ratio(rx, sampled), link),
        # what a sample costs the link, whatever the step rate: the seeds' cases compare
        # inputs of different sizes at different throughputs
        "pcie_rx_bytes_per_sample": ratio(rx, samples),
        "window_seconds": t1 - t0,
        "host_cpu_busy": _cpu_busy(scrapes, t0, t1),
        "precision": precision,
        "mfu": ratio(ratio(flops, wall), peak),
    }


def first_push(scrapes, run: str) -> float | None:
    """The time of the first scrape that shows the run's steps: before it, the window would
    hold the trainer's start-up, not its steps."""
    return next((t for t, samples in scrapes
                 if any(n == "gputrain_training_steps_total" and dict(labels).get("run") == run
                        for n, labels in samples)), None)


def wait_for_steps(exporter_url: str, run: str, proc: subprocess.Popen,
                   timeout: float) -> bool:
    """Whether the daemon's /metrics shows the run's steps within ``timeout`` seconds (False at
    once if the trainer has ended)."""
    needle = f'run="{run}"'
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            text = requests.get(exporter_url + "/metrics", timeout=10).text
        except requests.RequestException:
            text = ""
        if any(line.startswith("gputrain_training_steps_total{") and needle in line
               for line in text.splitlines()):
            return True
        time.sleep(0.5)
    return False


def adapt_workers(args: tuple[str, ...], shm_free: float | None) -> tuple[tuple[str, ...], str]:
    """The scenario's flags with fewer DataLoader workers where ``/dev/shm`` (``shm_free``
    bytes) cannot hold what they pass: each worker keeps 2 batches in flight (the default
    prefetch factor), and half of /dev/shm is left to everything else. A small /dev/shm (a
    container's 64 MiB default) otherwise kills the DataLoader ("bus error"). Returns the flags
    and a note ("" when unchanged)."""
    workers = int(flag_value(args, "--workers", "0"))
    if not workers or shm_free is None:
        return args, ""
    batch = int(flag_value(args, "--batch-size", "128")) * input_bytes(args)
    fits = int(shm_free / 2 // (2 * batch))
    if fits >= workers:
        return args, ""
    i = args.index("--workers")
    new = (*args[:i + 1], str(max(0, fits)), *args[i + 2:])
    return new, (f"--workers {workers} -> {max(0, fits)}: /dev/shm has {shm_free / 2**20:.0f} "
                 f"MiB free, a batch is {batch / 2**20:.1f} MiB")


def _cpu_busy(scrapes, t0: float, t1: float) -> float | None:
    modes = {}
    for mode in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"):
        d = _delta(_series(scrapes, "gputrain_host_cpu_seconds_total", mode=mode), t0, t1)
        if d is not None:
            modes[mode] = d
    total = sum(modes.values())
    return 1 - (modes.get("idle", 0) + modes.get("iowait", 0)) / total if total else None


def compare_with_smi(scrapes, smi_path: Path, gpu: str, t0: float, t1: float) -> dict:
    """The exporter's gauges against nvidia-smi rows taken within 1 s of each scrape."""
    import csv

    with gzip.open(smi_path, "rt", encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(io.StringIO(fh.read()), skipinitialspace=True)
                if r["index"] == gpu]
    pairs: dict[str, list[tuple[float, float]]] = {"power": [], "memory": [], "util": []}
    power = _series(scrapes, "gputrain_gpu_power_watts", gpu=gpu)
    memory = _series(scrapes, "gputrain_gpu_memory_used_bytes", gpu=gpu)
    util = _series(scrapes, "gputrain_gpu_utilization_ratio", gpu=gpu)

    def near(series, t):
        best = min(series, key=lambda p: abs(p[0] - t), default=None)
        return best[1] if best and abs(best[0] - t) <= 1.0 else None

    for row in rows:
        t = float(row["unix_time"])
        if not t0 <= t <= t1:
            continue
        for key, series, smi_value in (
                ("power", power, row.get("power.draw")),
                ("memory", memory, row.get("memory.used")),
                ("util", util, row.get("utilization.gpu"))):
            ours = near(series, t)
            try:
                theirs = float(smi_value)
            except (TypeError, ValueError):
                continue
            if ours is None:
                continue
            if key == "memory":
                ours = ours / 2**20  # MiB, as nvidia-smi reports
            if key == "util":
                ours = ours * 100
            pairs[key].append((ours, theirs))

    def rel(ps):
        if not ps:
            return None
        ours = sum(p[0] for p in ps) / len(ps)
        theirs = sum(p[1] for p in ps) / len(ps)
        return {"exporter": ours, "nvidia_smi": theirs, "samples": len(ps),
                "relative_difference": abs(ours - theirs) / theirs if theirs else None}

    return {k: rel(v) for k, v in pairs.items()}


@contextlib.contextmanager
def serving(args, log) -> Iterator[tuple[str, str]]:
    """A daemon on this machine's GPUs (the demo's with --cpu-demo) for one scenario: its
    metrics and ingest URLs."""
    port, ingest = free_port(), free_port()
    cmd = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
           f"--ingest.listen-address=127.0.0.1:{ingest}", "--sampler.interval=1s"]
    if args.cpu_demo:
        # a well-fed simulated GPU: what fires comes from the (real) training signals
        cmd += ["--gpu.backend=demo", "--demo.gpus=2", "--demo.load=0.95"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if requests.get(url + "/healthz", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        yield url, f"http://127.0.0.1:{ingest}"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


class StatusWatch(threading.Thread):
    """The daemon's status document, every 2 s while the scenario trains: the last one in
    which the run's rank is judged and has not finished (the page's verdict over the same
    scrapes as the recording), with the time it was read."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.url, self.run_name = url, run
        self.last: dict | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(2.0):
            try:
                doc = requests.get(self.url + "/api/v1/status", timeout=10).json()
            except (requests.RequestException, ValueError):
                continue
            ours = [r for r in doc.get("runs", []) if r.get("run") == self.run_name]
            if ours and ours[0].get("status") != "finished":
                self.last = {"time": doc.get("time"), "window_seconds":
                             doc.get("window_seconds"), "run": ours[0]}

    def stop(self) -> dict | None:
        self.stopping.set()
        self.join(timeout=15)
        return self.last


def run_scenario(sc: Scenario, args, exporter_url: str, ingest_url: str, out: Path) -> dict:
    rec_path = out / f"{sc.name}.prom.gz"
    try:
        shm_free: float | None = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm_free = None
    flags, adapted = adapt_workers(sc.args, shm_free)
    recorder = Recorder(exporter_url + "/metrics", rec_path)
    smi = SmiSampler(out / f"{sc.name}.smi.csv.gz") if shutil.which("nvidia-smi") else None
    recorder.start()
    watch = StatusWatch(exporter_url, sc.name)
    watch.start()
    if smi:
        smi.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUTRAIN_URL": ingest_url,
           "CUDA_VISIBLE_DEVICES": args.gpu, "GPUTRAIN_RUN": sc.name,
           # CUDA's default order is fastest first; NVML's (the exporter's) is PCI bus order
           "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    seconds = sc.seconds or args.seconds
    cmd = [sys.executable, str(ROOT / "examples" / "pytorch_train.py"), *flags,
           "--run", sc.name, "--seconds", str(seconds), "--device", args.device]
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    profile = None
    profiled = args.profile and args.profile_only in ("", sc.name)
    if profiled and seconds > (sc.warmup or args.warmup) + 10:
        # a profile of the running trainer, as `gputrain-exporter profile` asks for one, once
        # the daemon has its steps: a CUDA trainer's start-up (import, context, workers) can
        # outlast the warm-up, and a profile asked for before its first push is refused
        pushed = wait_for_steps(exporter_url, sc.name, proc, timeout=150)
        time.sleep(min(5.0, sc.warmup or args.warmup) if pushed else 0)
        try:
            profile = ask(ingest_url, sc.name, "0", 5, timeout=120)
        except Failed as exc:
            profile = {"state": "failed", "error": str(exc)}
    stdout, stderr = proc.communicate(timeout=seconds + 180)
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    ended = time.time()
    time.sleep(3)  # the client's last push, then one more scrape
    try:  # whether the daemon could join the trainer's processes (a sandbox may hide them)
        attribution = requests.get(exporter_url + "/api/v1/status", timeout=10).json().get(
            "attribution")
    except (requests.RequestException, ValueError) as exc:
        attribution = {"error": str(exc)}
    recorder.stop()
    status = watch.stop()
    if status is not None:
        (out / f"{sc.name}.status.json").write_text(json.dumps(status, indent=1) + "\n")
    if smi:
        smi.stop()
    result = {"scenario": sc.name, "args": list(flags), "seed": sc.seed, "adapted": adapted,
              "attribution": attribution,
              "returncode": proc.returncode, "trainer_output": proc.stdout.strip()[-500:],
              "trainer_errors": proc.stderr.strip()[-2000:] if proc.returncode else "",
              "started": started, "ended": ended, "scrapes": recorder.scrapes,
              "scrape_errors": recorder.errors, "profile": profile}
    scrapes = read_recording(rec_path)
    names = {dict(labels).get("name") for t, samples in scrapes[-1:]
             for (n, labels) in samples if n == "gputrain_gpu_info"
             and dict(labels).get("gpu") == args.gpu}
    result["gpu_name"] = next(iter(names - {None}), "")
    # the exporter's own index of the GPU the trainer used (CUDA_VISIBLE_DEVICES=args.gpu);
    # the window opens after the warm-up counted from the first push, not from the start
    pushed = first_push(scrapes, sc.name)
    result["first_push_seconds"] = None if pushed is None else pushed - started
    t0, t1 = max(started, pushed or started) + (sc.warmup or args.warmup), ended
    result["measured"] = summarize(scrapes, sc.name, args.gpu, t0, t1)
    if smi:
        result["nvidia_smi"] = compare_with_smi(scrapes, out / f"{sc.name}.smi.csv.gz",
                                                args.gpu, t0, t1)
    return result


def markdown(results: list[dict], fired: dict[str, list[str]] | None = None) -> str:
    """The table of a run: measured figures, the alerts fired (when a replay says), and what
    the published figure."""
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    columns = ["scenario", "GPU busy", "SM active", "tensor active", "data wait", "samples/s",
               "memory", "power", "MFU", *(["alerts fired"] if fired is not None else []),
               "published figure"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in results:
        m = r.get("measured", {})
        sps = m.get("samples_per_second")
        cells = [r["scenario"], pct(m.get("gpu_busy")), pct(m.get("sm_active")),
                 pct(m.get("tensor_active")), pct(m.get("data_wait")),
                 "n/a" if sps is None else f"{sps:.0f}", pct(m.get("memory_used")),
                 pct(m.get("power_used")), pct(m.get("mfu"))]
        if fired is not None:
            cells.append(", ".join(fired.get(r["scenario"], [])) or "none")
        lines.append("| " + " | ".join([*cells, r["seed"]]) + " |")
    return "\n".join(lines) + "\n"


def agreement_markdown(results: list[dict]) -> str:
    """Per scenario, the exporter beside nvidia-smi (power, memory, utilisation: the means of
    the same instants) and the PCIe bytes it read a sample beside the bytes the trainer sent."""
    lines = ["| scenario | power W (nvidia-smi) | memory MiB (nvidia-smi) | "
             "utilisation % (nvidia-smi) | PCIe received a sample (the input) |",
             "|" + " --- |" * 5]
    for r in results:
        smi = r.get("nvidia_smi") or {}

        def pair(key: str, digits: int, smi: dict = smi) -> str:
            c = smi.get(key)
            if not c:
                return "n/a"
            return f"{c['exporter']:.{digits}f} ({c['nvidia_smi']:.{digits}f})"

        got = r.get("measured", {}).get("pcie_rx_bytes_per_sample")
        pcie = "n/a" if got is None else \
            f"{got / 1e3:.0f} kB ({input_bytes(r.get('args', [])) / 1e3:.0f} kB)"
        lines.append(f"| {r['scenario']} | {pair('power', 1)} | {pair('memory', 0)} | "
                     f"{pair('util', 1)} | {pcie} |")
    return "\n".join(lines) + "\n"


def record_hardware(out: Path, url: str) -> dict[str, Any]:
    """NVLink, ECC and row-remapping as nvidia-smi reports them (its text, in the output
    folder) beside the exporter's series, for the comparison issue 17 asks for."""
    for name, args in (("nvidia-smi-nvlink.txt", ["nvlink", "-gt", "d"]),
                       ("nvidia-smi-ecc-remap.txt", ["-q", "-d", "ECC,ROW_REMAPPER"])):
        run = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
        (out / name).write_text(run.stdout + run.stderr)
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException as exc:
        return {"error": str(exc)}
    prefixes = ("gputrain_gpu_nvlink_", "gputrain_gpu_ecc_errors_total",
                "gputrain_gpu_remapped_rows", "gputrain_gpu_retired_pages")
    return {"exporter": [line for line in text.splitlines() if line.startswith(prefixes)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="directory for the recordings")
    p.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    p.add_argument("--seconds", type=float, default=60.0, help="training time per scenario")
    p.add_argument("--archive", type=Path,
                   help="also pack everything into this .tar.gz (a device's $OUT takes only "
                        "a few files)")
    p.add_argument("--warmup", type=float, default=15.0,
                   help="seconds left out of the summary (start-up, compile, first epoch)")
    p.add_argument("--gpu", default="0", help="the GPU index the trainer uses")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="do not profile each trainer (5 steps, after the warm-up)")
    p.add_argument("--profile-only", default="", metavar="SCENARIO",
                   help="profile this scenario's trainer only")
    p.add_argument("--deadline", type=float, default=0.0, metavar="UNIX_TIME",
                   help="skip the scenarios that would end after it (recorded as skipped)")
    p.add_argument("--cpu-demo", action="store_true",
                   help="no GPU: the demo GPU backend, torch on the CPU, the CPU scenarios")
    args = p.parse_args(argv)
    if args.cpu_demo:
        args.device = "cpu"
    table = CPU_BY_NAME if args.cpu_demo else BY_NAME
    names = [n for n in args.scenarios.split(",") if n] or \
        [s.name for s in (CPU_DEMO if args.cpu_demo else ALL)]
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown scenarios: {', '.join(unknown)} (known: {', '.join(table)})")
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    hardware = None
    log = open(args.out / "exporter.log", "w")  # noqa: SIM115 - closed below
    try:
        for i, name in enumerate(names):
            sc = table[name]
            need = (sc.seconds or args.seconds) + SCENARIO_OVERHEAD_SECONDS
            if args.deadline and time.time() + need > args.deadline:
                print(f"scenario {name}: skipped, {need:.0f} s would pass the deadline",
                      flush=True)
                results.append({"scenario": name, "skipped": True, "seed": sc.seed,
                                "args": list(sc.args), "returncode": 0, "measured": {}})
                continue
            print(f"scenario {name} ...", flush=True)
            # a daemon of its own: its status view's window then holds this scenario alone,
            # as the recording does, so the page and a replay judge the same data
            with serving(args, log) as (url, ingest_url):
                result = run_scenario(sc, args, url, ingest_url, args.out)
                if i == len(names) - 1 and shutil.which("nvidia-smi"):
                    # while the exporter still serves: its series beside nvidia-smi's
                    hardware = record_hardware(args.out, url)
            results.append(result)
            print(json.dumps(result["measured"]), flush=True)
    finally:
        log.close()
    failures = check(results, gpu=not args.cpu_demo)
    (args.out / "summary.json").write_text(json.dumps(
        {"scenarios": results, "failures": failures, "hardware": hardware,
         "cpu_demo": args.cpu_demo}, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(results))
    print(markdown(results))
    for failure in failures:
        print("FAIL:", failure)
    if args.archive:
        import tarfile

        with tarfile.open(args.archive, "w:gz") as tar:
            tar.add(args.out, arcname=args.out.name)
    return 0 if all(r["returncode"] == 0 for r in results) and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
