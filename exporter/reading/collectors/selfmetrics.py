"""The exporter's own health: build info and per-collector success, duration and freshness."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from exporter import __version__
from exporter.reading.sampler import CollectorStatus, Snapshot


class SelfCollector:
    """Renders gputrain_build_info and the gputrain_collector_* families."""

    def __init__(self, snapshot: Callable[[], Snapshot],
                 extra_status: Callable[[], dict[str, CollectorStatus]] | None = None,
                 interval: float | None = None) -> None:
        self._snapshot = snapshot
        self._extra_status = extra_status
        self._interval = interval  # seconds between sampler cycles: what "stale" counts in

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("gputrain_build_info", "The exporter's version; always 1.",
                              labels=["version", "python_version", "backend"]),
            GaugeMetricFamily("gputrain_collector_success",
                              "1 when the collector's last cycle succeeded.",
                              labels=["collector"]),
            GaugeMetricFamily("gputrain_collector_duration_seconds",
                              "How long the collector's last cycle took, in seconds.",
                              labels=["collector"]),
            GaugeMetricFamily("gputrain_collector_last_success_timestamp_seconds",
                              "Unix time of the collector's last successful cycle.",
                              labels=["collector"]),
            GaugeMetricFamily("gputrain_sampler_interval_seconds",
                              "Seconds between the sampler's cycles (--sampler.interval): a "
                              "collector's last success older than a few is stale."))

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        build, success, duration, fresh, interval = self._families()
        build.add_metric([__version__, platform.python_version(), snap.backend], 1)
        yield build
        statuses = dict(snap.collectors)
        if self._extra_status is not None:
            statuses.update(self._extra_status())
        for name, st in sorted(statuses.items()):
            success.add_metric([name], 1 if st.success else 0)
            duration.add_metric([name], st.duration_seconds)
            if st.last_success_timestamp is not None:
                fresh.add_metric([name], st.last_success_timestamp)
        yield success
        yield duration
        yield fresh
        if self._interval is not None:
            interval.add_metric([], self._interval)
            yield interval

