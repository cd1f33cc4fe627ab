"""Profiles of a running rank: `gputrain-exporter profile`, the push answer that carries the
request, the client's torch.profiler run and summary, Alertmanager's webhook, and where the
result shows (/api/v1/profile, /api/v1/status, the status page's data, /metrics).

Real parts: the daemon, real HTTP, real torch (CPU) training in a subprocess, Debian's
Alertmanager routing the shipped example config.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from conftest import (
    Alertmanager,
    require_module,
    sample_value,
    self_signed_cert,
    stop_all,
    wait_until,
)

from exporter.client.profiling import (
    RankProfiler,
    prune_traces,
    split_step,
    trace_budget,
    trace_dir,
    trace_path,
)
from exporter.protocol import (
    DEFAULT_PROFILE_STEPS,
    MAX_PROFILE_STEPS,
    PROFILE_PATH,
    PUSH_PATH,
    STEP_PARTS,
    Refused,
)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


# -- where a step's time went, on intervals whose answer is known -----------------------------

def test_a_step_splits_into_parts_that_sum_to_it():
    """10 ms step (times in µs): 4 ms fetch, forward ops 4.2-5.0, zero_grad 5.0-5.2, backward
    5.5-7.0, optimizer 7.2-7.6, an op after it 8.0-8.5 (a loss.item()), nothing after."""
    ops = [("enumerate(DataLoader)#x", 0, 4000), ("aten::linear", 4200, 4700),
           ("aten::relu", 4800, 5000), ("Optimizer.zero_grad#SGD.zero_grad", 5000, 5200),
           ("autograd::engine::evaluate_function: AddmmBackward0", 5500, 6000),
           ("autograd::engine::evaluate_function: ReluBackward0", 6500, 7000),
           ("Optimizer.step#SGD.step", 7200, 7600), ("aten::item", 8000, 8500)]
    parts = split_step((0, 10_000), 0.004, ops, [])
    assert parts["data_loading"] == pytest.approx(0.004)
    # from the first op after the fetch to the backward, less the zero_grad inside it
    assert parts["forward"] == pytest.approx(0.0013 - 0.0002)
    assert parts["backward"] == pytest.approx(0.0015)  # first to last autograd function
    assert parts["optimizer"] == pytest.approx(0.0002 + 0.0004)
    assert parts["other"] == pytest.approx(0.0005)
    # 4.0-4.2 (before the forward's first op), 7.0-7.2, 7.6-8.0 and 8.5-10
    assert parts["idle"] == pytest.approx(0.0002 + 0.0002 + 0.0004 + 0.0015)
    assert sum(parts[p] for p in STEP_PARTS) == pytest.approx(parts["seconds"]) == 0.01
    assert "gpu_busy" not in parts


def test_a_step_without_backward_is_forward_and_idle_and_the_gpu_busy_is_a_union():
    parts = split_step((0, 1000), 0.0, [("aten::mm", 100, 400), ("aten::add", 350, 500)],
                       [(0, 300), (200, 600), (900, 2000)])
    assert parts["forward"] == pytest.approx(0.0004) and parts["backward"] == 0
    assert parts["idle"] == pytest.approx(0.0006)
    assert parts["gpu_busy"] == pytest.approx(0.0007)  # 0-600 and 900-1000 of the step


def test_an_optimizer_step_that_runs_the_closure_is_optimizer_only_outside_it():
    """Lightning's automatic optimisation: Optimizer.step runs training_step and backward in
    its closure, then updates the weights."""
    ops = [("Optimizer.step#SGD.step", 1000, 9000), ("aten::linear", 1100, 3000),
           ("autograd::engine::evaluate_function: AddmmBackward0", 4000, 6000),
           ("aten::add_", 6500, 8500)]
    parts = split_step((0, 10_000), 0.001, ops, [])
    assert parts["forward"] == pytest.approx(0.0029)  # 1.1-4.0: first op to the backward
    assert parts["backward"] == pytest.approx(0.002)
    assert parts["optimizer"] == pytest.approx(0.0031)  # 1.0-1.1 and the update, 6.0-9.0
    assert parts["idle"] == pytest.approx(0.001)  # 9.0-10
    assert sum(parts[p] for p in STEP_PARTS) == pytest.approx(0.01)


def test_ops_of_other_steps_do_not_leak_into_a_step():
    ops = [("autograd::engine::evaluate_function: A", 100, 200),
           ("autograd::engine::evaluate_function: A", 1100, 1200)]
    first, second = split_step((0, 1000), 0, ops, []), split_step((1000, 2000), 0, ops, [])
    assert first["backward"] == second["backward"] == pytest.approx(0.0001)


# -- the client's side of the protocol -------------------------------------------------------

def _profiler() -> tuple[RankProfiler, list[str]]:
    calls: list[str] = []
    return RankProfiler("r", "0", lambda: calls.append("wake"),
                        lambda: calls.append("attention")), calls


@pytest.mark.parametrize("instruction", [
    {"type": "profile", "version": 2, "id": "p-0123456789ab", "steps": 3},  # a newer version
    {"type": "memory-snapshot", "version": 1, "id": "p-0123456789ab"},  # an unknown type
    {"type": "profile", "version": 1, "id": "../../x", "steps": 3},
    {"type": "profile", "version": 1, "id": "p-0123456789ab", "steps": 10_000},
    "profile", None,
])
def test_the_client_ignores_instructions_it_does_not_understand(instruction):
    prof, calls = _profiler()
    prof.offer(instruction)
    assert not prof.wanted and prof.report() is None and calls == []


def test_the_client_takes_one_profile_once_and_reports_until_the_daemon_has_it():
    prof, calls = _profiler()
    instruction = {"type": "profile", "version": 1, "id": "p-0123456789ab", "steps": 3}
    prof.offer(instruction)
    assert prof.wanted and prof.report() == {"id": "p-0123456789ab", "state": "accepted"}
    prof.offer(instruction)  # repeated by every answer until it runs: still one profile
    prof.offer({**instruction, "id": "p-ffffffffffff"})  # one at a time
    assert prof.report()["id"] == "p-0123456789ab" and calls.count("attention") == 2
    prof.close()  # training ended before a step boundary
    report = prof.report()
    assert report["state"] == "failed" and "training ended" in report["error"]
    prof.reported(report)
    assert prof.report() is None and not prof.wanted


def test_trace_files_stay_inside_the_trace_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path))
    directory = trace_dir("../../etc")
    assert directory == tmp_path.resolve()
    path = trace_path(directory, "../../etc/passwd", "0/../../x", "p-0123456789ab")
    assert path.parent == tmp_path.resolve() and path.name.endswith(".pt.trace.json.gz")
    monkeypatch.delenv("GPUTRAIN_TRACE_DIR")
    default = trace_dir("../../etc")
    assert default.name == ".._.._etc" and default.parent.name.startswith("gputrain-traces-")


# -- end to end: a real training process, the daemon, the command -----------------------------

def _train(daemon, run: str, trace: Path, *args: str) -> subprocess.Popen:
    require_module("torch")
    env = {**os.environ, "GPUTRAIN_URL": daemon.ingest_url, "GPUTRAIN_TRACE_DIR": str(trace),
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "examples/pytorch_train.py", "--device", "cpu", "--run", run,
         "--seconds", "600", "--batch-size", "8", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", "profile", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def training(tmp_path_factory, request):
    """A demo daemon and a CPU training run whose input is slow (150 ms per sample, 8 per
    batch: 1.2 s of sleep, where the model's step takes 20-170 ms on a busy 2-core machine and
    up to 0.9 s under the torch profiler beside CPU-burning processes): most of every step is
    data loading."""
    from conftest import Daemon

    tmp = tmp_path_factory.mktemp("profile")
    started: list = []
    try:
        d = Daemon("--gpu.backend=demo", "--demo.gpus=2", "--profile.alert-interval=1h",
                   "--profile.rank-interval=0s").start()
        started.append(d)
        proc = _train(d, "slow-input", tmp / "traces", "--input-sleep-ms", "150")
        started.append(proc)
        d.wait_sample("gputrain_training_steps_total", {"run": "slow-input"},
                      lambda v: v >= 2, timeout=180)
        yield {"daemon": d, "proc": proc, "traces": tmp / "traces"}
    finally:
        for s in started:
            if isinstance(s, subprocess.Popen):
                s.kill()
                s.wait(timeout=30)
        stop_all([s for s in started if not isinstance(s, subprocess.Popen)])


def test_the_profile_command_prints_where_the_time_went_and_the_trace_is_written(training):
    d = training["daemon"]
    out = _cli("--run", "slow-input", "--rank", "0", "--steps", "5", "--url", d.ingest_url,
               "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["state"] == "done" and doc["trigger"] == "cli" and doc["device"] == "cpu"
    assert len(doc["step_parts"]) == 5
    for step in doc["step_parts"]:
        assert sum(step[p] for p in STEP_PARTS) == pytest.approx(step["seconds"], rel=1e-6)
        # 8 samples x 150 ms of sleep per batch: 1.2 s of each step is data loading (less
        # the timer's edges)
        assert step["data_loading"] >= 1.15
        assert step["forward"] > 0 and step["backward"] > 0 and step["optimizer"] > 0
    # the largest part of the mean step (its share varies with how loaded the CPUs are)
    mean = doc["mean"]
    assert max(STEP_PARTS, key=lambda p: mean[p]) == "data_loading", mean
    assert any(op["name"].startswith("aten::") for op in doc["top_ops"])
    # the trace: gzipped Chrome JSON, inside GPUTRAIN_TRACE_DIR, its size as reported
    trace = Path(doc["trace"])
    assert trace.parent == training["traces"].resolve()
    assert trace.stat().st_size == doc["trace_bytes"]
    with gzip.open(trace, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep")]
    assert len(steps) == 5 and all(e["ph"] == "X" and e["dur"] > 0 for e in steps)
    # the recorded steps' spans match the summary's step times (microseconds)
    assert sorted(e["dur"] / 1e6 for e in steps) == pytest.approx(
        sorted(s["seconds"] for s in doc["step_parts"]), rel=0.05, abs=0.002)
    assert not list(trace.parent.glob("*.partial")) and not list(trace.parent.glob("*.json"))

    # where the result shows: the API, the status document, /metrics
    got = requests.get(f"{d.ingest_url}{PROFILE_PATH}/{doc['id']}", timeout=5).json()
    assert got["state"] == "done" and got["trace"] == doc["trace"]
    status = requests.get(f"{d.url}/api/v1/status", timeout=5).json()
    assert status["profiles"][0]["id"] == doc["id"]
    d.wait_sample("gputrain_training_profile_info",
                  {"run": "slow-input", "rank": "0", "trace": doc["trace"]},
                  lambda v: abs(v - doc["finished"]) < 1)
    # training went on
    assert training["proc"].poll() is None


def test_the_status_page_in_chromium_and_top_show_the_profile(training):
    from test_status import chromium, policy_violations

    d = training["daemon"]
    out = _cli("--run", "slow-input", "--steps", "2", "--url", d.ingest_url, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    run = chromium(d.url + "/", "--dump-dom")
    dom = run.stdout
    assert 'data-ready="1"' in dom, run.stderr[-2000:]
    assert f'data-profile="{doc["id"]}"' in dom
    assert 'data-top-part="data_loading"' in dom and doc["trace"] in dom
    assert policy_violations(run) == []
    top = subprocess.run([sys.executable, "-m", "exporter", "top", "--once", "--url", d.url],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    line = next(ln for ln in top.stdout.splitlines() if doc["id"] in ln)
    assert "slow-input/0" in line and "a step: data loading" in line
    assert doc["trace"] in "".join(top.stdout.split())  # rich may wrap the long path


def test_the_text_output_names_the_biggest_part_and_the_top_operators(training):
    out = _cli("--run", "slow-input", "--steps", "2", "--url", training["daemon"].ingest_url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Where each step's time went (ms):" in out.stdout
    assert "Most of a step: data loading" in out.stdout
    assert "Top operators by self CPU time" in out.stdout
    assert "queued; the rank takes it with its next push" in out.stderr


@pytest.mark.parametrize("args, code, message", [
    (["--run", "nope"], 2, "no rank of run 'nope' pushes to this daemon; runs here: "
                           "slow-input"),
    (["--run", "slow-input", "--rank", "7"], 2, "its ranks here: 0"),
    (["--run", "slow-input", "--steps", "0"], 2, f"--steps must be 1-{MAX_PROFILE_STEPS}"),
    (["--run", "slow-input", "--steps", str(MAX_PROFILE_STEPS + 1)], 2,
     f"--steps must be 1-{MAX_PROFILE_STEPS}"),
])
def test_the_command_says_what_is_wrong(training, args, code, message):
    out = _cli(*args, "--url", training["daemon"].ingest_url)
    assert out.returncode == code and message in out.stderr, out.stderr


def test_the_command_says_when_the_daemon_is_not_there():
    out = _cli("--run", "x", "--url", "http://127.0.0.1:9", timeout=60)
    assert out.returncode == 2 and "cannot reach the daemon" in out.stderr


def test_a_client_without_the_capability_gets_text_and_cannot_be_profiled(training):
    """An old client (no 'capabilities') gets the plain 'ok' answer it always had, and a
    profile of it is refused at once, saying why."""
    d = training["daemon"]
    body = {"version": 1, "run": "old-client", "rank": "0", "run_id": "abc", "steps": 1,
            "step_seconds": 0.1, "data_wait_seconds": 0.0, "samples": 8}
    r = requests.post(d.ingest_url + PUSH_PATH, json=body, timeout=5)
    assert r.status_code == 200 and r.text == "ok\n"
    r = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "old-client"}, timeout=5)
    assert r.status_code == 409 and "client does not offer it" in r.json()["error"]
    r = requests.post(d.ingest_url + PUSH_PATH, json={**body, "steps": 2,
                                                      "capabilities": ["profile"]}, timeout=5)
    assert r.headers["Content-Type"] == "application/json"
    assert r.json() == {"result": "ok", "instructions": []}


def _final(d, pid: str, timeout: float = 120) -> dict:
    def done():
        doc = requests.get(f"{d.ingest_url}{PROFILE_PATH}/{pid}?wait=2", timeout=10).json()
        return doc if doc["state"] in ("done", "failed", "expired") else None
    return wait_until(done, timeout=timeout, what=f"profile {pid} to finish")


def test_one_profile_per_rank_at_a_time_a_second_request_is_a_409(training):
    d = training["daemon"]
    first = requests.post(d.ingest_url + PROFILE_PATH,
                          json={"run": "slow-input", "rank": "0", "steps": 1}, timeout=5)
    assert first.status_code == 200, first.text
    pid = first.json()["id"]
    second = requests.post(d.ingest_url + PROFILE_PATH,
                           json={"run": "slow-input", "rank": 0, "steps": 3}, timeout=5)
    assert second.status_code == 409
    assert f"rank 0 of run slow-input is already being profiled ({pid}" in \
        second.json()["error"]
    out = _cli("--run", "slow-input", "--url", d.ingest_url)
    assert out.returncode == 2 and "one profile per rank at a time" in out.stderr
    assert _final(d, pid)["state"] == "done"
    # the rank is free again
    third = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "slow-input", "steps": 1},
                          timeout=5)
    assert third.status_code == 200, third.text
    assert _final(d, third.json()["id"])["state"] == "done"


NO_TORCH = """
import sys, time
sys.modules["torch"] = None  # as on a machine where torch is not installed
from exporter.client import TrainingMonitor
monitor = TrainingMonitor(run="no-torch", rank=0, endpoint=sys.argv[1], push_interval=0.2)
while True:
    with monitor.step(samples=8):
        time.sleep(0.02)
