"""What a review of the GPU path against nvidia-ml-py, nvml.h, nvitop and dcgm-exporter found:
each through the real binding over the fake driver (tests/fake_nvml.py), which answers as the
headers say."""

from __future__ import annotations

import json

import fake_nvml as fd
import pytest
from fake_nvml import FakeDriver, FakeGpu, a100_sxm4_mig, h100_sxm
from prometheus_client import CollectorRegistry
from test_gpu_collector import GIB, Rig, gpu, h100_mig

from exporter.reading.gpu_backends import NvmlBackend
from exporter.reading.nvml import Nvml
from exporter.serving.attribution import Attribution
from exporter.serving.ingest import IngestStore
from exporter.serving.training import TrainingCollector

pytestmark = pytest.mark.nvml
NEWER = "nvmlDeviceGetProcessesUtilizationInfo"


def state(rig: Rig, index: str = "0"):
    return next(g for g in rig.sampler.snapshot.gpus if g.identity.index == index)


# --- 1. a change of MIG mode, and a reopen, forget the device's cached answers ----------------

def test_turning_mig_off_brings_back_what_nvml_refused_in_mig_mode(clock):
    """An A100 in MIG mode refuses utilisation and per-process samples (cached as NOT_SUPPORTED,
    asked once); MIG turned off, they answer again without a restart. The near miss: while the
    mode stays, the refusal is asked once, not every cycle."""
    a100 = a100_sxm4_mig(0, util_rate=64, processes=[(4242, GIB)],
                         process_samples=[(1_000_000, 4242, 64, 20)])
    rig = Rig([a100], clock)
    for _ in range(3):
        rig.cycle()
    assert rig.value("gputrain_gpu_utilization_ratio") is None
    assert state(rig).sample.process_utilization is None
    asked = rig.calls["nvmlDeviceGetUtilizationRates"]
    rig.cycle()
    assert rig.calls["nvmlDeviceGetUtilizationRates"] == asked  # refused once, then not asked
    rig.driver.reconfigure_mig(a100, None)  # nvidia-smi -mig 0 (and a GPU reset)
    for _ in range(3):
        rig.cycle()
    assert rig.indexes() == ["0"]
    assert rig.value("gputrain_gpu_utilization_ratio") == pytest.approx(0.64)
    a100.process_samples.append((2_000_000, 4242, 50, 10))
    rig.cycle()
    assert state(rig).sample.process_utilization == {4242: pytest.approx((0.5, 0.1))}


def test_turning_mig_on_lists_the_slices_and_stops_asking_what_mig_mode_refuses(clock):
    g = h100_sxm(0, gpm=None, util_rate=30)
    rig = Rig([g], clock)
    rig.cycle()
    assert rig.value("gputrain_gpu_utilization_ratio") == pytest.approx(0.3)
    slices = h100_mig().mig
    rig.driver.reconfigure_mig(g, slices)
    rig.cycle(61.0)  # the periodic MIG listing
    rig.cycle()
    assert rig.indexes() == ["0", "0/0", "0/1"]
    assert rig.value("gputrain_gpu_utilization_ratio") is None  # refused in MIG mode


def test_a_reopened_gpu_is_asked_again_what_it_refused_before_its_reset(clock):
    """A GPU lost and reset answers what it refused before (a reset can change what the
    firmware supports): the reopen forgets its cached NOT_SUPPORTED answers."""
    g = gpu(0, errors={"nvmlDeviceGetPowerUsage": fd.NOT_SUPPORTED})
    rig = Rig([g], clock)
    rig.cycle()
    rig.cycle()
    assert rig.value("gputrain_gpu_power_watts") is None
    assert rig.calls["nvmlDeviceGetPowerUsage"] == 1
    identity = state(rig).identity
    assert rig.backend.sample(identity).power_watts is None  # the near miss: still cached
    assert rig.calls["nvmlDeviceGetPowerUsage"] == 1
    g.errors = {}  # reset: the new firmware state answers
    assert rig.backend.reopen(identity)  # what the sampler does with a GPU that was lost
    assert rig.backend.sample(identity).power_watts == 350.0


