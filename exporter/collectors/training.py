"""Training-run metric families from the ingest's live (run, rank) states."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from exporter.ingest import IngestStore, RankState
from exporter.sampler import CollectorStatus, Snapshot

LABELS = ["run", "rank"]


def resolve_gpus(st: RankState, snap: Snapshot) -> list[tuple[str, str]]:
    """(gpu index, uuid) pairs a rank uses: from its pushed UUIDs or indices, else from the
    GPUs whose NVML process list holds its pid. Only GPUs this node has are returned."""
    by_uuid = {g.identity.uuid: g.identity.index for g in snap.gpus if g.identity.uuid}
    by_index = {g.identity.index: g.identity.uuid for g in snap.gpus}
    out: list[tuple[str, str]] = []
    for ref in st.gpus:
        if ref in by_uuid:
            out.append((by_uuid[ref], ref))
        elif ref in by_index:
            out.append((ref, by_index[ref]))
    if not out and st.pid is not None:
        out = [(g.identity.index, g.identity.uuid) for g in snap.gpus
               if g.sample is not None and st.pid in g.sample.pids]
    return out


class TrainingCollector:
    """Renders every live (run, rank) the ingest holds, plus the ingest's own counters."""

    def __init__(self, store: IngestStore, snapshot: Callable[[], Snapshot]) -> None:
        self._store = store
        self._snapshot = snapshot
        self._status = CollectorStatus(True, 0.0, time.time())

    def describe(self) -> list[Metric]:
        return list(self._families())

    @property
    def status(self) -> CollectorStatus:
        """The last render, as a collector status (the ingest has no sampling cycle)."""
        return self._status

    def _families(self) -> tuple[Metric, ...]:
        """Every family this collector exports, empty, in the order it exports them."""
        steps = CounterMetricFamily("gputrain_training_steps_total",
                                    "Training steps completed.", labels=LABELS)
        wait = CounterMetricFamily(
            "gputrain_training_data_wait_seconds_total",
            "Seconds the training loop was blocked waiting for the data loader (inside step "
            "time).", labels=LABELS)
        samples = CounterMetricFamily("gputrain_training_samples_total",
                                      "Training samples processed.", labels=LABELS)
        hist = HistogramMetricFamily(
            "gputrain_training_step_duration_seconds",
            "Wall time of one training step, data wait included, in seconds.", labels=LABELS)
        phases = CounterMetricFamily(
            "gputrain_training_phase_seconds_total",
            "Seconds spent in each named phase (callbacks, checkpoint, evaluation, ...).",
            labels=[*LABELS, "phase"])
        last_step = GaugeMetricFamily("gputrain_training_last_step_timestamp_seconds",
                                      "Unix time the last step ended.", labels=LABELS)
        last_push = GaugeMetricFamily("gputrain_training_last_push_timestamp_seconds",
                                      "Unix time the daemon last heard from the rank.",
                                      labels=LABELS)
        cpu = CounterMetricFamily(
            "gputrain_training_process_cpu_seconds_total",
            "CPU seconds of the training process and its children (DataLoader workers).",
            labels=LABELS)
        rss = GaugeMetricFamily(
            "gputrain_training_process_resident_memory_bytes",
            "Resident memory of the training process and its children, in bytes.",
            labels=LABELS)
        read = CounterMetricFamily(
            "gputrain_training_process_read_bytes_total",
            "Bytes the training process and its children read (storage and page cache).",
            labels=LABELS)
        gpu_info = GaugeMetricFamily(
            "gputrain_training_gpu_info", "The GPUs a rank uses; always 1. Join on gpu/uuid.",
            labels=[*LABELS, "gpu", "uuid"])
        requests = CounterMetricFamily("gputrain_ingest_requests_total",
                                       "Push requests received, by HTTP status code.",
                                       labels=["code"])
        series = GaugeMetricFamily("gputrain_ingest_series",
                                   "Live (run, rank) pairs the daemon holds.", labels=[])
        return (steps, wait, samples, hist, phases, last_step, last_push, cpu, rss, read,
                gpu_info, requests, series)

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        states = sorted(self._store.states(), key=lambda s: (s.run, s.rank))
        snap = self._snapshot()
        (steps, wait, samples, hist, phases, last_step, last_push, cpu, rss, read, gpu_info,
         requests, series) = self._families()
        for st in states:
            lv = [st.run, st.rank]
            steps.add_metric(lv, st.steps)
            wait.add_metric(lv, st.data_wait_seconds)
            samples.add_metric(lv, st.samples)
            pairs = zip(st.bucket_bounds, st.bucket_counts, strict=True)
            buckets = [(floatToGoString(b), c) for b, c in pairs]
            buckets.append(("+Inf", st.steps))
            hist.add_metric(lv, buckets, st.step_seconds)
            for name, seconds in sorted(st.phases.items()):
                phases.add_metric([*lv, name], seconds)
            if st.last_step_timestamp is not None:
                last_step.add_metric(lv, st.last_step_timestamp)
            last_push.add_metric(lv, st.received_unix)
            if "cpu_seconds" in st.process:
                cpu.add_metric(lv, st.process["cpu_seconds"])
            if "resident_memory_bytes" in st.process:
                rss.add_metric(lv, st.process["resident_memory_bytes"])
            if "read_bytes" in st.process:
                read.add_metric(lv, st.process["read_bytes"])
            for index, uuid in resolve_gpus(st, snap):
                gpu_info.add_metric([*lv, index, uuid], 1)
        for family in (steps, wait, samples, hist, phases, last_step, last_push, cpu, rss, read,
                       gpu_info):
            if family.samples:
                yield family
        for code, n in sorted(self._store.requests().items()):
            requests.add_metric([code], n)
        yield requests
        series.add_metric([], len(states))
        yield series
        self._status = CollectorStatus(True, time.perf_counter() - started, time.time())