"""


def test_a_client_without_torch_answers_profiling_unavailable(daemon_factory):
    """A client that cannot import torch still takes the request, and answers it at once:
    the command says why, and the loop goes on as before."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    proc = subprocess.Popen([sys.executable, "-c", NO_TORCH, d.ingest_url], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        d.wait_sample("gputrain_training_steps_total", {"run": "no-torch"}, lambda v: v >= 1,
                      timeout=60)
        out = _cli("--run", "no-torch", "--url", d.ingest_url)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "failed: profiling unavailable: torch cannot be imported" in out.stderr
        before = sample_value(d.metrics(), "gputrain_training_steps_total", {"run": "no-torch"})
        d.wait_sample("gputrain_training_steps_total", {"run": "no-torch"},
                      lambda v: v > before, timeout=60)
        assert proc.poll() is None
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err


def test_dataloader_workers_never_profile_and_old_traces_are_pruned(daemon_factory, tmp_path,
                                                                     monkeypatch):
    """Workers forked while the rank records inherit torch's profiler, which then records
    (and slows) every op they run for nobody: the client turns it off in them. The trace
    directory's oldest traces of ours go past GPUTRAIN_TRACE_BUDGET_MB; a user's own stay."""
    torch = require_module("torch")
    from torch.utils.data import DataLoader, Dataset

    from exporter.client import TrainingMonitor

    mib = 1024 * 1024
    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("GPUTRAIN_TRACE_BUDGET_MB", "1")
    oldest = tmp_path / "workers-rank0-p-000000000001.pt.trace.json.gz"
    older = tmp_path / "workers-rank0-p-000000000002.pt.trace.json.gz"
    mine = tmp_path / "my-own.pt.trace.json.gz"  # not ours: never pruned
    for age, f in enumerate((mine, oldest, older)):
        f.write_bytes(b"\0" * (mib * 6 // 10))
        os.utime(f, (1_000_000 + age, 1_000_000 + age))

    class Flagged(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int):
            time.sleep(0.005)
            return torch.tensor(float(torch._C._autograd._profiler_enabled()))

    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    monitor = TrainingMonitor(run="workers", rank=0, endpoint=d.ingest_url, push_interval=0.2)
    # two batches an epoch, workers not persistent: each epoch forks them again, so some are
    # forked while the profile records
    loader = DataLoader(Flagged(), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    model = torch.nn.Linear(1, 1)
    asked, forked_while_recording, flags = None, 0, []
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            recording = torch._C._autograd._profiler_enabled()  # when iter() forks them
            for x in monitor.wrap(loader):
                model(x.unsqueeze(1)).sum().backward()
                if recording:
                    flags += x.tolist()
            forked_while_recording += recording
            if asked is None:
                r = requests.post(d.ingest_url + PROFILE_PATH,
                                  json={"run": "workers", "steps": 5}, timeout=5)
                asked = r.json()["id"] if r.ok else None
            elif monitor._profiler._state in ("done", "failed"):
                break
        assert asked is not None
        doc = _final(d, asked)
    finally:
        monitor.close()
    assert doc["state"] == "done", doc
    assert forked_while_recording >= 1 and flags and not any(flags), flags
    traces = sorted(tmp_path.glob("workers-rank0-p-*.pt.trace.json.gz"))
    assert Path(doc["trace"]) in traces
    with gzip.open(doc["trace"], "rt") as fh:
        pids = {e["pid"] for e in json.load(fh)["traceEvents"] if e.get("cat") == "cpu_op"}
    assert pids == {os.getpid()}
    assert not oldest.exists() and mine.exists()
    assert sum(f.stat().st_size for f in traces) <= mib or traces == [Path(doc["trace"])]


def test_old_traces_are_pruned_oldest_first_and_only_ours(tmp_path, monkeypatch):
    """The budget counts our traces in the trace directory (or, by default, under every run's
    directory beside it); the one just written always stays."""
    def put(directory: Path, name: str, size: int, age: int) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        f = directory / name
        f.write_bytes(b"x" * size)
        os.utime(f, (1_000_000 + age, 1_000_000 + age))
        return f

    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path / "set"))
    here = trace_dir("r")
    user = put(here, "mine.pt.trace.json.gz", 5000, 0)
    a = put(here, "r-rank0-p-00000000000a.pt.trace.json.gz", 400, 1)
    b = put(here, "r-rank1-p-00000000000b.pt.trace.json.gz", 300, 2)
    c = put(here, "r-rank0-p-00000000000c.pt.trace.json.gz", 500, 3)
    assert prune_traces(here, 900, keep=c) == [a]
    assert b.exists() and c.exists() and user.exists()
    assert prune_traces(here, 100, keep=c) == [b]  # over budget, but the new one stays
    assert c.exists() and user.exists()

    monkeypatch.delenv("GPUTRAIN_TRACE_DIR")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    old_run, new_run = trace_dir("old-run"), trace_dir("new-run")
    assert old_run.parent == new_run.parent
    gone = put(old_run, "old-run-rank0-p-00000000000d.pt.trace.json.gz", 700, 1)
    new = put(new_run, "new-run-rank0-p-00000000000e.pt.trace.json.gz", 700, 2)
    assert prune_traces(new_run, 1000, keep=new) == [gone]

    for raw, budget in (("0.5", 512 * 1024), ("nonsense", 1024 * 1024 * 1024),
                        ("-1", 1024 * 1024 * 1024)):
        monkeypatch.setenv("GPUTRAIN_TRACE_BUDGET_MB", raw)
        assert trace_budget() == budget


def test_a_long_profile_prints_its_slowest_steps():
    from exporter.cli.profile import render
    from exporter.serving.profiles import mean_parts

    steps = [{"seconds": 0.010 + (0.1 if i in (4, 17, 25) else 0.0), "data_loading": 0.0,
              "forward": 0.005, "backward": 0.003, "optimizer": 0.001, "other": 0.0,
              "idle": 0.001 + (0.1 if i in (4, 17, 25) else 0.0)} for i in range(30)]
    doc = {"id": "p-00000000000f", "run": "r", "rank": "0", "trigger": "cli", "device": "cpu",
           "trace": "/t/r.pt.trace.json.gz", "trace_bytes": 2048, "step_parts": steps,
           "mean": mean_parts(steps), "top_ops": []}
    text = render(doc)
    assert "Where the 10 slowest of the 30 steps' time went" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  ")
            and line.split()[0].isdigit()]
    assert len(rows) == 10
    assert {"5", "18", "26"} <= {r[0] for r in rows}  # 1-based step numbers
    doc["step_parts"] = steps[:20]
    assert "Where each step's time went" in render(doc)


