"""Every NVML path of the GPU collector, driven by the scripted fake through the real code."""

from __future__ import annotations

import logging
import time

import pytest
from fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP,
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
    NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
    NVML_PERF_POLICY_POWER,
    FakeGpu,
    FakePynvml,
)
from prometheus_client import CollectorRegistry, generate_latest

from exporter.reading.collectors import GpuCollector, SelfCollector
from exporter.reading.gpu_backends import NvmlBackend
from exporter.reading.nvml import Nvml
from exporter.reading.peak_flops import PeakTable, parse_peak_overrides
from exporter.reading.sampler import Sampler

H100_GPM = {"sm_util": 62.0, "sm_occupancy": 31.0, "tensor_util": 12.5, "dram_bw_util": 40.0,
            "pcie_rx_mib_s": 100.0, "pcie_tx_mib_s": 10.0}


def gpu(i: int, **kw) -> FakeGpu:
    return FakeGpu(uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
                   bus_id=f"00000000:{0x18 + i:02X}:00.0", **kw)


class Rig:
    """A sampler over the fake, and a registry of the GPU and self collectors."""

    def __init__(self, fake: FakePynvml, clock, interval: float = 1.0,
                 peaks: PeakTable | None = None) -> None:
        self.fake = fake
        self.clock = clock
        self.backend = NvmlBackend(Nvml(fake), clock=clock)
        self.sampler = Sampler(self.backend, None, interval=interval,
                               collectors={"gpu"}, clock=clock)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GpuCollector(lambda: self.sampler.snapshot, peaks))
        self.registry.register(SelfCollector(lambda: self.sampler.snapshot))

    def cycle(self, seconds: float = 1.0) -> None:
        self.sampler.run_once()
        self.clock.advance(seconds)

    def value(self, name: str, gpu: str = "0", **labels: str) -> float | None:
        uuid = {g.identity.index: g.identity.uuid for g in self.sampler.snapshot.gpus}.get(gpu)
        return self.registry.get_sample_value(name, {"gpu": gpu, "uuid": uuid, **labels})


def test_readings_in_base_units(clock):
    g = gpu(0, util_samples=[(100, 40), (200, 60)], gpm=H100_GPM, pids=[4242])
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    rig.cycle()  # GPM needs two samples
    v = rig.value
    assert v("gputrain_gpu_up") == 1
    assert v("gputrain_gpu_utilization_ratio") == pytest.approx(0.5)
    assert v("gputrain_gpu_memory_used_bytes") == 10 * 1024**3
    assert v("gputrain_gpu_memory_total_bytes") == 80 * 1024**3
    assert v("gputrain_gpu_power_watts") == 350.0
    assert v("gputrain_gpu_power_limit_watts") == 700.0
    assert v("gputrain_gpu_temperature_celsius") == 55
    assert v("gputrain_gpu_clock_hertz", clock="sm") == 1980e6
    assert v("gputrain_gpu_clock_hertz", clock="memory") == 2619e6
    assert v("gputrain_gpu_pcie_link_max_bytes_per_second") == pytest.approx(3938.5e6 * 16)
    assert v("gputrain_gpu_sm_active_ratio") == pytest.approx(0.62)
    assert v("gputrain_gpu_sm_occupancy_ratio") == pytest.approx(0.31)
    assert v("gputrain_gpu_tensor_active_ratio") == pytest.approx(0.125)
    assert v("gputrain_gpu_dram_active_ratio") == pytest.approx(0.40)
    assert rig.registry.get_sample_value("gputrain_gpu_info", {
        "gpu": "0", "uuid": g.uuid, "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "00000000:18:00.0", "driver_version": "570.86.15", "backend": "nvml",
        "parent": "", "profile": ""}) == 1
    assert rig.sampler.snapshot.gpus[0].sample.pids == (4242,)
    assert rig.registry.get_sample_value("gputrain_collector_success", {"collector": "gpu"}) == 1


