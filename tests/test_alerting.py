"""End to end on loopback: exporter (demo GPUs) <- training clients, Prometheus evaluating the
shipped rules (short `for` via `rules --config`), Alertmanager delivering to a webhook here,
and `gputrain-exporter diagnose` reading the same Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import yaml
from conftest import ROOT, Daemon, Prometheus, free_port, require_binary, wait_until

CLIENT = """
import sys, time
from exporter.client import TrainingMonitor
run, endpoint, wait_s, step_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
def loader():
    while True:
        time.sleep(wait_s)  # the data loader is slow
        yield [0] * 16
m = TrainingMonitor(run=run, rank=0, endpoint=endpoint, push_interval=0.5)
for batch in m.wrap(loader(), batch_size=16):
    time.sleep(step_s)  # forward and backward
"""


class Webhook:
    """An Alertmanager webhook receiver: keeps every alert it is sent."""

    def __init__(self) -> None:
        self.alerts: list[dict] = []
        received = self.alerts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.extend(body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def find(self, alertname: str, **labels: str) -> list[dict]:
        return [a for a in list(self.alerts) if a["labels"].get("alertname") == alertname
                and all(a["labels"].get(k) == v for k, v in labels.items())]


class Alertmanager:
    def __init__(self, tmp_path, webhook_url: str) -> None:
        binary = require_binary("prometheus-alertmanager", "alertmanager")
        self.port = free_port()
        d = tmp_path / "alertmanager"
        d.mkdir()
        (d / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "hook", "group_by": ["alertname", "run"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": webhook_url}]}],
        }))
        self.log = open(d / "log.txt", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={d / 'alertmanager.yml'}", f"--storage.path={d / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: requests.get(f"http://127.0.0.1:{self.port}/-/ready",
                                        timeout=1).status_code == 200,
                   timeout=30, what="Alertmanager to be ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)
        self.log.close()


def client(run: str, endpoint: str, wait_s: float, step_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, run, endpoint, str(wait_s),
                             str(step_s)], cwd=ROOT,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                 "CUDA_VISIBLE_DEVICES": "0"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    started: list = []
    try:
        idle = Daemon("--gpu.backend=demo", "--demo.gpus=2", "--demo.load=0").start()
        started.append(idle)
        busy = Daemon("--gpu.backend=demo", "--demo.gpus=2", "--demo.load=1").start()
        started.append(busy)
        started.append(client("starved", idle.ingest_url, wait_s=0.030, step_s=0.010))
        started.append(client("fed", busy.ingest_url, wait_s=0.0, step_s=0.020))
        cfg = tmp / "thresholds.yml"
        cfg.write_text(yaml.safe_dump({"recording_interval": "1s", "for": {
            "GpuTrainInputBound": "5s", "GpuTrainGPUUnderutilized": "5s"}}))
        rules = tmp / "gputrain.rules.yml"
        rules.write_text(subprocess.run(
            [sys.executable, "-m", "exporter", "rules", "--config", str(cfg)], cwd=ROOT,
            check=True, capture_output=True, text=True).stdout)
        hook = Webhook()
        am = Alertmanager(tmp, hook.url)
        started.append(am)
        prom = Prometheus(tmp, [idle.url.removeprefix("http://"), busy.url.removeprefix("http://")],
                          rule_files=[str(rules)], alertmanager=f"127.0.0.1:{am.port}").start()
        started.append(prom)
        yield {"prom": prom, "hook": hook, "idle": idle, "busy": busy}
    finally:
        for thing in reversed(started):
            if isinstance(thing, subprocess.Popen):
                thing.kill()
                thing.wait()
            else:
                thing.stop()


def test_alertmanager_delivers_input_bound_with_run_and_description(stack):
    hook = stack["hook"]
    alerts = wait_until(lambda: hook.find("GpuTrainInputBound", run="starved"), timeout=120,
                        what="GpuTrainInputBound at the webhook")
    alert = alerts[0]
    assert alert["status"] == "firing"
    assert alert["labels"]["severity"] == "warning"  # 75% data wait is "highly" input-bound
    assert alert["labels"]["rank"] == "0"
    description = alert["annotations"]["description"]
    assert description.startswith("Run starved rank 0 on 127.0.0.1:")
    assert "of each step waiting for the data loader" in description
    assert "DataLoader workers" in description
    assert alert["annotations"]["runbook_url"].endswith("#gputraininputbound")
    assert not hook.find("GpuTrainInputBound", run="fed")


def test_the_idle_gpu_of_the_starved_run_is_reported_through_the_gpu_info_join(stack):
    hook = stack["hook"]
    alerts = wait_until(lambda: hook.find("GpuTrainGPUUnderutilized", run="starved"),
                        timeout=120, what="GpuTrainGPUUnderutilized at the webhook")
    assert {a["labels"]["gpu"] for a in alerts} == {"0"}  # CUDA_VISIBLE_DEVICES=0, not GPU 1
    assert alerts[0]["labels"]["severity"] == "warning"
    assert alerts[0]["labels"]["uuid"].startswith("GPU-")
    assert not hook.find("GpuTrainGPUUnderutilized", run="fed")


def diagnose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", "diagnose", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _has_both_runs(prom: Prometheus) -> bool:
    """Both runs joined to a GPU whose busy ratio has enough samples to be a number."""
    joined = prom.query("run_rank_gpu:gputrain_gpu_busy_ratio:rate5m >= 0")
    return {r["metric"]["run"] for r in joined} == {"starved", "fed"}


def test_diagnose_names_the_input_bound_run_and_exits_1(stack):
    prom = stack["prom"]
    wait_until(lambda: _has_both_runs(prom), timeout=60, what="both runs in Prometheus")
    out = wait_until(lambda: (o := diagnose("--prometheus", prom.url, "--json")).returncode == 1
                     and o, timeout=60, what="diagnose to find the bottleneck")
    reports = {r["run"]: r for r in json.loads(out.stdout)}
    starved, fed = reports["starved"], reports["fed"]
    assert starved["bottleneck"] and starved["verdict"] in ("input-bound", "cpu-preprocessing")
    assert 0.6 < starved["data_wait_ratio"] < 0.9  # 30 ms of each 40 ms step
    assert 150 < starved["samples_per_second"] < 420  # 16 samples per step of 40 ms or more
    assert [g["gpu"] for g in starved["gpus"]] == ["0"]
    assert starved["gpus"][0]["busy"] < 0.05
    assert "num_workers" in starved["advice"] or "augmentation" in starved["advice"]
    assert not fed["bottleneck"] and fed["verdict"] == "gpu-bound"
    assert fed["gpus"][0]["busy"] > 0.95


def test_diagnose_text_for_one_healthy_run_exits_0(stack):
    prom = stack["prom"]
    wait_until(lambda: _has_both_runs(prom), timeout=60, what="both runs in Prometheus")
    out = wait_until(lambda: (o := diagnose("--prometheus", prom.url, "--run", "fed"))
                     .returncode == 0 and o, timeout=60, what="diagnose of the fed run")
    assert "run fed rank 0" in out.stdout and "verdict: gpu-bound" in out.stdout
    assert "starved" not in out.stdout


def test_diagnose_exits_2_with_a_reason_when_it_cannot_answer(stack, tmp_path):
    out = diagnose("--prometheus", stack["prom"].url, "--run", "no-such-run")
    assert out.returncode == 2 and "holds no run 'no-such-run'" in out.stderr
    out = diagnose("--prometheus", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "cannot reach Prometheus" in out.stderr
    empty = Prometheus(tmp_path, []).start()
    try:
        out = diagnose("--prometheus", empty.url)
        assert out.returncode == 2 and "holds no gputrain training data" in out.stderr
    finally:
        empty.stop()