@pytest.mark.parametrize("payload, code, message", [
    (b"{", 400, "must be JSON"),
    (b'{"rank": "0"}', 400, "field 'run'"),
    (b'{"run": "slow-input", "steps": "5"}', 400, "'steps' must be a whole number"),
    (b'{"run": "slow-input", "steps": 2.5}', 400,
     "'steps' must be a whole number (a float at most 2^53), got 2.5"),  # a push's check
    (b'{"run": "slow-input", "steps": 201}', 400, "steps must be 1-200"),
    (b'{"run": "nope"}', 404, "no rank of run 'nope' pushes to this daemon"),
    (b'{"run": "slow-input", "rank": "7"}', 404, "run 'slow-input' has no rank '7'"),
])
def test_bad_profile_requests_are_400s_that_say_why(training, payload, code, message):
    r = requests.post(training["daemon"].ingest_url + PROFILE_PATH, data=payload, timeout=5)
    assert r.status_code == code and message in r.json()["error"]


def test_a_bad_report_in_a_push_is_refused_and_changes_nothing(training):
    d = training["daemon"]
    body = {"version": 1, "run": "liar", "rank": "0", "run_id": "abc", "steps": 1,
            "step_seconds": 0.1, "data_wait_seconds": 0.0, "samples": 8,
            "profile": {"id": "p-0123456789ab", "state": "done", "trace": "/t",
                        "trace_bytes": -1, "steps": []}}
    r = requests.post(d.ingest_url + PUSH_PATH, json=body, timeout=5)
    assert r.status_code == 400 and "profile.trace_bytes" in r.text
    assert sample_value(d.metrics(), "gputrain_training_steps_total", {"run": "liar"}) is None


