"""Every NVML path of the GPU collector: the real nvidia-ml-py binding over the fake driver
(tests/fake_nvml.py), through the real backend, sampler and collector."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import fake_nvml as fd
import pytest
from fake_nvml import FakeDriver, FakeGpu, a100_sxm4_mig, h100_sxm, l4, v100_sxm2
from prometheus_client import CollectorRegistry, generate_latest

from exporter.reading.collectors import GpuCollector, SelfCollector
from exporter.reading.gpu_backends import PCIE_LANE_BYTES_PER_SECOND, NvmlBackend
from exporter.reading.nvml import Nvml
from exporter.reading.peak_flops import PeakTable, parse_peak_overrides
from exporter.reading.sampler import Sampler

pytestmark = pytest.mark.nvml

H100_GPM = {"sm_util": 62.0, "sm_occupancy": 31.0, "tensor_util": 12.5, "dram_bw_util": 40.0,
            "pcie_rx_mib_s": 100.0, "pcie_tx_mib_s": 10.0}
GIB = 1024**3


def gpu(i: int, **kw) -> FakeGpu:
    """A plain scripted GPU (H100 figures, no GPM, no NVLink) unless told otherwise."""
    return FakeGpu(uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
                   bus_id=f"00000000:{0x18 + i:02X}:00.0", **kw)


class Rig:
    """A sampler over the fake driver, and a registry of the GPU and self collectors."""

    def __init__(self, gpus: list[FakeGpu], clock, interval: float = 1.0,
                 peaks: PeakTable | None = None, **driver: object) -> None:
        self.driver = FakeDriver(gpus, clock=clock, **driver)
        self.clock = clock
        self.backend = NvmlBackend(Nvml(self.driver.binding), clock=clock)
        # the fake driver answers at once, but a loaded machine may not run a read within
        # 0.8 of a 0.1 s interval of real time; a cycle's readings are its own here
        self.sampler = Sampler(self.backend, None, interval=interval,
                               collectors={"gpu"}, clock=clock, read_wait=60.0)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GpuCollector(lambda: self.sampler.snapshot, peaks))
        self.registry.register(SelfCollector(lambda: self.sampler.snapshot))

    @property
    def calls(self):
        return self.driver.calls

    def cycle(self, seconds: float = 1.0) -> None:
        self.sampler.run_once()
        self.clock.advance(seconds)

    def value(self, name: str, gpu: str = "0", **labels: str) -> float | None:
        uuid = {g.identity.index: g.identity.uuid for g in self.sampler.snapshot.gpus}.get(gpu)
        return self.registry.get_sample_value(name, {"gpu": gpu, "uuid": uuid, **labels})

    def indexes(self) -> list[str]:
        return [g.identity.index for g in self.sampler.snapshot.gpus]


def test_readings_in_base_units(clock):
    g = gpu(0, util_samples=[(100, 40), (200, 60)], gpm=H100_GPM, processes=[(4242, GIB)])
    rig = Rig([g], clock)
    rig.cycle()
    rig.cycle()  # GPM needs two samples
    v = rig.value
    assert v("gputrain_gpu_up") == 1
    assert v("gputrain_gpu_utilization_ratio") == pytest.approx(0.5)
    assert v("gputrain_gpu_memory_used_bytes") == 10 * GIB
    assert v("gputrain_gpu_memory_total_bytes") == 81559 * 1024**2
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
        "pci_bus_id": "00000000:18:00.0", "driver_version": "590.48.01", "backend": "nvml",
        "parent": "", "profile": ""}) == 1
    assert rig.sampler.snapshot.gpus[0].sample.pids == (4242,)
    assert rig.registry.get_sample_value("gputrain_collector_success", {"collector": "gpu"}) == 1


def test_the_four_scripted_models_read_as_their_nvidia_smi_outputs(clock):
    rig = Rig([h100_sxm(0), a100_sxm4_mig(1), l4(2), v100_sxm2(3)], clock)
    rig.cycle()
    rig.cycle()
    assert rig.indexes() == ["0", "1", "1/0", "1/1", "1/2", "2", "3"]
    limits = {i: rig.value("gputrain_gpu_power_limit_watts", i) for i in ("0", "1", "2", "3")}
    assert limits == {"0": 700.0, "1": 400.0, "2": 72.0, "3": 300.0}
    assert rig.value("gputrain_gpu_nvlink_links", "0") == 18
    assert rig.value("gputrain_gpu_nvlink_links", "1") == 12
    assert rig.value("gputrain_gpu_nvlink_links", "2") is None  # the L4 has no NVLink
    assert rig.value("gputrain_gpu_nvlink_links", "3") == 6
    link = {i: rig.value("gputrain_gpu_pcie_link_max_bytes_per_second", i) for i in "0123"}
    assert link == pytest.approx({"0": PCIE_LANE_BYTES_PER_SECOND[5] * 16,
                                  "1": PCIE_LANE_BYTES_PER_SECOND[4] * 16,
                                  "2": PCIE_LANE_BYTES_PER_SECOND[4] * 16,
                                  "3": PCIE_LANE_BYTES_PER_SECOND[3] * 16})
    assert rig.value("gputrain_gpu_retired_pages", "3", cause="double_bit_ecc") == 0
    assert rig.value("gputrain_gpu_remapped_rows", "3", state="pending") is None
    assert rig.value("gputrain_gpu_sm_active_ratio", "0") == pytest.approx(0.62)
    assert rig.value("gputrain_gpu_sm_active_ratio", "3") is None  # no GPM before Hopper


def test_peak_flops_by_precision_for_known_models_and_nothing_for_unknown_ones(clock):
    names = ["NVIDIA H100 80GB HBM3", "A100-SXM4-40GB", "NVIDIA GeForce RTX 4090", "NVIDIA B200"]
    rig = Rig([gpu(i, name=n) for i, n in enumerate(names)], clock)
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
    rig = Rig(g, clock, peaks=PeakTable(overrides))
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


# --- utilisation -------------------------------------------------------------------------------

def test_utilisation_is_the_mean_of_new_buffer_samples_only(clock):
    g = gpu(0, util_samples=[(100, 100), (200, 100)])
    rig = Rig([g], clock)
    rig.cycle()
    g.util_samples += [(300, 0), (400, 20)]
    rig.cycle()
    assert rig.value("gputrain_gpu_utilization_ratio") == pytest.approx(0.10)


def test_utilisation_falls_back_to_rates_when_the_buffer_has_nothing(clock):
    rig = Rig([gpu(0, util_samples=[], util_rate=73),
               gpu(1, util_samples=[(100, 10)], util_rate=35,
                   errors={"nvmlDeviceGetSamples": fd.NO_DATA})], clock)
    rig.cycle()
    assert rig.value("gputrain_gpu_utilization_ratio") == pytest.approx(0.73)
    assert rig.value("gputrain_gpu_utilization_ratio", "1") == pytest.approx(0.35)


def test_busy_seconds_integrate_utilisation_over_time(clock):
    g = gpu(0, util_samples=[], util_rate=50)
    rig = Rig([g], clock)
    rig.cycle(1.0)
    rig.cycle(1.0)
    g.util_rate = 100
    rig.cycle(1.0)
    # first cycle has no interval behind it; then 1 s at 50 % and 1 s at 100 %
    assert rig.value("gputrain_gpu_busy_seconds_total") == pytest.approx(1.5)


def test_performance_state_as_nvml_answers_it(clock):
    """P0 on an H100, P8 on an L4 that answers it; nothing where NVML does not know (UNKNOWN) and
    on a MIG device, which answers NOT_SUPPORTED and is not asked again."""
    rig = Rig([h100_sxm(0), l4(1, pstate=8), gpu(2, pstate=32), a100_sxm4_mig(3)], clock)
    rig.cycle()
    rig.cycle()
    state = {i: rig.value("gputrain_gpu_performance_state", i) for i in rig.indexes()}
    assert state == {"0": 0, "1": 8, "2": None, "3": 0, "3/0": None, "3/1": None, "3/2": None}
    assert rig.calls["nvmlDeviceGetPerformanceState"] == 4 * 2 + 3


# --- PCIe --------------------------------------------------------------------------------------

def test_pcie_capacity_is_the_link_at_its_best_while_the_current_link_trains_down(clock):
    """An idle link trains down to Gen1; the host-to-device rule's denominator must not."""
    g = h100_sxm(0, pcie_gen=1, pcie_width=16)
    slot = h100_sxm(1, pcie_gen_max=4)  # a Gen5 GPU in a Gen4 slot runs at Gen4 at best
    rig = Rig([g, slot], clock)
    rig.cycle()
    best = PCIE_LANE_BYTES_PER_SECOND[5] * 16
    assert rig.value("gputrain_gpu_pcie_link_max_bytes_per_second") == pytest.approx(best)
    assert rig.value("gputrain_gpu_pcie_link_current_bytes_per_second") == pytest.approx(
        PCIE_LANE_BYTES_PER_SECOND[1] * 16)
    g.pcie_gen = 5  # under load
    rig.cycle()
    assert rig.value("gputrain_gpu_pcie_link_max_bytes_per_second") == pytest.approx(best)
    assert rig.value("gputrain_gpu_pcie_link_current_bytes_per_second") == pytest.approx(best)
    assert rig.value("gputrain_gpu_pcie_link_max_bytes_per_second", "1") == pytest.approx(
        PCIE_LANE_BYTES_PER_SECOND[4] * 16)


