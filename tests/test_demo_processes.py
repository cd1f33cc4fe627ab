"""The demo GPUs' processes as NVML would list them: the ranks that push (followed), a process
no rank owns (--demo.foreign-load), each one's share of the GPU's busy time, adding up to the
GPU's utilisation."""

from __future__ import annotations

import json

import pytest
from conftest import sample_value, wait_until

from exporter.reading.gpu_backends import DemoBackend
from exporter.reading.sampler import Sampler
from exporter.serving.ingest import IngestStore

FOREIGN = DemoBackend.FOREIGN_PID
GIB = 1024**3


def push(store: IngestStore, rank: str, seconds: float, pid: int, waited: float) -> None:
    """A rank's cumulative push after ``seconds`` in 0.1 s steps, ``waited`` of them waiting
    for data."""
    steps = round(seconds / 0.1)
    store.push(json.dumps({
        "version": 1, "run": "demo", "rank": rank, "run_id": f"r{rank}", "steps": steps,
        "step_seconds": seconds, "data_wait_seconds": waited, "samples": 8 * steps,
        "process": {"pid": pid}}).encode())


def gpus(snap) -> dict:
    return {g.identity.index: g for g in snap.gpus}


def test_a_foreign_process_on_gpu_0_is_listed_busy_and_holding_memory(clock):
    sampler = Sampler(DemoBackend(2, clock=clock, host="foreign", foreign_load=0.3), None,
                      collectors={"gpu"}, clock=clock)
    snap = sampler.run_once()
    g0, g1 = (gpus(snap)[i].sample for i in "01")
    assert g0.pids == (FOREIGN,) and g0.process_memory == {FOREIGN: 4 * GIB}
    assert g0.utilization == pytest.approx(0.3)
    assert g0.process_utilization == {FOREIGN: pytest.approx((0.3, g0.dram_active))}
    assert g1.pids == () and g1.process_utilization == {}
    assert 0.15 <= g1.utilization <= 0.95  # the wave, as without a foreign process


def test_the_processes_busy_seconds_add_up_to_the_gpus(clock):
    """Two ranks followed (GPU 0 and 1) and a foreign process on GPU 0, over a minute of
    pushes whose step time changes: on every GPU and cycle the shares add up to the
    utilisation, so each process's share times the seconds between readings adds up to the
    GPU's busy seconds, as the per-rank accounting integrates them."""
    store = IngestStore(clock=clock)
    backend = DemoBackend(2, clock=clock, host="add-up", foreign_load=0.25)
    backend.follow(store.states)
    sampler = Sampler(backend, None, interval=5.0, collectors={"gpu"}, clock=clock)
    per_pid: dict[tuple[str, int], float] = {}
    previous = None
    waited = {"0": 0.0, "1": 0.0}
    for n in range(1, 13):  # 5 s of steps between pushes, a varying part of it waiting
        waited["0"] += 5.0 * (0.3 + 0.1 * (n % 3))
        waited["1"] += 5.0 * 0.1 * (n % 4)
        push(store, "0", 5.0 * n, 111, waited["0"])
        push(store, "1", 5.0 * n, 222, waited["1"])
        snap = sampler.run_once()
        for index, g in gpus(snap).items():
            s = g.sample
            assert sum(sm for sm, _ in s.process_utilization.values()) == \
                pytest.approx(s.utilization)
            assert sum(mem for _, mem in s.process_utilization.values()) == \
                pytest.approx(s.dram_active)
            if previous is not None:
                dt = s.timestamp - previous[index]
                for pid, (sm, _) in s.process_utilization.items():
                    per_pid[index, pid] = per_pid.get((index, pid), 0.0) + sm * dt
        previous = {index: g.sample.timestamp for index, g in gpus(snap).items()}
        clock.advance(5.0)
    busy = {index: g.busy_seconds for index, g in gpus(snap).items()}
    assert busy["0"] > 0 and busy["1"] > 0
    for index in busy:
        mine = sum(v for (i, _), v in per_pid.items() if i == index)
        assert mine == pytest.approx(busy[index])
    assert {pid for i, pid in per_pid if i == "0"} == {111, FOREIGN}
    assert gpus(snap)["0"].sample.pids == (111, FOREIGN)


def test_more_demand_than_a_gpu_is_shared_in_proportion(clock):
    """A rank busy 90 % of its time and a foreign process busy 60 % on one GPU: the GPU is
    100 % busy and they share it 3:2, as time-sliced processes would."""
    store = IngestStore(clock=clock)
    backend = DemoBackend(1, clock=clock, host="overload", foreign_load=0.6)
    backend.follow(store.states)
    sampler = Sampler(backend, None, collectors={"gpu"}, clock=clock)
    push(store, "0", 1.0, 111, waited=0.1)
    s = gpus(sampler.run_once())["0"].sample
    assert s.utilization == 1.0
    assert {pid: sm for pid, (sm, _) in s.process_utilization.items()} == \
        pytest.approx({111: 0.6, FOREIGN: 0.4})


def test_a_pinned_load_wins_and_the_shares_follow_it(clock):
    store = IngestStore(clock=clock)
    backend = DemoBackend(1, load=0.8, clock=clock, host="pinned", foreign_load=0.2)
    backend.follow(store.states)
    sampler = Sampler(backend, None, collectors={"gpu"}, clock=clock)
    push(store, "0", 1.0, 111, waited=0.8)  # the rank computes 20 % of its time
    s = gpus(sampler.run_once())["0"].sample
    assert s.utilization == 0.8
    assert {pid: sm for pid, (sm, _) in s.process_utilization.items()} == \
        pytest.approx({111: 0.4, FOREIGN: 0.4})


def test_a_foreign_load_outside_0_to_1_is_refused():
    with pytest.raises(ValueError, match="foreign load must be between 0 and 1"):
        DemoBackend(1, foreign_load=1.5)


def test_the_foreign_load_flag_puts_a_stranger_on_gpu_0(daemon_factory):
    """As a laptop shows it: the demo daemon with --demo.foreign-load lists on GPU 0 a process
    no rank owns, with its memory, and GPU 0 is as busy as it."""
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=2", "--demo.foreign-load=0.4",
                       "--sampler.interval=0.2")
    text = wait_until(lambda: t if "unattributed_processes" in (t := d.metrics()) else None,
                      timeout=20, what="the unattributed process on GPU 0")
    assert sample_value(text, "gputrain_gpu_unattributed_processes", {"gpu": "0"}) == 1
    assert sample_value(text, "gputrain_gpu_unattributed_memory_bytes", {"gpu": "0"}) == 4 * GIB
    assert sample_value(text, "gputrain_gpu_unattributed_processes", {"gpu": "1"}) == 0
    assert sample_value(text, "gputrain_gpu_utilization_ratio", {"gpu": "0"}) == \
        pytest.approx(0.4)
