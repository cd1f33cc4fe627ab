"""py-spy stacks of a rank's process tree: `gputrain-exporter profile --stacks`, the alert that
asks for them, the roles' summaries, the stall dump, and the errors a user can act on.

Real parts: real py-spy (the [stacks] extra) attached to real CPU training processes (torch
DataLoader with two forked workers, a non-Python child, a Python child that is no worker),
the daemon over real HTTP, Debian's Alertmanager routing the shipped config, a real refused
attach (a process without CAP_SYS_PTRACE reading a non-dumpable one).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import requests
import yaml
from conftest import ENV_BIN, Alertmanager, require_binary, require_module, stop_all, wait_until

from exporter.client.stacks import (
    NOT_INSTALLED,
    find_py_spy,
    parse_collapsed,
    refused_why,
    summarise_samples,
)
from exporter.protocol import PROFILE_PATH, PUSH_PATH

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"

# A rank whose DataLoader (2 forked workers) spends its time in a transform with a name no
# library has; beside it a non-Python child (a logging agent) and a Python child that is no
# loader worker. "stall" blocks the training thread in a function of a known name.
TRAIN = r'''
import ctypes, os, subprocess, sys, threading, time
import torch
from torch.utils.data import DataLoader, Dataset
from exporter.client import TrainingMonitor

AGENT = """
import time
def zz_side_agent_loop():
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.005:
            pass
        time.sleep(0.02)
zz_side_agent_loop()
"""

def zz_distinctive_resize(x):
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01:
        pass
    return x

class Images(Dataset):
    def __len__(self):
        return 10**9
    def __getitem__(self, i):
        return zz_distinctive_resize(torch.ones(4))

def zz_blocked_on_peer(event):
    event.wait()

if __name__ == "__main__":
    mode = sys.argv[1]
    if "--not-dumpable" in sys.argv:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    children = [subprocess.Popen(["sleep", "3600"]),
                subprocess.Popen([sys.executable, "-c", AGENT])]
    monitor = TrainingMonitor(run=sys.argv[2], rank="0", push_interval=1.0)
    loader = DataLoader(Images(), batch_size=4, num_workers=2)
    for step, batch in enumerate(monitor.wrap(loader, batch_size=4)):
        (batch * 2).sum()
        if mode == "stall" and step == 3:
            zz_blocked_on_peer(threading.Event())
'''


def _require_py_spy() -> None:
    """py-spy of the [stacks] extra (scripts/test.sh installs it); its absence fails."""
    assert (ENV_BIN / "py-spy").exists(), "py-spy is missing: pip install -e '.[stacks]'"


def _start(tmp_path: Path, daemon, mode: str, run: str, *extra: str, env: dict | None = None,
           prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    require_module("torch")
    script = tmp_path / "train_stacks.py"
    script.write_text(TRAIN)
    return subprocess.Popen(
        [*prefix, sys.executable, str(script), mode, run, *extra], cwd=tmp_path,
        env={**os.environ, "GPUTRAIN_URL": daemon.ingest_url, "PYTHONPATH": str(ROOT),
             "GPUTRAIN_TRACE_DIR": str(tmp_path / "traces"), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    """The rank and every child it started (workers, the agents)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _stepping(daemon, run: str, steps: float = 2) -> None:
    daemon.wait_sample("gputrain_training_steps_total", {"run": run}, lambda v: v >= steps,
                       timeout=180)


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", "profile", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _role(doc: dict, role: str) -> dict | None:
    return next((r for r in doc["roles"] if r["role"] == role), None)


@pytest.fixture(scope="module")
def loader_bound(tmp_path_factory):
    """A demo daemon and the rank whose loader workers run zz_distinctive_resize."""
    from conftest import Daemon

    _require_py_spy()
    tmp = tmp_path_factory.mktemp("stacks")
    d = Daemon("--gpu.backend=demo", "--demo.gpus=1", "--profile.rank-interval=0s").start()
    proc = _start(tmp, d, "train", "loader-bound")
    try:
        _stepping(d, "loader-bound")
        yield {"daemon": d, "proc": proc, "tmp": tmp}
    finally:
        _kill(proc)
        stop_all([d])


