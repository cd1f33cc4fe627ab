"""A rank frozen in native code that holds the GIL: its client's pusher thread stops with its
loop, so nothing it pushes can tell. The exporter of its node still finds its process running
in its /proc: past ``vanished_seconds`` of silence the run is hung (never vanished, as it read
before), on the page, in ``diagnose`` and in Prometheus' alert alike. A process stopped by
SIGSTOP beside it is stopped, not hung. Real processes, a real daemon and Prometheus; the
thresholds are shortened by the rules config both read."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import requests
import yaml
from conftest import NO_HOST, ROOT, rules_file, sample_value, wait_until

# silent past 30 s: not vanished; past the 40 s ceiling: hung
THRESHOLDS = {"vanished_seconds": 30, "alive_seconds": 10, "silent_seconds": 20,
              "hung_min_seconds": 20, "hung_max_seconds": 40}

CLIENT = """
import ctypes, os, signal, sys, time
from exporter.client import TrainingMonitor
m = TrainingMonitor(run=sys.argv[1], push_interval=1)
for _ in m.wrap(range(40), batch_size=8):
    time.sleep(0.05)
print("stepped", flush=True)
if sys.argv[2] == "freeze":
    # libc's sleep called without releasing the GIL (a PyDLL function keeps it), as an
    # extension's blocking call that never releases it: every Python thread stops
    ctypes.PyDLL(None).sleep(600)
else:
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def _client(tmp_path, run: str, how: str, url: str) -> subprocess.Popen:
    script = tmp_path / f"{run}.py"
    script.write_text(CLIENT)
    return subprocess.Popen([sys.executable, str(script), run, how], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                 "GPUTRAIN_URL": url})