# --- 2. per-process busy time weighted by the samples' timestamps -----------------------------

def period_samples(pid: int, start_s: float, end_s: float, period_s: float, percent: int,
                   every: int = 1) -> list[tuple[int, int, int, int]]:
    """NVML's per-process samples: one each ``period_s`` (every ``every``-th period) in
    (start_s, end_s], timestamps in microseconds."""
    n0, n1 = int(start_s / period_s) + 1, int(end_s / period_s + 1e-9)
    return [(round(n * period_s * 1e6), pid, percent, percent // 2)
            for n in range(n0, n1 + 1) if n % every == 0]


@pytest.mark.parametrize("period", [1.5, 0.5])
def test_a_process_busy_all_the_time_is_busy_all_the_time_whatever_nvmls_sample_period(
        clock, period):
    """NVML's per-process period of 1.5 s, the sampler's 1 s: some cycles find no new sample.
    The process was busy all the time; its busy seconds are the GPU's, not two thirds of them
    (and the rest unattributed). A period shorter than the cycle counts each sample once."""
    g = gpu(0, util_rate=100, processes=[(4242, GIB)])
    rig = Rig([g], clock)
    t0 = clock()
    rig.cycle()
    for _ in range(12):
        now = clock() - t0
        g.process_samples = period_samples(4242, 0.0, now, period, 100)
        rig.cycle()
    st = state(rig)
    assert st.process_busy_seconds[4242] == pytest.approx(st.busy_seconds, rel=0.15)


def test_a_process_busy_every_other_period_is_busy_half_the_time(clock):
    """The near miss: a process with a sample every other 1.5 s period was idle in between
    (NVML gives no sample to an idle process): half the GPU's time, not all of it."""
    g = gpu(0, util_rate=100, processes=[(4242, GIB), (4343, GIB)])
    rig = Rig([g], clock)
    t0 = clock()
    rig.cycle()
    for _ in range(18):
        now = clock() - t0
        g.process_samples = sorted(period_samples(4242, 0.0, now, 1.5, 100, every=2)
                                   + period_samples(4343, 0.0, now, 1.5, 40))
        rig.cycle()
    st = state(rig)
    assert st.process_busy_seconds[4242] == pytest.approx(0.5 * st.busy_seconds, rel=0.2)
    assert st.process_busy_seconds[4343] == pytest.approx(0.4 * st.busy_seconds, rel=0.2)


# --- 3. Xid events: registered again on a reopen; a MIG device's on the MIG device -------------

def xid_backend(gpus: list[FakeGpu]) -> tuple[FakeDriver, NvmlBackend]:
    driver = FakeDriver(gpus)
    backend = NvmlBackend(Nvml(driver.binding))
    backend.start()
    assert backend.wait_xid(0.01) == []  # registers
    return driver, backend


def test_a_gpu_reset_and_reopened_has_its_xid_events_watched_again():
    g, other = gpu(0), gpu(1)
    driver, backend = xid_backend([g, other])
    identity = backend._devices["0"].identity
    g.lost = True
    driver.reset(g)  # nvidia-smi -r: its registration is gone
    g.lost = False
    assert backend.reopen(identity)
    driver.events.put((g, 79))
    assert backend.wait_xid(1.0) == [("0", 79)]
    driver.events.put((other, 13))  # the near miss: a GPU never reset keeps its registration
    assert backend.wait_xid(1.0) == [("1", 13)]
    backend.close()


def test_a_mig_devices_xid_is_counted_on_that_mig_device():
    a100 = a100_sxm4_mig(0)
    driver, backend = xid_backend([a100])
    driver.events.put((a100.mig[1], 31))  # a fault in GPU instance 5 (2g.10gb)
    assert backend.wait_xid(1.0) == [("0/1", 31)]
    driver.events.put((a100, 48))  # the near miss: the GPU's own (gpuInstanceId ~0)
    assert backend.wait_xid(1.0) == [("0", 48)]
    backend.close()


# --- 5. a rank on a MIG slice pushes its UUID as "GPU-..." -------------------------------------

def test_a_rank_pushing_a_mig_slices_uuid_as_gpu_uuid_is_on_that_slice(clock):
    a100 = a100_sxm4_mig(0)
    rig = Rig([a100], clock)
    rig.cycle()
    body = a100.mig[1].uuid.removeprefix("MIG-")
    store = IngestStore()
    for rank, ref in (("0", "GPU-" + body), ("1", a100.uuid), ("2", "GPU-" + body[:-1] + "f")):
        store.push(json.dumps({"version": 1, "run": "slice", "rank": rank, "run_id": "a",
                               "steps": 1, "step_seconds": 1.0, "data_wait_seconds": 0.0,
                               "samples": 8, "gpus": [ref]}).encode())
    registry = CollectorRegistry(auto_describe=False)
    views = Attribution(snapshot=rig.sampler.snapshot)  # the GPUs, before any join
    registry.register(TrainingCollector(store, lambda: views.latest))
    info = {(s.labels["rank"], s.labels["gpu"], s.labels["uuid"])
            for f in registry.collect() if f.name == "gputrain_training_gpu_info"
            for s in f.samples}
    # rank 0 on the slice (its MIG- UUID); rank 1 on the whole GPU; rank 2's UUID is no device
    assert info == {("0", "0/1", a100.mig[1].uuid), ("1", "0", a100.uuid)}


# --- 6. the fake driver answers as the headers say ---------------------------------------------

def test_the_fake_answers_gpm_on_a_mig_device_handle():
    driver = FakeDriver([h100_mig()])
    nv = driver.binding
    nv.nvmlInit()
    parent = nv.nvmlDeviceGetHandleByIndex(0)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    assert nv.nvmlGpmQueryDeviceSupport(mig).isSupportedDevice == 1
    sample = nv.nvmlGpmSampleAlloc()
    nv.nvmlGpmSampleGet(mig, sample)  # SUCCESS: no exception


def test_the_fake_lists_a_mig_gpus_aggregated_processes_only_with_privileges():
    a100 = a100_sxm4_mig(0)
    a100.mig[0].processes = [(4242, GIB)]
    for privileged, expected in ((True, [4242]), (False, None)):
        driver = FakeDriver([a100], privileged=privileged)
        nv = driver.binding
        nv.nvmlInit()
        parent = nv.nvmlDeviceGetHandleByIndex(0)
        mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
        assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(mig)] == [4242]
        if expected is None:
            with pytest.raises(nv.NVMLError) as err:
                nv.nvmlDeviceGetComputeRunningProcesses(parent)
            assert err.value.value == fd.NO_PERMISSION
        else:
            assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(parent)] == expected


