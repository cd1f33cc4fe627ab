"""The connections of the daemon's two ports and their limits, around aiohttp's parser.

A slow or idle connection costs a descriptor and a few kilobytes, never a thread. This module
keeps the daemon's own limits (docs/flags.md, "Endpoints and limits", says why these values):
a deadline for a request's headers and one for the whole request, a budget for the headers'
bytes and lines, caps on connections per port and per client address, a budget for the bodies
being read, and a bound on long-polls. What a port serves is exporter.serving.routes; the
listening, exporter.serving.server.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import ipaddress
import logging
import math
import resource
import socket
import ssl
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from exporter.protocol import MAX_BODY_BYTES

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
# the listen queue, and how many connections asyncio accepts at once (it closes the refused
# ones only after): the caps keep that many descriptors free per port
LISTEN_BACKLOG = 128
SWEEP_SECONDS = 0.5  # how often a port looks for connections past their deadline
# An idle keep-alive connection is closed to make room only once idle this long: a client
# sends its next request on it while the close is on its way (nothing tells it the request
# was not read), so a connection in use is never taken. A connection refused for want of room
# gets a 503 with Retry-After instead, and while a port or an address is crowded each answer
# closes its connection (Connection: close), so its clients take turns without a silent cut.
RECLAIM_IDLE_SECONDS = 2.0
CROWDED_SECONDS = 5.0  # a refusal marks the address (or the port) crowded this long
RETRY_AFTER_SECONDS = 1
BURST_SECONDS = 10.0  # refusals this close together are one burst: logged at its start and end
# After this many TLS handshakes, once none has ended for TRIM_QUIET_SECONDS, the C allocator
# is asked to give back what it holds free (glibc's malloc_trim): the SSL objects of a churn
# of handshakes are freed in an order that leaves the heap's top pinned, so without it the
# daemon stays at its peak after an attack (60 MB over idle after a minute from 520
# addresses)
TRIM_AFTER_HANDSHAKES = 256
TRIM_QUIET_SECONDS = 5.0
# on SIGTERM: the requests already being handled get this long to be answered (a push or a
# scrape takes milliseconds; a long-poll is answered at once with what it has)
SHUTDOWN_GRACE_SECONDS = 5.0
READ_CHUNK = 16 * 1024  # bytes one read takes from a connection (asyncio's default: 256 KiB)
ERROR_LOG_SECONDS = 60.0  # a client's failing requests are logged once in this long
MAX_LOGGED_ADDRESSES = 4096
TEXT_PLAIN = "text/plain; charset=utf-8"
SERVER = "gputrain-exporter"


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
    """A whole closing answer, for the connection level (before aiohttp has a request); a 503
    says when to come back."""
    body = (text + "\n").encode()
    retry = f"Retry-After: {RETRY_AFTER_SECONDS}\r\n" if status == 503 else ""
    return (f"HTTP/1.1 {status} {reason}\r\nServer: {SERVER}\r\nContent-Type: {TEXT_PLAIN}\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n").encode() + body


class Port:
    """The connections of one listening port: the caps, fairness between client addresses,
    the body budget and the long-polls. Used from the port's event loop thread only."""

    def __init__(self, name: str, max_connections: int, per_address: int) -> None:
        self.name = name
        self.max_connections = max_connections
        self.per_address = per_address
        self.conns: dict[Connection, None] = {}
        self.by_address: dict[str, dict[Connection, None]] = {}  # oldest first
        self.idle: dict[Connection, None] = {}  # waiting for a request, longest first
        self.handshakes: dict[Connection, None] = {}  # in their TLS handshake, oldest first
        self.body_bytes = 0
        self.body_by_address: dict[str, int] = {}
        # connections reading a body: (loop time the read began, the body's length)
        self.reading: dict[Connection, tuple[float, int]] = {}
        self.long_polls: dict[str, int] = {}
        self.refused = 0
        self.crowded: dict[str, float] = {}  # client -> loop time its crowding ends
        self.crowded_until = 0.0  # the whole port's
        self.burst = 0  # refusals in the burst under way
        self.handshakes_ended = 0  # since the allocator was last trimmed
        self.last_handshake_end = -math.inf
        self.burst_started = self.last_refusal = -math.inf
        self.draining = False  # shutting down: answer what is in, each answer closes
        self._logged: dict[str, float] = {}  # client address -> loop time of its last error
        self._wakers: set[asyncio.Future[None]] = set()

    # -- connections ---------------------------------------------------------------------------

    def admit(self, conn: Connection) -> str | None:
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
            self.crowd(conn.client)
            return self._refuse(f"{len(mine)} connections from {conn.address} are open on the "
                                f"{self.name} port, the most one address may hold")
        full = len(self.conns) >= self.max_connections
        fresh_cap = self.max_connections - max(1, int(self.max_connections * RESERVED_SHARE))
        if full or len(self.conns) >= fresh_cap:
            fresh = sum(1 for c in self.conns if not c.served)
            if (full or fresh >= fresh_cap) and not self._evict_slowest(fresh_only=True) and \
                    (fresh >= fresh_cap or not (self._close_idle(self.idle)
                                                or self._evict_slowest(fresh_only=False))):
                self.crowd(None)
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

    def crowd(self, client: str | None) -> None:
        """Answers to ``client`` (the whole port's, for None) close their connections for a
        while: its clients take turns on the connections it may hold."""
        until = asyncio.get_running_loop().time() + CROWDED_SECONDS
        if client is None:
            self.crowded_until = until
        else:
            if len(self.crowded) >= MAX_LOGGED_ADDRESSES:
                self.crowded.clear()
            self.crowded[client] = until

    def is_crowded(self, client: str, now: float) -> bool:
        return now < self.crowded_until or now < self.crowded.get(client, -math.inf)

    def _refuse(self, why: str) -> str:
        """A refusal (answered 503 with Retry-After where the connection can read it): the
        log says so at a burst's first and, from the sweep, at its end."""
        self.refused += 1
        now = asyncio.get_running_loop().time()
        if now - self.last_refusal > BURST_SECONDS:
            self.burst, self.burst_started = 0, now
            log.warning("refusing connections on the %s port (503, Retry-After %d s): %s",
                        self.name, RETRY_AFTER_SECONDS, why)
        self.burst += 1
        self.last_refusal = now
        return why

    def _close_idle(self, among: dict[Connection, None]) -> bool:
        for c in list(among) if among is self.idle else [c for c in among if c in self.idle]:
            if c.reclaim():
                return True
        return False

    def sweep(self, now: float) -> None:
        """Act on every connection whose deadline has passed (one look for all of them,
        not a timer per request)."""
        for conn in [c for c in self.conns if c.deadline <= now]:
            conn.expired()
        if self.handshakes_ended >= TRIM_AFTER_HANDSHAKES and \
                now - self.last_handshake_end > TRIM_QUIET_SECONDS:
            self.handshakes_ended = 0
            trim_allocator()
        if self.burst and now - self.last_refusal > BURST_SECONDS:
            log.warning("the %s port refused %d connection(s) over %.0f s; it takes them again",
                        self.name, self.burst, self.last_refusal - self.burst_started)
            self.burst = 0
        for conn, (began, length) in list(self.reading.items()):
            want = min(length, MIN_BODY_BYTES_PER_SECOND * (now - began - BODY_GRACE_SECONDS))
            if conn.received < want:
                conn.too_slow()

    def start_handshake(self, conn: Connection) -> str | None:
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

    def forget(self, conn: Connection) -> None:
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

    async def drain(self, grace: float) -> int:
        """Shutting down (the listening socket is closed already): connections with no
        request in are closed, those with one get up to ``grace`` seconds for its answer, which
        closes them; long-polls answer at once. Returns how many were still busy at the end
        (cut: their requests outlasted the grace)."""
        self.draining = True
        self.wake()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while True:
            for conn in list(self.conns):
                if conn.state in ("new", "idle") and not conn._pending_input():
                    conn._abort()  # nothing asked on it: closing cuts no request
                elif conn.state == "closing" and conn.answered():
                    conn._abort()  # its last answer is out
            if not self.conns or loop.time() >= deadline:
                break  # (a request's bytes in a connection's buffer are read and answered)
            await asyncio.sleep(0.02)
        cut = [c for c in self.conns if c.state != "closing"]
        for conn in list(self.conns):
            conn._abort()
        return len(cut)

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


