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
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.utils import floatToGoString

from exporter.reading.collectors import GpuCollector, Rendered, SelfCollector
from exporter.reading.peak_flops import PeakTable
from exporter.reading.sampler import CollectorStatus, Sampler
from exporter.serving.attribution import Attribution
from exporter.serving.ingest import IngestStore
from exporter.serving.status import StatusView
from exporter.serving.training import TrainingCollector

log = logging.getLogger(__name__)

MIN_GAP_SECONDS = 0.05  # between two builds, at the least
BUILD_SHARE = 0.1  # of one core, at most, spent building pages under a storm of pushes
UNUSED_SECONDS = 600.0  # a format nobody asked for this long is no longer built
FRESH_TIMEOUT_SECONDS = 5.0  # the longest /metrics?fresh=1 waits for the page thread
# /healthz fails when a change has waited this many sampler intervals for a page that shows
# it (at least STALE_MIN_SECONDS): the page builder fails or hangs
STALE_INTERVALS = 3
STALE_MIN_SECONDS = 3.0
FAILURE_LOG_SECONDS = 60.0  # a failing build logs its traceback at most this often
_EOF = b"# EOF\n"
# The only formats served, whatever the Accept header says (an Accept header is never a key:
# each distinct one kept a page, an encoder and a rebuild for ever)
TEXT = CONTENT_TYPE_PLAIN_0_0_4
OPENMETRICS = OPENMETRICS_CONTENT_TYPE
_OM_MEDIA = "application/openmetrics-text"
AGE_NAME = "gputrain_exporter_page_age_seconds"
_AGE_HELP = ("Seconds since the page being served was last brought up to date (it is rebuilt "
             "at every sampler cycle and push); it grows when the page builder fails.")
_AGE_HEADER = f"# HELP {AGE_NAME} {_AGE_HELP}\n# TYPE {AGE_NAME} gauge\n".encode()
COLLECTOR_AGE_NAME = "gputrain_collector_age_seconds"
_COLLECTOR_AGE_HELP = (
    "Seconds since the collector's last successful cycle, at this scrape, on the daemon's own "
    "monotonic clock: a node whose clock is off never reads as frozen (the timestamp in "
    "gputrain_collector_last_success_timestamp_seconds is its wall clock's).")
TIME_NAME = "gputrain_exporter_time_seconds"
_TIME_HELP = ("The daemon's wall clock at this scrape, in Unix seconds (node_exporter's "
              "node_time_seconds): the scrape's own time less this is the node's clock offset "
              "from Prometheus'.")
_TIME_HEADER = f"# HELP {TIME_NAME} {_TIME_HELP}\n# TYPE {TIME_NAME} gauge\n".encode()
_COLLECTOR_AGE_HEADER = (f"# HELP {COLLECTOR_AGE_NAME} {_COLLECTOR_AGE_HELP}\n"
                         f"# TYPE {COLLECTOR_AGE_NAME} gauge\n").encode()


def page_families() -> list[GaugeMetricFamily]:
    """The families the page itself adds at each request (written by :meth:`Exposition.page`,
    not by a collector)."""
    return [GaugeMetricFamily(AGE_NAME, _AGE_HELP),
            GaugeMetricFamily(COLLECTOR_AGE_NAME, _COLLECTOR_AGE_HELP, labels=["collector"]),
            GaugeMetricFamily(TIME_NAME, _TIME_HELP)]


def wants_openmetrics(accept: str | None) -> bool:
    """Whether an Accept header asks for OpenMetrics 1.0.0 (listed with no version, or
    version 1.0.0, and q above 0); anything else gets the text format 0.0.4. Never raises,
    whatever the header holds."""
    for part in (accept or "").split(","):
        media, *params = (p.strip().lower() for p in part.split(";"))
        if media != _OM_MEDIA:
            continue
        values = dict(p.partition("=")[::2] for p in params)
        if values.get("version", "1.0.0").strip() != "1.0.0":
            continue
        try:
            if float(values.get("q", "1")) <= 0:
                continue
        except ValueError:
            continue
        return True
    return False


@dataclass
class _Page:
    key: tuple[int, int]  # (snapshot cycle, ingest version) it shows
    plain: bytes  # without OpenMetrics' "# EOF" (the age line goes before it)
    built_at: float  # clock time it was last found up to date
    gzipped: bytes | None = None