def test_a_rank_frozen_holding_the_gil_is_hung_everywhere_and_a_stopped_one_is_not(
        tmp_path, daemon_factory, prometheus_factory):
    cfg = tmp_path / "thresholds.yml"
    cfg.write_text(yaml.safe_dump({"thresholds": THRESHOLDS}))
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", *NO_HOST,
                       f"--status.rules-config={cfg}")
    rules = rules_file(tmp_path, {"thresholds": THRESHOLDS, "recording_interval": "1s",
                                  "liveness_interval": "1s"})
    prom = prometheus_factory([d.url.removeprefix("http://")], rule_files=[str(rules)])
    frozen = _client(tmp_path, "frozen", "freeze", d.ingest_url)
    stopped = _client(tmp_path, "paused", "stop", d.ingest_url)
    try:
        def page() -> dict[str, dict]:
            doc = requests.get(d.url + "/api/v1/status", timeout=10).json()
            return {run["run"]: run["ranks"][0] for run in doc["runs"]}

        def hung() -> dict | None:
            ranks = page()
            return ranks if ranks.get("frozen", {}).get("verdict") == "hung" else None

        ranks = wait_until(hung, timeout=150, interval=1,
                           what=lambda: f"the frozen rank hung on the page ({page()})")
        assert "while its process runs on its node: frozen" in ranks["frozen"]["reason"], ranks
        assert ranks["paused"]["verdict"] == "stopped", ranks["paused"]
        text = d.metrics()
        assert sample_value(text, "gputrain_training_process_running",
                            {"run": "frozen", "rank": "0"}) == 1
        assert sample_value(text, "gputrain_training_process_running",
                            {"run": "paused", "rank": "0"}) is None  # stopped: not running

        def firing(alert: str, run: str) -> bool:
            return bool(prom.query(f'ALERTS{{alertname="{alert}",alertstate="firing",'
                                   f'run="{run}"}}'))

        wait_until(lambda: firing("GpuTrainRunHung", "frozen"), timeout=90, interval=1,
                   what="GpuTrainRunHung for the frozen run")
        out = subprocess.run([sys.executable, "-m", "exporter", "diagnose", "--prometheus",
                              prom.url, "--run", "frozen", "--json", "--config", str(cfg)],
                             cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        (rank,) = json.loads(out.stdout)["ranks"]
        assert rank["verdict"] == "hung" and "frozen" in rank["reason"], rank
        # it never read vanished, nor did the stopped one read hung, anywhere
        for alert, run in (("GpuTrainRunVanished", "frozen"), ("GpuTrainRunHung", "paused")):
            assert not prom.query(f'max_over_time(ALERTS{{alertname="{alert}",'
                                  f'run="{run}"}}[10m])'), (alert, run)
        assert frozen.poll() is None  # frozen, not ended: only its kill ends it
        # its stacks are not asked of it (it could only answer through its own pushes)
        assert "run frozen is hung" in d.log_text() and "none could be asked" in d.log_text()
    finally:
        for proc in (frozen, stopped):
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.parametrize("thresholds", [THRESHOLDS])
def test_the_shortened_thresholds_are_ones_the_rules_accept(thresholds):
    """(The live test's premise: the rules config takes them as they are.)"""
    from exporter.heuristics.rules import settings

    assert settings({"thresholds": thresholds})["thresholds"]["hung_max_seconds"] == 40


# --- the daemon's view on fake clocks (tests/test_departed.py's node and /proc) ---------------

def _frozen_node(tmp_path, letter: str = "S"):
    from test_departed import Node, Proc, pushing

    proc = Proc(tmp_path)
    node = Node(proc=str(tmp_path))
    proc.run(100)
    pushing(node, 60, "0")
    proc.run(100, state=letter)
    return node, proc


def _verdict(node) -> tuple[str, str]:
    (run,) = node.page()["runs"]
    rank = run["ranks"][0]
    return rank["verdict"], rank["reason"]


def test_a_frozen_rank_stays_live_past_the_ttl_and_reads_killed_when_it_dies(tmp_path):
    """Frozen for 20 minutes (past the ingest's 10-minute ttl): still hung, never vanished;
    killed then, it reads failed, killed."""
    from test_departed import looks

    node, proc = _frozen_node(tmp_path)
    looks(node, 20 * 60)
    assert _verdict(node)[0] == "hung", _verdict(node)
    assert node.store.departed() == []
    proc.end(100)
    looks(node)
    assert _verdict(node)[0] == "failed"
    assert node.value("gputrain_training_exit_info", reason="killed", detail="") == 1
    node.now += 50 * 60  # its death is the news: reported the dead ttl after it, not after
    node.observe()       # its last push, 20 minutes before it
    assert _verdict(node)[0] == "failed"


@pytest.mark.parametrize("letter, running", [("t", False), ("T", False), ("D", True),
                                             ("R", True), ("S", True)])
def test_a_stopped_process_is_not_frozen_and_any_running_state_is(tmp_path, letter, running):
    """A debugger's stop (t) is a stop as SIGSTOP's (T) is (the page says stopped: the live
    test above); in the kernel (D), spinning (R) or sleeping (S), a silent process runs."""
    from test_departed import looks

    node, _ = _frozen_node(tmp_path, letter)
    looks(node, 6 * 60)
    assert (_verdict(node)[0] == "hung") is running, _verdict(node)
    assert node.value("gputrain_training_process_running") == (1 if running else None)


def test_near_miss_a_client_whose_pushes_are_refused_is_heard_not_frozen(tmp_path):
    """Its FLOPs per sample raised past the GPU's peak mid-run: every push refused (400)
    while it trains. It is silent on the page, but no freeze: its process is heard."""
    from test_departed import looks

    from exporter.protocol import Refused

    node, _ = _frozen_node(tmp_path)
    for _ in range(84):  # seven minutes of refused pushes
        node.now += 5.0
        with pytest.raises(Refused):
            node.push(steps=0, process={"pid": 100, "start_time": 4242})  # counters backwards
        looks(node, 0)
        node.observe()
    assert _verdict(node)[0] != "hung", _verdict(node)
    assert node.value("gputrain_training_process_running") is None


def test_the_gauge_goes_with_the_ranks_end(tmp_path):
    node, _ = _frozen_node(tmp_path)
    node.observe()
    assert node.value("gputrain_training_process_running") == 1
    node.push(goodbye=True, exit_reason="completed", process={"pid": 100, "start_time": 4242})
    node.observe()
    assert node.value("gputrain_training_process_running") is None