class Connection(RequestHandler):
    """aiohttp's protocol with the daemon's limits around it.

    ``state``: ``head`` from connecting (or from a request's first byte) to the end of its
    headers, with HEADER_SECONDS to get there; ``busy`` while the request is read and
    answered, within REQUEST_SECONDS of its first byte; ``idle`` between requests, for up to
    IDLE_SECONDS; ``closing`` after a closing answer. Only ``idle`` and ``head`` connections
    are ever closed to make room for others.
    """

    def __init__(self, port: Port, server: web.Server, loop: asyncio.AbstractEventLoop,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(server, loop=loop, keepalive_timeout=IDLE_SECONDS + 5,
                         # None: no access log (aiohttp tests it, its annotation says Logger)
                         access_log=None,  # type: ignore[arg-type]
                         max_line_size=MAX_REQUEST_LINE,
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
        self.idle_since = 0.0  # loop time it last became idle
        self.deadline = math.inf  # loop time; see Port.sweep
        self._head_bytes = 0
        self._head_lines = 0
        self._line_bytes = 0
        self._tail = b""
        self._busy_bytes = 0
        self._raw: asyncio.Transport | None = None
        self._admitted = False
        self._client_done = False  # the client closed its side
        self._content: Any = None  # the body of the request being handled
        self._handshake: asyncio.Task[None] | None = None

    # -- connecting ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._raw is not None:  # the TLS transport, after the handshake (see _start_tls)
            super().connection_made(transport)
            return
        raw = self._raw = cast(asyncio.Transport, transport)  # a server's stream transport
        peer = raw.get_extra_info("peername")
        self.address = str(peer[0]) if peer else ""
        self.client = client_key(self.address)
        why = self.port.admit(self)
        if why is not None:
            if self.tls is None:  # a TLS client would read plain text as a broken handshake
                raw.write(_canned(503, "Service Unavailable", f"busy: {why}; try again"))
            raw.close()
            return
        self._admitted = True
        _read_in_chunks(raw)
        self._begin_head()
        if self.tls is None:
            super().connection_made(raw)
        else:
            why = self.port.start_handshake(self)
            if why is not None:
                self._released()
                raw.abort()
                return
            self._handshake = self._loop.create_task(self._start_tls(raw, self.tls))
            self._handshake.add_done_callback(self._handshake_done)

    async def _start_tls(self, transport: asyncio.Transport, tls: ssl.SSLContext) -> None:
        try:
            secure = await self._loop.start_tls(transport, self, tls, server_side=True,
                                                ssl_handshake_timeout=HEADER_SECONDS)
        except (OSError, RuntimeError, asyncio.TimeoutError,  # ssl.SSLError is OSError
                asyncio.CancelledError) as exc:  # (cancelled: the connection ended, _released)
            log.debug("connection from %s ended: the TLS handshake failed (%s)", self.address,
                      exc)
            _forget_traceback(exc)
            transport.abort()
            self._released()
            return
        finally:
            self.port.handshakes.pop(self, None)
            self.port.handshakes_ended += 1
            self.port.last_handshake_end = self._loop.time()
        if secure is None or transport.is_closing():
            self._released()
            return
        _read_in_chunks(getattr(secure, "_ssl_protocol", None))
        self.connection_made(secure)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._released()
        super().connection_lost(exc)

    def _handshake_done(self, task: asyncio.Task[None]) -> None:
        self._handshake = None  # the task, its frame and what it awaited are freed with it

    def _released(self) -> None:
        # A handshake still under way when its connection ends (evicted, cut, the client
        # gone) is cancelled: otherwise its task, asyncio's SSL protocol, the SSL object and
        # the timer of its timeout hold one another in a cycle that only a full garbage
        # collection frees, and the allocator keeps what it freed late (2 GB seen from
        # handshakes churned from many addresses)
        task = self._handshake
        if task is not None and not task.done():
            task.cancel()
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

    # asyncio's protocol returns whether to keep the transport (aiohttp's annotation: None)
    def eof_received(self) -> bool | None:  # type: ignore[override]
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
        elif not resp.prepared and (self.port.draining or
                                    self.port.is_crowded(self.client, self._loop.time())):
            # shutting down, or others wait for room: the client's next request comes on a
            # new connection (a close it is told of, never one that races its next request)
            resp.force_close()
        self._content = None
        answer = await super().finish_response(request, resp, start_time)
        if self.transport is None or self.state in ("closing", "closed"):
            return answer
        self.served += 1
        if resp.keep_alive:
            self.state = "idle"
            self.idle_since = self._loop.time()
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
        transport = cast("asyncio.Transport | None", self.transport) or self._raw
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

    def answered(self) -> bool:
        """Its closing answer has left this process (nothing of it is waiting to be sent)."""
        transport = cast("asyncio.Transport | None", self.transport) or self._raw
        return transport is None or transport.get_write_buffer_size() == 0

    def _abort(self) -> None:
        self.state = "closed"
        transport = cast("asyncio.Transport | None", self.transport) or self._raw
        if transport is not None:
            transport.abort()

    def reclaim(self) -> bool:
        """Close this idle connection to make room, if it has been idle RECLAIM_IDLE_SECONDS
        and no request has just arrived on it (bytes waiting to be read): its client
        reconnects on its next request."""
        if self.state != "idle" or \
                self._loop.time() - self.idle_since < RECLAIM_IDLE_SECONDS or \
                self._pending_input():
            return False
        self.state = "closed"
        self._released()  # its room is free now, so its descriptor must be too
        self._drop()
        return True

    def evict(self) -> None:
        """Close this connection, which is still sending headers, to make room."""
        self.state = "closed"
        self._released()
        if self.tls is None and self._raw is not None:
            self._raw.write(_canned(503, "Service Unavailable", f"busy: the {self.port.name} "
                                    "port is full and this connection had sent the least for "
                                    "its age"))
        self._drop()

    def _drop(self) -> None:
        """Close at once: a TLS close waits up to 30 s for the peer's close_notify, holding a
        descriptor the port no longer counts, so a TLS connection is cut."""
        if self._raw is None:
            return
        if self.tls is None:
            self._raw.close()
        else:
            self._raw.abort()

    def _pending_input(self) -> bool:
        transport = self._raw or self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
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


@functools.cache
def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to ask
        return None


def trim_allocator() -> None:
    """Give the C allocator's free memory back to the system, where it is glibc."""
    trim = _libc_trim()
    if trim is not None:
        trim(0)


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