# -- Alertmanager ------------------------------------------------------------------------------

def _alert(name: str, run: str, rank: str, status: str = "firing") -> dict:
    return {"status": status, "labels": {"alertname": name, "run": run, "rank": rank,
                                         "severity": "warning"}}


def test_the_webhook_profiles_once_per_run_and_says_what_it_skipped(daemon_factory, tmp_path):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    body = {"version": 1, "run": "hooked", "rank": "0", "run_id": "abc", "steps": 1,
            "step_seconds": 0.1, "data_wait_seconds": 0.0, "samples": 8,
            "capabilities": ["profile"]}
    assert requests.post(d.ingest_url + PUSH_PATH, json=body, timeout=5).ok
    payload = {"version": "4", "status": "firing", "alerts": [
        _alert("GpuTrainInputBound", "hooked", "0"),
        _alert("GpuTrainHostMemoryLeak", "hooked", "0"),  # a profile cannot explain a leak
        _alert("GpuTrainLaunchBound", "hooked", "0", status="resolved"),
        _alert("GpuTrainInputBound", "elsewhere", "3"),  # a rank of another node
    ]}
    r = requests.post(d.ingest_url + "/api/v1/alerts", json=payload, timeout=5)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [(s["alertname"], s["run"], s["rank"]) for s in answer["started"]] == [
        ("GpuTrainInputBound", "hooked", "0")]
    assert [s["run"] for s in answer["skipped"]] == ["elsewhere"]
    assert "no rank of run 'elsewhere'" in answer["skipped"][0]["reason"]
    # a second alert for the run within the hour: no second profile
    r = requests.post(d.ingest_url + "/api/v1/alerts", json={"alerts": [
        _alert("GpuTrainLowMFU", "hooked", "0")]}, timeout=5)
    assert r.json()["started"] == [] and "at most one per 3600 s" in \
        r.json()["skipped"][0]["reason"]
    profiles = requests.get(d.ingest_url + PROFILE_PATH, timeout=5).json()["profiles"]
    assert [(p["run"], p["trigger"], p["state"]) for p in profiles] == [
        ("hooked", "alert:GpuTrainInputBound", "queued")]
    # the rank's next push carries it
    r = requests.post(d.ingest_url + PUSH_PATH, json={**body, "steps": 2}, timeout=5)
    (instruction,) = r.json()["instructions"]
    assert instruction == {"type": "profile", "version": 1, "id": profiles[0]["id"],
                           "steps": DEFAULT_PROFILE_STEPS}
    assert requests.post(d.ingest_url + "/api/v1/alerts", data=b"[]",
                         timeout=5).status_code == 400