def test_the_fake_gives_no_volatile_ecc_through_a_mig_handle():
    driver = FakeDriver([a100_sxm4_mig(0)])
    nv = driver.binding
    nv.nvmlInit()
    parent = nv.nvmlDeviceGetHandleByIndex(0)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    assert nv.nvmlDeviceGetTotalEccErrors(parent, 0, 0) == 0
    with pytest.raises(nv.NVMLError) as err:
        nv.nvmlDeviceGetTotalEccErrors(mig, 0, 0)
    assert err.value.value == fd.NOT_SUPPORTED


def test_the_sizing_call_of_processes_utilization_info_is_insufficient_size():
    """nvml.h: called with procUtilArray NULL it answers INSUFFICIENT_SIZE with the count,
    whether or not there are samples; only the filling call says NOT_FOUND."""
    import ctypes

    g = gpu(0, processes=[(4242, GIB)])
    driver = FakeDriver([g])
    nv = driver.binding
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    info = fd._CProcessesUtilizationInfoV1(version=fd.PROCESSES_UTILIZATION_V1)
    fn = nv._nvmlGetFunctionPointer(NEWER)
    assert fn(handle, ctypes.byref(info)) == fd.INSUFFICIENT_SIZE
    assert info.processSamplesCount == 0
    g.process_samples = [(1_000, 4242, 50, 10)]
    assert fn(handle, ctypes.byref(info)) == fd.INSUFFICIENT_SIZE
    assert info.processSamplesCount == 1
