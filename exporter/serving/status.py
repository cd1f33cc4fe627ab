"""The daemon's own view, for one person on one box: ``/api/v1/status`` (JSON), the status
page at ``/`` and what ``gputrain-exporter top`` reads.

The document is built from :class:`~exporter.serving.history.History` when a request meets a
newer history than the last build (at most once per sampler cycle, however many viewers), and
the verdicts come from :func:`exporter.heuristics.verdict.judge`, the code ``diagnose`` runs.
The scrape path never touches any of it. The page is three small files served from the package,
so it needs no network and runs under the strict Content-Security-Policy it is sent with.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from exporter import __version__
from exporter.heuristics.catalogue import alive, hang_line
from exporter.heuristics.readings import stale_collectors
from exporter.heuristics.verdict import (
    ORDER,
    NodeReport,
    RankReport,
    judge,
    mean,
    node_findings,
    summary,
    visibility,
    wasted_gpus,
)
from exporter.serving.hangs import with_locations
from exporter.serving.history import History, tree_memory
from exporter.serving.stacks import GUARDED, recent_stacks, with_lines

log = logging.getLogger(__name__)

STATUS_PATH = "/api/v1/status"
VIEWER_SECONDS = 30.0  # the builder thread works this long after the last request
SCHEMA_VERSION = 1
# A rank not heard from this long is shown as stopped (six missed pushes at the client's 5 s)
STALE_PUSH_SECONDS = 30.0
# Where each kind of verdict sorts on a run's card: what to act on first
_RANKING = {name: i for i, name in enumerate(ORDER)}
# The page: path -> (file in exporter/serving/static, content type)
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
          "/static/status.css": ("status.css", "text/css; charset=utf-8"),
          "/static/status.js": ("status.js", "text/javascript; charset=utf-8")}
# where index.html takes the document it is first drawn from
INITIAL_MARK = b"<!-- initial status -->"
# Nothing but this origin's own script, style and JSON: no inline code, no CDN
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                           "connect-src 'self'; img-src 'self'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")


class StatusView:
    """Builds the status document from the history. While someone watches (a request in the
    last VIEWER_SECONDS), a thread of its own rebuilds it after every sampler cycle, so a
    request only sends bytes; the first request after a quiet spell builds it inline."""

    def __init__(self, history: History, thresholds: dict[str, float],
                 gpu_error: Any = None, backend: str = "", driver: Any = None,
                 profiles: Any = None, guarded: bool = False,
                 wall_clock: Callable[[], float] | None = None) -> None:
        self.history = history
        # unix seconds now, against which the collectors' last successes age (None: the last
        # snapshot's time, which a stuck sampler never moves on)
        self._wall = wall_clock
        self.profiles = profiles  # the ingest's ProfileBoard (recent(), version), if any
        self.guarded = guarded  # an ingest token guards the profiles' ids, traces, errors
        self.thresholds = thresholds
        self._gpu_error = gpu_error or (lambda: None)
        self.backend = backend
        self._driver = driver or (lambda: "")
        self._lock = threading.Lock()  # one build at a time
        self._cached: tuple[tuple[int, int, tuple[str, ...]], bytes] | None = None
        self._asked = -math.inf  # monotonic time of the last request
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.builds = 0
        self._assets: dict[str, bytes] = {}

    def asset(self, path: str) -> tuple[bytes, str] | None:
        """A file of the page by its URL path: (body, content type), or None. The page
        itself carries the current document, so its first paint shows the node, not a
        "Loading" that waits for a second request."""
        if path not in ASSETS:
            return None
        name, ctype = ASSETS[path]
        if name not in self._assets:
            self._assets[name] = resources.files("exporter.serving").joinpath(
                "static").joinpath(name).read_bytes()
        body = self._assets[name]
        if name == "index.html":
            # a data block, never run (the policy allows no inline script); "<" escaped so
            # no string in it can end the element
            data = self.json_bytes().replace(b"<", b"\\u003c")
            body = body.replace(INITIAL_MARK, b'<script type="application/json" '
                                b'id="initial-status">' + data + b"</script>")
        return body, ctype

    def json_bytes(self) -> bytes:
        """The document as JSON: the latest build while the builder thread keeps it fresh
        for a viewer, else built now if the history has moved on since the last one."""
        now = time.monotonic()
        watched = now - self._asked <= VIEWER_SECONDS and self._thread is not None
        self._asked = now
        cached, version = self._cached, self._version()
        # a watched document may lag the history by a cycle, never a profile's change
        if cached is not None and (cached[0] == version or
                                   (watched and cached[0][1:] == version[1:])):
            return cached[1]
        return self._build()

    def _version(self) -> tuple[int, int, tuple[str, ...]]:
        """What the document is built from: the history, the profiles, and which collectors
        are stale (a stuck sampler moves no history, only the clock)."""
        stale = stale_collectors(self.history.collector_ages(self._now()),
                                 self.thresholds["stale_intervals"])
        return (self.history.version, self.profiles.version if self.profiles else 0,
                tuple(stale))

    def _build(self) -> bytes:
        with self._lock:
            version = self._version()
            cached = self._cached
            if cached is None or cached[0] != version:
                cached = self._cached = (version, json.dumps(
                    self.document(), separators=(",", ":")).encode())
                self.builds += 1
            return cached[1]

    def _now(self) -> float | None:
        return self._wall() if self._wall is not None else None

    def changed(self) -> None:
        """The history moved on (a sampler cycle): rebuild soon if someone watches."""
        self._changed.set()

    def start(self) -> None:
        """Keep the document fresh for viewers in a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="gputrain-status",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._changed.wait()
            self._changed.clear()
            if self._stop.is_set():
                return
            if time.monotonic() - self._asked > VIEWER_SECONDS:
                continue  # nobody watches: build nothing
            try:
                self._build()
            except Exception:  # the loop must outlive a bug in one build
                log.exception("building the status document failed")

    def document(self) -> dict[str, Any]:
        """The status document (docs/status-page.md has an example)."""
        h = self.history
        snap = h.snapshot
        now = snap.timestamp if snap is not None else time.time()
        wall = self._now()  # a stuck sampler's last snapshot is old: its age is the point
        readings, host_window = h.gpu_readings(), h.host_readings()
        reports = judge(visibility(with_locations(h.reports(readings, host_window, now=wall), h,
                                                  self.profiles)), self.thresholds)
        states = h.rank_states()
        users: dict[str, list[dict[str, str]]] = {}
        for rep in reports:
            for g in rep.gpus:
                users.setdefault(g.uuid or g.gpu, []).append({"run": rep.run, "rank": rep.rank})
        gpus = []
        for key, (st, window, rates) in readings.items():
            s = st.sample if st.up else None
            ident = st.identity
            gpus.append({
                "gpu": ident.index, "uuid": ident.uuid, "name": ident.name,
                "parent": ident.parent or None, "up": st.up,
                "busy": _get(s, "utilization"), "sm_active": _get(s, "sm_active"),
                "tensor_active": _get(s, "tensor_active"),
                "memory_used_bytes": _get(s, "memory_used_bytes"),
                "memory_total_bytes": _get(s, "memory_total_bytes"),
                "power_watts": _get(s, "power_watts"),
                "power_limit_watts": _get(s, "power_limit_watts"),
                "pcie_rx_bytes_per_second": rates["rx"] if st.up else None,
                "pcie_tx_bytes_per_second": rates["tx"] if st.up else None,
                "pcie_link_bytes_per_second": _get(s, "pcie_link_max_bytes_per_second"),
                "temperature_celsius": _get(s, "temperature_celsius"),
                "window": {"busy": window.busy, "sm_active": window.sm_active,
                           "tensor_active": window.tensor_active,
                           "memory_used": window.memory_used, "power_used": window.power_used,
                           "pcie_rx_used": window.pcie_rx_used, "throttled": window.throttled},
                "ranks": users.get(key, []),
                # of the window, the share of the GPU's time each rank's processes kept it
                # busy, then the share no rank's did (where the driver gives per-process
                # samples)
                "shares": [{"run": run, "rank": rank, "busy": v}
                           for (run, rank), v in sorted(window.shares.items())]
                + ([{"run": None, "rank": None, "busy": window.unattributed}]
                   if window.unattributed is not None else []),
            })
        gpus.sort(key=lambda g: (g["parent"] or g["gpu"], g["parent"] is not None,
                                 len(g["gpu"]), g["gpu"]))
        stacks = self.profiles.latest_stacks() if self.profiles else {}
        runs: dict[str, list[RankReport]] = {}
        for rep in reports:
            runs.setdefault(rep.run, []).append(rep)
        node = node_findings(NodeReport("", h.instance, gpus=[w for _, w, _ in readings.values()],
                                        collectors_failing=h.collectors_failing(),
                                        collector_ages=h.collector_ages(wall)),
                             self.thresholds)
        host_now = h.host_readings(recent=True)
        cpu = snap.host.get("cpu") if snap is not None else None
        mem = snap.host.get("memory") if snap is not None else None
        return {
            "version": SCHEMA_VERSION,
            "exporter_version": __version__,
            "time": now,
            "instance": h.instance,
            "backend": self.backend,
            "driver_version": self._driver() or None,
            "gpu_error": self._gpu_error(),
            "attribution": attribution_note(h.view.unresolved if h.view is not None else {}),
            "window_seconds": h.window,
            "seconds_seen": h.seconds_seen(),
            "host": {
                "cpus": cpu.count if cpu is not None else None,
                "memory_total_bytes": mem.total_bytes if mem is not None else None,
                **{k: host_now.get(k) for k in (
                    "cpu_busy", "iowait", "memory_available", "disk_busy",
                    "disk_read_bytes_per_second", "disk_written_bytes_per_second",
                    "network_rx_used", "network_received_bytes_per_second",
                    "network_transmitted_bytes_per_second")},
                "window": {k: v for k, v in host_window.items() if not k.endswith("_peak")},
            },
            # the colour bands of a busy ratio: under low is bad, from target on good
            "bands": {"busy": {"low": self.thresholds["gpu_busy_low"],
                               "target": self.thresholds["gpu_busy_target"]}},
            "gpus": gpus,
            # faults and health findings of the node and its GPUs, whoever uses them
            "faults": [{"gpu": gpu or None, "verdict": f.name, "severity": severity,
                        "summary": summary(f.name), "reason": f.reason, "advice": f.advice}
                       for gpu, severity, f in node.findings],
            "runs": [_run(name, ranks, states, now, self.thresholds, stacks, self.guarded)
                     for name, ranks in sorted(runs.items())],
            # the last profiles asked for (`gputrain-exporter profile`, alerts), newest first
            "profiles": [_shown(with_lines(p.document(brief=True)), self.guarded)
                         for p in self.profiles.recent(10)] if self.profiles else [],
        }


