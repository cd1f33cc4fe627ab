"""NCCL Inspector's Prometheus textfiles: the bus bandwidth each communicator's collectives
achieve, at a cardinality that stays bounded.

NCCL 2.28+'s Inspector profiler plugin (``NCCL_PROFILER_PLUGIN=libnccl-profiler-inspector.so``,
``NCCL_INSPECTOR_ENABLE=1``, ``NCCL_INSPECTOR_PROM_DUMP=1``) rewrites, every
``NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS``, a node_exporter textfile per GPU in
``NCCL_INSPECTOR_DUMP_DIR`` with ``nccl_bus_bandwidth_gbs``, ``nccl_algorithm_bandwidth_gbs`` and
``nccl_collective_exec_time_microseconds``, labelled per collective (``comm_id``,
``collective``, ``rank``, ``n_ranks``, ``n_nodes``, and ``coll_sn``, ``timestamp``, ``pid``,
``message_size``... that change with every collective). This collector keeps, per communicator,
collective and NCCL rank, the latest collective's figures (the highest ``coll_sn``), in bytes
per second and seconds: the per-collective labels never become series.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from exporter.reading.collectors.owners import _Refreshing

log = logging.getLogger(__name__)

DEFAULT_DIR = "/var/lib/node_exporter/nccl_inspector"  # the Inspector README's example
MAX_FILES = 256
MAX_FILE_BYTES = 1 << 20
MAX_SERIES = 256  # (communicator, collective, rank) kept, whatever the files hold
LABELS = ("comm_id", "collective", "nccl_rank", "n_ranks", "n_nodes")
# the Inspector's metric -> (ours, its unit in ours)
METRICS = {
    "nccl_bus_bandwidth_gbs": ("gputrain_nccl_bus_bandwidth_bytes_per_second", 1e9),
    "nccl_algorithm_bandwidth_gbs": ("gputrain_nccl_algorithm_bandwidth_bytes_per_second", 1e9),
    "nccl_collective_exec_time_microseconds": ("gputrain_nccl_collective_duration_seconds", 1e-6),
}
HELP = {
    "gputrain_nccl_bus_bandwidth_bytes_per_second":
        "Bus bandwidth of the latest collective of each NCCL communicator, collective and rank "
        "(NCCL Inspector's nccl_bus_bandwidth_gbs): compare it with the fabric's speed.",
    "gputrain_nccl_algorithm_bandwidth_bytes_per_second":
        "Algorithm bandwidth (message size over time) of that collective (NCCL Inspector).",
    "gputrain_nccl_collective_duration_seconds":
        "Execution time of that collective (NCCL Inspector).",
}
# key -> (coll_sn, {our metric: value})
Reading = dict[tuple[str, ...], tuple[int, dict[str, float]]]


def _sn(labels: dict[str, str]) -> int:
    try:
        return int(labels.get("coll_sn", "0"))
    except ValueError:
        return 0


def parse_inspector(text: str, into: Reading) -> None:
    """Add one textfile's samples to ``into``, the latest collective of each key winning."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            ours = METRICS.get(sample.name)
            if ours is None:
                continue
            labels = sample.labels
            key = (labels.get("comm_id", ""), labels.get("collective", ""),
                   labels.get("rank", ""), labels.get("n_ranks", ""), labels.get("n_nodes", ""))
            sn = _sn(labels)
            old = into.get(key)
            if old is None and len(into) >= MAX_SERIES:
                continue
            if old is None or sn > old[0]:
                into[key] = (sn, {})
            elif sn < old[0]:
                continue
            into[key][1][ours[0]] = float(sample.value) * ours[1]


class NcclInspectorCollector(_Refreshing):
    """``gputrain_nccl_*{comm_id,collective,nccl_rank,n_ranks,n_nodes}`` from the textfiles
    NCCL Inspector writes (``--nccl.inspector-dir``)."""

    name = "nccl"

    def __init__(self, psutil_module: Any = None, directory: str = DEFAULT_DIR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(psutil_module, clock)
        self.directory = directory

    def fetch(self) -> Reading:
        """The latest figures of every file; a missing directory is no collective yet (NCCL
        makes it at the first dump); a file that does not parse is left out, and logged."""
        try:
            names = sorted(os.listdir(self.directory))[:MAX_FILES]
        except FileNotFoundError:
            return {}
        out: Reading = {}
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read(MAX_FILE_BYTES)
                parse_inspector(text, out)
            except (IsADirectoryError, FileNotFoundError):
                continue  # a directory, or a file being rewritten
            except ValueError as exc:
                log.debug("NCCL Inspector file %s does not parse: %s", path, exc)
        return out

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        return tuple(GaugeMetricFamily(name, HELP[name], labels=list(LABELS))
                     for name, _ in METRICS.values())

    def render(self, reading: Reading) -> Iterator[Metric]:
        families = {f.name: f for f in self.families()}
        for key, (_, values) in sorted(reading.items()):
            for name, value in values.items():
                families[name].add_metric(list(key), value)
        yield from families.values()
