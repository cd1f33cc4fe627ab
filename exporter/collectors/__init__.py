"""Collectors: turn the sampler's snapshot and the ingest's run state into metric families.

Each collector is a prometheus_client custom collector that only reads already-sampled data,
so a scrape costs the same whatever NVML or psutil are doing.
"""

from exporter.collectors.gpu import GpuCollector
from exporter.collectors.host import HostCollector
from exporter.collectors.selfmetrics import SelfCollector

__all__ = ["GpuCollector", "HostCollector", "SelfCollector"]
