"""HTTP: /metrics, /healthz, the status page (/) and /api/v1/status on the web address; the
push endpoint, profile requests and Alertmanager's webhook on the ingest address.

Each address is served by aiohttp's low-level server on an asyncio event loop in a thread of
its own, so a slow or idle connection costs a descriptor and a few kilobytes, never a thread.
Around aiohttp's parser this module keeps the daemon's own limits (docs/flags.md, "Endpoints
and limits", says why these values): a deadline for a request's headers and one for the
whole request, a budget for the headers' bytes and lines, caps on connections per port and
per client address, a budget for the bodies being read, and a bound on long-polls.

A scrape sends the page that exporter.serving.exposition keeps ready (no NVML call, no
rendering), so many Prometheus servers cost little more than one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import ipaddress
import json
import logging
import math
import re
import resource
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from exporter.protocol import (
    ALERTS_PATH,
    DEFAULT_PROFILE_STEPS,
    DEFAULT_STACKS_SECONDS,
    MAX_BODY_BYTES,
    PROFILE_PATH,
    PUSH_PATH,
    STACKS_MODES,
    Refused,
    check_unicode,
    count,
)
from exporter.serving.profiles import FINAL, Profile
from exporter.serving.status import ASSETS, CONTENT_SECURITY_POLICY, STATUS_PATH

if TYPE_CHECKING:
    from exporter.serving.exposition import Exposition
    from exporter.serving.ingest import IngestStore

log = logging.getLogger(__name__)

# Bounds of one connection and of a port (docs/flags.md, "Endpoints and limits", says why).
HEADER_SECONDS = 5.0  # from connecting, or from a request's first byte, to its headers' end
REQUEST_SECONDS = 10.0  # from a request's first byte to its answer's last byte
IDLE_SECONDS = 60.0  # a keep-alive connection may wait this long for its next request
CLOSING_SECONDS = 1.0  # after a closing answer, unread input is discarded this long
MAX_REQUEST_LINE = 8 * 1024
MAX_HEADER_BYTES = 16 * 1024  # the request line excluded
MAX_HEADERS = 64
MAX_CONNECTIONS = 512  # per port, at most: fewer where the descriptor limit is lower
RESERVED_DESCRIPTORS = 256  # kept for everything but the two ports (NVML, /proc, logs)
ADDRESS_SHARE = 2  # one client address holds at most 1/ADDRESS_SHARE of a port's connections
# this share of a port's connections is kept for connections that completed a request before
# (Prometheus and ranks keep theirs alive): connections that never did may fill the rest only
RESERVED_SHARE = 0.25
# TLS handshakes under way at once, per port and per client address: each holds asyncio's
# 256 KiB read buffer and an SSL object until it ends (HEADER_SECONDS at most)
MAX_HANDSHAKES = 64
MAX_HANDSHAKES_PER_ADDRESS = 16
BODY_BUDGET_BYTES = 16 * 1024 * 1024  # request bodies being read at once, per port
BODY_ADDRESS_SHARE = 8  # one client address reads at most 1/BODY_ADDRESS_SHARE of it (2 MiB)
# a body must arrive at this rate on average, after BODY_GRACE_SECONDS, or it is cut (408):
# a client trickling large declared bodies cannot hold the budget
MIN_BODY_BYTES_PER_SECOND = 32 * 1024
BODY_GRACE_SECONDS = 1.0
MAX_LONG_POLLS = 32  # per port: GETs of a profile that wait; more are answered at once
MAX_WAIT_SECONDS = 5.0  # a GET of a profile may wait this long for it (< REQUEST_SECONDS)
# the listen queue, and how many connections asyncio accepts at once (it closes the refused
# ones only after): the caps keep that many descriptors free per port
LISTEN_BACKLOG = 128
SWEEP_SECONDS = 0.5  # how often a port looks for connections past their deadline
READ_CHUNK = 16 * 1024  # bytes one read takes from a connection (asyncio's default: 256 KiB)
BLOCKING_THREADS = 4  # per port, for calls that may wait (?fresh=1, a status build)
GIL_SWITCH_SECONDS = 0.001  # the daemon's sys.setswitchinterval (bench/RESULTS.md says why)
ERROR_LOG_SECONDS = 60.0  # a client's failing requests are logged once in this long
MAX_LOGGED_ADDRESSES = 4096
GC_YOUNG_THRESHOLD = 7000  # the daemon's first garbage-collection threshold (Python's: 700)
_DIGITS = re.compile(r"[0-9]{1,12}")
_CODING = re.compile(r"\s*([A-Za-z0-9*_-]+)\s*(?:;\s*q\s*=\s*([0-9.]+))?\s*")
_TEXT = "text/plain; charset=utf-8"
SERVER = "gputrain-exporter"


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


def raise_descriptor_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft


def connection_caps(soft: int | None = None, ports: int = 2) -> tuple[int, int]:
    """(connections per port, connections per client address on a port), sized from the
    soft descriptor limit (the process's, by default): RESERVED_DESCRIPTORS stay for the rest
    of the daemon, and LISTEN_BACKLOG per port for connections accepted before they are
    refused."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = (MAX_CONNECTIONS + LISTEN_BACKLOG) * ports + RESERVED_DESCRIPTORS
    per_port = max(16, min(MAX_CONNECTIONS,
                           (soft - RESERVED_DESCRIPTORS) // ports - LISTEN_BACKLOG))
    return per_port, max(4, per_port // ADDRESS_SHARE)


def client_key(address: str) -> str:
    """What fairness counts as one client: an IPv4 address (an IPv4-mapped IPv6 one as
    such), or an IPv6 address's /64 (one host or site holds a whole /64)."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return address


def _canned(status: int, reason: str, text: str) -> bytes:
    """A whole closing answer, for the connection level (before aiohttp has a request)."""
    body = (text + "\n").encode()
    return (f"HTTP/1.1 {status} {reason}\r\nServer: {SERVER}\r\nContent-Type: {_TEXT}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _Port:
    """The connections of one listening port: the caps, fairness between client addresses,
    the body budget and the long-polls. Used from the port's event loop thread only."""

    def __init__(self, name: str, max_connections: int, per_address: int) -> None:
        self.name = name
        self.max_connections = max_connections
        self.per_address = per_address
        self.conns: dict[_Connection, None] = {}
        self.by_address: dict[str, dict[_Connection, None]] = {}  # oldest first
        self.idle: dict[_Connection, None] = {}  # waiting for a request, longest first
        self.handshakes: dict[_Connection, None] = {}  # in their TLS handshake, oldest first
        self.body_bytes = 0
        self.body_by_address: dict[str, int] = {}
        # connections reading a body: (loop time the read began, the body's length)
        self.reading: dict[_Connection, tuple[float, int]] = {}
        self.long_polls: dict[str, int] = {}
        self.refused = 0
        self._logged: dict[str, float] = {}  # client address -> loop time of its last error
        self._wakers: set[asyncio.Future[None]] = set()

    # -- connections ---------------------------------------------------------------------------

    def admit(self, conn: _Connection) -> str | None:
        """Take a new connection, making room by age and progress; or why it is refused.

        Past its address's share, an address's idle connection makes room, else the new one
        is refused. At the port's cap (or when connections that never completed a request
        fill all but RESERVED_SHARE of it), the connection still sending headers that has sent
        the least for its age goes first, among those that never completed a request; then
        the longest-idle keep-alive connection (its client reconnects on its next request);
        then the slowest sender of all. Connections that completed a request (Prometheus and
        ranks keep theirs alive) are thus the last to go, and a connection whose request is
        being handled is never taken. With many addresses at one connection each, the
        slowest loses, not the heaviest address."""
        mine = self.by_address.get(conn.client, {})
        if len(mine) >= self.per_address and not self._close_idle(mine):
            return self._refuse(f"{len(mine)} connections from {conn.address} are open on the "
                                f"{self.name} port, the most one address may hold")
        full = len(self.conns) >= self.max_connections
        fresh_cap = self.max_connections - max(1, int(self.max_connections * RESERVED_SHARE))
        if full or len(self.conns) >= fresh_cap:
            fresh = sum(1 for c in self.conns if not c.served)
            if (full or fresh >= fresh_cap) and not self._evict_slowest(fresh_only=True) and \
                    (fresh >= fresh_cap or not (self._close_idle(self.idle)
                                                or self._evict_slowest(fresh_only=False))):
                return self._refuse(f"{len(self.conns)} connections are open on the "
                                    f"{self.name} port ({fresh} that never completed a "
                                    "request), its limit")
        self.conns[conn] = None
        self.by_address.setdefault(conn.client, {})[conn] = None
        return None

    def _evict_slowest(self, fresh_only: bool) -> bool:
        """Close the connection still sending headers (or in its TLS handshake) that has sent
        the fewest bytes for its age (only among those that never completed a request, with
        ``fresh_only``); False when there is none."""
        now = asyncio.get_running_loop().time()
        slowest, least = None, math.inf
        for c in self.conns:
            if c.state != "head" or (fresh_only and c.served):
                continue
            rate = (c.head_progress + 1) / max(now - c.started, 1e-3)
            if rate < least:
                slowest, least = c, rate
        if slowest is None:
            return False
        slowest.evict()
        return True

    def may_log(self, address: str, now: float) -> bool:
        """Whether an error while serving ``address`` is logged: once per ERROR_LOG_SECONDS
        per client address (a client repeating a request that fails cannot flood the
        log)."""
        last = self._logged.get(address)
        if last is not None and now - last < ERROR_LOG_SECONDS:
            return False
        if len(self._logged) >= MAX_LOGGED_ADDRESSES:
            self._logged.clear()
        self._logged[address] = now
        return True

    def _refuse(self, why: str) -> str:
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            log.warning("%d connection(s) refused so far: %s", self.refused, why)
        return why

    def _close_idle(self, among: dict[_Connection, None]) -> bool:
        for c in list(among) if among is self.idle else [c for c in among if c in self.idle]:
            if c.reclaim():
                return True
        return False

    def sweep(self, now: float) -> None:
        """Act on every connection whose deadline has passed (one look for all of them,
        not a timer per request)."""
        for conn in [c for c in self.conns if c.deadline <= now]:
            conn.expired()
        for conn, (began, length) in list(self.reading.items()):
            want = min(length, MIN_BODY_BYTES_PER_SECOND * (now - began - BODY_GRACE_SECONDS))
            if conn.received < want:
                conn.too_slow()

    def start_handshake(self, conn: _Connection) -> str | None:
        """Room for ``conn``'s TLS handshake, or why it is refused: an address holds at most
        MAX_HANDSHAKES_PER_ADDRESS handshakes at once; past MAX_HANDSHAKES on the port, the
        oldest handshake is cut (an honest one takes milliseconds)."""
        mine = sum(1 for c in self.handshakes if c.client == conn.client)
        if mine >= MAX_HANDSHAKES_PER_ADDRESS:
            return self._refuse(f"{mine} TLS handshakes from {conn.address} are under way on "
                                f"the {self.name} port, the most one address may hold")
        if len(self.handshakes) >= MAX_HANDSHAKES:
            next(iter(self.handshakes)).evict()
        self.handshakes[conn] = None
        return None

    def forget(self, conn: _Connection) -> None:
        self.conns.pop(conn, None)
        self.handshakes.pop(conn, None)
        self.reading.pop(conn, None)
        self.idle.pop(conn, None)
        mine = self.by_address.get(conn.client)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_address[conn.client]

    # -- bodies and long-polls -----------------------------------------------------------------

    def reserve_body(self, address: str, length: int) -> bool:
        """Room for a body of ``length`` bytes from ``address``: within the port's budget,
        and within an address's share of it."""
        mine = self.body_by_address.get(address, 0)
        if self.body_bytes + length > BODY_BUDGET_BYTES or \
                mine + length > BODY_BUDGET_BYTES // BODY_ADDRESS_SHARE:
            return False
        self.body_bytes += length
        self.body_by_address[address] = mine + length
        return True

    def release_body(self, address: str, length: int) -> None:
        self.body_bytes -= length
        left = self.body_by_address.get(address, 0) - length
        if left > 0:
            self.body_by_address[address] = left
        else:
            self.body_by_address.pop(address, None)

    def start_long_poll(self, address: str) -> bool:
        """A long-poll may wait: fewer than MAX_LONG_POLLS wait on the port, and the address
        holds less than its share of them."""
        if sum(self.long_polls.values()) >= MAX_LONG_POLLS or \
                self.long_polls.get(address, 0) >= MAX_LONG_POLLS // ADDRESS_SHARE:
            return False
        self.long_polls[address] = self.long_polls.get(address, 0) + 1
        return True

    def end_long_poll(self, address: str) -> None:
        left = self.long_polls.get(address, 0) - 1
        if left > 0:
            self.long_polls[address] = left
        else:
            self.long_polls.pop(address, None)

    def wake(self) -> None:
        """A profile changed: long-polls look again."""
        for f in self._wakers:
            if not f.done():
                f.set_result(None)
        self._wakers.clear()

    async def changed(self, timeout: float) -> None:
        """Return after the next :meth:`wake`, or after ``timeout`` seconds."""
        f = asyncio.get_running_loop().create_future()
        self._wakers.add(f)
        try:
            await asyncio.wait_for(f, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._wakers.discard(f)


class _Connection(RequestHandler):
    """aiohttp's protocol with the daemon's limits around it.

    ``state``: ``head`` from connecting (or from a request's first byte) to the end of its
    headers, with HEADER_SECONDS to get there; ``busy`` while the request is read and
    answered, within REQUEST_SECONDS of its first byte; ``idle`` between requests, for up to
    IDLE_SECONDS; ``closing`` after a closing answer. Only ``idle`` and ``head`` connections
    are ever closed to make room for others.
    """

    def __init__(self, port: _Port, server: web.Server, loop: asyncio.AbstractEventLoop,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(server, loop=loop, keepalive_timeout=IDLE_SECONDS + 5,
                         access_log=None, max_line_size=MAX_REQUEST_LINE,
                         max_field_size=MAX_HEADER_BYTES, max_headers=MAX_HEADERS + 1,
                         lingering_time=CLOSING_SECONDS,
                         auto_decompress=False)  # a coded body is refused (415), never inflated
        self.port = port
        self.tls = tls
        self.address = ""  # the peer's address, for logs
        self.client = ""  # what fairness counts as one client: the address, an IPv6 /64
        self.served = 0  # requests completed on this connection
        self.slow_body = False  # its body was cut for arriving too slowly
        self.state = "new"
        self.started = 0.0  # loop time of the current request's first byte
        self.deadline = math.inf  # loop time; see _Port.sweep
        self._head_bytes = 0
        self._head_lines = 0
        self._line_bytes = 0
        self._tail = b""
        self._busy_bytes = 0
        self._raw: asyncio.BaseTransport | None = None
        self._admitted = False
        self._client_done = False  # the client closed its side
        self._content: Any = None  # the body of the request being handled
        self._handshake: asyncio.Task[None] | None = None

    # -- connecting ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._raw is not None:  # the TLS transport, after the handshake (see _start_tls)
            super().connection_made(transport)
            return
        self._raw = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if peer else ""
        self.client = client_key(self.address)
        why = self.port.admit(self)
        if why is not None:
            if self.tls is None:  # a TLS client would read plain text as a broken handshake
                transport.write(_canned(503, "Service Unavailable", f"busy: {why}; try again"))
            transport.close()
            return
        self._admitted = True
        _read_in_chunks(transport)
        self._begin_head()
        if self.tls is None:
            super().connection_made(transport)
        else:
            why = self.port.start_handshake(self)
            if why is not None:
                self._released()
                transport.abort()
                return
            self._handshake = self._loop.create_task(self._start_tls(transport))

    async def _start_tls(self, transport: asyncio.BaseTransport) -> None:
        try:
            secure = await self._loop.start_tls(transport, self, self.tls, server_side=True,
                                                ssl_handshake_timeout=HEADER_SECONDS)
        except (OSError, RuntimeError, asyncio.TimeoutError) as exc:  # ssl.SSLError is OSError
            log.debug("connection from %s ended: the TLS handshake failed (%s)", self.address,
                      exc)
            _forget_traceback(exc)
            transport.abort()
            self._released()
            return
        finally:
            self.port.handshakes.pop(self, None)
        if secure is None or transport.is_closing():
            self._released()
            return
        _read_in_chunks(getattr(secure, "_ssl_protocol", None))
        self.connection_made(secure)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._released()
        super().connection_lost(exc)

    def _released(self) -> None:
        self._disarm()
        if self._admitted:
            self._admitted = False
            self.port.forget(self)

    # -- deadlines -----------------------------------------------------------------------------

    def _arm(self, at: float) -> None:
        self.deadline = at  # the port's sweep looks every SWEEP_SECONDS

    def _disarm(self) -> None:
        self.deadline = math.inf

    def expired(self) -> None:
        """Its deadline has passed (the port's sweep): what to do depends on the state."""
        self.deadline = math.inf
        if self.state == "busy" and self._content is not None and \
                not self._content.is_eof() and self._content.exception() is None:
            # its body is late: the handler answers 408, then the connection closes
            self._content.set_exception(asyncio.TimeoutError())
            self._arm(self._loop.time() + CLOSING_SECONDS)
            return
        if self.state == "head":
            log.debug("%s sent no whole request headers within %.0f s", self.address,
                      HEADER_SECONDS)
            self._close_with(408, "Request Timeout", "the request's headers did not arrive "
                             f"within {HEADER_SECONDS:.0f} s")
        elif self.state == "idle":  # past IDLE_SECONDS: closed as reclaim() does
            if not self.reclaim():
                self._arm(self._loop.time() + SWEEP_SECONDS)  # a request has just come
        else:  # an answer not taken by REQUEST_SECONDS, or closing
            self._abort()

    @property
    def head_progress(self) -> int:
        """Bytes of the request's head received so far (0 in a TLS handshake)."""
        return self._head_bytes

    @property
    def received(self) -> int:
        """Bytes received since the request's head ended (its body, and what follows)."""
        return self._busy_bytes

    def too_slow(self) -> None:
        """Its body arrives slower than MIN_BODY_BYTES_PER_SECOND (the port's sweep): the
        handler answers 408, then the connection closes."""
        self.port.reading.pop(self, None)
        if self._content is not None and not self._content.is_eof() and \
                self._content.exception() is None:
            self.slow_body = True
            self._content.set_exception(asyncio.TimeoutError())
            self._arm(self._loop.time() + CLOSING_SECONDS)

    def _begin_head(self) -> None:
        self.state = "head"
        self.started = self._loop.time()
        self._head_bytes = self._head_lines = self._line_bytes = 0
        self._tail = b""
        self._arm(self.started + HEADER_SECONDS)

    # -- reading -------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state == "closing":
            return  # discarded: the answer is out, the connection closes
        if state == "idle":
            self.port.idle.pop(self, None)
            self._begin_head()
            state = "head"
        if state == "head":
            if not self._scan(data):
                return
        else:
            self._busy_bytes += len(data)
            if self._busy_bytes > MAX_BODY_BYTES + MAX_HEADER_BYTES + MAX_REQUEST_LINE:
                # more than one body and one pipelined request's headers while a request
                # is handled: stop reading; the connection closes after this answer
                self.state = "closing"
                self.close()
                return
        super().data_received(data)

    def _scan(self, data: bytes) -> bool:
        """Count the request line's bytes and the headers' bytes and lines until their end;
        past a limit, answer and close. Returns whether ``data`` may go on to the parser."""
        if not self._head_bytes:
            # the parser skips empty lines before a request line (RFC 9112, 2.2); so does the
            # count, else one would read as the end of the headers and lift their limits
            data = data.lstrip(b"\r\n")
            if not data:
                return True
        joined = self._tail + data
        ends = [e + n for e, n in ((joined.find(b"\r\n\r\n"), 4), (joined.find(b"\n\n"), 2))
                if e >= 0]
        stop = min(ends) if ends else len(joined)
        new = joined[len(self._tail):stop]
        self._head_bytes += len(new)
        self._head_lines += new.count(b"\n")
        if not self._line_bytes:
            i = new.find(b"\n")
            if i >= 0:
                self._line_bytes = self._head_bytes - len(new) + i + 1
            if (self._line_bytes or self._head_bytes) > MAX_REQUEST_LINE + 1:
                self._close_with(414, "URI Too Long", "the request line is over "
                                 f"{MAX_REQUEST_LINE} bytes")
                return False
        # the lines: the request line, the headers and the empty line that ends them
        if self._head_bytes - self._line_bytes > MAX_HEADER_BYTES or \
                self._head_lines > MAX_HEADERS + 2:
            self._close_with(431, "Request Header Fields Too Large",
                             f"the headers are over {MAX_HEADER_BYTES} bytes or "
                             f"{MAX_HEADERS} lines")
            return False
        if ends:
            self.begin_request()
            self._busy_bytes = len(joined) - stop
        else:
            self._tail = joined[-3:]
        return True

    def begin_request(self, request: web.BaseRequest | None = None) -> None:
        """The request's headers are in (or aiohttp starts on a pipelined one): it is being
        handled, and must be answered within REQUEST_SECONDS of its first byte."""
        if request is not None:  # its handler starts
            self._content = request.content
            if self._client_done and not request.content.is_eof():
                request.content.feed_eof()
        if self.state == "busy":
            return
        if self.state == "idle":
            self.port.idle.pop(self, None)
            self.started = self._loop.time()
        self.state = "busy"
        self._arm(self.started + REQUEST_SECONDS)

    def eof_received(self) -> bool | None:
        """The client closed its side: a request that is in (or whose body is being read)
        is answered, a short body as such, and then the connection closes; otherwise it
        closes now."""
        if self.state != "busy":
            return None
        self._client_done = True
        if self._content is not None and not self._content.is_eof():
            self._content.feed_eof()
        return True  # keep the transport open to write the answer

    # -- the request's life --------------------------------------------------------------------

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        if self._client_done or (not request.content.is_eof() and not resp.prepared):
            resp.force_close()  # a body left unread must never be parsed as a request
        self._content = None
        answer = await super().finish_response(request, resp, start_time)
        if self.transport is None or self.state in ("closing", "closed"):
            return answer
        self.served += 1
        if resp.keep_alive:
            self.state = "idle"
            self.port.idle[self] = None
            self._arm(self._loop.time() + IDLE_SECONDS)
        else:
            self.state = "closing"
            self._arm(self._loop.time() + CLOSING_SECONDS)
        return answer

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse is one debug line and a 4xx that says why; a
        failure of our own code is a bug: a traceback and a 500."""
        if isinstance(exc, HttpProcessingError) or status < 500:
            log.debug("bad request from %s: %s", self.address, message or exc)
            text = f"bad request: {getattr(exc, 'message', None) or message or status}"
        else:
            if self.port.may_log(self.address, self._loop.time()):
                log.error("error while serving %s (logged once a minute per client)",
                          self.address, exc_info=exc)
            text = "the daemon failed to answer; its log says why"
        resp = web.Response(status=status, text=text + "\n", content_type="text/plain",
                            headers={"Connection": "close", "Server": SERVER})  # HTTP/1.0
        resp.force_close()
        return resp

    # -- closing -------------------------------------------------------------------------------

    def _close_with(self, status: int, reason: str, text: str) -> None:
        """Answer at the connection level and close once the answer is out (input that
        arrives meanwhile is discarded, so the answer is not lost to a reset)."""
        transport = self.transport or self._raw
        self.state = "closing"
        if transport is None or transport.is_closing():
            return
        if self.transport is None and self.tls is not None:  # still in its TLS handshake
            self._abort()
            return
        transport.write(_canned(status, reason, text))
        if transport.can_write_eof():
            transport.write_eof()
        self._arm(self._loop.time() + CLOSING_SECONDS)

    def _abort(self) -> None:
        self.state = "closed"
        transport = self.transport or self._raw
        if transport is not None:
            transport.abort()

    def reclaim(self) -> bool:
        """Close this idle connection to make room, unless a request has just arrived on
        it (bytes waiting to be read): its client reconnects on its next request."""
        if self.state != "idle" or self._pending_input():
            return False
        self.state = "closed"
        self._released()  # its room is free now, so its descriptor must be too
        self._drop()
        return True

    def evict(self) -> None:
        """Close this connection, which is still sending headers, to make room."""
        self.state = "closed"
        self._released()
        if self.tls is None:
            self._raw.write(_canned(503, "Service Unavailable", f"busy: the {self.port.name} "
                                    "port is full and this connection had sent the least for "
                                    "its age"))
        self._drop()

    def _drop(self) -> None:
        """Close at once: a TLS close waits up to 30 s for the peer's close_notify, holding a
        descriptor the port no longer counts, so a TLS connection is cut."""
        if self.tls is None:
            self._raw.close()
        else:
            self._raw.abort()

    def _pending_input(self) -> bool:
        sock = (self._raw or self.transport).get_extra_info("socket")
        if sock is None:
            return False
        # asyncio's socket wrapper has no recv: look through a socket object on the same
        # descriptor (no duplicate, which could fail just when descriptors run out)
        peek = socket.socket(sock.family, sock.type, fileno=sock.fileno())
        try:
            return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True  # broken: leave it be
        finally:
            peek.detach()


def _forget_traceback(exc: BaseException) -> None:
    """Drop the tracebacks of a failed handshake's exception and of those it chains. Its
    traceback holds asyncio's start_tls frame, whose future holds the exception: a reference
    cycle that kept the connection's TLS buffers (256 KiB and an SSL object) until a full
    garbage collection, which the daemon's raised threshold makes rare."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def _read_in_chunks(transport: Any) -> None:
    """Make a transport read READ_CHUNK bytes at a time, so that what a connection holds
    before its handler has room for its body stays small (``max_size`` is an attribute of
    CPython's socket and TLS transports; elsewhere their default stays)."""
    if transport is not None and isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = READ_CHUNK


# -- the answers ----------------------------------------------------------------------------------

def _response(code: int, body: bytes, content_type: str = _TEXT,
              headers: dict[str, str] | None = None, close: bool = False) -> web.Response:
    resp = web.Response(status=code, body=body, headers={
        "Content-Type": content_type, "Server": SERVER, **(headers or {})})
    if close:
        resp.force_close()
    return resp


def _json(code: int, doc: Any, close: bool = False) -> web.Response:
    return _response(code, (json.dumps(doc) + "\n").encode(), "application/json",
                     {"Cache-Control": "no-store"}, close)


def _quoted(value: str, limit: int = 40) -> str:
    """A header's value as an answer may quote it: cut, every non-ASCII character escaped
    (aiohttp reads a byte that is not UTF-8 as a lone surrogate)."""
    return ascii(value[:limit])


def _address(request: web.BaseRequest) -> str:
    return request.protocol.address  # type: ignore[union-attr]


def _target(request: web.BaseRequest) -> tuple[str, str]:
    """The request target's path and query; an absolute-form target
    (``GET http://host/metrics``, RFC 9112 3.2.2, which proxies send) as its origin form."""
    raw = request.raw_path
    if not raw.startswith("/"):
        parts = urllib.parse.urlsplit(raw)
        if parts.scheme.lower() in ("http", "https") and parts.netloc:
            raw = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    path, _, query = raw.partition("?")
    return path, query


def _has_body(request: web.BaseRequest) -> bool:
    return bool(request.headers.get("Transfer-Encoding")) or \
        request.headers.get("Content-Length", "0").strip() not in ("", "0")


class _Site:
    """A port's handler: what it serves, the port's accounting and the blocking pool."""

    name: ClassVar[str]

    def __init__(self, healthy: Callable[[], bool], port: _Port,
                 pool: concurrent.futures.Executor) -> None:
        self.healthy = healthy
        self.port = port
        self.pool = pool

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called on the port's loop once it listens."""

    async def blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def health(self) -> web.Response:
        why = self.problem()
        if why is None:
            return _response(200, b"ok\n")
        return _response(503, (why + "\n").encode())

    def problem(self) -> str | None:
        """Why /healthz fails, or None."""
        if self.healthy():
            return None
        return ("the sampler has not completed a cycle in 3 intervals, or the /metrics page "
                "has stopped being rebuilt (the web port's /healthz says which)")


class WebSite(_Site):
    """The web port: /metrics, /healthz, the status page and /api/v1/status, from the page
    builder."""

    name = "web"

    def __init__(self, page: Exposition, port: _Port, pool: concurrent.futures.Executor) -> None:
        super().__init__(page.healthy, port, pool)
        self.page = page

    def problem(self) -> str | None:
        return self.page.problem()

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _response(405, b"only GET and HEAD here\n", close=_has_body(request))
        close = _has_body(request)  # an unread body must never be parsed as a request
        path, query = _target(request)
        app = self.page
        if path == "/metrics":
            gzip_ok = accepts_gzip(request.headers.get("Accept-Encoding"))
            accept = request.headers.get("Accept")
            fresh = "fresh=1" in query.split("&")
            got = None if fresh else app.cached_page(accept, gzip_ok)
            # a page to wait for or to build now is made in the pool, never on the loop
            body, ctype = got or await self.blocking(app.page, accept, gzip_ok, fresh)
            headers = {"Vary": "Accept-Encoding"}
            if gzip_ok:
                headers["Content-Encoding"] = "gzip"
            return _response(200, body, ctype, headers, close)
        if path == "/healthz":
            resp = self.health()
        elif path == STATUS_PATH and app.status is not None:
            resp = _response(200, await self.blocking(app.status.json_bytes),
                             "application/json", {"Cache-Control": "no-store"})
        elif app.status is not None and path in ASSETS and \
                (asset := await self.blocking(app.status.asset, path)) is not None:
            # in the pool: the page carries the status document, which may be built now
            resp = _response(200, asset[0], asset[1], {
                "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})
        else:
            resp = _response(404, b"not found: try /metrics, or / for the status page\n")
        if close:
            resp.force_close()
        return resp


class IngestSite(_Site):
    """The ingest port: pushes, profile requests and Alertmanager's webhook, into the store."""

    name = "ingest"

    def __init__(self, store: IngestStore, healthy: Callable[[], bool], port: _Port,
                 pool: concurrent.futures.Executor) -> None:
        super().__init__(healthy, port, pool)
        self.store = store

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        def wake() -> None:  # a profile changed (in any thread): the long-polls look again
            with contextlib.suppress(RuntimeError):  # the port has shut down
                loop.call_soon_threadsafe(self.port.wake)

        self.store.profiles.listeners.append(wake)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "POST":
            return await self._post(request)
        if request.method in ("GET", "HEAD"):
            return await self._get(request)
        return _response(405, f"POST JSON to {PUSH_PATH}\n".encode(), close=True)

    async def _post(self, request: web.BaseRequest) -> web.StreamResponse:
        store = self.store
        path = _target(request)[0]
        if path == PUSH_PATH:
            try:
                raw = await self._body(request)
            except Refused as exc:
                store.count(exc.status)
                log.debug("push from %s refused (%d): %s", _address(request), exc.status, exc)
                return _response(exc.status, (str(exc) + "\n").encode(), close=True)
            code, body, ctype = self._push(raw)
            store.count(code)
            if code >= 400:
                log.debug("push rejected (%d): %s", code, body[:300])
            return _response(code, body, ctype)
        if path in (PROFILE_PATH, ALERTS_PATH):
            try:
                raw = await self._body(request)
            except Refused as exc:
                log.debug("%s from %s refused (%d): %s", path, _address(request), exc.status,
                          exc)
                return _json(exc.status, {"error": str(exc)}, close=True)
            try:
                if path == PROFILE_PATH:
                    answer = _ask_profile(store.profiles, raw)
                else:
                    answer = store.profiles.alerts(raw)
            except Refused as exc:
                resp = _json(exc.status, {"error": str(exc)})
                if exc.retry_after is not None:
                    resp.headers["Retry-After"] = str(exc.retry_after)
                return resp
            return _json(200, answer)
        return _response(404, f"not found: push to {PUSH_PATH}; profiles at {PROFILE_PATH}, "
                              f"Alertmanager's webhook at {ALERTS_PATH}\n".encode(), close=True)

    async def _body(self, request: web.BaseRequest) -> bytes:
        """The request's body, after the token and the framing are checked, read within the
        request's deadline and the port's body budget. Raises Refused (the connection then
        closes: a body left unread must never be parsed as a request)."""
        if not self.store.authorized(request.headers.get("Authorization")):
            raise Refused(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        lengths = request.headers.getall("Content-Length", [])
        if request.headers.get("Transfer-Encoding") or not lengths:
            raise Refused(411, "a Content-Length header is required (no Transfer-Encoding)")
        if len(lengths) > 1:
            raise Refused(400, "more than one Content-Length header")
        if not _DIGITS.fullmatch(lengths[0].strip()):
            raise Refused(400, f"Content-Length must be digits only, got {lengths[0][:40]!r}")
        length = int(lengths[0])
        if length > MAX_BODY_BYTES:
            raise Refused(413, f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        coding = ",".join(request.headers.getall("Content-Encoding", [])).strip().lower()
        if coding not in ("", "identity"):
            raise Refused(415, f"Content-Encoding {_quoted(coding)} is not accepted: send the "
                               "JSON uncompressed (a push is a few kilobytes)")
        expect = request.headers.get("Expect")
        if expect is not None and expect.strip().lower() != "100-continue":
            raise Refused(417, f"Expect {_quoted(expect)} is not supported (only "
                               "100-continue)")
        conn: _Connection = request.protocol  # type: ignore[assignment]
        if not self.port.reserve_body(conn.client, length):
            raise Refused(503, f"the daemon is reading {self.port.body_bytes} bytes of other "
                               "requests' bodies, its limit; try again")
        if expect is not None and length:  # every check passed: the client may send it
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.port.reading[conn] = (asyncio.get_running_loop().time(), length)
        try:  # past the request's deadline, the port's sweep ends the read (TimeoutError)
            return await request.content.readexactly(length)
        except asyncio.TimeoutError:
            if conn.slow_body:
                raise Refused(408, "the body arrived slower than "
                                   f"{MIN_BODY_BYTES_PER_SECOND // 1024} KiB/s (after "
                                   f"{BODY_GRACE_SECONDS:.0f} s); it was cut") from None
            raise Refused(408, f"the body did not arrive within {REQUEST_SECONDS:.0f} s of "
                               "the request's start") from None
        except (asyncio.IncompleteReadError, RequestPayloadError) as exc:
            got = len(exc.partial) if isinstance(exc, asyncio.IncompleteReadError) else "fewer"
            raise Refused(400, f"the body is shorter than Content-Length ({got} of {length} "
                               "bytes came)") from None
        finally:
            self.port.reading.pop(conn, None)
            self.port.release_body(conn.client, length)

    def _push(self, raw: bytes) -> tuple[int, bytes, str]:
        try:
            message, state, instructions = self.store.accept(raw)
        except Refused as exc:
            return exc.status, (str(exc) + "\n").encode(), _TEXT
        except Exception:  # a bug: still answer and count it
            log.exception("processing a push failed")
            return 500, b"the daemon failed to process this push; its log says why\n", _TEXT
        if state.capabilities:  # a client that reads a JSON answer
            return 200, json.dumps({"result": message, "instructions": instructions}).encode(), \
                "application/json"
        return 200, (message + "\n").encode(), _TEXT

    async def _get(self, request: web.BaseRequest) -> web.StreamResponse:
        close = _has_body(request)
        path, query = _target(request)
        if path == "/healthz":
            resp = self.health()
        elif path == PROFILE_PATH or path.startswith(PROFILE_PATH + "/"):
            resp = await self._get_profile(request, path, query)
        else:
            resp = _response(405 if path in (PUSH_PATH, ALERTS_PATH) else 404,
                             f"POST JSON to {PUSH_PATH}\n".encode())
        if close:
            resp.force_close()
        return resp

    async def _get_profile(self, request: web.BaseRequest, path: str,
                           query: str) -> web.Response:
        store = self.store
        if not store.authorized(request.headers.get("Authorization")):
            return _json(401, {"error": "missing or wrong bearer token"})
        pid = path[len(PROFILE_PATH) + 1:]
        if not pid:
            return _json(200, {"profiles": [p.document(brief=True)
                                            for p in store.profiles.recent()]})
        wait = 0.0
        for item in query.split("&"):
            key, _, value = item.partition("=")
            if key == "wait":
                try:
                    wait = min(MAX_WAIT_SECONDS, max(0.0, float(value)))
                except ValueError:
                    return _json(400, {"error": f"wait must be seconds, got {value[:40]!r}"})
        conn: _Connection = request.protocol  # type: ignore[assignment]
        profile = store.profiles.get(pid)
        bounded = False
        if profile is not None and profile.state not in FINAL and wait > 0:
            if self.port.start_long_poll(conn.client):
                try:
                    profile = await self._wait(pid, wait)
                finally:
                    self.port.end_long_poll(conn.client)
            else:  # as many wait as the port allows: as it is now, and when to ask again
                bounded = True
        if profile is None:
            return _json(404, {"error": f"no profile {pid[:40]!r} on this daemon (it keeps "
                                        "the last ones only)"})
        resp = _json(200, profile.document())
        if bounded:
            resp.headers["Retry-After"] = "1"
        return resp

    async def _wait(self, pid: str, seconds: float) -> Profile | None:
        """The profile once final, or as it is after ``seconds``; looked at again whenever
        a profile changes, and each second (expiry is judged by the clock)."""
        board = self.store.profiles
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            profile = board.get(pid)
            left = deadline - loop.time()
            if profile is None or profile.state in FINAL or left <= 0:
                return profile
            await self.port.changed(min(left, 1.0))


def _ask_profile(board: Any, raw: bytes) -> dict[str, Any]:
    try:
        ask = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused(400, 'the body must be JSON: {"run": ..., "rank": ..., '
                           '"steps": ...}') from None
    check_unicode(ask, raw)
    if not isinstance(ask, dict) or not isinstance(ask.get("run"), str):
        raise Refused(400, "field 'run' (a string) is required")
    rank = ask.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        rank = str(rank)
    if rank is not None and not isinstance(rank, str):
        raise Refused(400, "field 'rank' must be a string or a whole number")
    steps = count(ask.get("steps", DEFAULT_PROFILE_STEPS), "steps")
    mode = ask.get("stacks")
    if mode is not None and mode not in STACKS_MODES:
        raise Refused(400, "field 'stacks' must be \"record\" (py-spy samples the rank's "
                           "processes for 'seconds') or \"dump\" (every thread once)")
    seconds = count(ask.get("seconds", DEFAULT_STACKS_SECONDS), "seconds")
    return board.request(ask["run"], rank, steps, "cli", mode=mode,
                         seconds=seconds).document()


# -- listening -------------------------------------------------------------------------------------

class Server:
    """One listening address served by aiohttp on an event loop in a thread of its own
    (:func:`serve_in_thread`). Bound when made, so that a port in use or a bad certificate
    is an error at start."""

    def __init__(self, sock: socket.socket,
                 site: Callable[[_Port, concurrent.futures.Executor], _Site],
                 tls: ssl.SSLContext | None, name: str) -> None:
        self.socket = sock
        self.address = sock.getsockname()
        self._tls = tls
        self._site = site
        self.name = name
        per_port, per_address = connection_caps()
        self.port = _Port(name, per_port, per_address)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            BLOCKING_THREADS, thread_name_prefix=f"gputrain-http-{name}-wait")

    def run(self) -> None:
        """Serve until :meth:`shutdown` (in the calling thread)."""
        loop = self._loop = asyncio.new_event_loop()
        loop.set_exception_handler(self._loop_error)
        try:
            loop.run_until_complete(self._listen(loop))
            self._started.set()
            loop.run_forever()
        finally:
            self._started.set()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:  # handlers of connections cut at shutdown
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's errors: accept() out of descriptors is a warning line (asyncio retries
        in a second); anything else is a bug, with its traceback."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE,
                                                      errno.ENOBUFS, errno.ENOMEM):
            self.port.refused += 1
            if self.port.refused in (1, 10, 100) or self.port.refused % 1000 == 0:
                log.warning("cannot accept connections on the %s port: %s; trying again in "
                            "a second", self.name, exc.strerror)
            return
        loop.default_exception_handler(context)

    async def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        site = self._site(self.port, self._pool)

        async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
            request.protocol.begin_request(request)  # type: ignore[attr-defined]
            return await site(request)

        aio = web.Server(dispatch, loop=loop, handler_cancellation=False)
        site.attach(loop)

        def sweep() -> None:
            loop.call_later(SWEEP_SECONDS, sweep)  # first: a failing sweep stops no deadline
            self.port.sweep(loop.time())

        loop.call_later(SWEEP_SECONDS, sweep)
        self._aio = await loop.create_server(
            lambda: _Connection(self.port, aio, loop, self._tls), sock=self.socket,
            backlog=LISTEN_BACKLOG)

    def shutdown(self) -> None:
        """Stop serving: every connection is closed, the loop ends."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def stop() -> None:
            self._aio.close()
            for conn in list(self.port.conns):
                conn._abort()
            loop.stop()

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.close()


def _bind(host: str, port: int) -> socket.socket:
    if host == "":
        try:  # '' means every address: IPv6 and, through it, IPv4
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            address: tuple = ("::", port)
        except OSError:
            sock, address = socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock, address = socket.socket(family, socket.SOCK_STREAM), (host, port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def make_server(host: str, port: int, handler: type[_Site], *serves: Any,
                tls: tuple[str, str] | None = None) -> Server:
    """Bind an HTTP(S) server of ``handler(*serves)`` (WebSite: the page builder;
    IngestSite: the store and the sampler's health check); an empty host listens on every
    IPv4 and IPv6 address. Raises OSError (the port, the files) or ssl.SSLError (the
    certificate) at once."""
    context = None
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(certfile=tls[0], keyfile=tls[1])
    sock = _bind(host, port)
    return Server(sock, lambda p, pool: handler(*serves, p, pool), context, handler.name)


def serve_in_thread(server: Server, name: str) -> threading.Thread:
    """Serve ``server`` from a thread named ``name``; returns once it listens."""
    t = threading.Thread(target=server.run, name=name, daemon=True)
    server._thread = t
    t.start()
    server._started.wait(10)
    return t

