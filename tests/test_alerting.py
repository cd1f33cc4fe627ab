"""End to end on loopback: exporter (demo GPUs) <- training clients, Prometheus evaluating the
shipped rules (short `for` via `rules --config`), Alertmanager delivering to a webhook here,
and `gputrain-exporter diagnose` reading the same Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import (
    NO_HOST,
    ROOT,
    Alertmanager,
    Daemon,
    Prometheus,
    Webhook,
    free_port,
    rules_file,
    stop_all,
    synthetic_client,
    wait_until,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    started: list = []
    try:
        # the host collectors off: the machine's own load cannot refine the verdicts
        idle = Daemon("--gpu.backend=demo", "--demo.gpus=2", "--demo.load=0", *NO_HOST).start()
        started.append(idle)
        busy = Daemon("--gpu.backend=demo", "--demo.gpus=2", "--demo.load=1", *NO_HOST).start()
        started.append(busy)
        started.append(synthetic_client("starved", idle.ingest_url, "--batch-size", "16",
                                        "--data-wait-ms", "30", "--compute-ms", "10"))
        started.append(synthetic_client("fed", busy.ingest_url, "--batch-size", "16",
                                        "--data-wait-ms", "0", "--compute-ms", "20"))
        rules = rules_file(tmp, {"recording_interval": "1s", "for": {
            "GpuTrainInputBound": "5s", "GpuTrainGPUUnderutilized": "5s"}})
        hook = Webhook()
        am_config = tmp / "alertmanager.yml"
        am_config.write_text(yaml.safe_dump({
            "route": {"receiver": "hook", "group_by": ["alertname", "run"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": hook.url}]}],
        }))
        am = Alertmanager(tmp, am_config).start()
        started.append(am)
        prom = Prometheus(tmp, [idle.url.removeprefix("http://"), busy.url.removeprefix("http://")],
                          rule_files=[str(rules)], alertmanager=f"127.0.0.1:{am.port}").start()
        started.append(prom)
        yield {"prom": prom, "hook": hook, "idle": idle, "busy": busy}
    finally:
        stop_all(started)


def test_alertmanager_delivers_input_bound_with_run_and_description(stack):
    hook = stack["hook"]
    # 75% data wait is "highly" input-bound: the warning, and the info tier that covers it
    alerts = wait_until(lambda: hook.find("GpuTrainInputBound", run="starved",
                                          severity="warning"), timeout=120,
                        what="GpuTrainInputBound's warning at the webhook")
    alert = alerts[0]
    assert alert["status"] == "firing"
    wait_until(lambda: hook.find("GpuTrainInputBound", run="starved", severity="info"),
               timeout=60, what="its info tier at the webhook too (no inhibition configured)")
    assert alert["labels"]["rank"] == "0"
    description = alert["annotations"]["description"]
    assert description.startswith("Run starved rank 0 on 127.0.0.1:")
    assert "of each step waiting for the data loader" in description
    assert "DataLoader workers" in description
    assert alert["annotations"]["runbook_url"].endswith("#gputraininputbound")
    assert not hook.find("GpuTrainInputBound", run="fed")


def test_the_idle_gpu_of_the_starved_run_is_reported_through_the_gpu_info_join(stack):
    hook = stack["hook"]
    alerts = wait_until(lambda: hook.find("GpuTrainGPUUnderutilized", run="starved",
                                          severity="warning"),
                        timeout=120, what="GpuTrainGPUUnderutilized's warning at the webhook")
    assert {a["labels"]["gpu"] for a in alerts} == {"0"}  # CUDA_VISIBLE_DEVICES=0, not GPU 1
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

    def settled():
        # exit 1 comes from the starved run alone: wait until the fed one is judged too
        out = diagnose("--prometheus", prom.url, "--json")
        ranks = {r["run"]: r for r in json.loads(out.stdout)["ranks"]} if out.stdout else {}
        return out.returncode == 1 and ranks.get("fed", {}).get("verdict") not in (
            None, "warming-up", "paused") and ranks

    reports = wait_until(settled, timeout=60, what="diagnose to judge both runs")
    starved, fed = reports["starved"], reports["fed"]
    assert starved["bottleneck"] and starved["verdict"] == "input-bound", starved
    assert 0.6 < starved["data_wait_ratio"] < 0.9  # 30 ms of each 40 ms step
    assert 150 < starved["samples_per_second"] < 420  # 16 samples per step of 40 ms or more
    assert [g["gpu"] for g in starved["gpus"]] == ["0"]
    assert starved["gpus"][0]["busy"] < 0.05
    assert "num_workers" in starved["advice"]
    assert not fed["bottleneck"] and fed["verdict"] == "gpu-bound", fed
    assert fed["gpus"][0]["busy"] > 0.95


def test_diagnose_text_for_one_healthy_run_exits_0(stack):
    prom = stack["prom"]
    wait_until(lambda: _has_both_runs(prom), timeout=60, what="both runs in Prometheus")
    # exit 0 too while it is warming-up: wait for its verdict from rates
    out = wait_until(lambda: (o := diagnose("--prometheus", prom.url, "--run", "fed"))
                     .returncode == 0 and "warming-up" not in o.stdout and o, timeout=60,
                     what="diagnose of the fed run")
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


def test_a_demo_memory_fault_fires_both_severities_on_the_last_gpu(daemon_factory,
                                                                   prometheus_factory, tmp_path):
    """`--demo.memory-fault`, as a user tries the alert on a laptop: the last GPU's new
    uncorrectable error is critical, its pending remap a warning; the other GPU is quiet."""
    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=2", "--demo.memory-fault")
    # another node, healthy, where a run trains: diagnose --run of it is not about the fault
    other = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--demo.load=0.97")
    client = synthetic_client("elsewhere", other.ingest_url, "--data-wait-ms", "0",
                              "--compute-ms", "20")
    rules = rules_file(tmp_path, {"recording_interval": "1s"})
    prom = prometheus_factory([d.url.removeprefix("http://") for d in (daemon, other)],
                              rule_files=[str(rules)])

    def firing():
        got = prom.query('ALERTS{alertname="GpuTrainGPUMemoryFault",alertstate="firing"}')
        severities = {a["metric"]["severity"] for a in got}
        return severities == {"critical", "warning"} and got

    alerts = wait_until(firing, timeout=90, what="GpuTrainGPUMemoryFault, both severities")
    assert {a["metric"]["gpu"] for a in alerts} == {"1"}
    (critical,) = [a for a in alerts if a["metric"]["severity"] == "critical"]
    assert critical["metric"]["type"] == "uncorrected"
    # diagnose names the same fault for the node, with no run on it, and exits 1
    out = wait_until(lambda: (o := diagnose("--prometheus", prom.url)).returncode == 1 and o,
                     timeout=60, what="diagnose to name the fault")
    assert "node" in out.stdout and "GPU 1: gpu-memory-fault (critical): 1 uncorrectable " \
        "ECC error(s)" in out.stdout, out.stdout + out.stderr
    doc = json.loads(diagnose("--prometheus", prom.url, "--json").stdout)
    faulty = [n for n in doc["nodes"] if n["findings"]]
    assert [(f["gpu"], f["name"], f["severity"]) for n in faulty for f in n["findings"]] == [
        ("1", "gpu-memory-fault", "critical")]
    assert [n["instance"] for n in faulty] == [daemon.url.removeprefix("http://")]
    try:
        # judged once its rates exist (seconds after its first push it is warming-up)
        out = wait_until(lambda: "verdict: " in (o := diagnose(
            "--prometheus", prom.url, "--run", "elsewhere")).stdout
            and "warming-up" not in o.stdout and o, timeout=60,
            what="diagnose of the other node's run")
        assert "gpu-memory-fault" not in out.stdout and out.returncode == 0, out.stdout
        assert "verdict: gpu-bound" in out.stdout, out.stdout
    finally:
        client.kill()
        client.wait()


def test_diagnose_says_an_exporter_is_down(daemon_factory, prometheus_factory):
    """Prometheus scrapes a node whose exporter stopped: a clear message and exit 1."""
    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    prom = prometheus_factory([daemon.url.removeprefix("http://")])
    wait_until(lambda: prom.query('up{job=~"gputrain.*"} == 1'), timeout=60,
               what="the exporter scraped")
    daemon.stop()
    wait_until(lambda: prom.query('up{job=~"gputrain.*"} == 0'), timeout=60,
               what="the scrape failing")
    out = diagnose("--prometheus", prom.url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"== node {daemon.url.removeprefix('http://')}" in out.stdout
    assert "node: exporter-down (critical): Prometheus cannot scrape the exporter" in out.stdout
    assert "It cannot scrape the exporter on" in out.stderr