def test_the_webhook_needs_the_ingest_token_when_one_is_set(daemon_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-16+")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", f"--ingest.token-file={token}")
    r = requests.post(d.ingest_url + "/api/v1/alerts", json={"alerts": []}, timeout=5)
    assert r.status_code == 401
    r = requests.post(d.ingest_url + "/api/v1/alerts", json={"alerts": []}, timeout=5,
                      headers={"Authorization": "Bearer s3cret-token-of-16+"})
    assert r.status_code == 200 and r.json() == {"started": [], "skipped": [], "skipped_total": 0}
    # the command says which flag or variable gives the token
    out = _cli("--run", "x", "--url", d.ingest_url, timeout=60)
    assert out.returncode == 2
    assert "asks for its ingest token (401): give it with --token-file FILE, or set " \
        "GPUTRAIN_TOKEN or GPUTRAIN_TOKEN_FILE" in out.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token-at-all")
    out = _cli("--run", "x", "--url", d.ingest_url, "--token-file", str(wrong), timeout=60)
    assert out.returncode == 2 and "refused the ingest token given (401)" in out.stderr


def test_alertmanager_with_the_shipped_config_asks_the_daemon_for_a_profile(training,
                                                                           tmp_path):
    """The example config's profile route, pointed at this daemon: an alert sent to a real
    Alertmanager (as Prometheus would) ends in a finished profile of that rank."""
    d = training["daemon"]
    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    (receiver,) = [r for r in config["receivers"] if r["name"] == "gputrain-profile"]
    assert receiver["webhook_configs"][0]["url"] == "http://127.0.0.1:19401/api/v1/alerts"
    receiver["webhook_configs"][0]["url"] = d.ingest_url + "/api/v1/alerts"
    for r in config["receivers"]:  # the people's receivers: nowhere, in a test
        if r["name"] != "gputrain-profile":
            r["webhook_configs"] = [{"url": "http://127.0.0.1:9/"}]
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    am = Alertmanager(tmp_path, path).start()
    try:
        before = {p["id"] for p in requests.get(d.ingest_url + PROFILE_PATH,
                                                timeout=5).json()["profiles"]}
        alert = {"labels": {"alertname": "GpuTrainInputBound", "run": "slow-input",
                            "rank": "0", "severity": "warning", "instance": "node-1"},
                 "annotations": {"summary": "A training run waits on its data loader."}}
        r = requests.post(am.url + "/api/v2/alerts", json=[alert], timeout=5)
        assert r.status_code == 200, r.text

        def finished(kind: str):
            docs = requests.get(d.ingest_url + PROFILE_PATH, timeout=5).json()["profiles"]
            new = [p for p in docs if p["id"] not in before and p["kind"] == kind
                   and p["trigger"] == "alert:GpuTrainInputBound"]
            return new if new and new[0]["state"] in ("done", "failed", "expired") else None

        (profile,) = wait_until(lambda: finished("torch"), timeout=120,
                                what="the alert's profile")
        assert profile["state"] == "done", profile
        # the largest part of the mean step (its share varies with how loaded the CPUs are)
        mean = profile["mean"]
        assert max(STEP_PARTS, key=lambda p: mean[p]) == "data_loading", mean
        assert Path(profile["trace"]).is_file()
        status = requests.get(d.url + "/api/v1/status", timeout=5).json()
        assert any(p["id"] == profile["id"] for p in status["profiles"])
        # the same alert asked for py-spy stacks of the rank too: the main process's time is
        # in the dataset that sleeps (the example's slow input)
        (stacks,) = wait_until(lambda: finished("stacks"), timeout=120,
                               what="the alert's py-spy stacks")
        assert stacks["state"] == "done" and stacks["mode"] == "record", stacks
        main = next(r for r in stacks["roles"] if r["role"] == "main")
        assert main["top"][0]["function"] == "SyntheticImages.__getitem__", main
    finally:
        stop_all([am])


def test_a_daemon_that_dies_mid_profile_does_not_stop_training(daemon_factory, tmp_path):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    proc = _train(d, "orphan", tmp_path, "--input-sleep-ms", "5")
    try:
        d.wait_sample("gputrain_training_steps_total", {"run": "orphan"}, lambda v: v >= 1,
                      timeout=180)
        r = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "orphan", "steps": 20},
                          timeout=5)
        assert r.ok
        pid = r.json()["id"]
        wait_until(lambda: requests.get(f"{d.ingest_url}{PROFILE_PATH}/{pid}", timeout=5)
                   .json()["state"] == "running", timeout=60, what="the profile to start")
        d.kill()
        # the trace is still written, and training goes on without the daemon
        # (a profile and its gzipped trace on two cores the suite's other workers load: over
        # 120 s seen)
        wait_until(lambda: list(tmp_path.glob("orphan-rank0-*.pt.trace.json.gz")),
                   timeout=300, what="the trace")
        # a daemon started again where the old one took pushes sees the steps go on: the
        # client kept training (and retrying its pushes) with no daemon to answer
        again = daemon_factory("--gpu.backend=demo", "--demo.gpus=1",
                               ingest_port=d.ingest_port)
        first = again.wait_sample("gputrain_training_steps_total", {"run": "orphan"},
                                  timeout=120)
        again.wait_sample("gputrain_training_steps_total", {"run": "orphan"},
                          lambda v: v > first, timeout=120)
        assert proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_lightning_run_is_profiled_through_its_callback(daemon_factory, tmp_path,
                                                         monkeypatch):
    """The step boundaries of the Lightning integration drive the profile as wrap()'s do:
    asked for from inside training, it finishes while Lightning trains on."""
    pl = require_module("lightning.pytorch")
    import torch

    from exporter.client.lightning import GpuTrainCallback

    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path / "traces"))
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    asked: dict = {}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int):
            time.sleep(0.002)  # 16 ms of input per batch of 8
            return torch.randn(16), torch.randn(1)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class AskAndStop(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if not asked:  # until the rank's first push has reached the daemon
                r = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "lit", "steps": 3},
                                  timeout=5)
                if r.ok:
                    asked.update(r.json())
            if asked and requests.get(f"{d.ingest_url}{PROFILE_PATH}/{asked['id']}",
                                      timeout=5).json()["state"] in ("done", "failed"):
                trainer.should_stop = True

    trainer = pl.Trainer(max_steps=3000, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[GpuTrainCallback(run="lit", endpoint=d.ingest_url,
                                                     push_interval=0.2), AskAndStop()])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(Data(), batch_size=8))
    doc = requests.get(f"{d.ingest_url}{PROFILE_PATH}/{asked['id']}", timeout=5).json()
    assert doc["state"] == "done", doc
    assert trainer.global_step < 3000
    mean = doc["mean"]
    assert mean["data_loading"] >= 0.012  # the 16 ms fetch, as the client measured it
    assert mean["backward"] > 0 and mean["optimizer"] > 0
    assert Path(doc["trace"]).parent == (tmp_path / "traces").resolve()