def test_pcie_prefers_gpm_rates_to_the_byte_counters(clock):
    g = gpu(0, gpm=H100_GPM, pcie_rx_bytes=10**9, pcie_tx_bytes=10**8)
    rig = Rig([g], clock)
    for _ in range(3):
        rig.cycle(2.0)
        g.pcie_rx_bytes += 7 * 10**9  # what the counters say is not what GPM measured
    # GPM's 100 MiB/s over the 4 s between three readings
    assert rig.value("gputrain_gpu_pcie_received_bytes_total") == pytest.approx(100 * 2**20 * 4)
    assert rig.value("gputrain_gpu_pcie_transmitted_bytes_total") == pytest.approx(10 * 2**20 * 4)
    assert rig.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_pcie_64_bit_counters_without_gpm(clock):
    g = l4(0, pcie_rx_bytes=1_000_000, pcie_tx_bytes=10)
    rig = Rig([g], clock)
    rig.cycle()
    g.pcie_rx_bytes += 4_000_000
    g.pcie_tx_bytes += 500
    rig.cycle()
    assert rig.value("gputrain_gpu_pcie_received_bytes_total") == 4_000_000
    assert rig.value("gputrain_gpu_pcie_transmitted_bytes_total") == 500
    assert rig.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_32_bit_pcie_counters_are_integrated_across_their_wrap(clock):
    """"Value can be wrapped" (nvml.h): a 32-bit counter that wraps between two readings still
    gives the bytes moved, as long as the link cannot have carried a whole 4 GiB meanwhile."""
    g = l4(0, pcie_counter_type=fd.UINT, pcie_rx_bytes=2**32 - 1000, pcie_tx_bytes=2**32 - 10)
    rig = Rig([g], clock, interval=0.1)  # Gen4 x16 moves at most 3.2 GB in 0.1 s
    rig.cycle(0.1)
    g.pcie_rx_bytes += 3_000_000_000  # wraps
    g.pcie_tx_bytes += 500
    rig.cycle(0.1)
    g.pcie_rx_bytes += 1_000_000
    rig.cycle(0.1)
    assert rig.value("gputrain_gpu_pcie_received_bytes_total") == pytest.approx(3_001_000_000)
    assert rig.value("gputrain_gpu_pcie_transmitted_bytes_total") == pytest.approx(500)
    assert rig.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_32_bit_pcie_counters_that_may_wrap_twice_give_way_to_the_throughput_call(clock):
    g = l4(0, pcie_counter_type=fd.UINT, pcie_rx_kbs=2000, pcie_tx_kbs=100)
    rig = Rig([g], clock)  # 1 s: 31.5 GB could pass, seven times round a 32-bit counter
    for _ in range(3):
        rig.cycle(2.0)
        g.pcie_rx_bytes += 5 * 2**32 + 7
    assert rig.value("gputrain_gpu_pcie_received_bytes_total") == pytest.approx(2000 * 1024 * 4)
    assert rig.value("gputrain_gpu_pcie_transmitted_bytes_total") == pytest.approx(100 * 1024 * 4)


def test_pcie_falls_back_to_the_throughput_call_before_driver_555(clock, caplog):
    """The throughput call answers KB/s that are KiB/s (nvml.h's unit; nvitop multiplies by
    1024), and one ~20 ms window stands for the cycle: an estimate, said once in the log."""
    rig = Rig([gpu(0, pcie_rx_kbs=2000, pcie_tx_kbs=100)], clock, version="550.54.15")
    with caplog.at_level(logging.INFO, logger="exporter"):
        for _ in range(3):
            rig.cycle(2.0)
    assert rig.calls["nvmlDeviceGetPcieThroughput"] == 3 * 2  # each cycle, both directions
    assert rig.value("gputrain_gpu_pcie_received_bytes_total") == pytest.approx(2000 * 1024 * 4)
    assert rig.value("gputrain_gpu_pcie_transmitted_bytes_total") == pytest.approx(100 * 1024 * 4)
    said = [r.getMessage() for r in caplog.records if "throughput call" in r.getMessage()]
    assert len(said) == 1 and "20 ms" in said[0] and "estimate" in said[0]


# --- energy, clock events ---------------------------------------------------------------------

def test_energy_counter_from_nvml_deltas(clock):
    g = gpu(0, energy_mj=5_000_000)
    rig = Rig([g], clock)
    rig.cycle()
    g.energy_mj += 350_000
    rig.cycle()
    assert rig.value("gputrain_gpu_energy_joules_total") == pytest.approx(350.0)