def attribution_note(unresolved: Mapping[tuple[str, str], int]) -> dict[str, Any] | None:
    """None where every GPU process could be read on the host, else how many could not and
    the fix: their GPU shares are unknown (not zero) and no GPU of theirs is called shared."""
    if not unresolved:
        return None
    return {"unresolved_processes": sum(unresolved.values()),
            "gpus": sorted(gpu for gpu, _ in unresolved),
            "note": "GPU processes this daemon cannot read in /proc (it does not run in the "
                    "host's PID namespace, or a sandbox hides it): their ranks' GPU shares "
                    "are unknown. Run the daemon with hostPID: true (Kubernetes) or "
                    "--pid=host / pid: host (Docker, compose)."}


def _shown(profile: dict[str, Any], guarded: bool) -> dict[str, Any]:
    """A profile as the status view shows it: with an ingest token set, without what
    GET /api/v1/profile guards (its id, trace, top operators and error; of py-spy stacks,
    the file and the functions)."""
    if not guarded:
        return profile
    hidden: dict[str, Any] = {"id": None, "trace": None, "top_ops": []}
    if profile.get("kind") == "stacks" and profile.get("state") == "done":
        # py-spy's functions and files are the program's, as an operator's name is
        hidden.update(file=None, where=[], lines=[GUARDED], roles=[
            {**r, "top": []} for r in profile.get("roles", [])])
    if profile.get("error"):
        hidden["error"] = GUARDED
    return {**profile, **hidden}


