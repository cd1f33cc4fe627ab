"""What every host collector is: a reader run by the sampler, a renderer run by a scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from prometheus_client.core import Metric

if TYPE_CHECKING:
    from exporter.reading.sampler import Snapshot


class HostCollector:
    """One host collector (``--collector.<name>``).

    :meth:`read` runs in the sampler's cycle, timed, and returns plain data (None or an
    exception counts as a failed cycle); :meth:`render` turns that data into metric families
    at scrape time; :meth:`families` lists the families it can export, empty, for
    ``describe()``. The psutil module is a parameter so that tests pass a fake.
    """

    name: ClassVar[str]

    def __init__(self, psutil_module: Any = None) -> None:
        if psutil_module is None:
            import psutil
            psutil_module = psutil
        self.psutil = psutil_module

    def read(self) -> Any:
        raise NotImplementedError

    def families(self) -> tuple[Metric, ...]:
        raise NotImplementedError

    def render(self, reading: Any) -> Iterator[Metric]:
        raise NotImplementedError

    def render_snapshot(self, reading: Any, snapshot: Snapshot) -> Iterator[Metric]:
        """:meth:`render`, for collectors that also need the snapshot (its GPUs)."""
        return self.render(reading)


class Rendered:
    """A host collector as prometheus_client's registry sees it: its part of the latest
    snapshot, with ``describe()`` filled in so the registry catches duplicate series."""

    def __init__(self, collector: HostCollector, snapshot: Callable[[], Snapshot]) -> None:
        self.collector = collector
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return list(self.collector.families())

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        reading = snap.host.get(self.collector.name)
        if reading is not None:
            yield from self.collector.render_snapshot(reading, snap)
