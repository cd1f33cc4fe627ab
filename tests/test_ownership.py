"""Who holds each GPU: the ranks' processes (joined through NVML's process list, never with a
pid label) and the memory no rank owns."""

from __future__ import annotations

import json

from conftest import synthetic_client
from prometheus_client import CollectorRegistry

from exporter.collectors.training import Owners, TrainingCollector
from exporter.gpu_backends import GpuIdentity, GpuSample
from exporter.ingest import IngestStore
from exporter.sampler import GpuState, Snapshot

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
    registry.register(TrainingCollector(store, lambda: snap, Owners(parent_of)))
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
