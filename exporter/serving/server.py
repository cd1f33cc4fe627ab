"""HTTP: each address (the web port, the ingest port) is served by aiohttp's low-level server
on an asyncio event loop in a thread of its own. What a port serves is
exporter.serving.routes; its connections and their limits, exporter.serving.connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from exporter.serving.connections import (
    LISTEN_BACKLOG,
    SHUTDOWN_GRACE_SECONDS,
    SWEEP_SECONDS,
    Connection,
    Port,
    connection_caps,
)
from exporter.serving.routes import Site

log = logging.getLogger(__name__)

BLOCKING_THREADS = 4  # per port, for calls that may wait (?fresh=1, a status build)
GIL_SWITCH_SECONDS = 0.001  # the daemon's sys.setswitchinterval (bench/RESULTS.md says why)
GC_YOUNG_THRESHOLD = 7000  # the daemon's first garbage-collection threshold (Python's: 700)


class Server:
    """One listening address served by aiohttp on an event loop in a thread of its own
    (:func:`serve_in_thread`). Bound when made, so that a port in use or a bad certificate
    is an error at start."""

    def __init__(self, sock: socket.socket,
                 site: Callable[[Port, concurrent.futures.Executor], Site],
                 tls: ssl.SSLContext | None, name: str) -> None:
        self.socket = sock
        self.address = sock.getsockname()
        self._tls = tls
        self._site = site
        self.name = name
        per_port, per_address = connection_caps()
        self.port = Port(name, per_port, per_address)
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
            lambda: Connection(self.port, aio, loop, self._tls), sock=self.socket,
            backlog=LISTEN_BACKLOG)

    def shutdown(self, grace: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Stop serving: accept no more connections, answer the requests already in (within
        ``grace`` seconds, each answer with ``Connection: close``), close the rest; the loop
        ends."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def stop() -> None:
            try:
                self._aio.close()  # the listening socket: new connections are refused
                cut = await self.port.drain(grace)
                if cut:
                    log.warning("shutting down: %d request(s) on the %s port were not "
                                "answered within %.0f s", cut, self.name, grace)
            finally:
                loop.stop()

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(stop(), loop)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=grace + 10)
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


def make_server(host: str, port: int, handler: type[Site], *serves: Any,
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
    make: Callable[..., Site] = handler  # each site takes what it serves, then the port's
    return Server(sock, lambda p, pool: make(*serves, p, pool), context, handler.name)


def serve_in_thread(server: Server, name: str) -> threading.Thread:
    """Serve ``server`` from a thread named ``name``; returns once it listens."""
    t = threading.Thread(target=server.run, name=name, daemon=True)
    server._thread = t
    t.start()
    server._started.wait(10)
    return t