def _get(sample: Any, name: str) -> Any:
    return None if sample is None else getattr(sample, name)


def _lead(verdict: str, reps: list[RankReport]) -> RankReport:
    """The rank whose reason a run's verdict is told by: of failed ranks, the one that ended
    first (a launcher ends the others after it, by SIGTERM: the first failure is the cause);
    else the first rank."""
    if verdict == "failed":
        return max(reps, key=lambda r: r.seconds_since_push or 0.0)
    return reps[0]


def _run(name: str, ranks: list[RankReport], states: dict, now: float,
         thresholds: dict[str, float], stacks: dict | None = None,
         guarded: bool = False) -> dict[str, Any]:
    """One run's card: its verdicts, worst first, and its ranks (each with its last py-spy
    capture where it is recent)."""
    by_verdict: dict[str, list[RankReport]] = {}
    for rep in ranks:
        by_verdict.setdefault(rep.verdict, []).append(rep)
    verdicts = [{"verdict": v, "summary": summary(v), "advice": lead.advice,
                 "reason": lead.reason, "status": lead.status,
                 "ranks": [r.rank for r in reps],
                 "also": list(dict.fromkeys(f.name for r in reps for f in r.also))}
                for v, reps in sorted(by_verdict.items(), key=lambda kv: _RANKING[kv[0]])
                for lead in [_lead(v, reps)]]
    wasted = wasted_gpus(ranks)
    hung = [r for r in ranks if r.verdict == "hung"]
    return {
        "run": name,
        "status": verdicts[0]["status"],
        # a hung run's one line: where its ranks are, the culprit first
        "hang": (hang_line([r for r in hung if alive(r, thresholds)],
                           [r for r in ranks if not alive(r, thresholds)])
                 + (f"; {hung[0].partial}" if hung[0].partial else ""))
        if hung else None,
        "verdicts": verdicts,
        "partial": ranks[0].partial or None,
        "samples_per_second": _sum([r.samples_per_second for r in ranks]),
        "mfu": mean([r.mfu for r in ranks]),
        "goodput": mean([r.goodput for r in ranks]),
        "gpus_idle": wasted,
        "ranks": [{**_rank(rep, states.get((rep.run, rep.rank)), now),
                   "stacks": recent_stacks((stacks or {}).get((rep.run, rep.rank)), now,
                                           guarded)} for rep in ranks],
    }


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _rank(rep: RankReport, st: Any, now: float) -> dict[str, Any]:
    since_push = max(0.0, now - st.received_unix) if st is not None else None
    memory = tree_memory(st) if st is not None else None
    return {
        "rank": rep.rank,
        "samples_per_second": rep.samples_per_second,
        "steps_per_second": rep.steps_per_second,
        "step_seconds": rep.step_seconds,
        "data_wait_ratio": rep.data_wait_ratio,
        "comm_ratio": rep.comm_ratio,
        "comm_exposed_ratio": rep.comm_exposed_ratio,
        "phases": rep.phases,
        "mfu": rep.mfu,
        "goodput": rep.goodput,
        "badput": rep.badput,
        "precision": st.precision if st is not None else None,
        "gpus": [{"gpu": g.gpu, "uuid": g.uuid} for g in rep.gpus],
        "step_p50_seconds": rep.step_p50_seconds,
        "step_p99_seconds": rep.step_p99_seconds,
        # the process tree's memory as the leak rule judges it: "pss", or "rss" where the
        # client cannot read smaps_rollup (its RSS counts shared pages once per process)
        "memory_bytes": memory[0] if memory else None,
        "memory_measure": memory[1] if memory else None,
        "seconds_since_step": rep.seconds_since_step,
        "seconds_since_push": since_push,
        "pushing": since_push is not None and since_push <= STALE_PUSH_SECONDS
        and rep.verdict != "vanished",
        "finished": rep.finished,
        "failed": rep.failed,
        # how its process ended (a goodbye's reason: closed, completed, exited, exception,
        # signal) and the exception's type or the signal's name
        "exit_reason": next(iter(rep.exit), None),
        "exit_detail": rep.exit_detail,
        # the step in progress and the declared phase in progress, by the daemon's clock
        "step_in_progress_seconds": rep.step_in_progress,
        "phase_in_progress": rep.phase_in_progress,
        # where its hang's stacks found it (collective, data_loading, ...) and the function
        "location": next(iter(rep.location), None),
        "location_function": rep.location_detail,
        # seconds since its steps changed pace, inside the window (None: they did not)
        "regime_changed_seconds": rep.regime_changed_seconds,
        "status": rep.status,
        "verdict": rep.verdict,
        "summary": summary(rep.verdict),
        "reason": rep.reason,
        "advice": rep.advice,
        "also": [{"verdict": f.name, "reason": f.reason, "advice": f.advice}
                 for f in rep.also],
    }
