"""What each port serves: /metrics, /healthz, the status page (/) and /api/v1/status on the
web port; the push endpoint, profile requests and Alertmanager's webhook on the ingest port.

A scrape sends the page that exporter.serving.exposition keeps ready (no NVML call, no
rendering), so many Prometheus servers cost little more than one. The connections and their
limits are exporter.serving.connections; the listening, exporter.serving.server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import re
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

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
from exporter.serving.connections import (
    BODY_GRACE_SECONDS,
    MIN_BODY_BYTES_PER_SECOND,
    REQUEST_SECONDS,
    SERVER,
    TEXT_PLAIN,
    Connection,
    Port,
)
from exporter.serving.profiles import FINAL, Profile
from exporter.serving.status import ASSETS, CONTENT_SECURITY_POLICY, STATUS_PATH

if TYPE_CHECKING:
    from exporter.serving.exposition import Exposition
    from exporter.serving.ingest import IngestStore

log = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 5.0  # a GET of a profile may wait this long for it (< REQUEST_SECONDS)
_DIGITS = re.compile(r"[0-9]{1,12}")
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


def _response(code: int, body: bytes, content_type: str = TEXT_PLAIN,
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
    return str(getattr(request.protocol, "address", ""))  # our Connection's


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


class Site:
    """A port's handler: what it serves, the port's accounting and the blocking pool."""

    name: ClassVar[str]

    def __init__(self, healthy: Callable[[], bool], port: Port,
                 pool: concurrent.futures.Executor) -> None:
        self.healthy = healthy
        self.port = port
        self.pool = pool

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called on the port's loop once it listens."""

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request (each port's site says how)."""
        raise NotImplementedError

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


class WebSite(Site):
    """The web port: /metrics, /healthz, the status page and /api/v1/status, from the page
    builder."""

    name = "web"

    def __init__(self, page: Exposition, port: Port, pool: concurrent.futures.Executor) -> None:
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


class IngestSite(Site):
    """The ingest port: pushes, profile requests and Alertmanager's webhook, into the store."""

    name = "ingest"

    def __init__(self, store: IngestStore, healthy: Callable[[], bool], port: Port,
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
        conn: Connection = request.protocol  # type: ignore[assignment]
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
            return exc.status, (str(exc) + "\n").encode(), TEXT_PLAIN
        except Exception:  # a bug: still answer and count it
            log.exception("processing a push failed")
            return 500, b"the daemon failed to process this push; its log says why\n", TEXT_PLAIN
        if state.capabilities:  # a client that reads a JSON answer
            return 200, json.dumps({"result": message, "instructions": instructions}).encode(), \
                "application/json"
        return 200, (message + "\n").encode(), TEXT_PLAIN

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
        conn: Connection = request.protocol  # type: ignore[assignment]
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
            if profile is None or profile.state in FINAL or left <= 0 or self.port.draining:
                return profile  # (shutting down: as it is now)
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
