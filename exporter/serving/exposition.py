"""The /metrics page, built off the request path.

A thread rebuilds the page when the sampler publishes a snapshot or a rank pushes, so a scrape
only sends bytes that are ready (Prometheus scrapes every 15-60 s and would otherwise always
meet a page to render). Builds are coalesced: however many pushes arrive, the builder spends
at most about a tenth of a core. The node's families (sampler snapshot) are formatted once per
snapshot through prometheus_client; the training families are written by the training
collector, each rank's lines reused until it pushes again.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder

from exporter.reading.collectors import GpuCollector, Rendered, SelfCollector
from exporter.reading.peak_flops import PeakTable
from exporter.reading.sampler import CollectorStatus, Sampler
from exporter.serving.ingest import IngestStore
from exporter.serving.status import StatusView
from exporter.serving.training import GpuShares, TrainingCollector

log = logging.getLogger(__name__)

MIN_GAP_SECONDS = 0.05  # between two builds, at the least
BUILD_SHARE = 0.1  # of one core, at most, spent building pages under a storm of pushes
UNUSED_SECONDS = 600.0  # a format nobody asked for this long is no longer built
FRESH_TIMEOUT_SECONDS = 5.0  # the longest /metrics?fresh=1 waits for the page thread
_EOF = b"# EOF\n"
_OPENMETRICS = "application/openmetrics-text"


@dataclass
class _Page:
    key: tuple[int, int]  # (snapshot cycle, ingest version) it shows
    plain: bytes
    gzipped: bytes | None = None


class Exposition:
    """Builds the registry from the enabled collectors and keeps its page ready.

    :meth:`page` is the scrape path (no rendering once a variant has been asked for);
    :meth:`render` builds a page now, for tests and tools.
    """

    def __init__(self, sampler: Sampler, store: IngestStore | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 peaks: PeakTable | None = None, status: StatusView | None = None,
                 shares: GpuShares | None = None) -> None:
        self.sampler = sampler
        self.status = status  # the daemon's own view (/, /api/v1/status), served beside
        self._clock = clock
        self.store = store
        snap = lambda: sampler.snapshot  # noqa: E731 - read the latest at every build
        self.collectors: list = [  # the node's, in page order; training comes last
            SelfCollector(snap, self._training_status, interval=sampler.interval),
            ProcessCollector(namespace="gputrain_exporter", registry=None)]
        if "gpu" in sampler.collectors:
            self.collectors.append(GpuCollector(snap, peaks))
        self.collectors.extend(Rendered(collector, snap) for collector in sampler.host)
        self.node = CollectorRegistry()
        for collector in self.collectors:
            self.node.register(collector)
        self.training = TrainingCollector(store, snap, shares=shares) \
            if store is not None else None
        # per content type, as prometheus_client's choose_encoder names it
        self._encoders: dict[str, Callable[[CollectorRegistry], bytes]] = {}
        self._node_cache: dict[str, tuple[int, bytes]] = {}
        self._pages: dict[str, _Page] = {}
        self._lock = threading.Lock()  # one build at a time
        self._built = threading.Condition()  # notified after every build
        # the variants scrapers asked for (content type, gzip), and when they last did
        self._wanted: dict[tuple[str, bool], float] = {}
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.builds = 0

    def _training_status(self) -> dict[str, CollectorStatus]:
        return {} if self.training is None else {"training": self.training.status}

    # -- the scrape path -------------------------------------------------------------------

    def page(self, accept: str | None = None, gzip_ok: bool = False,
             fresh: bool = False) -> tuple[bytes, str]:
        """The latest built page for this Accept header: (body, content type). ``fresh``
        waits (at most FRESH_TIMEOUT_SECONDS) for a page that holds every push answered
        before this call: for scripts and tests that push and then read, never needed by
        Prometheus. It waits for the page thread; it never renders."""
        ctype = self._content_type(accept)
        now = self._clock()
        last = self._wanted.get((ctype, gzip_ok))
        self._wanted[(ctype, gzip_ok)] = now
        if fresh and self.store is not None:
            self._wait_for(ctype, gzip_ok, self.store.version)
        page = self._pages.get(ctype)
        body = None
        if page is not None and last is not None and now - last <= UNUSED_SECONDS:
            body = page.gzipped if gzip_ok else page.plain
        if body is None:  # the first request of this variant in a while: build it here
            page = self._build(ctype, gzip_ok)
            body = page.gzipped if gzip_ok else page.plain
        return body, ctype

    def _content_type(self, accept: str | None) -> str:
        """The content type prometheus_client chooses for this Accept header (its encoder
        kept for the builds)."""
        encoder, ctype = choose_encoder(accept or "")
        self._encoders.setdefault(ctype, encoder)
        return ctype

    def _wait_for(self, ctype: str, gzip_ok: bool, version: int) -> None:
        if self._thread is None:  # no page thread: build here (tests, tools)
            self._build(ctype, gzip_ok)
            return
        deadline = time.monotonic() + FRESH_TIMEOUT_SECONDS
        with self._built:
            self._dirty.set()
            while True:
                page = self._pages.get(ctype)
                if page is not None and page.key[1] >= version and (
                        page.gzipped is not None or not gzip_ok):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._built.wait(left)

    def render(self, accept: str | None = None, gzip_ok: bool = False) -> tuple[bytes, str]:
        """A page built now from the latest state: (body, content type)."""
        ctype = self._content_type(accept)
        page = self._build(ctype, gzip_ok)
        return page.gzipped if gzip_ok else page.plain, ctype

    # -- building --------------------------------------------------------------------------

    def _key(self) -> tuple[int, int]:
        return (self.sampler.snapshot.cycle,
                self.store.states_version() if self.store is not None else 0)

    def _build(self, ctype: str, gzip_ok: bool) -> _Page:
        with self._lock:
            key = self._key()
            page = self._pages.get(ctype)
            if page is None or page.key != key:
                page = _Page(key, self._plain(ctype, key[0]))
            if gzip_ok and page.gzipped is None:
                page.gzipped = gzip.compress(page.plain, compresslevel=1)
            self._pages[ctype] = page
            self.builds += 1
        with self._built:
            self._built.notify_all()
        return page

    def _plain(self, ctype: str, cycle: int) -> bytes:
        om = ctype.startswith(_OPENMETRICS)
        cached = self._node_cache.get(ctype)
        if cached is None or cached[0] != cycle:
            body = self._encoders[ctype](self.node)
            cached = (cycle, body.removesuffix(_EOF) if om else body)
            self._node_cache[ctype] = cached
        parts = [cached[1]]
        if self.training is not None:
            parts.append(self.training.render(om))
        if om:
            parts.append(_EOF)
        return b"".join(parts)

    def changed(self) -> None:
        """Something the page shows changed (a snapshot, a push): rebuild soon."""
        self._dirty.set()

    def start(self) -> None:
        """Keep the page ready in a background thread until :meth:`stop`."""
        self.sampler.listeners.append(self.changed)
        if self.store is not None:
            self.store.listeners.append(self.changed)
        self._thread = threading.Thread(target=self._loop, name="gputrain-page", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def rebuild(self) -> None:
        """Build every variant a scraper asked for in the last UNUSED_SECONDS."""
        now = self._clock()
        for (ctype, gz), seen in sorted(dict(self._wanted).items()):
            if now - seen <= UNUSED_SECONDS:
                self._build(ctype, gz)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            self._dirty.clear()
            started = time.perf_counter()
            try:
                self.rebuild()
            except Exception:  # the loop must outlive a bug in one build
                log.exception("building the /metrics page failed")
            took = time.perf_counter() - started
            # Coalesce: a storm of pushes waits here and is built once.
            self._stop.wait(max(MIN_GAP_SECONDS, took * (1 - BUILD_SHARE) / BUILD_SHARE))