def test_peak_flops_by_precision_for_known_models_and_nothing_for_unknown_ones(clock):
    names = ["NVIDIA H100 80GB HBM3", "A100-SXM4-40GB", "NVIDIA GeForce RTX 4090", "NVIDIA B200"]
    rig = Rig(FakePynvml([gpu(i, name=n) for i, n in enumerate(names)]), clock)
    rig.cycle()
    peak = lambda i, p: rig.value("gputrain_gpu_peak_flops", str(i), precision=p)  # noqa: E731
    assert peak(0, "bf16") == pytest.approx(989.4e12)  # the datasheet's 1,979 with sparsity
    assert peak(0, "fp8") == pytest.approx(1978.9e12)
    assert peak(0, "fp32") == pytest.approx(66.9e12)
    # an older driver's name without "NVIDIA "; the A100 has no FP8
    assert peak(1, "bf16") == pytest.approx(312e12)
    assert peak(1, "tf32") == pytest.approx(156e12)
    assert peak(1, "fp8") is None
    # never a guess for a model the table lacks, while its neighbours carry on
    samples = [s for f in rig.registry.collect() if f.name == "gputrain_gpu_peak_flops"
               for s in f.samples if s.labels["gpu"] == "2"]
    assert samples == []
    assert rig.value("gputrain_gpu_up", "2") == 1
    assert peak(3, "fp8") == pytest.approx(4.5e15)


def test_peak_flops_overrides_add_models_and_correct_single_precisions(clock):
    overrides = parse_peak_overrides(
        "NVIDIA GeForce RTX 4090:bf16=165.2T,fp32=82.6e12;NVIDIA H100 80GB HBM3:fp8=2P")
    g = [gpu(0, name="NVIDIA GeForce RTX 4090"), gpu(1, name="NVIDIA H100 80GB HBM3")]
    rig = Rig(FakePynvml(g), clock, peaks=PeakTable(overrides))
    rig.cycle()
    assert rig.value("gputrain_gpu_peak_flops", "0", precision="bf16") == pytest.approx(165.2e12)
    assert rig.value("gputrain_gpu_peak_flops", "0", precision="fp32") == pytest.approx(82.6e12)
    assert rig.value("gputrain_gpu_peak_flops", "0", precision="fp8") is None
    assert rig.value("gputrain_gpu_peak_flops", "1", precision="fp8") == pytest.approx(2e15)
    assert rig.value("gputrain_gpu_peak_flops", "1", precision="bf16") == pytest.approx(989.4e12)


@pytest.mark.parametrize("value, message", [
    ("NVIDIA L40:bf16", "expected precision=FLOPS"),
    ("NVIDIA L40:int8=10T", "unknown precision 'int8'"),
    ("NVIDIA L40:bf16=0T", "positive"),
    ("NVIDIA L40:bf16=-3T", "expected FLOP/s"),
    ("NVIDIA L40:bf16=fast", "expected FLOP/s"),
    ("bf16=181T", "expected 'DEVICE NAME:bf16=989T"),
    ({"NVIDIA L40": {"bf16": 0}}, "positive"),
    ({"NVIDIA L40": [181e12]}, "expected a mapping of precision"),
])
def test_bad_peak_flops_say_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        parse_peak_overrides(value)


def test_utilisation_is_the_mean_of_new_buffer_samples_only(clock):
    g = gpu(0, util_samples=[(100, 100), (200, 100)])
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    g.util_samples += [(300, 0), (400, 20)]
    rig.cycle()
    assert rig.value("gputrain_gpu_utilization_ratio") == pytest.approx(0.10)


def test_utilisation_falls_back_to_rates_when_the_buffer_has_nothing(clock):
    g = gpu(0, util_samples=[], util_rate=73)
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    assert rig.value("gputrain_gpu_utilization_ratio") == pytest.approx(0.73)


def test_busy_seconds_integrate_utilisation_over_time(clock):
    g = gpu(0, util_samples=[], util_rate=50)
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle(1.0)
    rig.cycle(1.0)
    g.util_rate = 100
    rig.cycle(1.0)
    # first cycle has no interval behind it; then 1 s at 50 % and 1 s at 100 %
    assert rig.value("gputrain_gpu_busy_seconds_total") == pytest.approx(1.5)


