"""The daemon as a user runs it: `python -m exporter`, real HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
import requests
from conftest import ROOT, require_binary, sample_value, self_signed_cert, wait_until
from prometheus_client.parser import text_string_to_metric_families

from exporter.reading.collectors import host_collectors
from exporter.reading.gpu_backends import DemoBackend
from exporter.reading.gpu_metrics import H100_IDLE_WATTS
from exporter.reading.sampler import Sampler
from exporter.serving.exposition import Exposition
from exporter.serving.routes import WebSite
from exporter.serving.server import make_server, serve_in_thread

CONTRACT_GPU_METRICS = [
    "gputrain_gpu_info", "gputrain_gpu_up", "gputrain_gpu_utilization_ratio",
    "gputrain_gpu_busy_seconds_total", "gputrain_gpu_sampled_seconds_total",
    "gputrain_gpu_sm_active_ratio",
    "gputrain_gpu_sm_occupancy_ratio", "gputrain_gpu_tensor_active_ratio",
    "gputrain_gpu_dram_active_ratio", "gputrain_gpu_memory_used_bytes",
    "gputrain_gpu_memory_total_bytes", "gputrain_gpu_power_watts",
    "gputrain_gpu_power_limit_watts", "gputrain_gpu_energy_joules_total",
    "gputrain_gpu_pcie_received_bytes_total", "gputrain_gpu_pcie_transmitted_bytes_total",
    "gputrain_gpu_pcie_link_max_bytes_per_second", "gputrain_gpu_temperature_celsius",
    "gputrain_gpu_clock_hertz", "gputrain_gpu_clock_event_seconds_total",
]
CONTRACT_HOST_METRICS = [
    "gputrain_host_cpu_seconds_total", "gputrain_host_cpus",
    "gputrain_host_memory_total_bytes", "gputrain_host_memory_available_bytes",
    "gputrain_host_disk_read_bytes_total", "gputrain_host_disk_written_bytes_total",
    "gputrain_host_network_received_bytes_total", "gputrain_host_network_transmitted_bytes_total",
]


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_without_a_driver_it_serves_host_metrics_and_says_so(daemon_factory):
    if _nvml_works():
        pytest.skip("this machine has a working NVIDIA driver")
    d = daemon_factory()
    text = d.metrics()
    for name in CONTRACT_HOST_METRICS:
        assert name in text, name
    # no driver is no fault: no collector fails, no alert fires, the page shows no fault card
    assert sample_value(text, "gputrain_collector_success", {"collector": "gpu"}) is None
    assert "gputrain_gpu_up" not in text
    doc = requests.get(d.url + "/api/v1/status", timeout=5).json()
    assert doc["faults"] == [] and doc["gpu_error"]
    log = d.log_text()
    assert log.count("No NVIDIA GPU can be read") == 1, log
    assert "serving host metrics only" in log
    assert d.proc.poll() is None


def test_demo_backend_serves_every_contract_metric_for_8_gpus(daemon_factory):
    d = daemon_factory("--gpu.backend=demo", "--sampler.interval=0.2")
    wait_until(lambda: "gputrain_gpu_busy_seconds_total" in d.metrics(), timeout=10)
    families = {f.name: f for f in text_string_to_metric_families(d.metrics())}
    for name in CONTRACT_GPU_METRICS:
        base = name.removesuffix("_total")
        assert base in families, name
        gpus = {s.labels["gpu"] for s in families[base].samples}
        assert gpus == {str(i) for i in range(8)}, name
    info = [s for s in families["gputrain_gpu_info"].samples]
    assert all(s.labels["backend"] == "demo" for s in info)
    assert len({s.labels["uuid"] for s in info}) == 8


def test_promtool_check_metrics_has_no_warnings(daemon_factory):
    promtool = require_binary("promtool")
    d = daemon_factory("--gpu.backend=demo", "--sampler.interval=0.2")
    wait_until(lambda: "gputrain_gpu_busy_seconds_total" in d.metrics(), timeout=10)
    out = subprocess.run([promtool, "check", "metrics"], input=d.metrics(), text=True,
                         capture_output=True)
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", (
        out.stdout + out.stderr)


def test_demo_load_flag_pins_the_busy_ratio(daemon_factory):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=2", "--demo.load=0",
                       "--sampler.interval=0.2")
    text = wait_until(lambda: t if "utilization_ratio" in (t := d.metrics()) else None)
    assert sample_value(text, "gputrain_gpu_utilization_ratio", {"gpu": "1"}) == 0.0
    assert sample_value(text, "gputrain_gpu_power_watts", {"gpu": "1"}) == H100_IDLE_WATTS


def test_bad_config_exits_2_naming_the_key(tmp_path):
    f = tmp_path / "c.yml"
    f.write_text("sampler:\n  interval: fast\n")
    out = subprocess.run([sys.executable, "-m", "exporter", f"--config.file={f}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "'sampler.interval'" in out.stderr


def test_ingest_on_a_public_address_needs_a_token(tmp_path):
    out = subprocess.run([sys.executable, "-m", "exporter", "--ingest.listen-address=0.0.0.0:0",
                          "--web.listen-address=127.0.0.1:0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "--ingest.token-file" in out.stderr


def _in_process_server(sampler: Sampler):
    app = Exposition(sampler)
    server = make_server("127.0.0.1", 0, WebSite, app)
    serve_in_thread(server, "test-http")
    return server, f"http://127.0.0.1:{server.address[1]}"


def test_healthz_turns_503_when_the_sampler_stalls(clock):
    sampler = Sampler(DemoBackend(2, 0.5, clock=clock), None, interval=1.0, clock=clock)
    sampler.run_once()
    server, url = _in_process_server(sampler)
    try:
        assert requests.get(url + "/healthz", timeout=5).status_code == 200
        clock.advance(3.5)
        r = requests.get(url + "/healthz", timeout=5)
        assert r.status_code == 503 and "3 intervals" in r.text
        assert requests.get(url + "/metrics", timeout=5).status_code == 200
    finally:
        server.shutdown()


def test_concurrent_scrapes_are_safe():
    sampler = Sampler(DemoBackend(8), host_collectors(), interval=0.02)
    sampler.start()
    server, url = _in_process_server(sampler)
    failures: list[str] = []

    def scrape() -> None:
        s = requests.Session()
        for _ in range(40):
            r = s.get(url + "/metrics", timeout=10, headers={"Accept-Encoding": "gzip"})
            try:
                names = {f.name for f in text_string_to_metric_families(r.text)}
                assert r.status_code == 200 and "gputrain_gpu_up" in names
            except Exception as exc:  # collected and asserted below
                failures.append(repr(exc))

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.shutdown()
    sampler.stop()
    assert failures == []


def test_https_with_the_tls_flags(tmp_path, daemon_factory):
    cert, key = self_signed_cert(tmp_path, "IP:127.0.0.1")
    d = daemon_factory("--gpu.backend=demo", f"--web.tls-cert-file={cert}",
                       f"--web.tls-key-file={key}", start=False)
    d.url_scheme = "https"
    d.proc = subprocess.Popen(d.args, cwd=ROOT, env=d.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"https://127.0.0.1:{d.port}"
    r = wait_until(lambda: requests.get(url + "/metrics", verify=str(cert), timeout=2),
                   timeout=20, what="HTTPS /metrics")
    assert r.status_code == 200 and "gputrain_gpu_up" in r.text
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{d.port}/metrics", timeout=2)


def test_sigterm_stops_the_daemon_cleanly(daemon_factory):
    d = daemon_factory("--gpu.backend=demo")
    d.proc.terminate()
    assert d.proc.wait(timeout=10) == 0
    assert "shutting down" in d.log_text()


def test_demo_gpus_follow_the_ranks_that_push(clock):
    """The laptop tour: a CPU training process that pushes to a demo daemon is listed on a
    demo GPU as NVML would list it (rank 0 on GPU 0, or the GPUs it names), and that GPU's
    load follows the run: busy while it computes, idle once its pushes stop."""
    import json

    from exporter.serving.attribution import resolve_gpus
    from exporter.serving.ingest import IngestStore

    store = IngestStore(clock=clock)
    backend = DemoBackend(4, clock=clock, host="follow-test")
    backend.follow(store.states)
    sampler = Sampler(backend, None, collectors={"gpu"}, clock=clock)

    def push(rank: str, steps: int, pid: int, **over) -> None:
        body = {"version": 1, "run": "tour", "rank": rank, "run_id": f"r{rank}",
                "steps": steps, "step_seconds": 0.1 * steps,
                "data_wait_seconds": 0.07 * steps, "samples": 8 * steps,
                "process": {"pid": pid}, **over}
        store.push(json.dumps(body).encode())

    def gpu(snap, index):
        return next(g for g in snap.gpus if g.identity.index == index).sample

    push("0", 10, 111)  # input-bound: 70 % of each step waits for data
    push("5", 10, 222, data_wait_seconds=0.0)  # rank 5 of 4 GPUs: GPU 1
    push("2", 10, 333, gpus=["3"], data_wait_seconds=0.0)  # names its GPU
    snap = sampler.run_once()
    assert gpu(snap, "0").pids == (111,) and gpu(snap, "1").pids == (222,)
    assert gpu(snap, "3").pids == (333,) and gpu(snap, "2").pids == ()
    assert gpu(snap, "0").utilization == pytest.approx(0.3)
    assert gpu(snap, "1").utilization == pytest.approx(1.0)
    st = next(s for s in store.states() if s.rank == "0")
    assert resolve_gpus(st, snap) == [("0", snap.gpus[0].identity.uuid)]
    # in the next 5 s rank 0 computed 0.2 s and waited the rest: its GPU is 4 % busy
    clock.advance(5.0)
    push("0", 50, 111, step_seconds=5.0, data_wait_seconds=0.07 * 10 + 3.8)
    snap = sampler.run_once()
    assert gpu(snap, "0").utilization == pytest.approx((5.0 - 4.5 - (1.0 - 0.7)) / 5.0)
    # its pushes stop: the GPU is idle but still held by the process
    clock.advance(20.0)
    snap = sampler.run_once()
    assert gpu(snap, "0").utilization == 0.0 and gpu(snap, "0").pids == (111,)


def test_pushes_over_tls_verified_by_server_name(tmp_path, daemon_factory, caplog):
    """The Kubernetes set-up: the ingest serves HTTPS with its own certificate, which names
    the service (not the node IP the client dials); the client verifies it with the CA file
    and that name, and a client without the name is refused, its training unaffected."""
    from exporter.client import TrainingMonitor

    cert, key = self_signed_cert(tmp_path, "DNS:gputrain-exporter")
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-16+chars\n")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", f"--ingest.token-file={token}",
                       f"--ingest.tls-cert-file={cert}", f"--ingest.tls-key-file={key}")
    wait_until(lambda: f"ingest for training clients on https://127.0.0.1:{d.ingest_port}"
               in d.log_text(), timeout=10, what="the ingest's https address in the log")
    endpoint = f"https://127.0.0.1:{d.ingest_port}"
    m = TrainingMonitor(run="tls", endpoint=endpoint, push_interval=60, ca_file=str(cert),
                        tls_server_name="gputrain-exporter", token="s3cret-token-of-16+chars")
    for _ in m.wrap(range(5), batch_size=2):
        pass
    assert m.flush(10)
    m.close()
    assert sample_value(d.metrics(), "gputrain_training_steps_total", {"run": "tls"}) == 5
    stranger = TrainingMonitor(run="tls-no-name", endpoint=endpoint, push_interval=60,
                               ca_file=str(cert), token="s3cret-token-of-16+chars")
    for _ in stranger.wrap(range(3), batch_size=2):
        pass
    assert not stranger.flush(5)  # 127.0.0.1 is not the certificate's name
    stranger.close(timeout=1)
    assert any("cannot push" in r.getMessage() for r in caplog.records)
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post(f"http://127.0.0.1:{d.ingest_port}/api/v1/push", json={}, timeout=5)


@pytest.mark.parametrize("part", ["web", "ingest"])
def test_every_startup_error_names_the_flag_and_the_value(tmp_path, part):
    """A port in use, a missing certificate, a garbage one, a key without its certificate:
    the exporter exits non-zero with one line naming the flag and the value or file."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    missing = tmp_path / "missing.pem"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        other = "ingest" if part == "web" else "web"
        cases = [
            ([f"--{part}.listen-address={busy}", f"--{other}.listen-address=127.0.0.1:0"],
             [f"--{part}.listen-address {busy}", "in use"]),
            ([f"--{part}.tls-cert-file={missing}", f"--{part}.tls-key-file={missing}"],
             [f"--{part}.tls-cert-file {missing}", "No such file"]),
            ([f"--{part}.tls-cert-file={garbage}", f"--{part}.tls-key-file={garbage}"],
             [f"--{part}.tls-cert-file {garbage}", "not a usable certificate"]),
            ([f"--{part}.tls-cert-file={garbage}"],
             [f"--{part}.tls-cert-file and --{part}.tls-key-file go together"]),
        ]
        for args, says in cases:
            ports = [] if any("listen-address" in a for a in args) else [
                "--web.listen-address=127.0.0.1:0", "--ingest.listen-address=127.0.0.1:0"]
            out = subprocess.run([sys.executable, "-m", "exporter", "--gpu.backend=demo",
                                  *ports, *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode in (1, 2), (args, out.stderr)
            for phrase in says:
                assert phrase in out.stderr, (args, phrase, out.stderr)
            assert "Traceback" not in out.stderr


def test_a_page_built_for_a_scrape_is_built_in_the_pool_never_on_the_event_loop(clock):
    """The first scrape of a variant builds the page then: in the server's blocking pool, so
    the loop that serves every other connection never renders; later scrapes take the page
    the page thread keeps current, without building."""
    sampler = Sampler(DemoBackend(2, 0.5, clock=clock), None, interval=1.0, clock=clock)
    sampler.run_once()
    app = Exposition(sampler)
    built_on: list[str] = []
    build = app._build

    def recording_build(om: bool, gzip_ok: bool):
        built_on.append(threading.current_thread().name)
        return build(om, gzip_ok)

    app._build = recording_build  # type: ignore[method-assign]
    server = make_server("127.0.0.1", 0, WebSite, app)
    serve_in_thread(server, "test-http")
    try:
        url = f"http://127.0.0.1:{server.address[1]}/metrics"
        for _ in range(3):
            r = requests.get(url, timeout=10)
            assert r.status_code == 200 and "gputrain_gpu_up" in r.text
        assert built_on, "the first scrape of a variant builds it"
        assert len(built_on) == 1, built_on  # then the kept page, without building
        assert built_on[0].startswith("gputrain-http-web-wait"), built_on
    finally:
        server.shutdown()
        server.close_socket()
