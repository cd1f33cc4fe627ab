"""What the command-line tools say when a server cannot be asked: in words, not a library's;
and what they print of strings from a rank or the network: with control characters escaped.

``diagnose`` (Prometheus), ``top`` (the daemon's metrics address) and ``profile`` (its ingest
address) check the URL they were given before they use it, and say why a request failed as a
person would: refused, timed out, no such host, a TLS failure; never urllib3's retry text.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit


def check_url(url: str, flag: str) -> str | None:
    """Why ``url`` (given with ``flag``) cannot be asked, or None when it can."""
    parts = urlsplit(url)
    if "://" not in url:
        return (f"{flag} {url}: give the scheme, as in {flag} http://{url}")
    if parts.scheme not in ("http", "https"):
        return f"{flag} {url}: the scheme must be http:// or https://, not {parts.scheme}://"
    if not parts.hostname:
        return f"{flag} {url}: no host in it"
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return f"{flag} {url}: the port is not a number"
    return None


def ingest_address(url: str, where: str) -> str:
    """The daemon's ingest address from ``url`` (given as ``where``: ``endpoint=``,
    ``GPUTRAIN_URL``, ``--url``), as a base to add ``/api/v1/push`` or
    ``/api/v1/profile`` to; ValueError says exactly what is wrong with it. The push path
    itself is accepted (and dropped); any other path is refused, as the daemon serves none."""
    from exporter.protocol import DEFAULT_INGEST_PORT, PUSH_PATH

    url = url.strip()
    bad = check_url(url, where)
    if bad:
        raise ValueError(f"{bad} (the daemon's ingest address, port {DEFAULT_INGEST_PORT} by "
                         "default)")
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith(PUSH_PATH):
        path = path[:-len(PUSH_PATH)]
    if path or parts.query or parts.fragment:
        base = f"{parts.scheme}://{parts.netloc}"
        raise ValueError(f"{where} {url}: give the daemon's ingest address without a path, as "
                         f"in {base} (the client adds {PUSH_PATH} itself)")
    return f"{parts.scheme}://{parts.netloc}"


def connection_error(exc: BaseException, url: str) -> str:
    """Why a request to ``url`` failed, in words, from a requests exception."""
    import requests

    where = urlsplit(url).netloc or url
    text = str(exc)
    if isinstance(exc, requests.exceptions.SSLError):
        return f"the TLS handshake with {where} failed (is it https, and its certificate trusted?)"
    if isinstance(exc, (requests.exceptions.ConnectTimeout, requests.exceptions.ReadTimeout,
                        requests.exceptions.Timeout)):
        return f"{where} did not answer in time"
    if "Name or service not known" in text or "nodename nor servname" in text or \
            "Temporary failure in name resolution" in text or "No address associated" in text:
        return f"no host named {urlsplit(url).hostname} can be found"
    if "Connection refused" in text:
        return f"nothing listens on {where} (connection refused)"
    if "Connection reset" in text or "RemoteDisconnected" in text or \
            "Connection aborted" in text:
        return f"{where} closed the connection without an answer"
    if "No route to host" in text or "Network is unreachable" in text:
        return f"{where} cannot be reached from here (no route)"
    if isinstance(exc, requests.exceptions.InvalidURL):
        return f"{url} is not a URL that can be asked"
    return f"{where} cannot be reached ({type(exc).__name__})"


# C0 and C1 controls, DEL, Unicode's line separators and bidirectional overrides: what can
# move the cursor, set a title, clear the screen, or make text read other than it is
_CONTROL = "\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_ANY = re.compile(f"[\n{_CONTROL}]")
_ALL_BUT_NEWLINE = re.compile(f"[{_CONTROL}]")


def printable(text: str, newlines: bool = False) -> str:
    """``text`` with every control character written as its escape (``\\x1b``,
    ``\\u202e``), so that a string from a rank or the network cannot drive the terminal;
    ``newlines`` keeps line breaks (a report of several lines)."""
    pattern = _ALL_BUT_NEWLINE if newlines else _ANY
    return pattern.sub(lambda m: ascii(m.group())[1:-1], text)


def printable_doc(doc: Any) -> Any:
    """A JSON document with :func:`printable` applied to every string in it, keys included."""
    if isinstance(doc, str):
        return printable(doc)
    if isinstance(doc, list):
        return [printable_doc(v) for v in doc]
    if isinstance(doc, dict):
        return {printable(k): printable_doc(v) for k, v in doc.items()}
    return doc
