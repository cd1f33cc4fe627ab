"""`gputrain-exporter profile`: ask a running rank for a torch.profiler trace and print where
its steps' time went; with ``--stacks``, py-spy stacks of its process tree instead.

The daemon queues the request; the rank's client takes it from the answer to its next push,
profiles N steps, writes the trace on its own machine and pushes a summary back, which this
command waits for (``GET /api/v1/profile/<id>?wait=5`` in a loop).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import requests

from exporter.client.pusher import ServerName
from exporter.protocol import (
    DEFAULT_INGEST_PORT,
    DEFAULT_INGEST_URL,
    DEFAULT_PROFILE_STEPS,
    DEFAULT_STACKS_SECONDS,
    MAX_PROFILE_STEPS,
    MAX_STACKS_SECONDS,
    PROFILE_PATH,
    STEP_PARTS,
)
from exporter.serving.stacks import render as render_stacks
from exporter.terminal import connection_error, ingest_address, printable

DEFAULT_URL = DEFAULT_INGEST_URL
TABLE_STEPS = 20  # a profile of more steps prints only its slowest
SLOWEST_STEPS = 10
PART_TITLES = {"data_loading": "data", "forward": "forward", "backward": "backward",
               "optimizer": "optimizer", "other": "other", "idle": "idle"}
PART_WORDS = {"data_loading": "data loading", "forward": "the forward pass",
              "backward": "the backward pass", "optimizer": "the optimizer",
              "other": "other operations", "idle": "idle (no torch operation: Python, waits)"}


class Failed(Exception):
    """The request could not be made or answered; the message says why."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="profile N steps of a running rank with torch.profiler "
                                       "and print where their time went")
    p.add_argument("--run", required=True, help="the run's name (its `run` label)")
    p.add_argument("--rank", help="the rank (default: the run's lowest rank on this node)")
    p.add_argument("--stacks", action="store_true",
                   help="instead of torch.profiler: py-spy samples the rank's process tree "
                        "(main process, DataLoader workers, pin-memory thread, other children) "
                        "for --seconds and prints which functions each spends its time in "
                        "(py-spy in the training environment: gputrain-exporter[stacks])")
    p.add_argument("--dump", action="store_true",
                   help="with --stacks: one dump of every thread of every process of the rank "
                        "instead (where is a stalled rank stuck)")
    p.add_argument("--seconds", type=int, default=DEFAULT_STACKS_SECONDS,
                   help=f"with --stacks: seconds to sample (1-{MAX_STACKS_SECONDS}, default "
                        f"{DEFAULT_STACKS_SECONDS})")
    p.add_argument("--steps", type=int, default=DEFAULT_PROFILE_STEPS,
                   help=f"steps to record after one warm-up step (1-{MAX_PROFILE_STEPS}, "
                        f"default {DEFAULT_PROFILE_STEPS})")
    p.add_argument("--url", default=os.environ.get("GPUTRAIN_URL") or DEFAULT_URL,
                   help=f"the daemon's ingest address (GPUTRAIN_URL, else {DEFAULT_URL})")
    p.add_argument("--token-file", help="file with the ingest token (else GPUTRAIN_TOKEN or "
                                        "GPUTRAIN_TOKEN_FILE)")
    p.add_argument("--ca-file", default=os.environ.get("GPUTRAIN_CA_FILE"),
                   help="CA bundle for an https:// daemon (GPUTRAIN_CA_FILE)")
    p.add_argument("--tls-server-name", default=os.environ.get("GPUTRAIN_TLS_SERVER_NAME"),
                   help="the name to verify the daemon's certificate against where --url is an "
                        "address it does not name, a node IP (GPUTRAIN_TLS_SERVER_NAME)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the result (600)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=main)


def _token(path: str | None) -> str | None:
    path = path or os.environ.get("GPUTRAIN_TOKEN_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read().strip() or None
        except OSError as exc:
            raise Failed(f"cannot read the token file {path}: {exc.strerror}") from None
    return os.environ.get("GPUTRAIN_TOKEN") or None


def _call(session: requests.Session, method: str, url: str, **kwargs: Any
          ) -> tuple[dict[str, Any], float]:
    """The daemon's JSON answer, and the seconds its Retry-After asks to wait (else 0)."""
    try:
        # verify per request: a session's own loses to REQUESTS_CA_BUNDLE in the environment
        r = session.request(method, url, timeout=(3.0, 15.0), verify=session.verify, **kwargs)
    except requests.exceptions.SSLError as exc:
        raise Failed(f"the TLS handshake with {url} failed ({exc.__context__ or exc}); check "
                     "--ca-file and --tls-server-name") from None
    except requests.RequestException as exc:
        raise Failed(f"cannot reach the daemon: {connection_error(exc, url)}; is it running, "
                     f"and is --url its ingest address (port {DEFAULT_INGEST_PORT} by "
                     "default)?") from None
    try:
        doc = r.json()
    except ValueError:
        raise Failed(f"{url} answered {r.status_code} with no JSON: is --url the daemon's "
                     "ingest address?") from None
    if r.status_code == 401:
        given = "Authorization" in session.headers
        raise Failed("the daemon refused the ingest token given (401): check the file of "
                     "--token-file, GPUTRAIN_TOKEN or GPUTRAIN_TOKEN_FILE" if given else
                     "the daemon asks for its ingest token (401): give it with --token-file "
                     "FILE, or set GPUTRAIN_TOKEN or GPUTRAIN_TOKEN_FILE")
    if r.status_code != 200:
        raise Failed(doc.get("error", f"the daemon answered {r.status_code}")
                     if isinstance(doc, dict) else f"the daemon answered {r.status_code}")
    try:
        retry = min(5.0, max(0.0, float(r.headers.get("Retry-After", 0))))
    except ValueError:
        retry = 1.0
    return doc, retry


def ask(url: str, run: str, rank: str | None, steps: int, timeout: float,
        token: str | None = None, ca_file: str | None = None,
        progress: Any = None, server_name: str | None = None,
        stacks: str | None = None, seconds: int = DEFAULT_STACKS_SECONDS) -> dict[str, Any]:
    """Ask for a profile and wait for it: the daemon's final document of it (state done,
    failed or expired), or the last one seen after ``timeout`` seconds. Raises Failed."""
    session = requests.Session()
    session.headers["Content-Type"] = "application/json"
    if token:
        session.headers["Authorization"] = f"Bearer {token}"
    if ca_file:
        session.verify = ca_file
    if server_name:
        session.mount("https://", ServerName(server_name))
    base = url.rstrip("/") + PROFILE_PATH
    body: dict[str, Any] = {"run": run, "steps": steps}
    if rank is not None:
        body["rank"] = rank
    if stacks is not None:
        body.update(stacks=stacks, seconds=seconds)
    doc, retry = _call(session, "POST", base, data=json.dumps(body))
    deadline = time.monotonic() + timeout
    seen = None
    while True:
        if progress is not None and doc["state"] != seen:
            seen = doc["state"]
            progress(doc)
        if doc["state"] in ("done", "failed", "expired") or time.monotonic() >= deadline:
            return doc
        # answered without waiting (the daemon holds as many long-polls as it allows)
        time.sleep(min(retry, max(0.0, deadline - time.monotonic())))
        wait = max(0.1, min(5.0, deadline - time.monotonic()))
        doc, retry = _call(session, "GET", f"{base}/{doc['id']}?wait={wait:.1f}")


def _progress(doc: dict[str, Any]) -> None:
    words = {"queued": "queued; the rank takes it with its next push",
             "accepted": "taken by the rank; it starts at its next step",
             "running": f"recording {doc['steps']} steps after one warm-up step"
             if doc.get("kind", "torch") == "torch" else
             f"py-spy samples its processes for {doc['seconds']} s"
             if doc.get("mode") == "record" else "py-spy dumps every thread"}
    if doc["state"] in words:
        print(printable(f"profile {doc['id']} of run {doc['run']} rank {doc['rank']}: "
                        f"{words[doc['state']]}"), file=sys.stderr)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(doc: dict[str, Any]) -> str:
    """A finished profile as text: the trace, each step's parts, the top operators."""
    trigger = "you" if doc["trigger"] == "cli" else f"the alert {doc['trigger'][6:]}"
    lines = [f"Profile {doc['id']}: run {doc['run']}, rank {doc['rank']}, "
             f"{len(doc['step_parts'])} steps on the {doc['device'].upper()}, asked for by "
             f"{trigger}",
             f"Trace: {doc['trace']} ({_size(doc['trace_bytes'])}; on the rank's machine: open "
             "it in https://ui.perfetto.dev or TensorBoard's profiler)", ""]
    gpu = all("gpu_busy" in s for s in doc["step_parts"]) and doc["step_parts"]
    head = ["step", "total", *(PART_TITLES[p] for p in STEP_PARTS)] + (["GPU busy"] if gpu
                                                                        else [])
    rows = list(enumerate(doc["step_parts"], 1))
    if len(rows) > TABLE_STEPS:  # a long profile: its slowest steps are the ones to look at
        slowest = sorted(rows, key=lambda r: r[1]["seconds"])[-SLOWEST_STEPS:]
        rows = sorted(slowest, key=lambda r: r[0])
        lines.append(f"Where the {SLOWEST_STEPS} slowest of the {len(doc['step_parts'])} "
                     "steps' time went (ms; --json has every step):")
    else:
        lines.append("Where each step's time went (ms):")
    lines.append("  " + "".join(f"{h:>10}" for h in head))
    named = [(str(i), s) for i, s in rows] + [("mean", doc["mean"])]
    for name, s in named:
        cells = [name, f"{s['seconds'] * 1e3:.1f}",
                 *(f"{s[p] * 1e3:.1f}" for p in STEP_PARTS)]
        if gpu:
            cells.append(f"{s['gpu_busy'] * 1e3:.1f}")
        lines.append("  " + "".join(f"{c:>10}" for c in cells))
    mean = doc["mean"]
    if mean.get("seconds"):
        top = max(STEP_PARTS, key=lambda p: mean[p])
        lines.append(f"Most of a step: {PART_WORDS[top]}, "
                     f"{mean[top] / mean['seconds']:.0%} of it." + (
                         f" The GPU was busy {mean['gpu_busy'] / mean['seconds']:.0%} of "
                         "the step." if gpu else ""))
    if doc["top_ops"]:
        device = any(op["self_device_seconds"] > 0 for op in doc["top_ops"])
        key = "self_device_seconds" if device else "self_cpu_seconds"
        lines += ["", f"Top operators by self {'GPU' if device else 'CPU'} time "
                      f"(over the {len(doc['step_parts'])} steps):",
                  f"  {'self ms':>10}{'calls':>8}  name"]
        for op in doc["top_ops"]:
            lines.append(f"  {op[key] * 1e3:>10.1f}{op['calls']:>8}  {op['name']}")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    if ns.dump and not ns.stacks:
        print("gputrain-exporter profile: --dump goes with --stacks", file=sys.stderr)
        return 2
    if ns.stacks and not 1 <= ns.seconds <= MAX_STACKS_SECONDS:
        print(f"gputrain-exporter profile: --seconds must be 1-{MAX_STACKS_SECONDS}",
              file=sys.stderr)
        return 2
    if not 1 <= ns.steps <= MAX_PROFILE_STEPS:
        print(f"gputrain-exporter profile: --steps must be 1-{MAX_PROFILE_STEPS}",
              file=sys.stderr)
        return 2
    try:
        ns.url = ingest_address(ns.url, "--url")
    except ValueError as exc:
        print(printable(f"gputrain-exporter profile: {exc}"), file=sys.stderr)
        return 2
    try:
        doc = ask(ns.url, ns.run, ns.rank, ns.steps, ns.timeout, _token(ns.token_file),
                  ns.ca_file, None if ns.json else _progress, ns.tls_server_name,
                  ("dump" if ns.dump else "record") if ns.stacks else None, ns.seconds)
    except Failed as exc:
        print(printable(f"gputrain-exporter profile: {exc}"), file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(doc, indent=2))  # ASCII: every control character escaped
    elif doc["state"] == "done":
        text = render_stacks(doc) if doc.get("kind") == "stacks" else render(doc)
        print(printable(text, newlines=True))
    if doc["state"] == "done":
        return 0
    if not ns.json:
        if doc["state"] in ("failed", "expired"):
            print(printable(f"gputrain-exporter profile: {doc['id']} {doc['state']}: "
                            f"{doc.get('error')}"), file=sys.stderr)
        else:
            print(printable(f"gputrain-exporter profile: {doc['id']} still {doc['state']} "
                            f"after {ns.timeout:.0f} s; ask again with GET "
                            f"{ns.url.rstrip('/')}{PROFILE_PATH}/{doc['id']}"), file=sys.stderr)
    return 1
