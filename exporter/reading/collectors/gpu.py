"""Per-GPU metric families from a snapshot, as the descriptors of
:mod:`exporter.reading.gpu_metrics` say (names, types, help, labels, page order)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.reading import gpu_metrics as gm
from exporter.reading.peak_flops import PeakTable
from exporter.reading.sampler import Snapshot


def _family(m: gm.GpuMetric) -> GaugeMetricFamily | CounterMetricFamily:
    if m.type == "gauge":
        return GaugeMetricFamily(m.name, m.help, labels=[*gm.LABELS, *m.labels])
    return CounterMetricFamily(m.name, m.help, labels=[*gm.LABELS, *m.labels])


class GpuCollector:
    """Renders every GPU of the latest snapshot; a down GPU exports only its info and up=0."""

    def __init__(self, snapshot: Callable[[], Snapshot], peaks: PeakTable | None = None) -> None:
        self._snapshot = snapshot
        self._peaks = peaks or PeakTable()

    def describe(self) -> list[Metric]:
        return [_family(m) for m in gm.GPU_METRICS]

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if not snap.gpus:
            return
        families = {m.name: _family(m) for m in gm.GPU_METRICS}
        gauges = [(m.attr, families[m.name]) for m in gm.GPU_METRICS
                  if m.attr and m.type == "gauge"]
        counters = [(m.attr, families[m.name]) for m in gm.GPU_METRICS
                    if m.attr and m.type == "counter"]
        info, up, xids = (families[m.name] for m in (gm.INFO, gm.UP, gm.XID_ERRORS))
        clocks, events, ecc, remapped, retired, peak = (families[m.name] for m in (
            gm.CLOCKS, gm.CLOCK_EVENTS, gm.ECC_ERRORS, gm.REMAPPED_ROWS, gm.RETIRED_PAGES,
            gm.PEAK_FLOPS))
        for g in snap.gpus:
            ident = g.identity
            labels = [ident.index, ident.uuid]
            info.add_metric([*labels, ident.name, ident.pci_bus_id, snap.driver_version,
                             snap.backend, ident.parent, ident.profile], 1)
            up.add_metric(labels, 1 if g.up else 0)
            for xid, count in sorted(g.xid_errors.items()):
                xids.add_metric([*labels, str(xid)], count)
            if not g.up or g.sample is None:
                continue
            s = g.sample
            for source, plain in ((s, gauges), (g, counters)):
                for attr, family in plain:
                    value: float | None = getattr(source, attr)
                    if value is not None:
                        family.add_metric(labels, value)
            for clock, hz in sorted(s.clocks_hertz.items()):
                clocks.add_metric([*labels, clock], hz)
            for reason, seconds in sorted(g.clock_event_seconds.items()):
                events.add_metric([*labels, reason], seconds)
            for kind, errors in sorted(g.ecc_errors.items()):
                ecc.add_metric([*labels, kind], errors)
            for state, rows in s.remapped_rows.items():
                remapped.add_metric([*labels, state], rows)
            for cause, pages in sorted(s.retired_pages.items()):
                retired.add_metric([*labels, cause], pages)
            if not ident.parent:  # a MIG slice's share of the peak depends on its profile
                for precision, flops in sorted(self._peaks.peaks(ident.name).items()):
                    peak.add_metric([*labels, precision], flops)
        for family in families.values():  # the descriptors' order
            if family.samples:
                yield family
