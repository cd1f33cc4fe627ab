"""The exposition users scrape: pinned by a golden file, and scraped by a real Prometheus."""

from __future__ import annotations

from pathlib import Path

from conftest import FakeClock, wait_until
from prometheus_client import CollectorRegistry, generate_latest
from test_daemon import CONTRACT_GPU_METRICS

from exporter.reading.collectors import GpuCollector
from exporter.reading.gpu_backends import DemoBackend
from exporter.reading.sampler import Sampler

GOLDEN = Path(__file__).parent / "golden" / "demo_gpus.prom"


def test_golden_exposition_of_two_demo_gpus(update_golden):
    clock = FakeClock()
    sampler = Sampler(DemoBackend(2, load=0.5, clock=clock, host="golden-host"), None,
                      interval=1.0, collectors={"gpu"}, clock=clock)
    for _ in range(3):
        sampler.run_once()
        clock.advance(1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuCollector(lambda: sampler.snapshot))
    text = generate_latest(registry).decode()
    if update_golden:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "exposition changed: rerun with --update-golden and review"


def test_a_real_prometheus_scrapes_every_contract_metric_for_8_gpus(daemon_factory,
                                                                     prometheus_factory):
    d = daemon_factory("--gpu.backend=demo", "--sampler.interval=0.5")
    prom = prometheus_factory([f"127.0.0.1:{d.port}"])
    wait_until(lambda: prom.query('up{job="gputrain"} == 1'), timeout=30,
               what="Prometheus to scrape the exporter")
    for name in CONTRACT_GPU_METRICS:
        result = wait_until(lambda n=name: prom.query(f"count(count by (gpu) ({n}))"),
                            timeout=15, what=name)
        assert float(result[0]["value"][1]) == 8, name
    # counters integrate: the busy counter of a busy demo GPU grows between scrapes
    rate = wait_until(lambda: prom.query("sum(rate(gputrain_gpu_busy_seconds_total[5s])) > 0"),
                      timeout=20, what="busy seconds to grow")
    assert 0 < float(rate[0]["value"][1]) <= 8
