"""Who holds each GPU: the ranks' processes (joined through NVML's process list, never with a
pid label) and the memory no rank owns."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, synthetic_client
from prometheus_client import CollectorRegistry

from exporter.reading.collectors.owners import KubernetesCollector, SlurmCollector
from exporter.reading.gpu_backends import GpuIdentity, GpuSample
from exporter.reading.sampler import GpuState, Snapshot
from exporter.serving.attribution import Attribution, Owners
from exporter.serving.ingest import IngestStore
from exporter.serving.training import TrainingCollector

GIB = 2**30


def snapshot(*gpus: tuple[str, dict[int, float]]) -> Snapshot:
    states = tuple(GpuState(GpuIdentity(i, f"GPU-{i}"), up=True,
                            sample=GpuSample(0.0, pids=tuple(mem), process_memory=mem))
                   for i, mem in gpus)
    return Snapshot(1, 0.0, "test", "", states)


def push(store: IngestStore, rank: str, pid: int) -> None:
    store.push(json.dumps({"version": 1, "run": "llm", "rank": rank, "run_id": "a",
                           "steps": 1, "step_seconds": 1.0, "data_wait_seconds": 0.0,
                           "samples": 8, "process": {"pid": pid}}).encode())


def test_a_ranks_children_count_as_its_own_and_strangers_are_counted_per_gpu():
    # 100 is rank 0's pushed pid; 150 its grandchild (a compile worker); 900 another job
    parents = {150: 120, 120: 100, 900: 1, 300: 250, 250: 1}
    asked: list[int] = []

    def parent_of(pid: int) -> int | None:
        asked.append(pid)
        return parents.get(pid)

    store = IngestStore()
    push(store, "0", 100)
    push(store, "1", 200)
    snap = snapshot(("0", {100: 30 * GIB, 150: 2 * GIB, 900: 5 * GIB}),
                    ("1", {200: 40 * GIB, 300: GIB}))
    registry = CollectorRegistry(auto_describe=False)
    views = Attribution(Owners(parent_of))
    views.update(snap, store.states())  # the sampler's cycle: the join, once
    registry.register(TrainingCollector(store, lambda: views.latest))
    v = registry.get_sample_value
    assert v("gputrain_training_gpu_memory_bytes",
             {"run": "llm", "rank": "0", "gpu": "0", "uuid": "GPU-0"}) == 32 * GIB
    assert v("gputrain_training_gpu_memory_bytes",
             {"run": "llm", "rank": "1", "gpu": "1", "uuid": "GPU-1"}) == 40 * GIB
    assert v("gputrain_gpu_unattributed_memory_bytes", {"gpu": "0", "uuid": "GPU-0"}) == 5 * GIB
    assert v("gputrain_gpu_unattributed_processes", {"gpu": "0", "uuid": "GPU-0"}) == 1
    assert v("gputrain_gpu_unattributed_processes", {"gpu": "1", "uuid": "GPU-1"}) == 1
    # no label of any series is a pid
    for family in registry.collect():
        for s in family.samples:
            assert not {"pid", "process"} & set(s.labels), s
    asked.clear()
    list(registry.collect())
    assert asked == []  # each parent is read once while the process lives


def test_a_pushing_process_owns_its_demo_gpus_memory_on_the_page(daemon_factory):
    """A demo daemon lists a process that pushes to it on its GPU, as NVML would: the page
    has the rank's GPU memory, and nothing on that GPU is unattributed."""
    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=2")
    client = synthetic_client("owned", daemon.ingest_url, "--compute-ms", "10")
    try:
        used = daemon.wait_sample("gputrain_training_gpu_memory_bytes",
                                  {"run": "owned", "rank": "0", "gpu": "0"},
                                  predicate=lambda x: x > 0, timeout=30)
        total = daemon.wait_sample("gputrain_gpu_memory_used_bytes", {"gpu": "0"})
        assert used < total  # the rank holds what the GPU uses, less the driver's context
        assert daemon.wait_sample("gputrain_gpu_unattributed_processes", {"gpu": "0"}) == 0
    finally:
        client.kill()
        client.wait()


# --- Slurm: the shipped prolog and epilog, and the job-mapping directory ---------------------

def slurm(script: str, directory: Path, job: str, gpus: str) -> None:
    subprocess.run(["sh", str(ROOT / "deploy" / "slurm" / script)], check=True, timeout=30,
                   env={"PATH": "/usr/bin:/bin", "GPUTRAIN_SLURM_DIR": str(directory),
                        "SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus})


def rendered(collector, snap: Snapshot) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in collector.render_snapshot(collector.read(), snap)
            for s in family.samples}


def test_the_prolog_and_epilog_drive_the_job_of_each_gpu(tmp_path):
    directory = tmp_path / "slurm-gpus"
    snap = snapshot(("0", {}), ("1", {}), ("2", {}))
    slurm("gputrain-prolog.sh", directory, "4242", "0,1")
    slurm("gputrain-prolog.sh", directory, "4243", "1")  # two jobs share GPU 1
    slurm("gputrain-prolog.sh", directory, "4244", "../../etc")  # no path escapes the dir
    (directory / "GPU-2").write_text("5000\n")  # a GPU named by its UUID
    assert sorted(p.name for p in directory.iterdir()) == ["0", "1", "GPU-2"]
    jobs = lambda: sorted((dict(k)["gpu"], dict(k)["job"]) for k in  # noqa: E731
                          rendered(SlurmCollector(directory=str(directory)), snap))
    assert jobs() == [("0", "4242"), ("1", "4242"), ("1", "4243"), ("2", "5000")]
    slurm("gputrain-epilog.sh", directory, "4242", "0,1")
    assert jobs() == [("1", "4243"), ("2", "5000")]
    assert not (directory / "0").exists()


def test_the_job_mapping_is_read_every_ten_seconds_and_a_missing_directory_is_no_job(tmp_path):
    now = [0.0]
    collector = SlurmCollector(directory=str(tmp_path / "none"), clock=lambda: now[0])
    assert collector.read() == {}
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "0").write_text("77\n")
    assert collector.read() == {}  # cached
    now[0] += 10
    assert collector.read() == {"0": ("77",)}