class Exposition:
    """Builds the registry from the enabled collectors and keeps its page ready.

    :meth:`page` is the scrape path (no rendering once a format has been asked for);
    :meth:`render` builds a page now, for tests and tools. The page served ends with its
    age (AGE_NAME), written at each request.
    """

    def __init__(self, sampler: Sampler, store: IngestStore | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 peaks: PeakTable | None = None, status: StatusView | None = None,
                 views: Attribution | None = None,
                 regimes: Callable[[], dict[tuple[str, str], float]] | None = None) -> None:
        self.sampler = sampler
        if views is None:  # a page alone (tests, tools): it follows the sampler itself
            views = Attribution(snapshot=sampler.snapshot)
            views.follow(sampler, store)
        self.views = views  # one view per cycle: the page, the history and the status read it
        self.status = status  # the daemon's own view (/, /api/v1/status), served beside
        self._clock = clock
        self.store = store
        snap = lambda: self.views.latest.snapshot  # noqa: E731 - the latest at every build
        self.collectors: list = [  # the node's, in page order; training comes last
            SelfCollector(snap, self._training_status, interval=sampler.interval),
            ProcessCollector(namespace="gputrain_exporter", registry=None)]
        if "gpu" in sampler.collectors:
            self.collectors.append(GpuCollector(snap, peaks))
        self.collectors.extend(Rendered(collector, snap) for collector in sampler.host)
        self.node = CollectorRegistry()
        for collector in self.collectors:
            self.node.register(collector)
        self.training = TrainingCollector(store, lambda: self.views.latest, regimes=regimes) \
            if store is not None else None
        # by format (OpenMetrics or not): at most two of each, whatever clients send
        self._node_cache: dict[bool, tuple[int, bytes]] = {}
        self._pages: dict[bool, _Page] = {}
        self._lock = threading.Lock()  # one build at a time
        self._built = threading.Condition()  # notified after every build
        # the variants scrapers asked for (OpenMetrics, gzip), and when they last did
        self._wanted: dict[tuple[bool, bool], float] = {}
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.builds = 0
        self.failures = 0  # builds that raised
        self._failure_logged = -math.inf
        self._failure_why = ""
        # clock time of the oldest change no successful rebuild has taken in yet
        self._waiting_since: float | None = None

    def _training_status(self) -> dict[str, CollectorStatus]:
        return {} if self.training is None else {"training": self.training.status}

    # -- the scrape path -------------------------------------------------------------------

    def page(self, accept: str | None = None, gzip_ok: bool = False,
             fresh: bool = False) -> tuple[bytes, str]:
        """The latest built page for this Accept header: (body, content type). ``fresh``
        waits (at most FRESH_TIMEOUT_SECONDS) for a page that holds every push answered
        before this call: for scripts and tests that push and then read, never needed by
        Prometheus. The first request of a variant in a while builds it in the calling
        thread (the server calls this in its pool; :meth:`cached_page` first, on its loop)."""
        om = wants_openmetrics(accept)
        now = self._clock()
        last = self._wanted.get((om, gzip_ok))
        self._wanted[(om, gzip_ok)] = now
        if fresh and self.store is not None:
            self._wait_for(om, gzip_ok, self.store.version)
        page = self._pages.get(om)
        if page is None or not self._current(page, gzip_ok, last, now):
            # the first request of this variant in a while: build it here
            try:
                page = self._build(om, gzip_ok)
            except Exception:
                self._failed()
                page = self._pages.get(om)
                if page is None or (gzip_ok and page.gzipped is None):
                    raise
        return self._finish(page, om, gzip_ok, self._clock()), OPENMETRICS if om else TEXT

    def cached_page(self, accept: str | None = None,
                    gzip_ok: bool = False) -> tuple[bytes, str] | None:
        """The page the page thread keeps current for this Accept header, as :meth:`page`
        gives it, or None where it would have to be built now: never renders, so it may be
        called on an event loop."""
        om = wants_openmetrics(accept)
        now = self._clock()
        page = self._pages.get(om)
        if page is None or not self._current(page, gzip_ok, self._wanted.get((om, gzip_ok)),
                                             now):
            return None
        self._wanted[(om, gzip_ok)] = now
        return self._finish(page, om, gzip_ok, now), OPENMETRICS if om else TEXT

    @staticmethod
    def _current(page: _Page, gzip_ok: bool, last: float | None, now: float) -> bool:
        """Whether ``page`` serves a variant last asked for at ``last`` (the page thread
        rebuilds only the variants asked for within UNUSED_SECONDS)."""
        return not (gzip_ok and page.gzipped is None) and last is not None and \
            now - last <= UNUSED_SECONDS

    def _finish(self, page: _Page, om: bool, gzip_ok: bool, now: float) -> bytes:
        """The page as sent: its body, then its age (and OpenMetrics' end), gzipped as a
        second gzip member where the body is (a gzip stream may hold several)."""
        age = floatToGoString(round(max(0.0, now - page.built_at), 3))
        wall = floatToGoString(round(self.sampler.wall(), 3))
        tail = b"".join((_AGE_HEADER, f"{AGE_NAME} {age}\n".encode(), self._collector_ages(),
                         _TIME_HEADER, f"{TIME_NAME} {wall}\n".encode(), _EOF if om else b""))
        if gzip_ok:
            return page.gzipped + gzip.compress(tail, compresslevel=1)  # type: ignore[operator]
        return page.plain + tail

    def _collector_ages(self) -> bytes:
        """Each collector's age at this request (COLLECTOR_AGE_NAME), by the monotonic clock
        that timed its last success: the sampler's for its collectors, the ingest's for the
        training page. At each request, not at the page's build: a page that stops being
        rebuilt ages too."""
        aged = [(name, st, self.sampler.now) for name, st in
                self.views.latest.snapshot.collectors.items()]
        if self.training is not None and self.store is not None:
            aged.append(("training", self.training.status, self.store.now))
        lines = [_COLLECTOR_AGE_HEADER]
        for name, st, clock in sorted(aged, key=lambda x: x[0]):
            if st.last_success_monotonic is not None:
                age = round(max(0.0, clock() - st.last_success_monotonic), 3)
                lines.append(f'{COLLECTOR_AGE_NAME}{{collector="{name}"}} '
                             f"{floatToGoString(age)}\n".encode())
        return b"".join(lines) if len(lines) > 1 else b""

    def _wait_for(self, om: bool, gzip_ok: bool, version: int) -> None:
        if self._thread is None:  # no page thread: build here (tests, tools)
            self._build(om, gzip_ok)
            return
        deadline = time.monotonic() + FRESH_TIMEOUT_SECONDS
        with self._built:
            self._dirty.set()
            while True:
                page = self._pages.get(om)
                if page is not None and page.key[1] >= version and (
                        page.gzipped is not None or not gzip_ok):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._built.wait(left)

    def render(self, accept: str | None = None, gzip_ok: bool = False) -> tuple[bytes, str]:
        """A page built now from the latest state: (body, content type)."""
        om = wants_openmetrics(accept)
        page = self._build(om, gzip_ok)
        return self._finish(page, om, gzip_ok, page.built_at), OPENMETRICS if om else TEXT

    # -- health ----------------------------------------------------------------------------

    def stale_for(self) -> float:
        """Seconds a change (a snapshot, a push) has waited for a page that shows it: 0 while
        the builder keeps up."""
        since = self._waiting_since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def problem(self) -> str | None:
        """Why /healthz fails, or None: the sampler stopped completing cycles, or the page
        has not been rebuilt for STALE_INTERVALS intervals (its builder fails or hangs)."""
        if not self.sampler.healthy():
            return "the sampler has not completed a cycle in 3 intervals"
        limit = max(STALE_MIN_SECONDS, STALE_INTERVALS * self.sampler.interval)
        stale = self.stale_for()
        if stale > limit:
            why = f" (last error: {self._failure_why})" if self._failure_why else ""
            return (f"the /metrics page has not been rebuilt for {stale:.0f} s, over "
                    f"{STALE_INTERVALS} sampler intervals: Prometheus sees a page that stops "
                    f"changing{why}")
        return None

    def healthy(self) -> bool:
        """True when /healthz should answer 200 (see :meth:`problem`)."""
        return self.problem() is None

    def _failed(self) -> None:
        """A build raised: counted, and logged with its traceback at most once per
        FAILURE_LOG_SECONDS (with the count of failures since)."""
        self.failures += 1
        exc = sys.exc_info()[1]
        self._failure_why = f"{type(exc).__name__}: {exc}"[:300]
        now = self._clock()
        if now - self._failure_logged >= FAILURE_LOG_SECONDS:
            self._failure_logged = now
            log.error("building the /metrics page failed (%d failure(s) so far); the last "
                      "page built is served and its age grows", self.failures, exc_info=True)

    # -- building --------------------------------------------------------------------------

    def _key(self) -> tuple[int, int]:
        return (self.views.latest.cycle,
                self.store.states_version() if self.store is not None else 0)

    def _build(self, om: bool, gzip_ok: bool) -> _Page:
        with self._lock:
            key = self._key()
            now = self._clock()
            page = self._pages.get(om)
            if page is None or page.key != key:
                page = _Page(key, self._plain(om, key[0]), now)
            else:
                page.built_at = now  # still the latest
            if gzip_ok and page.gzipped is None:
                page.gzipped = gzip.compress(page.plain, compresslevel=1)
            self._pages[om] = page
            self.builds += 1
        with self._built:
            self._built.notify_all()
        return page

    def _plain(self, om: bool, cycle: int) -> bytes:
        cached = self._node_cache.get(om)
        if cached is None or cached[0] != cycle:
            body = generate_openmetrics(self.node) if om else generate_latest(self.node)
            cached = (cycle, body.removesuffix(_EOF) if om else body)
            self._node_cache[om] = cached
        parts = [cached[1]]
        if self.training is not None:
            parts.append(self.training.render(om))
        return b"".join(parts)

    def changed(self) -> None:
        """Something the page shows changed (a snapshot, a push): rebuild soon."""
        if self._waiting_since is None:
            self._waiting_since = self._clock()
        self._dirty.set()

    def start(self) -> None:
        """Keep the page ready in a background thread until :meth:`stop`."""
        self.views.listeners.append(lambda _view: self.changed())
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
        for (om, gz), seen in sorted(dict(self._wanted).items()):
            if now - seen <= UNUSED_SECONDS:
                self._build(om, gz)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            self._dirty.clear()
            began = self._clock()
            started = time.perf_counter()
            try:
                self.rebuild()
            except Exception:  # the loop must outlive a bug in one build
                self._failed()
            else:
                since = self._waiting_since
                if since is not None and since <= began:
                    self._waiting_since = None
                self._failure_why = ""
            took = time.perf_counter() - started
            # Coalesce: a storm of pushes waits here and is built once.
            self._stop.wait(max(MIN_GAP_SECONDS, took * (1 - BUILD_SHARE) / BUILD_SHARE))