def throttle(rig: Rig, g: FakeGpu, **ns: int) -> dict[str, float | None]:
    """Two readings around ``ns`` more nanoseconds of each clock event and each violation
    counter; the exported seconds by reason."""
    rig.cycle()
    for reason, add in ns.items():
        if reason in g.clock_events_ns:
            g.clock_events_ns[reason] += add
        if reason in g.violation_ns:
            g.violation_ns[reason] += add
    rig.cycle()
    reasons = ("sw_power_cap", "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown",
               "hw_power_brake_slowdown")
    return {r: rig.value("gputrain_gpu_clock_event_seconds_total", reason=r) for r in reasons}


# (driver, which reasons the exporter can trust it to report): the field numbering in
# exporter.reading.nvml.CLOCK_EVENT_NUMBERING; the fake driver numbers its fields by the same
# headers (tests/fake_nvml.py field_meaning)
@pytest.mark.parametrize("driver, hardware_reasons", [
    ("550.54.15", False),  # before the fields: violation counters, no HW slowdown reasons
    ("570.172.08", False),  # 251-268 are power-smoothing settings here
    ("575.51.03", True),  # 251-253
    ("580.65.06", True),  # 251-253 (13.0.39 header)
    ("580.76.05", False),  # between the two numberings: not trusted
    ("580.82.07", True),  # 269-271 (nvidia-ml-py 13.580.82)
    ("590.48.01", True),  # 269-271 (13.1 header)
    ("610.20.01", True),
])
def test_clock_events_follow_the_drivers_field_numbering_whatever_the_binding(
        clock, driver, hardware_reasons):
    g = gpu(0, violation_ns={"sw_power_cap": 0, "sw_thermal_slowdown": 0, "sync_boost": 0})
    rig = Rig([g], clock, version=driver)
    got = throttle(rig, g, sw_power_cap=250_000_000, sw_thermal_slowdown=100_000_000,
                   hw_thermal_slowdown=1_000_000_000, hw_power_brake_slowdown=20_000_000)
    assert got["sw_power_cap"] == pytest.approx(0.25)
    assert got["sw_thermal_slowdown"] == pytest.approx(0.1)  # the field, else THERMAL violation
    if hardware_reasons:
        assert got["hw_thermal_slowdown"] == pytest.approx(1.0)
        assert got["hw_power_brake_slowdown"] == pytest.approx(0.02)
    else:  # never a power-smoothing preset or ramp rate read as nanoseconds
        assert got["hw_thermal_slowdown"] is None
        assert got["hw_power_brake_slowdown"] is None


def test_a_clock_event_field_that_is_no_nanosecond_counter_is_dropped(clock, monkeypatch,
                                                                      caplog):
    """Were the numbering table wrong for a driver, the answers give it away: the 590 driver's
    251-253 are power-smoothing settings of a 32-bit type; a counter that goes down or grows
    faster than time is no throttle counter either."""
    import exporter.reading.nvml as nvml

    wrong = {"sw_thermal_slowdown": 251, "hw_thermal_slowdown": 252,
             "hw_power_brake_slowdown": 253}
    monkeypatch.setattr(nvml, "CLOCK_EVENT_NUMBERING", ((((0,)), wrong),))
    g = gpu(0)
    rig = Rig([g], clock, version="590.48.01")
    with caplog.at_level(logging.WARNING):
        got = throttle(rig, g, hw_thermal_slowdown=10**9)
    assert got["hw_thermal_slowdown"] is None and got["hw_power_brake_slowdown"] is None
    assert got["sw_power_cap"] == 0  # the fields whose number never moved carry on
    assert "not a nanosecond counter" in caplog.text

    monkeypatch.setattr(nvml, "CLOCK_EVENT_NUMBERING", (((0,), None), ((590,), {
        "hw_thermal_slowdown": 270, "hw_power_brake_slowdown": 271})))
    g = gpu(0)
    rig = Rig([g], clock, version="590.48.01")
    got = throttle(rig, g, hw_thermal_slowdown=5 * 10**9, hw_power_brake_slowdown=10**8)
    assert got["hw_thermal_slowdown"] is None  # 5 s of throttling in 1 s
    assert got["hw_power_brake_slowdown"] == pytest.approx(0.1)
    g.clock_events_ns["hw_power_brake_slowdown"] -= 10**7  # going down
    rig.cycle()
    assert rig.value("gputrain_gpu_clock_event_seconds_total",
                     reason="hw_power_brake_slowdown") is None


def test_clock_events_fall_back_to_violation_counters(clock):
    g = v100_sxm2(0)
    rig = Rig([g], clock, version="535.129.03")
    got = throttle(rig, g, sw_power_cap=3_000_000_000)
    assert got["sw_power_cap"] == pytest.approx(3.0)
    assert got["hw_thermal_slowdown"] is None


@pytest.mark.parametrize("bits, slowed", [
    (0x8 | 0x40, "hw_thermal_slowdown"),  # HW_SLOWDOWN with HW_THERMAL: thermal
    (0x8 | 0x80, "hw_power_brake_slowdown"),  # ... with the power brake
    (0x8, "hw_slowdown"),  # HW_SLOWDOWN alone: another hardware reason
    (0x1, None),  # idle: no slowdown
    (0x10, None),  # sync boost: clocks aligned on purpose, no throttle
])
def test_a_hardware_slowdown_before_driver_575_is_read_from_the_reasons_bitmask(
        clock, bits, slowed):
    """A 550 driver has no per-reason counters of hardware slowdowns: the reasons bitmask
    (nvmlDeviceGetCurrentClocksEventReasons) counts each reading's interval to the reasons set,
    so a GPU its hardware slows is throttled on every driver."""
    g = gpu(0, violation_ns={"sw_power_cap": 0, "sw_thermal_slowdown": 0, "sync_boost": 0})
    g.clock_event_reasons = 0
    rig = Rig([g], clock, version="550.54.15")
    rig.cycle()  # a reading, then a second passes
    g.clock_event_reasons = bits
    for _ in range(4):  # four readings a second apart, the bits set at each
        rig.cycle()
    for reason in ("hw_thermal_slowdown", "hw_power_brake_slowdown", "hw_slowdown"):
        got = rig.value("gputrain_gpu_clock_event_seconds_total", reason=reason)
        assert got == pytest.approx(4.0 if reason == slowed else 0.0, abs=0.01), reason
    # the counters the driver has (the violation counters) are never replaced by the bitmask
    assert rig.value("gputrain_gpu_clock_event_seconds_total", reason="sw_power_cap") == 0.0


def test_the_reasons_bitmask_never_replaces_a_reasons_own_counter(clock):
    g = gpu(0)
    g.clock_event_reasons = 0x8 | 0x40
    rig = Rig([g], clock, version="590.48.01")
    for _ in range(3):
        rig.cycle()
    assert rig.value("gputrain_gpu_clock_event_seconds_total", reason="hw_slowdown") is not None
    assert rig.value("gputrain_gpu_clock_event_seconds_total",
                     reason="hw_thermal_slowdown") == 0.0  # its field, not the bitmask


# --- asked once, logged once ------------------------------------------------------------------