def test_a_report_the_daemon_refuses_is_dropped_and_the_totals_go_on(daemon_factory):
    """A client whose report the daemon cannot read (a bug, a newer field) must not have
    every later push refused with it."""
    from exporter.client import TrainingMonitor

    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    monitor = TrainingMonitor(run="dropped", rank=0, endpoint=d.ingest_url, start=False)
    try:
        monitor._profiler._report = {"id": "p-0123456789ab", "state": "done",
                                     "trace": "/t", "trace_bytes": -1}
        with monitor.step(samples=8):
            pass
        assert not monitor.flush()  # refused with the report: a 400 that names it
        assert monitor._profiler.report() is None
        assert monitor.flush()  # without it
        assert sample_value(d.metrics(), "gputrain_training_steps_total",
                            {"run": "dropped"}) == 1
    finally:
        monitor.close()


def test_the_command_reaches_an_https_ingest_with_a_token_by_server_name(daemon_factory,
                                                                         tmp_path):
    """As on Kubernetes: the ingest's certificate names `gputrain-exporter`, not the address
    dialled, and it wants the token. The request gets through (to a 404 that names the run)
    with --ca-file, --tls-server-name and --token-file, and not without the name."""
    cert, key = self_signed_cert(tmp_path, "DNS:gputrain-exporter")
    token = tmp_path / "token"
    token.write_text("a-token-of-sixteen-or-more")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", f"--ingest.token-file={token}",
                       f"--ingest.tls-cert-file={cert}", f"--ingest.tls-key-file={key}")
    url = d.ingest_url.replace("http://", "https://")
    common = ["--run", "somewhere", "--url", url, "--ca-file", str(cert)]
    out = _cli(*common, "--token-file", str(token), "--tls-server-name", "gputrain-exporter")
    assert out.returncode == 2 and "no rank of run 'somewhere'" in out.stderr, out.stderr
    out = _cli(*common, "--token-file", str(token))
    assert out.returncode == 2 and "the TLS handshake" in out.stderr  # 127.0.0.1: no
    out = _cli(*common, "--tls-server-name", "gputrain-exporter")
    assert out.returncode == 2 and "asks for its ingest token (401)" in out.stderr


def test_a_keras_fit_on_torch_is_profiled_through_its_callback(tmp_path, monkeypatch):
    """Keras 3 on the torch backend: the callback's step boundaries drive the profile (the
    instruction handed over as the pusher does; no daemon needed for the client's side)."""
    require_module("torch")
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    keras = require_module("keras")
    import numpy as np

    from exporter.client import TrainingMonitor
    from exporter.client.keras import GpuTrainCallback

    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path))
    monitor = TrainingMonitor(run="keras-prof", endpoint="http://127.0.0.1:9", start=False)
    callback = GpuTrainCallback(batch_size=8, monitor=monitor)
    profiler = monitor._profiler
    profiler.offer({"type": "profile", "version": 1, "id": "p-00000000000a", "steps": 3})
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(400, 32).astype("float32"), np.random.rand(400, 1).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    wait_until(lambda: (profiler.report() or {}).get("state") in ("done", "failed"),
               timeout=60, what="the profile's summary")
    report = profiler.report()
    assert report["state"] == "done", report
    assert len(report["steps"]) == 3
    for step in report["steps"]:
        assert sum(step[p] for p in STEP_PARTS) == pytest.approx(step["seconds"], rel=1e-6)
    assert Path(report["trace"]).parent == tmp_path.resolve()


def test_a_profile_that_ends_with_training_is_still_delivered(daemon_factory, tmp_path,
                                                             monkeypatch):
    """Training stops right after the last profiled step: close() waits for the trace (a
    few seconds at most) and its goodbye push carries the result."""
    require_module("torch")
    import torch

    from exporter.client import TrainingMonitor
    from exporter.client.profiling import _FINISHING

    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path))
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    monitor = TrainingMonitor(run="last", rank=0, endpoint=d.ingest_url, push_interval=0.2)
    # many small ops: a trace that takes a while to write (longer than close()'s own second)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(60)])
    asked = None
    for _ in range(5000):
        with monitor.step(samples=8):
            model(torch.randn(8, 8)).sum().backward()
        if asked is None:
            # 4 steps: on two cores under three other workers a 10-step trace outlasted
            # close()'s 10 s (the profile then read "running": CI, 2026-11-28)
            r = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "last", "steps": 4},
                              timeout=5)
            asked = r.json()["id"] if r.ok else None
        if monitor._profiler._prof is _FINISHING:
            break
        time.sleep(0.01)
    monitor.close()
    doc = requests.get(f"{d.ingest_url}{PROFILE_PATH}/{asked}", timeout=5).json()
    assert doc["state"] == "done", doc
    assert Path(doc["trace"]).is_file()