def test_the_daemon_exports_the_job_of_each_gpu(daemon_factory, tmp_path):
    (tmp_path / "0").write_text("4242\n")
    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=2", "--collector.slurm",
                            f"--slurm.job-mapping-dir={tmp_path}")
    assert daemon.wait_sample("gputrain_gpu_job_info", {"gpu": "0", "job": "4242"}) == 1
    assert daemon.wait_sample("gputrain_collector_success", {"collector": "slurm"}) == 1


# --- Kubernetes: a real gRPC server speaking pod-resources v1 on a unix socket ---------------

def _message(*fields: tuple[int, bytes | str]) -> bytes:
    """Protobuf wire format: length-delimited fields only, as the pod-resources API uses."""
    out = b""
    for number, value in fields:
        data = value.encode() if isinstance(value, str) else value
        out += _varint((number << 3) | 2) + _varint(len(data)) + data
    return out


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def pod(namespace: str, name: str, *containers: bytes) -> bytes:
    return _message((1, name), (2, namespace), *((3, c) for c in containers))


def container(name: str, *groups: tuple[str, list[str]]) -> bytes:
    return _message((1, name), *((2, _message((1, resource), *((2, d) for d in devices)))
                                 for resource, devices in groups))


@pytest.fixture
def kubelet(tmp_path):
    """A gRPC server on a unix socket answering v1.PodResourcesLister/List."""
    from concurrent import futures

    import grpc

    answer = {"pods": [
        pod("ml", "llama-0", container("trainer", ("nvidia.com/gpu", ["GPU-0", "GPU-1"]),
                                       ("cpu", ["2", "3"]))),
        pod("ml", "notebook", container("jupyter", ("nvidia.com/mig-1g.10gb", ["MIG-7"]))),
        pod("web", "nginx", container("nginx")),
        pod("ml", "elsewhere", container("x", ("nvidia.com/gpu", ["GPU-on-another-node"]))),
    ]}

    def list_pods(request: bytes, context) -> bytes:
        return b"".join(_message((1, p)) for p in answer["pods"])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(
            list_pods, request_deserializer=lambda b: b, response_serializer=lambda b: b)})])
    sock = tmp_path / "kubelet.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield sock
    server.stop(0)


def test_the_pods_of_each_gpu_come_from_the_kubelet(kubelet):
    snap = snapshot(("0", {}), ("1", {}))
    mig = GpuState(GpuIdentity("1/0", "MIG-7", parent="1"), up=True)
    snap = Snapshot(1, 0.0, "test", "", (*snap.gpus, mig))
    got = rendered(KubernetesCollector(socket_path=str(kubelet)), snap)
    rows = sorted((d["gpu"], d["namespace"], d["pod"], d["container"])
                  for d in map(dict, got))
    assert rows == [("0", "ml", "llama-0", "trainer"), ("1", "ml", "llama-0", "trainer"),
                    ("1/0", "ml", "notebook", "jupyter")]


def test_a_missing_kubelet_socket_fails_the_collector_with_the_reason(tmp_path):
    collector = KubernetesCollector(socket_path=str(tmp_path / "absent.sock"))
    with pytest.raises(RuntimeError, match=r"pod-resources socket .*absent\.sock: UNAVAILABLE"):
        collector.read()


def test_a_failing_source_is_retried_every_ten_seconds_not_every_cycle(tmp_path):
    now = [0.0]
    collector = KubernetesCollector(socket_path=str(tmp_path / "absent.sock"),
                                    clock=lambda: now[0])
    fetched = []
    real = collector.fetch
    collector.fetch = lambda: fetched.append(now[0]) or real()
    for _ in range(12):  # a cycle a second: failing every time, asked at 0 s and 10 s
        with pytest.raises(RuntimeError, match="UNAVAILABLE"):
            collector.read()
        now[0] += 1.0
    assert fetched == [0.0, 10.0]


def test_a_process_driving_several_gpus_is_on_each_gpu_nvml_lists_it_on():
    """device_map="auto" or pipeline stages in one process: the client pushes torch's current
    device only, NVML lists the process (or a child) on four GPUs; the rank's GPUs are the
    four. The near miss: a GPU holding only another job's process is not the rank's."""
    store = IngestStore()
    store.push(json.dumps({"version": 1, "run": "llm", "rank": "0", "run_id": "a",
                           "steps": 1, "step_seconds": 1.0, "data_wait_seconds": 0.0,
                           "samples": 8, "gpus": ["GPU-0"], "process": {"pid": 100}}).encode())
    snap = snapshot(("0", {100: 20 * GIB}), ("1", {100: 20 * GIB}), ("2", {150: 20 * GIB}),
                    ("3", {100: 20 * GIB}), ("4", {900: 5 * GIB}))
    registry = CollectorRegistry(auto_describe=False)
    views = Attribution(Owners({150: 100, 100: 1, 900: 1}.get))
    views.update(snap, store.states())
    registry.register(TrainingCollector(store, lambda: views.latest))
    info = sorted(s.labels["gpu"] for f in registry.collect()
                  if f.name == "gputrain_training_gpu_info" for s in f.samples)
    assert info == ["0", "1", "2", "3"]