def test_not_supported_is_asked_once_and_left_out(clock):
    g = gpu(0, errors={"nvmlDeviceGetTemperatureV": fd.NOT_SUPPORTED,
                       "nvmlDeviceGetTemperature": fd.NOT_SUPPORTED},
            field_errors={198: fd.NOT_SUPPORTED})
    rig = Rig([g], clock)
    for _ in range(5):
        rig.cycle()
    assert rig.calls["nvmlDeviceGetTemperatureV"] == 1
    assert rig.calls["nvmlDeviceGetTemperature"] == 1
    assert rig.value("gputrain_gpu_temperature_celsius") is None
    assert rig.value("gputrain_gpu_power_watts") == 350.0  # the rest carries on
    # unsupported fields are also dropped from later field requests
    assert rig.calls["field:198"] == 1
    assert rig.calls["field:197"] == 5
    assert "NaN" not in generate_latest(rig.registry).decode()


def test_gpm_absent_where_unsupported_and_nan_never_exported(clock):
    old = gpu(0, gpm=None)
    nan = gpu(1, gpm={"sm_util": float("nan"), "tensor_util": 3.0})
    rig = Rig([old, nan], clock)
    rig.cycle()
    rig.cycle()
    assert rig.value("gputrain_gpu_sm_active_ratio") is None
    assert rig.value("gputrain_gpu_sm_active_ratio", gpu="1") is None
    assert rig.value("gputrain_gpu_tensor_active_ratio", gpu="1") == pytest.approx(0.03)
    assert "NaN" not in generate_latest(rig.registry).decode()


def test_a_function_the_driver_lacks_is_logged_once(clock, caplog):
    rig = Rig([gpu(i) for i in range(4)], clock,
              missing=("nvmlDeviceGetTotalEnergyConsumption",))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rig.cycle()
    lines = [r for r in caplog.records if "nvmlDeviceGetTotalEnergyConsumption" in r.message]
    assert len(lines) == 1
    # energy then comes from power x time: 350 W over the 2 s between 3 cycles
    assert rig.value("gputrain_gpu_energy_joules_total") == pytest.approx(700.0)


def test_an_older_binding_without_a_function_is_fine(clock, caplog):
    rig = Rig([gpu(0, gpm=H100_GPM)], clock)
    del rig.driver.binding.nvmlGpmQueryDeviceSupport  # as in nvidia-ml-py before 11.515
    with caplog.at_level(logging.WARNING):
        rig.cycle()
        rig.cycle()
    assert rig.value("gputrain_gpu_sm_active_ratio") is None
    assert rig.value("gputrain_gpu_power_watts") == 350.0
    assert sum("nvmlGpmQueryDeviceSupport" in r.message for r in caplog.records) == 1


# --- lost, reset, hung, no driver -------------------------------------------------------------

@pytest.mark.parametrize("fault", ["lost", "reset_required"])
def test_lost_gpu_turns_up_to_zero_while_others_carry_on_and_is_retried(clock, caplog, fault):
    gpus = [gpu(0), gpu(1), gpu(2)]
    rig = Rig(gpus, clock)
    rig.cycle()
    setattr(gpus[1], fault, True)
    with caplog.at_level(logging.ERROR):
        rig.cycle()
        rig.cycle()
    assert rig.value("gputrain_gpu_up", gpu="1") == 0
    assert rig.value("gputrain_gpu_power_watts", gpu="1") is None  # no stale values
    assert rig.value("gputrain_gpu_up", gpu="0") == 1
    assert rig.value("gputrain_gpu_up", gpu="2") == 1
    assert rig.value("gputrain_gpu_power_watts", gpu="2") == 350.0
    assert sum("is lost" in r.message for r in caplog.records) == 1
    setattr(gpus[1], fault, False)
    rig.cycle(10.0)  # the retry waits 10 s
    rig.cycle()
    assert rig.value("gputrain_gpu_up", gpu="1") == 1
    assert rig.value("gputrain_gpu_power_watts", gpu="1") == 350.0


@pytest.mark.parametrize("code, failing", [(fd.LIBRARY_NOT_FOUND, None),
                                           (fd.DRIVER_NOT_LOADED, None), (fd.NO_PERMISSION, 0)])