def test_the_alert_rate_limit_frees_a_run_after_the_interval_and_on_a_refusal(clock):
    """On the board itself with a fake clock: a refused request (its rank not here yet) takes
    no slot; a run is profiled again once the interval has passed, and a profile that nobody
    takes expires, saying why."""
    from types import SimpleNamespace

    from exporter.serving.profiles import QUEUE_TIMEOUT, ProfileBoard

    ranks: list = []
    board = ProfileBoard(lambda: ranks, alert_interval=600, clock=clock,
                         profiled_alerts=frozenset({"GpuTrainInputBound"}))
    call = json.dumps({"alerts": [_alert("GpuTrainInputBound", "r", "0")]}).encode()
    assert board.alerts(call)["started"] == []  # no rank of r here yet
    ranks.append(SimpleNamespace(run="r", rank="0", run_id="a", capabilities=("profile",)))
    (first,) = board.alerts(call)["started"]  # the refusal took no slot
    clock.advance(QUEUE_TIMEOUT + 1)
    expired = board.get(first["id"])
    assert expired.state == "expired" and "did not take it" in expired.error
    clock.advance(100)
    assert board.alerts(call)["started"] == []  # 161 s after the first: rate-limited
    clock.advance(600)
    (again,) = board.alerts(call)["started"]  # a new profile once the interval has passed
    assert again["id"] != first["id"] and board.get(again["id"]).state == "queued"


def test_the_status_document_shows_a_profile_at_once(clock):
    """A profile asked for (or finished) between two sampler cycles is in the very next
    /api/v1/status, watched or not: the document is keyed on the profiles too."""
    from types import SimpleNamespace

    from exporter.heuristics.rules import DEFAULTS
    from exporter.serving.history import History
    from exporter.serving.profiles import ProfileBoard
    from exporter.serving.status import StatusView

    ranks = [SimpleNamespace(run="r", rank="0", run_id="a", capabilities=("profile",))]
    board = ProfileBoard(lambda: ranks, clock=clock)
    view = StatusView(History(300), DEFAULTS["thresholds"], profiles=board)
    assert json.loads(view.json_bytes())["profiles"] == []
    view._thread = object()  # as if the builder thread kept it fresh for a viewer
    profile = board.request("r", "0", 3)
    (shown,) = json.loads(view.json_bytes())["profiles"]
    assert shown["id"] == profile.id and shown["state"] == "queued"


# -- issue 29: the webhook turned against the daemon, rate limits, redaction, the terminal ------

RANK = {"version": 1, "run": "hooked", "rank": "0", "run_id": "abc", "steps": 1,
        "step_seconds": 0.1, "data_wait_seconds": 0.0, "samples": 8,
        "capabilities": ["profile"]}


def test_a_malformed_alert_is_skipped_with_a_short_reason_never_a_traceback(daemon_factory):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--log.level=debug")
    assert requests.post(d.ingest_url + PUSH_PATH, json=RANK, timeout=5).ok
    bad_name = _alert("GpuTrainInputBound", "hooked", "0")
    bad_name["labels"]["alertname"] = ["GpuTrainInputBound"]
    bad_run = _alert("GpuTrainInputBound", "hooked", "0")
    bad_run["labels"]["run"] = {"a": "x" * 10000}
    for _ in range(20):  # the client made thousands of tracebacks a second
        r = requests.post(d.ingest_url + "/api/v1/alerts", timeout=5, json={"alerts": [
            _alert("GpuTrainInputBound", "hooked", "0"), bad_name, "not an alert",
            {"status": "firing", "labels": ["x"]}, bad_run]})
        assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["skipped_total"] == 5  # 4 malformed and the rate-limited valid one
    reasons = [s["reason"] for s in answer["skipped"]]
    assert "the alert's alertname is not a string" in reasons
    assert "the alert is not an object" in reasons and "the alert has no labels object" in reasons
    assert "the alert names no valid run and rank" in reasons
    assert len(r.content) < 4096, "no malformed value is echoed"
    profiles = requests.get(d.ingest_url + PROFILE_PATH, timeout=5).json()["profiles"]
    assert len(profiles) == 1  # the valid alert, once
    assert "Traceback" not in d.log_text()


def test_the_webhook_answer_stays_short_whatever_the_number_of_live_runs(daemon_factory):
    """300 live runs with 128-character names, then 1,000 firing alerts for runs that are not
    here: the answer lists 20 of the skipped alerts, counts all 1,000, and each reason names
    at most 5 live runs (the issue's answer was 133 MB)."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--ingest.max-series=300")
    s = requests.Session()
    for i in range(300):
        assert s.post(d.ingest_url + PUSH_PATH, timeout=10,
                      json={**RANK, "run": f"r{i:03d}" + "x" * 124}).ok
    call = {"alerts": [_alert("GpuTrainInputBound", f"gone-{i}", "0") for i in range(1000)]}
    r = s.post(d.ingest_url + "/api/v1/alerts", json=call, timeout=30)
    assert r.status_code == 200
    answer = r.json()
    assert answer["started"] == [] and answer["skipped_total"] == 1000
    assert len(answer["skipped"]) == 20
    assert "runs here: r000" in answer["skipped"][0]["reason"]
    assert answer["skipped"][0]["reason"].endswith("and 295 more")
    assert len(r.content) < 64 * 1024, len(r.content)


def test_a_rank_is_profiled_at_most_once_per_rank_interval(daemon_factory):
    """After a profile of a rank ends, another within --profile.rank-interval is a 429 that
    says when to ask again (Retry-After too); the command prints it."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--profile.rank-interval=1h")
    assert requests.post(d.ingest_url + PUSH_PATH, json=RANK, timeout=5).ok
    pid = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "hooked"},
                        timeout=5).json()["id"]
    r = requests.post(d.ingest_url + PUSH_PATH, json={**RANK, "steps": 2}, timeout=5)
    assert r.json()["instructions"][0]["id"] == pid
    r = requests.post(d.ingest_url + PUSH_PATH, timeout=5, json={
        **RANK, "steps": 3, "profile": {"id": pid, "state": "failed", "error": "no torch"}})
    assert r.ok
    r = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "hooked"}, timeout=5)
    assert r.status_code == 429 and "--profile.rank-interval" in r.json()["error"]
    assert 3500 <= int(r.headers["Retry-After"]) <= 3600
    out = _cli("--run", "hooked", "--url", d.ingest_url, timeout=60)
    assert out.returncode == 2 and "at most one profile of a rank per 3600 s" in out.stderr


