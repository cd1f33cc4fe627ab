"""The background pusher: sends a monitor's cumulative state to the daemon.

It runs in a daemon thread with a ``requests.Session`` and short timeouts. When the daemon is
down it logs one warning, backs off (up to a minute), and the next successful push carries all
the totals, so nothing is lost. Nothing it does can raise into the training loop. The goodbye
(:meth:`Pusher.stop`) is the last push: none follows it, and it keeps to its time limit even
while another push holds the connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import requests

from exporter.client.cgroup import CgroupCpu
from exporter.client.process_tree import ProcessTree
from exporter.client.profiling import RankProfiler
from exporter.client.stacks import StackSampler
from exporter.protocol import (
    DEFAULT_INGEST_PORT,
    PROFILE_CAPABILITY,
    PUSH_PATH,
    SCHEMA_VERSION,
    STACKS_CAPABILITY,
)

log = logging.getLogger("exporter.client")

TIMEOUT = (0.5, 2.0)  # connect, read (seconds)
MAX_BACKOFF = 60.0


class Pusher:
    """Pushes ``totals()`` for (run, rank, run_id) to ``endpoint`` every ``interval``
    seconds."""

    def __init__(self, totals: Callable[[], dict[str, Any]], run: str, rank: str, run_id: str,
                 endpoint: str, interval: float, token: str | None = None,
                 ca_file: str | None = None, server_name: str | None = None,
                 profiler: RankProfiler | None = None,
                 stacks: StackSampler | None = None) -> None:
        self._totals = totals
        self._profiler = profiler
        self._stacks = stacks
        self._identity = {"version": SCHEMA_VERSION, "run": run, "rank": rank,
                          "run_id": run_id}
        self.interval = interval
        self._url = endpoint + PUSH_PATH
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        # per request: a session's own verify loses to REQUESTS_CA_BUNDLE in the environment
        self._verify: str | bool = ca_file or True
        self._server_name = server_name
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # push_now() waits for a push whose totals were read after it asked: it takes ticket
        # n; a push reads the tickets issued before it reads the totals, and when it is done
        # marks them tried (and accepted, if the daemon took it).
        self._pushed = threading.Condition()
        self._tickets = 0
        self._tried = 0
        self._accepted = 0
        self._thread: threading.Thread | None = None
        self._session: requests.Session | None = None
        self._failing = False
        self._warned_codes: set[int] = set()
        self._tree: ProcessTree | None = None
        self._cgroup: CgroupCpu | None = None
        self._disabled = False
        self._ended = False  # the goodbye was sent (or tried): no push after it
        self._lock = threading.Lock()  # one push at a time (the thread, or close())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gputrain-pusher", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Push soon, from the pusher thread (a profile's state changed)."""
        self._wake.set()

    def disable(self) -> None:
        """After fork: this process is not the one that measures; never push."""
        self._disabled = True
        self._thread = None

    def _run(self) -> None:
        # a push's imports (psutil's) now, not in the goodbye at the interpreter's exit: an
        # import that runs exec() there (a namedtuple's) makes CPython forget an uncaught
        # KeyboardInterrupt, and the process exits 1 instead of by SIGINT
        with contextlib.suppress(Exception):
            self.payload()
        delay = self.interval
        while not self._stopping.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            if self._stopping.is_set():
                break
            ok = self.push_once()
            delay = self.interval if ok else min(MAX_BACKOFF, max(delay * 2, self.interval))

    def push_now(self, timeout: float) -> bool:
        """Push the totals as they are now and wait up to ``timeout`` seconds; True when the
        daemon accepted them (or later ones). A push already under way when this is called
        carries older totals and does not count."""
        if self._thread is None:
            return self.push_once()
        with self._pushed:
            self._tickets += 1
            ticket = self._tickets
            self._wake.set()
            self._pushed.wait_for(lambda: self._tried >= ticket, timeout)
            return self._accepted >= ticket

    def payload(self, goodbye: bool = False, reason: str | None = None,
                detail: str | None = None) -> dict[str, Any]:
        """The push's body; with ``goodbye``, how the process ended: ``reason`` (one of
        protocol.EXIT_REASONS) and ``detail`` (an exception's type, a signal's name)."""
        body: dict[str, Any] = {**self._identity, **self._totals()}
        try:
            if self._tree is None or self._cgroup is None:
                self._tree = ProcessTree(os.getpid())
                self._cgroup = CgroupCpu(os.getpid())
            body["process"] = {**self._tree.read(), **self._cgroup.read()}
        except Exception as exc:  # psutil missing or the process table unreadable
            log.debug("gputrain: process stats unavailable: %s", exc)
        if goodbye:
            body["goodbye"] = True
            if reason is not None:
                body["exit_reason"] = reason
                if detail is not None:
                    body["exit_detail"] = detail
        if self._profiler is not None:
            # without torch too: its client then answers "profiling unavailable"
            body["capabilities"] = [PROFILE_CAPABILITY]
            report = self._profiler.report()
            if report is not None:
                body["profile"] = report
        if self._stacks is not None:
            # without py-spy too: its capture then fails saying how to install it
            body.setdefault("capabilities", []).append(STACKS_CAPABILITY)
            report = self._stacks.report()
            if report is not None:
                body["stacks"] = report
        return body

    def push_once(self, goodbye: bool = False, timeout: Any = TIMEOUT,
                  deadline: float | None = None, reason: str | None = None,
                  detail: str | None = None) -> bool:
        """One push; never raises. Returns True when the daemon accepted it. With a
        ``deadline`` (``time.monotonic()`` seconds), waiting for a push under way to end and
        this one's connect and read all end by then; past it, nothing is sent."""
        wait = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if self._disabled or not self._lock.acquire(timeout=wait):
            return False
        try:
            if self._ended:  # the goodbye went first (a push that raced it): the rank is gone
                return False
            self._ended = goodbye
            if deadline is not None:
                left = max(0.05, deadline - time.monotonic())
                connect = min(0.5, left / 2)
                timeout = (connect, max(0.05, left - connect))
            with self._pushed:
                serves = self._tickets  # read before the totals are
            ok = self._push_locked(goodbye, timeout, reason, detail)
        finally:
            self._lock.release()
        with self._pushed:
            self._tried = max(self._tried, serves)
            if ok:
                self._accepted = max(self._accepted, serves)
            self._pushed.notify_all()
        return ok

    def _push_locked(self, goodbye: bool, timeout: Any, reason: str | None = None,
                     detail: str | None = None) -> bool:
        try:
            if self._session is None:
                self._session = requests.Session()
                if self._server_name:
                    self._session.mount("https://", ServerName(self._server_name))
            body = self.payload(goodbye, reason, detail)
            r = self._session.post(self._url, json=body, headers=self._headers,
                                   timeout=timeout, verify=self._verify)
        except Exception as exc:  # connection refused, timeout, anything: never into training
            if not self._failing:
                reason = type(exc).__name__
                if isinstance(exc, requests.ConnectionError) and "refused" in str(exc):
                    reason = "connection refused"
                log.warning("gputrain: cannot push to %s (%s); training is not affected, the "
                            "totals will be sent when the daemon answers", self._url, reason)
            self._failing = True
            return False
        if r.status_code == 200:
            if self._failing:
                log.info("gputrain: pushing to %s again", self._url)
            self._failing = False
            self._answered(r, body)
            return True
        if r.status_code == 400 and self._profiler is not None and "profile" in body:
            # never let a report the daemon cannot read block the totals' pushes
            self._profiler.reported(body["profile"], refused=r.text.strip()[:300])
        if r.status_code == 400 and self._stacks is not None and "stacks" in body:
            self._stacks.reported(body["stacks"], refused=r.text.strip()[:300])
        if r.status_code not in self._warned_codes:
            self._warned_codes.add(r.status_code)
            hint = (" (is GPUTRAIN_URL, endpoint= or --url the daemon's ingest address, "
                    f"port {DEFAULT_INGEST_PORT} by default, without a path?)"
                    if r.status_code in (404, 405) else "")
            log.warning("gputrain: %s refused a push (%d)%s: %s", self._url, r.status_code,
                        hint, r.text.strip()[:300])
        self._failing = True
        return False

    def _answered(self, r: requests.Response, body: dict[str, Any]) -> None:
        """Hand the answer's instructions to the profiler (a JSON answer, for a push that
        listed capabilities; anything not understood is ignored)."""
        if self._profiler is None and self._stacks is None:
            return
        if "profile" in body and self._profiler is not None:
            self._profiler.reported(body["profile"])
        if "stacks" in body and self._stacks is not None:
            self._stacks.reported(body["stacks"])
        if not r.headers.get("Content-Type", "").startswith("application/json"):
            return
        try:
            answer = r.json()
        except ValueError:
            return
        instructions = answer.get("instructions") if isinstance(answer, dict) else None
        for instruction in instructions if isinstance(instructions, list) else ():
            for taker in (self._profiler, self._stacks):
                if taker is not None:  # each ignores a type it does not know
                    taker.offer(instruction)

    def stop(self, goodbye: bool, timeout: float, reason: str | None = None,
             detail: str | None = None) -> None:
        """Stop the thread and send the final state once, within ``timeout`` seconds in all
        (waiting for a push under way included): ``reason`` and ``detail`` say how the
        process ended (see :meth:`payload`)."""
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        if not self._disabled:
            self.push_once(goodbye=goodbye, deadline=deadline, reason=reason, detail=detail)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._session is not None:
            self._session.close()


class ServerName(requests.adapters.HTTPAdapter):
    """Verify the daemon's certificate against a fixed name rather than the URL's host: on
    Kubernetes a rank reaches its node's daemon by the node's IP, which no certificate names."""

    def __init__(self, name: str) -> None:
        self._name = name
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["server_hostname"] = self._name
        kwargs["assert_hostname"] = self._name
        super().init_poolmanager(*args, **kwargs)
