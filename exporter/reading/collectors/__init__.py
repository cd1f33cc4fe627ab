"""The collectors, as a table (node_exporter's ``registerCollector``): a name, whether it is
on by default, what it exports, and for host collectors the class that reads and renders it.

Each name gets a ``--collector.<name>`` / ``--no-collector.<name>`` flag and its own
``gputrain_collector_success``, ``_duration_seconds`` and ``_last_success_timestamp_seconds``
series. Adding a host collector is one file (a
:class:`~exporter.reading.collectors.base.HostCollector`) and one row here. Every collector only
renders already-sampled data, so a scrape costs the same whatever NVML or psutil are doing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.reading.collectors.base import HostCollector, Rendered
from exporter.reading.collectors.cpu import CpuCollector
from exporter.reading.collectors.disk import DiskCollector
from exporter.reading.collectors.gpu import GpuCollector
from exporter.reading.collectors.memory import MemoryCollector
from exporter.reading.collectors.nccl import NcclInspectorCollector
from exporter.reading.collectors.network import NetworkCollector
from exporter.reading.collectors.owners import KubernetesCollector, SlurmCollector
from exporter.reading.collectors.selfmetrics import SelfCollector


@dataclass(frozen=True)
class CollectorEntry:
    default: bool
    help: str
    host: type[HostCollector] | None = None  # host collectors: read in the sampler
    # settings key -> keyword argument of the host collector's constructor
    options: tuple[tuple[str, str], ...] = ()


COLLECTORS: dict[str, CollectorEntry] = {
    "gpu": CollectorEntry(True, "per-GPU utilisation, SM and tensor activity, memory, power, "
                                "PCIe, clocks, throttling and Xid errors (NVML)"),
    "cpu": CollectorEntry(True, "host CPU seconds by mode, logical CPUs", CpuCollector),
    "memory": CollectorEntry(True, "host physical and available memory", MemoryCollector),
    "disk": CollectorEntry(True, "bytes read and written and busy time per disk", DiskCollector,
                           (("host.disk-exclude", "exclude"),)),
    "network": CollectorEntry(True, "bytes received and sent and link speed per interface",
                              NetworkCollector, (("host.netdev-exclude", "exclude"),
                                                 ("host.netdev-speed", "speed"))),
    "training": CollectorEntry(True, "what training clients push: steps, step time, data wait, "
                                     "samples, phases, process tree, their GPUs"),
    "kubernetes": CollectorEntry(False, "the pod and container each GPU is allocated to, from "
                                        "the kubelet's pod-resources socket",
                                 KubernetesCollector,
                                 (("kubernetes.pod-resources-socket", "socket_path"),)),
    "slurm": CollectorEntry(False, "the Slurm job using each GPU, from a job-mapping directory",
                            SlurmCollector, (("slurm.job-mapping-dir", "directory"),)),
    "nccl": CollectorEntry(False, "the bus bandwidth of each NCCL communicator's collectives, "
                                  "from NCCL Inspector's Prometheus textfiles",
                           NcclInspectorCollector, (("nccl.inspector-dir", "directory"),)),
}


def host_collectors(enabled: Iterable[str] | None = None, settings: dict[str, Any] | None = None,
                    psutil_module: Any = None, **overrides: dict[str, Any]) -> list[HostCollector]:
    """The enabled host collectors (by default those on by default), in table order, built
    from ``settings`` (flag values by key); ``overrides`` maps a collector name to extra
    constructor arguments (tests)."""
    wanted = {n for n, e in COLLECTORS.items() if e.default} if enabled is None else set(enabled)
    out = []
    for name, entry in COLLECTORS.items():
        if entry.host is None or name not in wanted:
            continue
        kwargs = {arg: settings[key] for key, arg in entry.options
                  if settings is not None and key in settings}
        kwargs.update(overrides.get(name, {}))
        out.append(entry.host(psutil_module, **kwargs))
    return out


__all__ = ["COLLECTORS", "GpuCollector", "HostCollector", "Rendered", "SelfCollector",
           "host_collectors"]


def host_samples(collectors: Iterable[HostCollector],
                 readings: Mapping[str, Any]) -> dict[str, float | dict[str, float]]:
    """The host's samples as the page shows them, by sample name (a counter's with
    ``_total``; a labelled one as a dict by its label's value), each collector's rendered from
    its reading in ``readings`` (a snapshot's ``host``)."""
    out: dict[str, float | dict[str, float]] = {}
    for collector in collectors:
        reading = readings.get(collector.name)
        if reading is None:
            continue
        for family in collector.render(reading):
            for sample in family.samples:
                if sample.labels:
                    into = out.setdefault(sample.name, {})
                    if isinstance(into, dict):
                        into["|".join(sample.labels.values())] = float(sample.value)
                else:
                    out[sample.name] = float(sample.value)
    return out