def test_0s_means_no_limit_for_both_profile_intervals(clock):
    from types import SimpleNamespace

    from exporter.config import resolve
    from exporter.serving.profiles import QUEUE_TIMEOUT, ProfileBoard

    ns = argparse.Namespace(**{"profile.alert-interval": "0s", "profile.rank-interval": "0"})
    settings = resolve(ns)
    assert settings["profile.alert-interval"] == 0 and settings["profile.rank-interval"] == 0
    ranks = [SimpleNamespace(run="r", rank="0", run_id="a", capabilities=("profile",))]
    board = ProfileBoard(lambda: ranks, alert_interval=0, clock=clock, rank_interval=0,
                         profiled_alerts=frozenset({"GpuTrainInputBound"}))
    call = json.dumps({"alerts": [_alert("GpuTrainInputBound", "r", "0")]}).encode()
    for _ in range(3):
        (started,) = board.alerts(call)["started"]
        clock.advance(QUEUE_TIMEOUT + 1)  # nobody takes it: it expires, the rank is free
        assert board.get(started["id"]).state == "expired"
    limited = ProfileBoard(lambda: ranks, clock=clock, rank_interval=600)
    limited.request("r", "0", 1)
    clock.advance(QUEUE_TIMEOUT + 1)
    with pytest.raises(Refused) as refused:
        limited.request("r", "0", 1)
    assert refused.value.status == 429 and refused.value.retry_after == 600 - QUEUE_TIMEOUT - 1
    clock.advance(600)
    assert limited.request("r", "0", 1).state == "queued"


def test_with_a_token_the_status_view_leaves_out_what_the_token_guards(daemon_factory,
                                                                         tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-16+")
    auth = {"Authorization": "Bearer s3cret-token-of-16+"}
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", f"--ingest.token-file={token}")
    assert requests.post(d.ingest_url + PUSH_PATH, json=RANK, headers=auth, timeout=5).ok
    pid = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "hooked"}, headers=auth,
                        timeout=5).json()["id"]
    requests.post(d.ingest_url + PUSH_PATH, json={**RANK, "steps": 2}, headers=auth, timeout=5)
    requests.post(d.ingest_url + PUSH_PATH, headers=auth, timeout=5, json={
        **RANK, "steps": 3, "profile": {"id": pid, "state": "failed",
                                        "error": "cannot write /home/alice/secret"}})
    status = requests.get(d.url + "/api/v1/status", timeout=5)
    (shown,) = status.json()["profiles"]
    assert shown["run"] == "hooked" and shown["state"] == "failed"
    assert shown["id"] is None and "secret" not in status.text and pid not in status.text
    guarded = requests.get(f"{d.ingest_url}{PROFILE_PATH}/{pid}", headers=auth, timeout=5)
    assert "/home/alice/secret" in guarded.json()["error"]


EVIL = "aten::mm\x1b]0;pwned\x07\x1b[2J\u202e"


def test_the_profile_command_escapes_what_a_rank_sends(daemon_factory):
    """A rank's operator names, trace path and errors reach the terminal with their control
    characters escaped: they cannot set its title, clear it or reorder text."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    assert requests.post(d.ingest_url + PUSH_PATH, json=RANK, timeout=5).ok
    cli = subprocess.Popen([sys.executable, "-m", "exporter", "profile", "--run", "hooked",
                            "--steps", "1", "--url", d.ingest_url], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        answer = wait_until(lambda: requests.post(
            d.ingest_url + PUSH_PATH, json={**RANK, "steps": 2}, timeout=5).json()[
            "instructions"], timeout=60, what="the command's request to reach the rank")
        step = {"seconds": 0.1, **dict.fromkeys(STEP_PARTS, 0.0), "forward": 0.1}
        r = requests.post(d.ingest_url + PUSH_PATH, timeout=5, json={
            **RANK, "steps": 3, "profile": {
                "id": answer[0]["id"], "state": "done", "trace": "/tmp/t\x9b2J.json.gz",
                "trace_bytes": 10, "device": "cpu", "steps": [step],
                "top_ops": [{"name": EVIL, "calls": 1, "self_cpu_seconds": 0.1}]}})
        assert r.ok, r.text
        out, err = cli.communicate(timeout=60)
    finally:
        cli.kill()
    assert cli.returncode == 0, err
    assert "aten::mm\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in out and "t\\x9b2J" in out
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in out + err


def test_top_escapes_what_the_daemon_sends(daemon_factory):
    """`top` prints names from any daemon it is pointed at: control characters in them are
    escaped (a status document served by a stand-in with a hostile instance and GPU name)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    doc = requests.get(d.url + "/api/v1/status", timeout=5).json()
    doc["instance"] = "node\x1b]0;pwned\x07"
    doc["gpus"][0]["name"] = "NVIDIA \x1b[2JH100 [link=http://evil]x[/link]"
    body = json.dumps(doc).encode()

    class Stand(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    stand = ThreadingHTTPServer(("127.0.0.1", 0), Stand)
    threading.Thread(target=stand.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{stand.server_port}"
    # wide enough for every column: the escaped names are long, and a narrower frame drops
    # the GPU's name column first (top's layout has tests of its own)
    wide = {**os.environ, "COLUMNS": "250"}
    try:
        top = subprocess.run([sys.executable, "-m", "exporter", "top", "--once", "--url", url],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, env=wide)
        # into a pipe, frame after frame: the later ones are fetched again, escaped too
        live = subprocess.Popen([sys.executable, "-m", "exporter", "top", "--interval", "0.2",
                                 "--url", url], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                env=wide)
        watchdog = threading.Timer(60, live.kill)
        watchdog.start()
        frames = []
        try:
            for line in live.stdout:
                if "H100" in line:
                    frames.append(line)
                if len(frames) == 3:
                    break
        finally:
            watchdog.cancel()
            live.kill()
            live.wait()
    finally:
        stand.shutdown()
    assert top.returncode == 0, top.stderr
    assert "node\\x1b]0;pwned\\x07" in top.stdout and "\\x1b[2JH100" in top.stdout
    assert "\x1b" not in top.stdout and "\x07" not in top.stdout
    # rich markup from the network is shown as written, not made a link
    assert "[link=http://evil]x[/link]" in top.stdout
    assert len(frames) == 3 and all("\\x1b[2JH100 [link=http://evil]x[/link]" in f
                                    for f in frames), frames


def test_diagnose_escapes_label_values_from_prometheus(monkeypatch, capsys):
    from test_diagnose import report

    from exporter.heuristics import diagnose
    from exporter.heuristics.rules import DEFAULTS

    rep = report(0.3, 0.6)
    rep.run = "r\x1b]0;pwned\x07"
    monkeypatch.setattr(diagnose, "diagnose", lambda *a, **k: (
        diagnose.judge([rep], DEFAULTS["thresholds"]), []))
    ns = argparse.Namespace(prometheus="http://x", run=None, window="5m", config=None,
                            time=None, json=False)
    diagnose.main(ns)
    out = capsys.readouterr().out
    assert "r\\x1b]0;pwned\\x07" in out and "\x1b" not in out and "\x07" not in out