def test_the_workers_transform_comes_first_among_the_loader_workers_samples(loader_bound):
    d = loader_bound["daemon"]
    out = _cli("--stacks", "--seconds", "4", "--run", "loader-bound", "--url", d.ingest_url,
               "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["kind"] == "stacks" and doc["mode"] == "record" and doc["state"] == "done"
    workers = _role(doc, "loader_workers")
    assert workers is not None, doc["roles"]
    assert workers["processes"] == 2  # the two DataLoader workers, not the other children
    # what they work on: less their wait for the next index in _worker_loop, which is all a
    # worker does while the main process asks for no batch (starved of CPU on a loaded
    # machine, it once asked for none in most of the 4 s)
    working = [t for t in workers["top"] if t["function"] != "_worker_loop"]
    assert working[0]["function"] == "zz_distinctive_resize", workers["top"]
    assert working[0]["file"] == "train_stacks.py"
    assert working[0]["samples"] > 0.5 * sum(t["samples"] for t in working), workers["top"]
    # the near misses: the main process never runs the transform, and the Python child that
    # is no worker is an "other child" in its own function, not a loader worker
    main = _role(doc, "main")
    assert main is None or all(t["function"] != "zz_distinctive_resize" for t in main["top"])
    other = _role(doc, "other")
    assert other is not None and other["top"][0]["function"] == "zz_side_agent_loop", \
        doc["roles"]
    # the flame graph file: speedscope's format, on the rank's machine, beside the traces
    path = Path(doc["file"])
    assert path.parent == loader_bound["tmp"] / "traces" and path.name.endswith(
        ".speedscope.json")
    flame = json.loads(path.read_text())
    assert flame["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    names = {f["name"] for f in flame["shared"]["frames"]}
    assert "zz_distinctive_resize" in names
    assert any(p["name"].startswith("loader workers") for p in flame["profiles"])
    # nothing of it in /metrics: function names are unbounded
    assert "zz_distinctive_resize" not in d.metrics()


def test_the_text_names_the_workers_function_with_its_share(loader_bound):
    d = loader_bound["daemon"]
    out = _cli("--stacks", "--seconds", "3", "--run", "loader-bound", "--rank", "0", "--url",
               d.ingest_url)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "loader workers (2 processes)" in ln)
    assert " % in zz_distinctive_resize (train_stacks.py:" in line
    assert "Flame graph: " in out.stdout and "speedscope" in out.stdout
    # and the status document shows the last capture beside the run
    status = requests.get(d.url + "/api/v1/status", timeout=5).json()
    stacks = [p for p in status["profiles"] if p.get("kind") == "stacks"]
    assert stacks and any(r["role"] == "loader_workers" for r in stacks[0]["roles"])


def test_the_page_top_and_diagnose_show_the_last_capture_beside_the_run(loader_bound):
    from test_status import chromium, policy_violations

    from exporter.heuristics.diagnose import RankReport, daemon_stacks, judge, text_report
    from exporter.heuristics.rules import DEFAULTS

    d = loader_bound["daemon"]
    out = _cli("--stacks", "--seconds", "2", "--run", "loader-bound", "--url", d.ingest_url,
               "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    run = chromium(d.url + "/", "--dump-dom")
    dom = run.stdout
    assert 'data-ready="1"' in dom, run.stderr[-2000:]
    assert 'data-stacks="0"' in dom and f'data-profile="{doc["id"]}"' in dom
    assert "% in zz_distinctive_resize (train_stacks.py:" in dom
    assert policy_violations(run) == []
    top = subprocess.run([sys.executable, "-m", "exporter", "top", "--once", "--url", d.url],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    # rich may wrap a long line inside the run's panel, between its borders
    flat = " ".join(top.stdout.replace("\u2502", " ").split())
    assert "rank 0 py-spy stacks" in flat and "in zz_distinctive_resize" in flat
    # diagnose --daemon: under the rank the daemon holds a capture of, and only there
    stacks = daemon_stacks(d.url)
    assert set(stacks) == {("loader-bound", "0")}
    reps = [RankReport("gputrain", "n1:19400", "loader-bound", r, steps_per_second=1,
                       data_wait_ratio=0.8) for r in ("0", "1")]
    text = text_report(judge(reps, DEFAULTS["thresholds"]), stacks=stacks)
    rank0, rank1 = text.split("run loader-bound rank 1")
    assert "py-spy stacks of the daemon" in rank0 and "zz_distinctive_resize" in rank0
    assert "py-spy" not in rank1


def test_a_dump_names_every_process_and_a_non_python_child_does_not_break_it(loader_bound):
    d = loader_bound["daemon"]
    out = _cli("--stacks", "--dump", "--run", "loader-bound", "--url", d.ingest_url, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    roles = [p["role"] for p in doc["processes"]]
    assert roles[0] == "main" and roles.count("loader_workers") == 2, roles
    # the logging agent (sleep) is listed, and said to be no Python process
    assert any(p.get("error") == "not a Python process" for p in doc["processes"])
    main = doc["processes"][0]
    assert any(t["name"] == "MainThread" for t in main["threads"])
    assert not any(t["name"].startswith("gputrain-") for t in main["threads"])


def test_stacks_requests_that_cannot_be_made_are_4xx_that_say_why(loader_bound):
    d = loader_bound["daemon"]
    url = d.ingest_url + PROFILE_PATH
    for body, code, message in [
        ({"run": "loader-bound", "stacks": "flame"}, 400, "field 'stacks' must be"),
        ({"run": "loader-bound", "stacks": "record", "seconds": 0}, 400, "seconds must be 1-60"),
        ({"run": "loader-bound", "stacks": "record", "seconds": "ten"}, 400,
         "field 'seconds' must be a whole number"),
        ({"run": "nowhere", "stacks": "dump"}, 404, "no rank of run 'nowhere'"),
    ]:
        r = requests.post(url, json=body, timeout=10)
        assert r.status_code == code and message in r.json()["error"], (body, r.text)
    out = _cli("--dump", "--run", "loader-bound", "--url", d.ingest_url)
    assert out.returncode == 2 and "--dump goes with --stacks" in out.stderr
    out = _cli("--stacks", "--seconds", "61", "--run", "loader-bound", "--url", d.ingest_url)
    assert out.returncode == 2 and "--seconds must be 1-60" in out.stderr


def test_a_client_without_stacks_is_refused_in_words_and_a_bad_report_is_a_400(daemon_factory):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    body = {"version": 1, "run": "old", "rank": "0", "run_id": "abc", "steps": 1,
            "step_seconds": 0.1, "data_wait_seconds": 0.0, "samples": 8,
            "capabilities": ["profile"]}
    assert requests.post(d.ingest_url + PUSH_PATH, json=body, timeout=5).ok
    r = requests.post(d.ingest_url + PROFILE_PATH, json={"run": "old", "stacks": "record"},
                      timeout=5)
    assert r.status_code == 409 and "cannot take py-spy stacks" in r.json()["error"]
    # a stall alert for it is skipped with that reason; a bottleneck alert still profiles it
    r = requests.post(d.ingest_url + "/api/v1/alerts", json={"alerts": [
        {"status": "firing", "labels": {"alertname": "GpuTrainStalled", "run": "old",
                                        "rank": "0"}},
        {"status": "firing", "labels": {"alertname": "GpuTrainInputBound", "run": "old",
                                        "rank": "0"}}]}, timeout=5)
    answer = r.json()
    assert [(s["alertname"], s["kind"]) for s in answer["started"]] == [
        ("GpuTrainInputBound", "torch")]
    assert "cannot take py-spy stacks" in answer["skipped"][0]["reason"]
    bad = {**body, "steps": 2, "capabilities": ["profile", "stacks"],
           "stacks": {"id": "p-000000000001", "state": "done", "mode": "record",
                      "file": "/tmp/x", "file_bytes": 1, "seconds": 1, "rate": 100,
                      "samples": 1, "roles": [{"role": "gpu-thief", "top": []}]}}
    r = requests.post(d.ingest_url + PUSH_PATH, json=bad, timeout=5)
    assert r.status_code == 400 and "'stacks.roles[0]' must be an object whose role" in r.text


def test_the_stall_alert_through_alertmanager_dumps_where_the_rank_is_stuck(daemon_factory,
                                                                            tmp_path):
    """GpuTrainStalled, sent to a real Alertmanager with the shipped config, ends in a dump
    whose main thread is in zz_blocked_on_peer; a bottleneck alert asks for a record and a
    torch profile, and Stalled no torch profile (it records no step)."""
    _require_py_spy()
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--profile.rank-interval=0s")
    proc = _start(tmp_path, d, "stall", "stuck")
    am = None
    try:
        _stepping(d, "stuck", 3)
        config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
        for r in config["receivers"]:
            r["webhook_configs"] = [{"url": d.ingest_url + "/api/v1/alerts"
                                     if r["name"] == "gputrain-profile" else
                                     "http://127.0.0.1:9/"}]
        path = tmp_path / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config))
        am = Alertmanager(tmp_path, path).start()
        alert = {"labels": {"alertname": "GpuTrainStalled", "run": "stuck", "rank": "0",
                            "severity": "critical", "instance": "node-1"}}
        assert requests.post(am.url + "/api/v2/alerts", json=[alert], timeout=5).ok

        def finished():
            docs = requests.get(d.ingest_url + PROFILE_PATH, timeout=5).json()["profiles"]
            mine = [p for p in docs if p["trigger"] == "alert:GpuTrainStalled"]
            return mine if mine and mine[0]["state"] in ("done", "failed", "expired") \
                else None

        (dump,) = wait_until(finished, timeout=120, what="the stall alert's dump")
        assert dump["kind"] == "stacks" and dump["mode"] == "dump", dump
        assert dump["state"] == "done", dump
        full = requests.get(f"{d.ingest_url}{PROFILE_PATH}/{dump['id']}", timeout=5).json()
        main = full["processes"][0]
        (thread,) = [t for t in main["threads"] if t["name"] == "MainThread"]
        functions = [f["function"] for f in thread["frames"]]
        assert "zz_blocked_on_peer" in functions, functions
        assert thread["frames"][thread["where"]]["function"] == "zz_blocked_on_peer"
        # the status document's brief form says where, in a line per thread
        status = requests.get(d.url + "/api/v1/status", timeout=5).json()
        (brief,) = [p for p in status["profiles"] if p["id"] == dump["id"]]
        assert brief["where"][0]["caller"]["function"] == "zz_blocked_on_peer"
        assert "processes" not in brief
        out = _cli("--stacks", "--dump", "--run", "stuck", "--url", d.ingest_url)
        assert out.returncode == 0 and "zz_blocked_on_peer (train_stacks.py:" in out.stdout
    finally:
        _kill(proc)
        stop_all([s for s in (am,) if s is not None])


def test_without_py_spy_the_capture_fails_saying_how_to_install_it(daemon_factory, tmp_path):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    # the venv's py-spy is beside sys.executable: this rank runs a Python of a directory of
    # its own (a symlink), with a PATH that has no py-spy
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    script = tmp_path / "train_stacks.py"
    script.write_text(TRAIN)
    # (a venv's python out of its directory is the base one: the venv's packages by path)
    packages = sysconfig.get_paths()["purelib"]
    proc = subprocess.Popen(
        [str(bin_dir / "python"), str(script), "train", "no-spy"], cwd=tmp_path,
        env={**os.environ, "GPUTRAIN_URL": d.ingest_url,
             "PYTHONPATH": os.pathsep.join((str(ROOT), packages)),
             "PATH": "/usr/bin:/bin", "GPUTRAIN_TRACE_DIR": str(tmp_path / "traces")},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert shutil.which("py-spy", path="/usr/bin:/bin") is None
        _stepping(d, "no-spy")
        out = _cli("--stacks", "--seconds", "2", "--run", "no-spy", "--url", d.ingest_url)
        assert out.returncode == 1
        assert "py-spy is not installed in this training environment: install it with pip " \
               "install 'gputrain-exporter[stacks]'" in out.stderr, out.stderr
    finally:
        _kill(proc)


def test_a_refused_attach_says_why_and_how_to_allow_it(daemon_factory, tmp_path):
    """A rank that made itself non-dumpable, run without CAP_SYS_PTRACE: the kernel refuses
    py-spy, and the error says so in words."""
    setpriv = require_binary("setpriv")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    proc = _start(tmp_path, d, "train", "refused", "--not-dumpable",
                  prefix=(setpriv, "--inh-caps=-all", "--bounding-set=-all"))
    try:
        _stepping(d, "refused")
        out = _cli("--stacks", "--seconds", "2", "--run", "refused", "--url", d.ingest_url)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "py-spy was refused access to process" in out.stderr, out.stderr
        assert "is not dumpable" in out.stderr and "CAP_SYS_PTRACE" in out.stderr
        # the near miss: the same rank, dumpable, is read by its own py-spy without a
        # capability (py-spy runs as its child)
    finally:
        _kill(proc)
    proc = _start(tmp_path, d, "train", "allowed",
                  prefix=(setpriv, "--inh-caps=-all", "--bounding-set=-all"))
    try:
        _stepping(d, "allowed")
        out = _cli("--stacks", "--seconds", "2", "--run", "allowed", "--url", d.ingest_url)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        _kill(proc)


# -- the words, over what py-spy writes and what /proc says -----------------------------------

def _proc(tmp_path: Path, scope: str | None, cap: bool) -> str:
    (tmp_path / "self").mkdir(parents=True)
    caps = 1 << 19 if cap else 0
    (tmp_path / "self" / "status").write_text(f"Name:\tx\nCapEff:\t{caps:016x}\n")
    if scope is not None:
        (tmp_path / "sys/kernel/yama").mkdir(parents=True)
        (tmp_path / "sys/kernel/yama/ptrace_scope").write_text(scope + "\n")
    return str(tmp_path)


@pytest.mark.parametrize("scope, cap, says, never", [
    ("2", False, ["ptrace_scope is 2", "SYS_PTRACE", "kernel.yama.ptrace_scope=1"], []),
    ("3", True, ["ptrace_scope is 3", "reboot"], []),
    ("1", False, ["ptrace_scope is 1", "spawn or forkserver"], ["ptrace_scope is 2"]),
    # near misses: with the capability, scopes 1 and 2 are no reason
    ("2", True, [], ["ptrace_scope"]),
    (None, True, [], ["ptrace_scope", "no CAP_SYS_PTRACE"]),
])
def test_a_refusal_names_the_yama_scope_and_the_capability(tmp_path, scope, cap, says, never):
    text = refused_why(os.getpid(), _proc(tmp_path, scope, cap))
    for s in says:
        assert s in text, text
    for s in never:
        assert s not in text, text


def test_pin_memory_and_workers_are_told_apart_from_other_children():
    raw = "\n".join([
        'process 10:"python t.py";thread (10): MainThread;<module> (t.py:9);step (t.py:3) 5',
        'process 10:"python t.py";thread (12): Thread-2;Thread.run (threading.py:982);'
        '_pin_memory_loop (torch/utils/data/_utils/pin_memory.py:52);do_one (pin_memory.py:30) 7',
        'process 10:"python t.py";thread (13): gputrain-stacks;wait (x.py:1) 50',
        'process 10:"python t.py";process 20:"python t.py";thread (20): MainThread;'
        '_worker_loop (torch/utils/data/_utils/worker.py:300);resize (transforms.py:142) 71',
        'process 10:"python t.py";process 20:"python t.py";thread (21): QueueFeederThread;'
        '_feed (multiprocessing/queues.py:231) 2',
        'process 10:"python t.py";process 30:"python -c import x\nx.run()";thread (30): '
        'MainThread;resize (agent.py:1) 40',
    ])
    roles = {r["role"]: r for r in summarise_samples(parse_collapsed(raw, 10), 10)}
    assert set(roles) == {"main", "pin_memory", "loader_workers", "other"}
    # the worker's queue feeder, parked all along, is not counted against its main thread
    assert roles["loader_workers"]["processes"] == 1 and roles["loader_workers"]["threads"] == 1
    assert roles["loader_workers"]["top"][0] == {
        "function": "resize", "file": "transforms.py", "line": 142, "samples": 71,
        "share": 1.0}
    assert roles["other"]["top"][0]["file"] == "agent.py"  # same name, not a worker
    assert roles["pin_memory"]["top"][0]["function"] == "do_one"
    assert roles["main"]["samples"] == 5  # the client's own gputrain-stacks thread left out


def test_py_spy_is_found_beside_the_interpreter_or_said_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUTRAIN_PY_SPY", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_py_spy() is None
    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\n")
    spy.chmod(0o755)
    assert find_py_spy() == str(spy)
    assert "pip install 'gputrain-exporter[stacks]'" in NOT_INSTALLED


def test_a_wait_is_charged_to_the_code_that_waits_not_to_the_standard_library():
    paths = sysconfig.get_paths()
    std, site = paths["stdlib"], paths["purelib"]
    raw = (f'process 10:"p";thread (10): MainThread;<module> ({ROOT}/train.py:9);'
           f'_MultiProcessingDataLoaderIter._try_get_data ({site}/torch/utils/data/'
           f'dataloader.py:1291);Queue.get ({std}/multiprocessing/queues.py:113);'
           f'wait ({std}/multiprocessing/connection.py:947) 90\n'
           f'process 10:"p";thread (10): MainThread;<module> ({ROOT}/train.py:9);'
           f'slow_read ({ROOT}/train.py:3) 10\n')
    (main,) = summarise_samples(parse_collapsed(raw, 10), 10)
    assert [(t["function"], t["file"], t["share"]) for t in main["top"]] == [
        ("_MultiProcessingDataLoaderIter._try_get_data", "torch/utils/data/dataloader.py", 0.9),
        ("slow_read", "train.py", 0.1)]


@pytest.mark.parametrize("error, torn, done, reads", [
    ("Failed to get stack traces", 2, True, 3),
    ("Failed to get stack traces", 3, False, 3),
    ("Permission denied (os error 13)", 1, False, 1),  # a refusal: no second try
])
def test_a_dump_torn_by_the_running_process_is_taken_again(tmp_path, monkeypatch, error, torn,
                                                          done, reads):
    """A nonblocking read walks the frames while the process runs on, and sometimes fails
    mid-walk ("Failed to get stack traces"): the dump is taken again, up to three reads in all.
    The near misses: three torn reads fail the dump with py-spy's own words, and a refused
    read is not taken again."""
    from exporter.client.stacks import DUMP_ATTEMPTS, CaptureFailed, capture

    assert DUMP_ATTEMPTS == 3
    count = tmp_path / "reads"
    frame = {"name": "zz_waits", "filename": "/srv/train.py", "short_filename": "train.py",
             "line": 7}
    doc = json.dumps([{"thread_name": "MainThread", "os_thread_id": 1, "active": True,
                       "owns_gil": False, "frames": [frame]}])
    spy = tmp_path / "py-spy"
    spy.write_text(f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}
if [ $n -le {torn} ]; then echo "Error: {error}" >&2; exit 1; fi
echo '{doc}'
""")
    spy.chmod(0o755)
    monkeypatch.setenv("GPUTRAIN_PY_SPY", str(spy))
    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path / "traces"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if done:
            result = capture("dump", 0, sleeper.pid, "torn", "0", "p-0123456789ab")
            (thread,) = result["processes"][0]["threads"]
            assert thread["frames"][0]["function"] == "zz_waits"
        else:
            with pytest.raises(CaptureFailed, match=r"Failed to get stack traces|refused"):
                capture("dump", 0, sleeper.pid, "torn", "0", "p-0123456789ab")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert int(count.read_text()) == reads