def test_no_driver_means_host_only_one_log_line_and_no_failing_collector(clock, caplog, code,
                                                                         failing):
    """No NVIDIA driver at all (a CPU node) is no fault: host metrics, one log line, and no
    gpu collector failing. A driver that is there but unusable (no permission on /dev/nvidia*)
    is: its collector fails."""
    from exporter.reading.collectors import host_collectors

    driver = FakeDriver([], init_error=code)
    sampler = Sampler(NvmlBackend(Nvml(driver.binding), clock=clock), host_collectors(),
                      interval=1.0, clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            sampler.run_once()
            clock.advance(1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SelfCollector(lambda: sampler.snapshot))
    assert registry.get_sample_value("gputrain_collector_success",
                                     {"collector": "gpu"}) == failing
    assert registry.get_sample_value("gputrain_collector_success", {"collector": "cpu"}) == 1
    assert {"cpu", "memory"} <= set(sampler.snapshot.host)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "serving host metrics only" in warnings[0].message
    assert driver.calls["nvmlInit"] == 1  # retried only after a minute


def test_no_library_at_all_is_library_not_found(clock, monkeypatch):
    """The binding's own load failing (no libnvidia-ml.so.1) reads as no driver."""
    driver = FakeDriver([])

    def no_library(path, *args, **kwargs):
        raise OSError(f"{path}: cannot open shared object file")

    monkeypatch.setattr(driver.binding, "CDLL", no_library)
    backend = NvmlBackend(Nvml(driver.binding), clock=clock)
    with pytest.raises(Exception, match=r"libnvidia-ml\.so\.1"):
        backend.start()


def test_a_hung_gpu_does_not_hold_up_the_others(clock):
    """A GPU whose calls never return: the others' readings come on time, the hung one is
    marked down after three intervals without an answer, and comes back once it answers.
    The sampler's clock is a fake one (the three intervals), its waits real but long enough
    for a loaded machine; the hung GPU waits on an event, not a timer."""
    gpus = [gpu(0), gpu(1)]
    driver = FakeDriver(gpus)
    sampler = Sampler(NvmlBackend(Nvml(driver.binding), clock=clock), None, interval=2.0,
                      collectors={"gpu"}, clock=clock)
    sampler.run_once()
    hung = threading.Event()
    gpus[1].hold = hung
    try:
        clock.advance(2.0)
        snap = sampler.run_once()  # waits up to 1.6 s (real) for the reads
        assert snap.gpus[0].up and snap.gpus[0].sample.timestamp == clock.now
        assert snap.gpus[1].up  # not yet: under three intervals without an answer
        clock.advance(6.5)  # three intervals and more
        snap = sampler.run_once()
        assert snap.gpus[0].up and snap.gpus[0].sample.timestamp == clock.now
        assert not snap.gpus[1].up
    finally:
        hung.set()
    gpus[1].hold = None
    deadline = time.monotonic() + 20
    while not sampler.run_once().gpus[1].up and time.monotonic() < deadline:
        clock.advance(2.0)
    assert sampler.snapshot.gpus[1].up
    sampler.stop()


# --- MIG --------------------------------------------------------------------------------------

def test_a_mig_gpu_and_its_devices_report_what_nvml_answers_on_them(clock):
    """NVML answers no utilisation on a MIG-enabled GPU or its devices; an A100 has no GPM
    either, so neither has a busy ratio, never a made-up one. Memory is per MIG device."""
    a100 = a100_sxm4_mig(0, processes=[])
    a100.mig[0].processes = [(4242, 3 * GIB)]
    rig = Rig([a100, l4(1)], clock)
    rig.cycle()
    rig.cycle()
    assert rig.indexes() == ["0", "0/0", "0/1", "0/2", "1"]
    assert rig.value("gputrain_gpu_up") == 1
    assert rig.value("gputrain_gpu_power_watts") == 350.0
    for index in ("0", "0/0", "0/1", "0/2"):
        assert rig.value("gputrain_gpu_utilization_ratio", index) is None
        assert rig.value("gputrain_gpu_busy_seconds_total", index) is None
        assert rig.value("gputrain_gpu_up", index) == 1
    assert rig.value("gputrain_gpu_memory_total_bytes", "0/0") == 20 * GIB
    assert rig.value("gputrain_gpu_power_watts", "0/0") is None  # a board reading
    assert rig.registry.get_sample_value("gputrain_gpu_info", {
        "gpu": "0/1", "uuid": a100.mig[1].uuid, "name": "NVIDIA A100-SXM4-40GB MIG 2g.10gb",
        "pci_bus_id": a100.bus_id, "driver_version": "590.48.01", "backend": "nvml",
        "parent": "0", "profile": "2g.10gb"}) == 1
    assert rig.sampler.snapshot.gpus[1].sample.pids == (4242,)
    assert rig.sampler.snapshot.gpus[0].sample.pids == (4242,)  # the GPU lists all of them
    assert rig.value("gputrain_gpu_utilization_ratio", "1") == pytest.approx(0.5)
    # a slice's share of the peak depends on its profile: no figure rather than a wrong one
    assert rig.value("gputrain_gpu_peak_flops", "0", precision="bf16") == pytest.approx(312e12)
    assert rig.value("gputrain_gpu_peak_flops", "0/0", precision="bf16") is None


def h100_mig(busy: tuple[float, ...] = (80.0, 20.0)) -> FakeGpu:
    migs = [FakeGpu(uuid=f"MIG-{n:08x}-2222-3333-4444-555555555555", gpu_instance_id=gi,
                    name=f"NVIDIA H100 80GB HBM3 MIG {profile}", memory_total=mib * 1024**2,
                    memory_used=GIB, gpm={"graphics_util": b, "sm_util": b * 0.9})
            for n, (gi, profile, mib, b) in enumerate(zip((1, 2), ("3g.40gb", "4g.40gb"),
                                                          (40448, 40448), busy, strict=False))]
    return h100_sxm(0, mig=migs)


def test_a_mig_devices_busy_and_activity_come_from_gpm_of_its_gpu_instance(clock):
    rig = Rig([h100_mig()], clock)
    for _ in range(3):
        rig.cycle()
    assert rig.value("gputrain_gpu_utilization_ratio", "0/0") == pytest.approx(0.8)
    assert rig.value("gputrain_gpu_sm_active_ratio", "0/0") == pytest.approx(0.72)
    assert rig.value("gputrain_gpu_utilization_ratio", "0/1") == pytest.approx(0.2)
    # busy seconds: GPM's busy over the 2 s after its first window
    assert rig.value("gputrain_gpu_busy_seconds_total", "0/0") == pytest.approx(1.6)
    # the GPU itself: NVML's utilisation is not supported in MIG mode, GPM's whole-GPU is
    assert rig.value("gputrain_gpu_utilization_ratio", "0") == pytest.approx(0.71)


def test_mig_devices_are_listed_again_after_a_reconfiguration(clock, caplog):
    g = h100_mig()
    rig = Rig([g, h100_sxm(1)], clock)
    rig.cycle()
    rig.cycle()
    old = [m.uuid for m in g.mig]
    new = [FakeGpu(uuid="MIG-77777777-2222-3333-4444-555555555555", gpu_instance_id=3,
                   name="NVIDIA H100 80GB HBM3 MIG 7g.80gb", memory_total=80 * GIB,
                   gpm={"graphics_util": 55.0})]
    rig.driver.reconfigure_mig(g, new)  # nvidia-smi mig -dci, -dgi, -cgi 7g.80gb -C
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            rig.cycle()
    uuids = [s.identity.uuid for s in rig.sampler.snapshot.gpus]
    assert not set(old) & set(uuids)
    assert rig.indexes() == ["0", "0/0", "1"]
    assert rig.value("gputrain_gpu_up", "0/0") == 1
    assert rig.registry.get_sample_value("gputrain_gpu_info", {
        "gpu": "0/0", "uuid": new[0].uuid, "name": "NVIDIA H100 80GB HBM3 MIG 7g.80gb",
        "pci_bus_id": g.bus_id, "driver_version": "590.48.01", "backend": "nvml",
        "parent": "0", "profile": "7g.80gb"}) == 1
    assert rig.value("gputrain_gpu_utilization_ratio", "0/0") == pytest.approx(0.55)
    assert rig.value("gputrain_gpu_up", "1") == 1
    assert "NVML" not in caplog.text  # no INVALID_ARGUMENT logged as an NVML failure
    # the destroyed devices' GPM samples were given back: two for each of the three devices
    assert len(rig.driver.gpm_allocated) == 2 * 3


def test_mig_devices_created_later_are_found_by_the_periodic_listing(clock):
    g = h100_mig(busy=(80.0,))
    rig = Rig([g], clock)
    rig.cycle()
    g.mig.append(FakeGpu(uuid="MIG-88888888-2222-3333-4444-555555555555", gpu_instance_id=9,
                         name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", parent=g))
    rig.cycle(30.0)
    assert rig.indexes() == ["0", "0/0"]
    rig.cycle(31.0)
    rig.cycle()
    assert rig.indexes() == ["0", "0/0", "0/1"]
    assert rig.value("gputrain_gpu_utilization_ratio", "0/0") == pytest.approx(0.8)


# --- GPM ----------------------------------------------------------------------------------------

def test_gpm_windows_are_over_100_ms_whatever_the_sampling_interval(clock):
    """Sampling every 50 ms: GPM samples 50 ms apart are refused by NVML, so a window stays
    open until it is old enough, and the readings in between carry the last window's values."""
    g = gpu(0, gpm=H100_GPM)
    rig = Rig([g], clock, interval=0.05)
    seen = []
    for _ in range(8):
        rig.cycle(0.05)
        seen.append(rig.value("gputrain_gpu_sm_active_ratio"))
    assert seen[:3] == [None, None, None]  # the first window closes after 150 ms
    assert seen[3:] == pytest.approx([0.62] * 5)
    assert rig.calls["nvmlGpmMetricsGet"] == 2  # windows of 150 ms: at 150 ms and 300 ms


def test_gpm_samples_are_freed_when_a_gpu_is_reopened(clock):
    g = gpu(0, gpm=H100_GPM)
    rig = Rig([g, gpu(1, gpm=H100_GPM)], clock)
    rig.cycle()
    for _ in range(3):
        g.lost = True
        rig.cycle()
        g.lost = False
        rig.cycle(10.0)
        rig.cycle()
    rig.cycle()  # the reopened GPU's first GPM window
    assert rig.value("gputrain_gpu_up") == 1
    assert rig.value("gputrain_gpu_sm_active_ratio") == pytest.approx(0.62)
    assert len(rig.driver.gpm_allocated) == 2 * 2
    rig.sampler.stop()
    assert rig.driver.gpm_allocated == set()


# --- processes --------------------------------------------------------------------------------

def test_running_processes_and_their_memory_some_unknown(clock):
    """Two or more processes read through the binding's struct array (nvidia-ml-py 12.535.77's
    struct was 8 bytes longer than the driver's, garbling every pid after the first); memory the
    driver cannot tell (NVML_VALUE_NOT_AVAILABLE) is no figure."""
    g = gpu(0, processes=[(4242, 2 * GIB), (4343, None), (4444, GIB)])
    rig = Rig([g], clock)
    rig.cycle()
    s = rig.sampler.snapshot.gpus[0].sample
    assert s.pids == (4242, 4343, 4444)
    assert s.process_memory == {4242: 2 * GIB, 4444: GIB}


@pytest.mark.parametrize("driver, missing", [
    ("590.48.01", ()),
    ("470.256.02", ()),  # no _v3: the binding's _v2 wrapper where it has one
])
def test_running_processes_use_the_newest_call_the_driver_and_binding_have(clock, driver,
                                                                            missing):
    rig = Rig([gpu(0, processes=[(4242, GIB), (4343, GIB)])], clock, version=driver,
              missing=missing)
    rig.cycle()
    rig.cycle()
    v3 = rig.driver.has_symbol("nvmlDeviceGetComputeRunningProcesses_v3")
    listed = v3 or hasattr(rig.driver.binding, "nvmlDeviceGetComputeRunningProcesses_v2")
    assert rig.sampler.snapshot.gpus[0].sample.pids == ((4242, 4343) if listed else ())
    used = "nvmlDeviceGetComputeRunningProcesses_v3" if v3 else \
        "nvmlDeviceGetComputeRunningProcesses_v2"
    assert rig.calls[used] == (2 if listed else 0)
    assert rig.value("gputrain_gpu_power_watts") == 350.0


def test_a_driver_without_the_versioned_process_calls_keeps_its_other_readings(clock, caplog):
    """The binding's unversioned call raises NVMLLibraryMismatchError (no NVMLError) where the
    driver has neither _v3 nor _v2."""
    rig = Rig([gpu(0, processes=[(4242, GIB)]), gpu(1)], clock, version="440.118.02")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rig.cycle()
    for index in ("0", "1"):
        assert rig.value("gputrain_gpu_up", index) == 1
        assert rig.value("gputrain_gpu_power_watts", index) == 350.0
    assert rig.sampler.snapshot.gpus[0].sample.pids == ()
    assert "reading GPU" not in caplog.text


# --- per-process utilisation -------------------------------------------------------------------

NEWER, OLDER = "nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization"


def shares(rig: Rig, index: str = "0") -> dict[int, tuple[float, float | None]]:
    """The GPU's per-process utilisation: pid -> (SM busy ratio, memory-bandwidth ratio)."""
    return next(g for g in rig.sampler.snapshot.gpus
                if g.identity.index == index).sample.process_utilization


def approx_shares(expected: dict[int, tuple[float, float]]):
    return {pid: pytest.approx(v) for pid, v in expected.items()}


def the_call(rig: Rig) -> str:
    """The per-process call this driver and binding have: the newer from driver 550 on."""
    return NEWER if rig.driver.has_symbol(NEWER) and hasattr(rig.driver.binding, NEWER) \
        else OLDER


@pytest.mark.parametrize("driver", ["590.48.01", "535.183.06"])
def test_per_process_utilisation_is_the_mean_of_each_pids_samples_since_the_last_reading(
        clock, driver):
    """Two processes on a GPU: each pid's SM and memory ratios are the means of its samples
    newer than those read before; a pid without a new sample is absent. Only the newest call
    the driver and the binding have is asked."""
    g = gpu(0, processes=[(4242, GIB), (4343, GIB)],
            process_samples=[(1_000, 4242, 40, 10), (1_100, 4343, 20, 6), (1_200, 4242, 60, 30)])
    rig = Rig([g], clock, version=driver)
    rig.cycle()
    assert shares(rig) == approx_shares({4242: (0.5, 0.2), 4343: (0.2, 0.06)})
    g.process_samples += [(1_300, 4242, 90, 50), (1_400, 4242, 70, 30)]  # 4343: nothing new
    rig.cycle()
    assert shares(rig) == approx_shares({4242: (0.8, 0.4)})
    asked = the_call(rig)
    assert asked == (NEWER if driver.startswith("590") and hasattr(rig.driver.binding, NEWER)
                     else OLDER)
    assert rig.calls[asked] == 2
    assert rig.calls[NEWER if asked == OLDER else OLDER] == 0


def test_no_new_sample_is_no_pid_and_no_error_and_the_call_goes_on(clock, caplog):
    """NVML's NOT_FOUND ("no valid sample entries") is no change: an empty reading, nothing
    logged, and the call is made again the next cycle, which finds the next sample."""
    g = gpu(0, processes=[(4242, GIB)], process_samples=[(1_000, 4242, 70, 20)])
    rig = Rig([g], clock)
    with caplog.at_level(logging.DEBUG, logger="exporter"):
        rig.cycle()
        rig.cycle()
        assert shares(rig) == {}
        rig.cycle()
        g.process_samples.append((2_000, 4242, 30, 10))
        rig.cycle()
    assert shares(rig) == approx_shares({4242: (0.3, 0.1)})
    assert rig.calls[the_call(rig)] == 4
    assert rig.value("gputrain_gpu_up") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("how", ["not supported", "not in the driver"])
def test_unsupported_per_process_utilisation_is_asked_once_and_stays_empty(clock, caplog, how):
    """A driver that answers NOT_SUPPORTED to both calls, or lacks both functions: each is
    asked once (through the binding), then never again; the GPU's other readings carry on."""
    unsupported = {NEWER: fd.NOT_SUPPORTED, OLDER: fd.NOT_SUPPORTED}
    g = gpu(0, processes=[(4242, GIB)], process_samples=[(1_000, 4242, 70, 20)],
            errors=unsupported if how == "not supported" else {})
    rig = Rig([g], clock, missing=() if how == "not supported" else (NEWER, OLDER))
    asked = Counter()
    for name in (NEWER, OLDER):
        wrapped = getattr(rig.driver.binding, name, None)
        if wrapped is not None:
            setattr(rig.driver.binding, name,
                    lambda *a, _n=name, _w=wrapped: asked.update([_n]) or _w(*a))
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            rig.cycle()
    assert shares(rig) is None  # none at all, unlike a driver with no new sample ({})
    assert asked[OLDER] == 1 and asked[NEWER] == (1 if hasattr(rig.driver.binding, NEWER) else 0)
    assert rig.sampler.snapshot.gpus[0].sample.pids == (4242,)
    assert rig.value("gputrain_gpu_power_watts") == 350.0
    assert not caplog.records


def test_a_newer_call_of_another_struct_version_gives_way_to_the_older_one(clock):
    """ARGUMENT_VERSION_MISMATCH from nvmlDeviceGetProcessesUtilizationInfo (a struct version
    this driver does not take): the older call serves from then on."""
    g = gpu(0, processes=[(4242, GIB)], process_samples=[(1_000, 4242, 70, 20)],
            errors={NEWER: fd.ARGUMENT_VERSION_MISMATCH})
    rig = Rig([g], clock)
    rig.cycle()
    g.process_samples.append((2_000, 4242, 50, 20))
    rig.cycle()
    assert shares(rig) == approx_shares({4242: (0.5, 0.2)})
    assert rig.calls[NEWER] == (1 if hasattr(rig.driver.binding, NEWER) else 0)
    assert rig.calls[OLDER] == 2


def test_samples_a_driver_should_not_give_are_dropped(clock):
    """What nvtop met on real drivers: samples not newer than the timestamp asked for, values
    over 100 % and pid 0 (an entry never written). They count for nothing."""
    g = gpu(0, processes=[(4242, GIB)], process_samples_stale=True,
            process_samples=[(1_000, 4242, 40, 10), (1_100, 0, 90, 0),
                             (1_200, 4242, 2**32 - 1, 0)])
    rig = Rig([g], clock)
    rig.cycle()
    assert shares(rig) == approx_shares({4242: (0.4, 0.1)})
    g.process_samples.append((1_300, 4242, 80, 30))
    rig.cycle()  # the driver answers the 1,000 us sample again: only the new one counts
    assert shares(rig) == approx_shares({4242: (0.8, 0.3)})


def test_mig_devices_have_no_per_process_utilisation_asked_once(clock):
    """nvml.h: "On MIG-enabled GPUs, querying process utilization is not currently supported":
    the GPU in MIG mode and its devices answer NOT_SUPPORTED, asked once each; a GPU beside
    them that is not in MIG mode has its processes' shares."""
    mig = h100_mig()
    mig.mig[0].processes = [(4242, GIB)]
    plain = h100_sxm(1, processes=[(5151, GIB)], process_samples=[(1_000, 5151, 64, 32)])
    rig = Rig([mig, plain], clock)
    for _ in range(4):
        rig.cycle()
    assert rig.indexes() == ["0", "0/0", "0/1", "1"]
    assert all(shares(rig, i) is None for i in ("0", "0/0", "0/1"))
    rig.driver.gpus[1].process_samples.append((2_000, 5151, 50, 25))
    rig.cycle()
    assert shares(rig, "1") == approx_shares({5151: (0.5, 0.25)})
    assert rig.calls[the_call(rig)] == 3 + 5  # each MIG-side device once, the plain GPU always


# --- versioned calls ----------------------------------------------------------------------------

def test_memory_comes_from_the_v2_call_and_falls_back_once_on_an_older_driver(clock, caplog):
    """v2's "used" leaves out the driver's reserved memory (what nvidia-smi shows); a driver
    without it (before 510) is asked once, then v1 serves, reserved memory included."""
    new = Rig([gpu(0)], clock)
    old = Rig([gpu(0)], clock, version="470.256.02")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            new.cycle()
            old.cycle()
    g = new.driver.gpus[0]
    assert new.value("gputrain_gpu_memory_used_bytes") == g.memory_used
    assert old.value("gputrain_gpu_memory_used_bytes") == g.memory_used + g.memory_reserved
    assert new.calls["nvmlDeviceGetMemoryInfo_v2"] == 3
    assert old.calls["nvmlDeviceGetMemoryInfo_v2"] == 0  # the symbol is not in that driver
    assert old.calls["nvmlDeviceGetMemoryInfo"] == 3
    assert "nvmlDeviceGetMemoryInfo" not in caplog.text  # a missing variant is not missed


@pytest.mark.parametrize("drop_wrapper", [False, True])
def test_temperature_from_the_versioned_call_where_the_driver_has_it(clock, drop_wrapper):
    """nvmlDeviceGetTemperature is deprecated in the 13.0 header: the V call where the driver
    has it (570 on), through the exporter's own wrapper where the binding has none; drivers
    that have dropped the old call still give a temperature."""
    rig = Rig([gpu(0, temperature=61)], clock, missing=("nvmlDeviceGetTemperature",))
    if drop_wrapper and hasattr(rig.driver.binding, "nvmlDeviceGetTemperatureV"):
        del rig.driver.binding.nvmlDeviceGetTemperatureV  # as nvidia-ml-py before 12.570
    rig.cycle()
    rig.cycle()
    assert rig.value("gputrain_gpu_temperature_celsius") == 61
    assert rig.calls["nvmlDeviceGetTemperatureV"] == 2
    old = Rig([gpu(0, temperature=48)], clock, version="565.57.01")
    old.cycle()
    old.cycle()
    assert old.value("gputrain_gpu_temperature_celsius") == 48
    assert old.calls["nvmlDeviceGetTemperature"] == 2


# --- events, scrapes, import, shutdown -----------------------------------------------------------

def test_xid_events_are_counted_in_their_own_thread():
    gpus = [gpu(0), gpu(1)]
    driver = FakeDriver(gpus)
    sampler = Sampler(NvmlBackend(Nvml(driver.binding)), None, interval=0.2,
                      collectors={"gpu"})
    sampler.start()
    try:
        driver.events.put((gpus[1], 79))
        driver.events.put((gpus[1], 79))
        driver.events.put((gpus[0], 13))
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
    assert driver.shutdown_while_busy == []  # the Xid wait had returned first


def test_a_driver_that_comes_later_gets_its_xid_events_watched():
    """The exporter started before the driver was loaded (DRIVER_NOT_LOADED): once the retry
    finds the GPUs, their Xid events are watched too (the watch started only with the GPUs)."""
    g = gpu(0)
    driver = FakeDriver([g], init_error=fd.DRIVER_NOT_LOADED)
    sampler = Sampler(NvmlBackend(Nvml(driver.binding)), None, interval=0.2,
                      collectors={"gpu"})
    sampler.start()
    try:
        assert sampler.gpu_error
        driver.init_error = None
        sampler._backend_next_try = 0.0  # the retry is due (every BACKEND_RETRY_SECONDS)
        deadline = time.monotonic() + 10
        while not sampler.snapshot.gpus and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sampler.snapshot.gpus, "the driver was found"
        driver.events.put((g, 79))
        while time.monotonic() < deadline and \
                sampler.snapshot.gpus[0].xid_errors.get(79) != 1:
            time.sleep(0.05)
        assert sampler.snapshot.gpus[0].xid_errors == {79: 1}
    finally:
        sampler.stop()


def test_shutdown_waits_for_the_calls_in_flight():
    """nvmlShutdown under a call still inside the driver is undefined behaviour: it comes only
    once the calls in flight have returned, and a call after it is refused, not made."""
    g = gpu(0)
    driver = FakeDriver([g])
    backend = NvmlBackend(Nvml(driver.binding))
    identity = backend.start()[0]
    g.delay_s = 0.5
    reading = threading.Thread(target=backend.sample, args=(identity,))
    reading.start()
    while not driver.in_flight:
        time.sleep(0.01)
    backend.close()
    reading.join()
    assert driver.calls["nvmlShutdown"] == 1
    assert driver.shutdown_while_busy == []
    g.delay_s = 0.0
    assert backend.nvml.call("nvmlDeviceGetCount") is None
    assert driver.calls["nvmlDeviceGetCount"] == 1  # the one at start


def test_a_scrape_makes_no_nvml_call(clock):
    rig = Rig([gpu(0, gpm=H100_GPM), gpu(1)], clock)
    rig.cycle()
    rig.cycle()
    before = sum(rig.calls.values())
    for _ in range(5):
        generate_latest(rig.registry)
    assert sum(rig.calls.values()) == before


def test_nvml_is_not_touched_at_import(monkeypatch):
    import importlib

    import pynvml

    import exporter.reading.gpu_backends
    import exporter.reading.nvml

    driver = FakeDriver([gpu(0)])
    for name in ("CDLL", "nvmlLib"):  # restored after the test: no later test meets the fake
        monkeypatch.setattr(pynvml, name, getattr(pynvml, name))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    fd.install(driver, pynvml)  # the global module, as Nvml() without a module loads it
    importlib.reload(exporter.reading.nvml)
    importlib.reload(exporter.reading.gpu_backends)
    assert driver.calls == {}
    nv = exporter.reading.nvml.Nvml()
    assert not nv.initialized and nv.lib is None
    nv.init()
    assert nv.lib is pynvml and nv.driver == (590, 48, 1)
    assert nv.call("nvmlDeviceGetCount") == 1
    nv.shutdown()


def test_help_texts_say_what_the_readings_mean_across_gpus(clock):
    rig = Rig([gpu(0)], clock)
    rig.cycle()
    text = generate_latest(rig.registry).decode()
    assert "a one-second average on Ampere and newer GPUs except the A100" in text
    assert "# HELP gputrain_gpu_nvlink_links Active NVLink links" not in text  # no NVLink here


# --- NVLink and memory health ---------------------------------------------------------------

def test_nvlink_bytes_come_from_the_all_links_counters(clock):
    g = gpu(0, nvlink_present=18, nvlink_rx_kib=1000, nvlink_tx_kib=500)
    rig = Rig([g, gpu(1)], clock)
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
    assert rig.calls["field:91"] == 5 + 1  # GPU 0 each of 5 cycles, GPU 1 once


def test_nvlink_links_counts_the_active_ones_not_the_present_ones(clock):
    g = h100_sxm(0, nvlink_down={3, 7})
    rig = Rig([g], clock)
    rig.cycle()
    assert rig.value("gputrain_gpu_nvlink_links") == 16
    g.nvlink_down = set(range(18))  # every link down: 0, not absent
    rig.cycle()
    assert rig.value("gputrain_gpu_nvlink_links") == 0


def test_nvlink_from_gpm_where_the_counters_are_not_supported(clock):
    g = gpu(0, nvlink_present=18, nvlink_rx_kib=None, nvlink_tx_kib=None,
            gpm={**H100_GPM, "nvlink_rx_mib_s": 1024.0, "nvlink_tx_mib_s": 512.0})
    rig = Rig([g], clock)
    for _ in range(4):
        rig.cycle()
    # GPM's rates from its second reading, integrated over the seconds watched
    rx = rig.value("gputrain_gpu_nvlink_received_bytes_total")
    watched = rig.value("gputrain_gpu_sampled_seconds_total")
    assert watched == 3 and rx == pytest.approx(watched * 1024 * 2**20)
    assert rig.value("gputrain_gpu_nvlink_transmitted_bytes_total") == pytest.approx(rx / 2)


def test_ecc_counts_stay_monotonic_across_a_driver_reload(clock):
    g = gpu(0, ecc_volatile={0: 3, 1: 0})
    rig = Rig([g], clock)
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
    rig = Rig([gpu(0, ecc_volatile=None)], clock)
    for _ in range(4):
        rig.cycle()
    assert rig.value("gputrain_gpu_ecc_errors_total", type="corrected") is None
    assert rig.calls["nvmlDeviceGetTotalEccErrors"] == 2  # each type once


def test_row_remapping_states(clock):
    rig = Rig([gpu(0, remapped_rows=(3, 1, 1, 0))], clock)
    rig.cycle()
    assert {s: rig.value("gputrain_gpu_remapped_rows", state=s) for s in
            ("correctable", "uncorrectable", "pending", "failed")} == {
        "correctable": 3, "uncorrectable": 1, "pending": 1, "failed": 0}
    assert rig.value("gputrain_gpu_retired_pages", cause="double_bit_ecc") is None


def test_retired_pages_on_a_gpu_before_ampere_and_a_driver_without_the_remapper(clock, caplog):
    g = v100_sxm2(0, retired_pages={0: [1, 2, 3], 1: [4]}, retired_pending=1)
    rig = Rig([g, v100_sxm2(1)], clock, missing=("nvmlDeviceGetRemappedRows",))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rig.cycle()
    assert rig.value("gputrain_gpu_retired_pages", cause="multiple_single_bit_ecc") == 3
    assert rig.value("gputrain_gpu_retired_pages", cause="double_bit_ecc") == 1
    assert rig.value("gputrain_gpu_retired_pages_pending") == 1
    assert rig.value("gputrain_gpu_retired_pages_pending", "1") == 0
    assert rig.value("gputrain_gpu_remapped_rows", state="pending") is None
    missing = [r for r in caplog.records if "nvmlDeviceGetRemappedRows" in r.getMessage()]
    assert len(missing) == 1  # the missing function is logged once, not per GPU or cycle


def test_a_gpu_lost_while_reading_its_memory_health_goes_down_alone(clock):
    g = gpu(0, nvlink_present=4)
    rig = Rig([g, gpu(1, nvlink_present=4)], clock)
    rig.cycle()
    g.errors["nvmlDeviceGetRemappedRows"] = fd.GPU_IS_LOST
    rig.cycle()
    assert rig.value("gputrain_gpu_up") == 0
    assert rig.value("gputrain_gpu_up", gpu="1") == 1
    assert rig.value("gputrain_gpu_nvlink_links", gpu="1") == 4