def test_pcie_counters_prefer_cumulative_field_values(clock):
    g = gpu(0, pcie_rx_bytes=1_000_000, pcie_tx_bytes=10, gpm=H100_GPM)
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    g.pcie_rx_bytes += 4_000_000
    g.pcie_tx_bytes += 500
    rig.cycle()
    assert rig.value("gputrain_gpu_pcie_received_bytes_total") == 4_000_000
    assert rig.value("gputrain_gpu_pcie_transmitted_bytes_total") == 500
    assert rig.fake.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_pcie_falls_back_to_gpm_rates_then_to_the_throughput_call(clock):
    with_gpm = gpu(0, gpm=H100_GPM,
                   field_errors={NVML_FI_DEV_PCIE_COUNT_RX_BYTES: NVML_ERROR_NOT_SUPPORTED,
                                 NVML_FI_DEV_PCIE_COUNT_TX_BYTES: NVML_ERROR_NOT_SUPPORTED})
    without = gpu(1, pcie_rx_kbs=2000, pcie_tx_kbs=100,
                  field_errors=dict(with_gpm.field_errors))
    rig = Rig(FakePynvml([with_gpm, without]), clock)
    for _ in range(3):
        rig.cycle(2.0)
    # GPM rates cover the time between readings: 100 MiB/s over the 4 s of three cycles
    assert rig.value("gputrain_gpu_pcie_received_bytes_total") == pytest.approx(
        100 * 1024**2 * 4.0)
    assert rig.fake.calls["nvmlDeviceGetPcieThroughput"] == 3 * 2  # GPU 1 only, 2 directions
    # the throughput call from the first cycle: 2000 KB/s x 4 s
    assert rig.value("gputrain_gpu_pcie_received_bytes_total", gpu="1") == pytest.approx(
        2000 * 1000 * 4.0)
    assert rig.value("gputrain_gpu_pcie_transmitted_bytes_total", gpu="1") == pytest.approx(
        100 * 1000 * 4.0)


def test_energy_counter_from_nvml_deltas(clock):
    g = gpu(0, energy_mj=5_000_000)
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    g.energy_mj += 350_000
    rig.cycle()
    assert rig.value("gputrain_gpu_energy_joules_total") == pytest.approx(350.0)


def test_clock_event_seconds_from_field_counters(clock):
    g = gpu(0)
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    g.clock_events_ns[NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP] += 250_000_000
    g.clock_events_ns[NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN] += 1_000_000_000
    rig.cycle()
    assert rig.value("gputrain_gpu_clock_event_seconds_total",
                     reason="sw_power_cap") == pytest.approx(0.25)
    assert rig.value("gputrain_gpu_clock_event_seconds_total",
                     reason="hw_thermal_slowdown") == pytest.approx(1.0)


def test_clock_events_fall_back_to_violation_counters(clock):
    g = gpu(0, clock_events_ns={}, violation_ns={NVML_PERF_POLICY_POWER: 0})
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    g.violation_ns[NVML_PERF_POLICY_POWER] = 3_000_000_000
    rig.cycle()
    assert rig.value("gputrain_gpu_clock_event_seconds_total",
                     reason="sw_power_cap") == pytest.approx(3.0)


def test_not_supported_is_asked_once_and_left_out(clock):
    g = gpu(0, errors={"nvmlDeviceGetTemperature": NVML_ERROR_NOT_SUPPORTED})
    rig = Rig(FakePynvml([g]), clock)
    for _ in range(5):
        rig.cycle()
    assert rig.fake.calls["nvmlDeviceGetTemperature"] == 1
    assert rig.value("gputrain_gpu_temperature_celsius") is None
    assert rig.value("gputrain_gpu_power_watts") == 350.0  # the rest carries on
    # unsupported fields are also dropped from later field requests
    assert rig.fake.calls[f"field:{NVML_FI_DEV_PCIE_COUNT_RX_BYTES}"] == 5
    text = generate_latest(rig.registry).decode()
    assert "NaN" not in text


def test_gpm_absent_where_unsupported_and_nan_never_exported(clock):
    old = gpu(0, gpm=None)
    nan = gpu(1, gpm={"sm_util": float("nan"), "tensor_util": 3.0})
    rig = Rig(FakePynvml([old, nan]), clock)
    rig.cycle()
    rig.cycle()
    assert rig.value("gputrain_gpu_sm_active_ratio") is None
    assert rig.value("gputrain_gpu_sm_active_ratio", gpu="1") is None
    assert rig.value("gputrain_gpu_tensor_active_ratio", gpu="1") == pytest.approx(0.03)
    assert "NaN" not in generate_latest(rig.registry).decode()


