"""HTTP: /metrics, /healthz, the status page (/) and /api/v1/status on the web address; the
push endpoint, profile requests and Alertmanager's webhook on the ingest address.

A scrape sends the page that exporter.serving.exposition keeps ready (no NVML call, no
rendering), so many Prometheus servers cost little more than one.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import logging
import re
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from exporter.protocol import (
    ALERTS_PATH,
    DEFAULT_PROFILE_STEPS,
    MAX_BODY_BYTES,
    PROFILE_PATH,
    PUSH_PATH,
    Refused,
)
from exporter.reading.sampler import Sampler
from exporter.serving.ingest import IngestStore
from exporter.serving.profiles import ProfileBoard
from exporter.serving.status import CONTENT_SECURITY_POLICY, STATUS_PATH

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"[0-9]{1,12}")
# Bounds of one connection (module constants: the README's "Limits" says why these values).
MAX_CONNECTIONS = 128  # per listening port, each with its own thread
IDLE_SECONDS = 60.0  # a keep-alive connection may wait this long for its next request
REQUEST_SECONDS = 10.0  # from a request's first byte to its last, headers and body
MAX_HEADER_BYTES = 16 * 1024  # request line excluded
MAX_HEADERS = 64
ACCEPT_BACKOFF_SECONDS = 0.1  # after accept() fails (no descriptors left): do not spin
_CODING = re.compile(r"\s*([A-Za-z0-9*_-]+)\s*(?:;\s*q\s*=\s*([0-9.]+))?\s*")


def accepts_gzip(header: str | None) -> bool:
    """Whether an Accept-Encoding header takes gzip: listed (or ``*``) with q above 0."""
    q = {}
    for part in (header or "").split(","):
        m = _CODING.fullmatch(part)
        if m:
            try:
                q[m.group(1).lower()] = float(m.group(2)) if m.group(2) else 1.0
            except ValueError:
                continue
    return q.get("gzip", q.get("*", 0.0)) > 0


LANDING_PAGE = b"""<html><head><title>gputrain-exporter</title></head><body>
<h1>gputrain-exporter</h1><p><a href="/metrics">Metrics</a> &middot;
<a href="/healthz">Health</a></p></body></html>
"""  # where no status view is wired (tests that serve the metrics page alone)


class _HeaderBudget:
    """A request's headers, read from ``rfile`` within a byte and line budget: beyond it,
    http.server answers 431 before any body is read or any token checked."""

    def __init__(self, rfile: Any) -> None:
        self._rfile = rfile
        self._bytes = 0
        self._lines = 0

    def readline(self, limit: int = -1) -> bytes:
        left = MAX_HEADER_BYTES - self._bytes
        line = self._rfile.readline(min(limit, left + 1) if limit >= 0 else left + 1)
        self._bytes += len(line)
        self._lines += 1
        if self._bytes > MAX_HEADER_BYTES:
            raise http.client.LineTooLong(f"headers over {MAX_HEADER_BYTES} bytes")
        if self._lines > MAX_HEADERS + 1:
            raise http.client.HTTPException(f"more than {MAX_HEADERS} headers")
        return line


class _Handler(BaseHTTPRequestHandler):
    server_version = "gputrain-exporter"
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; without TCP_NODELAY, Nagle's algorithm and the
    # client's delayed ACK add ~40 ms to every keep-alive response.
    disable_nagle_algorithm = True
    timeout = REQUEST_SECONDS  # each read; the server's watchdog bounds a whole request

    def setup(self) -> None:
        super().setup()
        self.requests_served = 0

    def handle_one_request(self) -> None:
        """http.server's, with deadlines: a new connection's first request within
        REQUEST_SECONDS, a kept-alive one's next request within IDLE_SECONDS, each whole
        request within REQUEST_SECONDS of its first byte, the headers within a budget. While
        it waits for a request, the connection may be closed to make room for a new one."""
        watchdog = self.server.watchdog
        try:
            watchdog.arm(self.connection, IDLE_SECONDS if self.requests_served else
                         REQUEST_SECONDS)
            self.server.waiting(self.connection, True)
            try:
                started = self.rfile.peek(1)
            finally:
                self.server.waiting(self.connection, False)
            if not started:
                self.close_connection = True
                return
            self.requests_served += 1
            watchdog.arm(self.connection, REQUEST_SECONDS)
            self.raw_requestline = self.rfile.readline(8193)
            if len(self.raw_requestline) > 8192:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            rfile, self.rfile = self.rfile, _HeaderBudget(self.rfile)
            try:
                parsed = self.parse_request()
            finally:
                self.rfile = rfile
            if not parsed:
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(501, f"unsupported method ({self.command!r})")
                return
            method()
            self.wfile.flush()
        except (TimeoutError, OSError, ValueError) as exc:
            # a deadline passed (the watchdog shut the socket), or the client went away
            log.debug("connection from %s ended: %s", self.client_address, exc)
            self.close_connection = True
        finally:
            watchdog.disarm(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _has_body(self) -> bool:
        """The request announces a body (which GET and HEAD handlers never read)."""
        return bool(self.headers.get("Transfer-Encoding")) or \
            self.headers.get("Content-Length", "0").strip() not in ("", "0")

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        if self.command in ("GET", "HEAD") and self._has_body():
            # an unread body must never be parsed as the next request
            self.close_connection = True
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _health(self) -> None:
        sampler: Sampler = self.server.app.sampler
        if sampler.healthy():
            self._send(200, b"ok\n")
        else:
            self._send(503, b"the sampler has not completed a cycle in 3 intervals\n")


class MetricsHandler(_Handler):
    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/metrics":
            gzip_ok = accepts_gzip(self.headers.get("Accept-Encoding"))
            body, ctype = self.server.app.page(self.headers.get("Accept"), gzip_ok,
                                               fresh="fresh=1" in query.split("&"))
            headers = {"Vary": "Accept-Encoding"}
            if gzip_ok:
                headers["Content-Encoding"] = "gzip"
            self._send(200, body, ctype, headers)
        elif path == "/healthz":
            self._health()
        elif path == STATUS_PATH and self.server.app.status is not None:
            self._send(200, self.server.app.status.json_bytes(), "application/json",
                       {"Cache-Control": "no-store"})
        elif self.server.app.status is not None and \
                (asset := self.server.app.status.asset(path)) is not None:
            self._send(200, asset[0], asset[1], {
                "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})
        elif path == "/":
            self._send(200, LANDING_PAGE, "text/html; charset=utf-8")
        else:
            self._send(404, b"not found: try /metrics, or / for the status page\n")

    do_HEAD = do_GET


MAX_WAIT_SECONDS = 5.0  # a GET of a profile may wait this long for it to finish (< REQUEST_SECONDS)


class IngestHandler(_Handler):
    def do_POST(self) -> None:
        store: IngestStore = self.server.app.store
        path = self.path.split("?", 1)[0]
        if path == PUSH_PATH:
            code, body, ctype = self._push(store)
            store.count(code)
            self._send(code, body, ctype)
            if code >= 400:
                log.debug("push rejected (%d): %s", code, body[:300])
        elif path in (PROFILE_PATH, ALERTS_PATH):
            try:
                raw = self._body(store)
                if path == PROFILE_PATH:
                    answer = self._ask_profile(store.profiles, raw)
                else:
                    answer = store.profiles.alerts(raw)
            except Refused as exc:
                self._json(exc.status, {"error": str(exc)})
            else:
                self._json(200, answer)
        else:
            self.close_connection = True
            self._send(404, f"not found: push to {PUSH_PATH}; profiles at {PROFILE_PATH}, "
                            f"Alertmanager's webhook at {ALERTS_PATH}\n".encode())

    def _json(self, code: int, doc: Any) -> None:
        self._send(code, (json.dumps(doc) + "\n").encode(), "application/json",
                   {"Cache-Control": "no-store"})

    def _body(self, store: IngestStore) -> bytes:
        """The request's body, after the token and the framing are checked."""
        if not store.authorized(self.headers.get("Authorization")):
            self.close_connection = True
            raise Refused(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get("Transfer-Encoding") or not lengths:
            self.close_connection = True
            raise Refused(411, "a Content-Length header is required (no Transfer-Encoding)")
        if len(lengths) > 1:
            self.close_connection = True
            raise Refused(400, "more than one Content-Length header")
        if not _DIGITS.fullmatch(lengths[0].strip()):
            self.close_connection = True
            raise Refused(400, f"Content-Length must be digits only, got {lengths[0][:40]!r}")
        length = int(lengths[0])
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body must not be parsed as a request
            raise Refused(413, f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        raw = self.rfile.read(length)
        if len(raw) != length:
            self.close_connection = True
            raise Refused(400, "the body is shorter than Content-Length")
        return raw

    def _push(self, store: IngestStore) -> tuple[int, bytes, str]:
        text = "text/plain; charset=utf-8"
        try:
            message, state, instructions = store.accept(self._body(store))
        except Refused as exc:
            return exc.status, (str(exc) + "\n").encode(), text
        except Exception:  # a bug: still answer and count it
            log.exception("processing a push failed")
            return 500, b"the daemon failed to process this push; its log says why\n", text
        if state.capabilities:  # a client that reads a JSON answer
            return 200, json.dumps({"result": message, "instructions": instructions}).encode(), \
                "application/json"
        return 200, (message + "\n").encode(), text

    @staticmethod
    def _ask_profile(board: ProfileBoard, raw: bytes) -> dict[str, Any]:
        try:
            ask = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise Refused(400, 'the body must be JSON: {"run": ..., "rank": ..., '
                               '"steps": ...}') from None
        if not isinstance(ask, dict) or not isinstance(ask.get("run"), str):
            raise Refused(400, "field 'run' (a string) is required")
        rank = ask.get("rank")
        if isinstance(rank, int) and not isinstance(rank, bool):
            rank = str(rank)
        if rank is not None and not isinstance(rank, str):
            raise Refused(400, "field 'rank' must be a string or a whole number")
        steps = ask.get("steps", DEFAULT_PROFILE_STEPS)
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise Refused(400, f"field 'steps' must be a whole number, got {steps!r}")
        return board.request(ask["run"], rank, steps, "cli").document()

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/healthz":
            self._health()
        elif path == PROFILE_PATH or path.startswith(PROFILE_PATH + "/"):
            store: IngestStore = self.server.app.store
            if not store.authorized(self.headers.get("Authorization")):
                self._json(401, {"error": "missing or wrong bearer token"})
                return
            pid = path[len(PROFILE_PATH) + 1:]
            if not pid:
                self._json(200, {"profiles": [p.document(brief=True)
                                              for p in store.profiles.recent()]})
                return
            wait = 0.0
            for item in query.split("&"):
                key, _, value = item.partition("=")
                if key == "wait":
                    try:
                        wait = min(MAX_WAIT_SECONDS, max(0.0, float(value)))
                    except ValueError:
                        self._json(400, {"error": f"wait must be seconds, got {value!r}"})
                        return
            profile = store.profiles.wait(pid, wait)
            if profile is None:
                self._json(404, {"error": f"no profile {pid!r} on this daemon (it keeps the "
                                          "last ones only)"})
            else:
                self._json(200, profile.document())
        else:
            self._send(405 if path in (PUSH_PATH, ALERTS_PATH) else 404,
                       f"POST JSON to {PUSH_PATH}\n".encode())


class _Watchdog:
    """One thread for all connections of a server: a connection whose deadline passes is shut
    down, which ends the blocked read of the thread serving it (a slow client cannot hold a
    thread and a descriptor past REQUEST_SECONDS, however slowly it trickles bytes in)."""

    def __init__(self) -> None:
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gputrain-http-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self, conn: socket.socket, seconds: float) -> None:
        with self._lock:
            self._deadlines[conn] = time.monotonic() + seconds

    def disarm(self, conn: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(conn, None)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                expired = [c for c, t in self._deadlines.items() if t <= now]
                for c in expired:
                    del self._deadlines[c]
            for c in expired:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    max_connections = MAX_CONNECTIONS

    def server_activate(self) -> None:
        super().server_activate()
        self.watchdog = _Watchdog()
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._refused = 0
        self._idle: dict[socket.socket, None] = {}  # waiting for a request, oldest first
        self._idle_lock = threading.Lock()

    def waiting(self, conn: socket.socket, idle: bool) -> None:
        """Mark a connection as waiting for its next request (or no longer)."""
        with self._idle_lock:
            if idle:
                self._idle[conn] = None
            else:
                self._idle.pop(conn, None)

    def _close_an_idle_connection(self) -> bool:
        """Close the connection that has waited longest for a request, as nginx reclaims
        keep-alive connections: its client reconnects on its next request. A connection in
        the middle of a request is never taken."""
        with self._idle_lock:
            if not self._idle:
                return False
            conn = next(iter(self._idle))
            del self._idle[conn]
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        return True

    def get_request(self) -> tuple[Any, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("cannot accept a connection on %s: %s; backing off",
                            self.server_address, exc.strerror)
                time.sleep(ACCEPT_BACKOFF_SECONDS)  # serve_forever would spin on it
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, at most max_connections at once. At the limit, the
        longest-idle connection makes room; when every one is mid-request, the new one is
        closed at once (the client sees a reset and retries), never queued behind them."""
        if not self._slots.acquire(blocking=False) and not (
                self._close_an_idle_connection() and self._slots.acquire(timeout=1.0)):
            self._refused += 1
            if self._refused in (1, 10, 100) or self._refused % 1000 == 0:
                log.warning("%d connection(s) to %s refused: %d are open (the limit)",
                            self._refused, self.server_address, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        if hasattr(self, "watchdog"):
            self.watchdog.stop()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that disconnects early, or speaks plain HTTP to the TLS port, is one line
        at debug level; anything else is a bug worth a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (OSError, ssl.SSLError, TimeoutError)):
            log.debug("connection from %s ended: %s", client_address, exc)
        else:
            log.exception("error while serving %s", client_address)

    def __init__(self, address: tuple[str, int], handler: type, app: Any,
                 family: int = socket.AF_INET) -> None:
        self.address_family = family
        self.app = app
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # ':port' means every address, IPv4 included.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def make_server(host: str, port: int, handler: type, app: Any,
                tls: tuple[str, str] | None = None) -> ThreadingHTTPServer:
    """Bind an HTTP(S) server; an empty host listens on every IPv4 and IPv6 address."""
    if host == "":
        try:
            server = _Server(("::", port), handler, app, socket.AF_INET6)
        except OSError:
            server = _Server(("0.0.0.0", port), handler, app)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = _Server((host, port), handler, app, family)
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(certfile=tls[0], keyfile=tls[1])
        # The handshake then happens in the request's own thread, not in the accept loop.
        server.socket = context.wrap_socket(server.socket, server_side=True,
                                            do_handshake_on_connect=False)
    return server


def serve_in_thread(server: ThreadingHTTPServer, name: str) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    t.start()
    return t