def test_function_not_found_is_logged_once(clock, caplog):
    gpus = [gpu(i, errors={"nvmlDeviceGetTotalEnergyConsumption":
                           NVML_ERROR_FUNCTION_NOT_FOUND}) for i in range(4)]
    rig = Rig(FakePynvml(gpus), clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rig.cycle()
    lines = [r for r in caplog.records if "nvmlDeviceGetTotalEnergyConsumption" in r.message]
    assert len(lines) == 1
    # energy then comes from power x time: 350 W over the 2 s between 3 cycles
    assert rig.value("gputrain_gpu_energy_joules_total") == pytest.approx(700.0)


def test_an_older_nvidia_ml_py_without_a_function_is_fine(clock, caplog):
    fake = FakePynvml([gpu(0, gpm=H100_GPM)], missing=("nvmlGpmQueryDeviceSupport",))
    rig = Rig(fake, clock)
    with caplog.at_level(logging.WARNING):
        rig.cycle()
        rig.cycle()
    assert rig.value("gputrain_gpu_sm_active_ratio") is None
    assert rig.value("gputrain_gpu_power_watts") == 350.0
    assert sum("nvmlGpmQueryDeviceSupport" in r.message for r in caplog.records) == 1


def test_lost_gpu_turns_up_to_zero_while_others_carry_on_and_is_retried(clock, caplog):
    gpus = [gpu(0), gpu(1), gpu(2)]
    rig = Rig(FakePynvml(gpus), clock)
    rig.cycle()
    gpus[1].lost = True
    with caplog.at_level(logging.ERROR):
        rig.cycle()
        rig.cycle()
    assert rig.value("gputrain_gpu_up", gpu="1") == 0
    assert rig.value("gputrain_gpu_power_watts", gpu="1") is None  # no stale values
    assert rig.value("gputrain_gpu_up", gpu="0") == 1
    assert rig.value("gputrain_gpu_up", gpu="2") == 1
    assert rig.value("gputrain_gpu_power_watts", gpu="2") == 350.0
    assert sum("is lost" in r.message for r in caplog.records) == 1
    gpus[1].lost = False
    rig.cycle(10.0)  # the retry waits 10 s
    rig.cycle()
    assert rig.value("gputrain_gpu_up", gpu="1") == 1
    assert rig.value("gputrain_gpu_power_watts", gpu="1") == 350.0


@pytest.mark.parametrize("code", [NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_driver_means_host_only_one_log_line_and_gpu_collector_failing(clock, caplog, code):
    from exporter.reading.collectors import host_collectors

    fake = FakePynvml([], init_error=code)
    sampler = Sampler(NvmlBackend(Nvml(fake), clock=clock), host_collectors(), interval=1.0,
                      clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            sampler.run_once()
            clock.advance(1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SelfCollector(lambda: sampler.snapshot))
    assert registry.get_sample_value("gputrain_collector_success", {"collector": "gpu"}) == 0
    assert registry.get_sample_value("gputrain_collector_success", {"collector": "cpu"}) == 1
    assert {"cpu", "memory"} <= set(sampler.snapshot.host)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "serving host metrics only" in warnings[0].message
    assert fake.calls["nvmlInit"] == 1  # retried only after a minute


def test_a_hung_gpu_does_not_hold_up_the_others(clock):
    real_clock = time.monotonic
    gpus = [gpu(0), gpu(1, delay_s=0.0)]
    fake = FakePynvml(gpus)
    sampler = Sampler(NvmlBackend(Nvml(fake)), None, interval=0.2, collectors={"gpu"},
                      clock=real_clock)
    sampler.run_once()
    gpus[1].delay_s = 1.5
    started = real_clock()
    snap = sampler.run_once()
    assert real_clock() - started < 0.5
    assert snap.gpus[0].up and snap.gpus[0].sample.timestamp >= started
    # after three intervals without an answer the hung GPU is marked down
    time.sleep(0.5)
    snap = sampler.run_once()
    assert snap.gpus[0].up and not snap.gpus[1].up
    gpus[1].delay_s = 0.0
    time.sleep(1.5)
    sampler.run_once()
    snap = sampler.run_once()
    assert snap.gpus[1].up
    sampler.stop()


def test_mig_parent_keeps_working_and_mig_devices_report_what_they_support(clock):
    migs = [FakeGpu(uuid="MIG-11111111-2222-3333-4444-555555555555", gpu_instance_id=1,
                    name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                    gpm={"sm_util": 80.0},
                    errors={"nvmlDeviceGetPowerUsage": NVML_ERROR_NOT_SUPPORTED,
                            "nvmlDeviceGetSamples": NVML_ERROR_NOT_SUPPORTED,
                            "nvmlDeviceGetUtilizationRates": NVML_ERROR_NOT_SUPPORTED},
                    memory_used=5 * 1024**3, memory_total=10 * 1024**3),
            FakeGpu(uuid="MIG-66666666-2222-3333-4444-555555555555", gpu_instance_id=2,
                    memory_used=1 * 1024**3, memory_total=10 * 1024**3)]
    parent = gpu(0, mig=migs, gpm=H100_GPM,
                 errors={"nvmlDeviceGetSamples": NVML_ERROR_NOT_SUPPORTED,
                         "nvmlDeviceGetUtilizationRates": NVML_ERROR_NOT_SUPPORTED})
    rig = Rig(FakePynvml([parent, gpu(1)]), clock)
    rig.cycle()
    rig.cycle()
    assert [g.identity.index for g in rig.sampler.snapshot.gpus] == ["0", "0/0", "0/1", "1"]
    assert rig.value("gputrain_gpu_up") == 1
    assert rig.value("gputrain_gpu_power_watts") == 350.0
    assert rig.value("gputrain_gpu_utilization_ratio") is None  # not supported in MIG mode
    assert rig.value("gputrain_gpu_memory_used_bytes", gpu="0/0") == 5 * 1024**3
    assert rig.value("gputrain_gpu_sm_active_ratio", gpu="0/0") == pytest.approx(0.8)
    assert rig.value("gputrain_gpu_power_watts", gpu="0/0") is None
    assert rig.value("gputrain_gpu_up", gpu="0/1") == 1
    assert rig.registry.get_sample_value("gputrain_gpu_info", {
        "gpu": "0/0", "uuid": migs[0].uuid, "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        "pci_bus_id": "00000000:18:00.0", "driver_version": "570.86.15", "backend": "nvml",
        "parent": "0", "profile": "3g.40gb"}) == 1
    # a MIG device's processes and memory, as the physical GPU's
    assert rig.value("gputrain_gpu_memory_total_bytes", gpu="0/1") == 10 * 1024**3
    assert rig.value("gputrain_gpu_up", gpu="1") == 1
    # a slice's share of the peak depends on its profile: no figure rather than a wrong one
    assert rig.value("gputrain_gpu_peak_flops", gpu="0", precision="bf16") == pytest.approx(
        989.4e12)
    assert rig.value("gputrain_gpu_peak_flops", gpu="0/0", precision="bf16") is None


def test_xid_events_are_counted_in_their_own_thread():
    gpus = [gpu(0), gpu(1)]
    fake = FakePynvml(gpus)
    sampler = Sampler(NvmlBackend(Nvml(fake)), None, interval=0.2, collectors={"gpu"})
    sampler.start()
    try:
        fake.events.put((gpus[1], 79))
        fake.events.put((gpus[1], 79))
        fake.events.put((gpus[0], 13))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            snap = sampler.snapshot
            if snap.gpus[1].xid_errors.get(79) == 2 and snap.gpus[0].xid_errors.get(13) == 1:
                break
            time.sleep(0.05)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(GpuCollector(lambda: sampler.snapshot))
        assert registry.get_sample_value("gputrain_gpu_xid_errors_total", {
            "gpu": "1", "uuid": gpus[1].uuid, "xid": "79"}) == 2
        assert registry.get_sample_value("gputrain_gpu_xid_errors_total", {
            "gpu": "0", "uuid": gpus[0].uuid, "xid": "13"}) == 1
    finally:
        sampler.stop()


def test_a_scrape_makes_no_nvml_call(clock):
    rig = Rig(FakePynvml([gpu(0, gpm=H100_GPM), gpu(1)]), clock)
    rig.cycle()
    rig.cycle()
    before = sum(rig.fake.calls.values())
    for _ in range(5):
        generate_latest(rig.registry)
    assert sum(rig.fake.calls.values()) == before


def test_nvml_is_not_touched_at_import():
    import importlib

    import exporter.reading.gpu_backends
    import exporter.reading.nvml

    importlib.reload(exporter.reading.nvml)
    importlib.reload(exporter.reading.gpu_backends)
    nv = exporter.reading.nvml.Nvml(FakePynvml([gpu(0)]))
    assert not nv.initialized and nv.lib is None


def test_memory_comes_from_the_v2_call_and_falls_back_once_on_an_older_driver(clock, caplog):
    """v2's "used" leaves out the driver's reserved memory (what nvidia-smi shows); a driver
    without it is asked once, then v1 serves, reserved memory included."""
    new, old = gpu(0), gpu(1, memory_v2=False)
    rig = Rig(FakePynvml([new, old]), clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rig.cycle()
    assert rig.value("gputrain_gpu_memory_used_bytes", gpu="0") == new.memory_used
    assert rig.value("gputrain_gpu_memory_used_bytes", gpu="1") == \
        old.memory_used + old.memory_reserved
    assert rig.fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 3 + 1  # GPU 0 each cycle, GPU 1 once
    assert rig.fake.calls["nvmlDeviceGetMemoryInfo"] == 3  # v1 only for GPU 1
    assert "NVML function" not in caplog.text  # a missing variant is no missing function


@pytest.mark.parametrize("missing, used", [
    ((), "nvmlDeviceGetComputeRunningProcesses_v3"),
    (("nvmlDeviceGetComputeRunningProcesses_v3",), "nvmlDeviceGetComputeRunningProcesses_v2"),
    (("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
     "nvmlDeviceGetComputeRunningProcesses"),
])
def test_running_processes_use_the_newest_call_the_binding_has(clock, missing, used):
    rig = Rig(FakePynvml([gpu(0, pids=[4242, 4343])], missing=missing), clock)
    rig.cycle()
    rig.cycle()
    assert rig.sampler.snapshot.gpus[0].sample.pids == (4242, 4343)
    assert rig.fake.calls[used] == 2
    assert sum(n for name, n in rig.fake.calls.items()
               if name.startswith("nvmlDeviceGetComputeRunningProcesses")) == 2


def test_the_fake_matches_the_real_pynvml_signatures():
    """Every NVML function the fake scripts exists in nvidia-ml-py's pynvml and takes the same
    arguments, so code that works against the fake calls the real library the same way."""
    import inspect

    import pynvml

    fake = FakePynvml([])
    names = [n for n in dir(FakePynvml) if n.startswith("nvml") and callable(getattr(fake, n))]
    assert len(names) > 30
    for name in names:
        real = getattr(pynvml, name, None)
        assert real is not None, f"pynvml has no {name}"
        want = list(inspect.signature(real).parameters.values())
        got = list(inspect.signature(getattr(fake, name)).parameters.values())
        assert [(p.kind, p.default) for p in got] == [(p.kind, p.default) for p in want], \
            f"{name}: fake {inspect.signature(getattr(fake, name))}, " \
            f"pynvml {inspect.signature(real)}"
        optional = [p.name for p in want if p.default is not inspect.Parameter.empty]
        assert [p.name for p in got if p.default is not inspect.Parameter.empty] == optional


# --- NVLink and memory health ---------------------------------------------------------------

def test_nvlink_bytes_come_from_the_all_links_counters(clock):
    g = gpu(0, nvlink_links=18, nvlink_rx_kib=1000, nvlink_tx_kib=500)
    rig = Rig(FakePynvml([g, gpu(1)]), clock)
    rig.cycle()
    g.nvlink_rx_kib += 2**20  # 1 GiB in a second
    g.nvlink_tx_kib += 2**19
    rig.cycle()
    assert rig.value("gputrain_gpu_nvlink_received_bytes_total") == 2**30
    assert rig.value("gputrain_gpu_nvlink_transmitted_bytes_total") == 2**29
    assert rig.value("gputrain_gpu_nvlink_links") == 18
    assert rig.value("gputrain_gpu_nvlink_link_max_bytes_per_second") == 26_562e6
    # a GPU without NVLink exports none of it, and is asked for its links once
    for name in ("gputrain_gpu_nvlink_received_bytes_total", "gputrain_gpu_nvlink_links",
                 "gputrain_gpu_nvlink_link_max_bytes_per_second"):
        assert rig.value(name, gpu="1") is None
    for _ in range(3):
        rig.cycle()
    assert rig.fake.calls["field:91"] == 5 + 1  # GPU 0 each of 5 cycles, GPU 1 once


def test_nvlink_from_gpm_where_the_counters_are_not_supported(clock):
    g = gpu(0, nvlink_links=18, nvlink_rx_kib=None, nvlink_tx_kib=None,
            gpm={**H100_GPM, "nvlink_rx_mib_s": 1024.0, "nvlink_tx_mib_s": 512.0})
    rig = Rig(FakePynvml([g]), clock)
    for _ in range(4):
        rig.cycle()
    # GPM's rates from its second reading, integrated over the seconds watched
    rx = rig.value("gputrain_gpu_nvlink_received_bytes_total")
    watched = rig.value("gputrain_gpu_sampled_seconds_total")
    assert watched == 3 and rx == pytest.approx(watched * 1024 * 2**20)
    assert rig.value("gputrain_gpu_nvlink_transmitted_bytes_total") == pytest.approx(rx / 2)


def test_ecc_counts_stay_monotonic_across_a_driver_reload(clock):
    g = gpu(0, ecc_volatile={0: 3, 1: 0})
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    assert rig.value("gputrain_gpu_ecc_errors_total", type="corrected") == 3  # since load
    g.ecc_volatile = {0: 5, 1: 1}
    rig.cycle()
    g.ecc_volatile = {0: 0, 1: 0}  # the driver reloaded: its volatile counts start again
    rig.cycle()
    g.ecc_volatile = {0: 2, 1: 0}
    rig.cycle()
    assert rig.value("gputrain_gpu_ecc_errors_total", type="corrected") == 7
    assert rig.value("gputrain_gpu_ecc_errors_total", type="uncorrected") == 1


def test_ecc_not_supported_is_asked_once_and_exports_nothing(clock):
    rig = Rig(FakePynvml([gpu(0, ecc_volatile=None)]), clock)
    for _ in range(4):
        rig.cycle()
    assert rig.value("gputrain_gpu_ecc_errors_total", type="corrected") is None
    assert rig.fake.calls["nvmlDeviceGetTotalEccErrors"] == 2  # each type once


def test_row_remapping_states(clock):
    g = gpu(0, remapped_rows=(3, 1, 1, 0))
    rig = Rig(FakePynvml([g]), clock)
    rig.cycle()
    assert {s: rig.value("gputrain_gpu_remapped_rows", state=s) for s in
            ("correctable", "uncorrectable", "pending", "failed")} == {
        "correctable": 3, "uncorrectable": 1, "pending": 1, "failed": 0}
    assert rig.value("gputrain_gpu_retired_pages", cause="double_bit_ecc") is None


def test_retired_pages_on_a_gpu_before_ampere_and_a_driver_without_the_remapper(clock, caplog):
    g = gpu(0, remapped_rows=None, retired_pages={0: [1, 2, 3], 1: [4]}, retired_pending=1)
    fake = FakePynvml([g, gpu(1, retired_pages={0: [], 1: []})],
                      missing=("nvmlDeviceGetRemappedRows",))
    rig = Rig(fake, clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rig.cycle()
    assert rig.value("gputrain_gpu_retired_pages", cause="multiple_single_bit_ecc") == 3
    assert rig.value("gputrain_gpu_retired_pages", cause="double_bit_ecc") == 1
    assert rig.value("gputrain_gpu_retired_pages_pending") == 1
    assert rig.value("gputrain_gpu_remapped_rows", state="pending") is None
    missing = [r for r in caplog.records if "nvmlDeviceGetRemappedRows" in r.getMessage()]
    assert len(missing) == 1  # the missing function is logged once, not per GPU or cycle


def test_a_gpu_lost_while_reading_its_memory_health_goes_down_alone(clock):
    g = gpu(0, nvlink_links=4)
    rig = Rig(FakePynvml([g, gpu(1, nvlink_links=4)]), clock)
    rig.cycle()
    g.errors["nvmlDeviceGetRemappedRows"] = 15  # GPU_IS_LOST
    rig.cycle()
    assert rig.value("gputrain_gpu_up") == 0
    assert rig.value("gputrain_gpu_up", gpu="1") == 1
    assert rig.value("gputrain_gpu_nvlink_links", gpu="1") == 4
