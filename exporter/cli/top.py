"""`gputrain-exporter top`: the node's GPUs, runs and verdicts in the terminal, live.

It reads a daemon's ``/api/v1/status`` (the metrics address; read-only, no token) once a second
and draws it with rich (the ``top`` extra: tables, bars and colour, redrawn in place). ``--once``
prints one frame and exits, for scripts and tests.

Exit status: 0 after a frame (or Ctrl-C); 2 when the daemon cannot be read or rich is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import requests

from exporter.heuristics.verdict import percent
from exporter.protocol import DEFAULT_METRICS_PORT, STEP_PARTS
from exporter.serving.stacks import summary_lines
from exporter.serving.status import STATUS_PATH
from exporter.terminal import check_url, connection_error, printable, printable_doc

DEFAULT_URL = f"http://localhost:{DEFAULT_METRICS_PORT}"
TIMEOUT_SECONDS = 3.0


class Unreachable(Exception):
    """The daemon did not answer with a status document; the message says why."""


def fetch(url: str, session: requests.Session | None = None) -> dict[str, Any]:
    """The status document of the daemon at ``url`` (its metrics address)."""
    target = url.rstrip("/") + STATUS_PATH
    try:
        r = (session or requests).get(target, timeout=TIMEOUT_SECONDS)
    except requests.RequestException as exc:
        raise Unreachable(f"cannot read {target}: {connection_error(exc, url)}; is the "
                          "daemon running, and is --url its metrics address (port "
                          f"{DEFAULT_METRICS_PORT} by default)?") from None
    if r.status_code != 200:
        raise Unreachable(f"{target} answered HTTP {r.status_code}: is it a gputrain-exporter "
                          "0.1 or newer, on its metrics address (not the ingest one)?")
    try:
        doc = r.json()
    except ValueError:
        raise Unreachable(f"{target} did not answer JSON") from None
    if not isinstance(doc, dict) or doc.get("version") != 1:
        raise Unreachable(f"{target} answered a status document this top cannot read "
                          f"(version {doc.get('version') if isinstance(doc, dict) else '?'})")
    return printable_doc(doc)  # names and reasons come from the network


def _memory(rank: dict[str, Any]) -> str:
    """A rank's process-tree memory as the leak rule judges it: PSS, else RSS (said so)."""
    if rank.get("memory_bytes") is None:
        return "n/a"
    measure = " PSS" if rank.get("memory_measure") == "pss" else " RSS (no PSS)"
    return _bytes(rank["memory_bytes"]) + measure


def _bytes(x: float | None) -> str:
    if x is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return ""


def _ago(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s < 90:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def _num(x: float | None, fmt: str = ".1f", scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None else f"{x * scale:{fmt}}{unit}"


def frame(doc: dict[str, Any], error: str | None = None, width: int = 80) -> Any:
    """One screen of ``top`` as a rich renderable, laid out for ``width`` columns."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    # the document's bands: a busy ratio is coloured as the alerts judge it
    bands = doc.get("bands", {}).get("busy", {"low": 0.5, "target": 0.9})

    def bar(ratio: float | None, label: str, good_high: bool = False, cells: int = 10) -> Text:
        r = 0.0 if ratio is None else max(0.0, min(1.0, ratio))
        filled = round(r * cells)
        style = "grey50"
        if good_high and ratio is not None:
            style = "green" if r >= bands["target"] else "yellow" if r >= bands["low"] \
                else "red"
        if not cells:
            return Text(label, style=style if good_high else "")
        return Text.assemble(("█" * filled, style), ("░" * (cells - filled), "grey23"),
                             f" {label}")

    seen = min(doc["seconds_seen"], doc["window_seconds"])
    head = Text.assemble(
        ("gputrain-exporter", "bold"), f" on {doc['instance']} · {doc['backend']} backend",
        f", driver {doc['driver_version']}" if doc.get("driver_version") else "",
        f" · verdicts over the last {_ago(seen)} · "
        f"{time.strftime('%H:%M:%S', time.localtime(doc['time']))}")
    parts: list[Any] = [head]
    if error:
        parts.append(Text(f"{error}; showing the last answer", style="bold red"))
    for f in doc.get("faults", []):  # they outrank every run's verdict
        where = "node" if f["gpu"] is None else f"GPU {f['gpu']}"
        parts.append(Text.assemble(
            (f"{where}: {f['summary']} ", "bold red" if f["severity"] == "critical"
             else "bold yellow"), (f"{f['verdict']} · {f['severity']}: {f['reason']}", "grey70"),
            ("  What to do: ", "bold"), f["advice"]))

    narrow = width < 120  # short bars: the numbers beside them are what counts
    gpu_rows = []
    for g in doc["gpus"]:
        name = (g["name"] or "").removeprefix("NVIDIA ")
        users = gpu_users(g) or "no run pushes here"
        if not g["up"]:
            gpu_rows.append([g["gpu"], name, Text("lost", style="bold red"), "", "", "", "", "",
                             "", Text(f"does not answer NVML; {users}", style="red")])
            continue
        mem = (g["memory_used_bytes"] / g["memory_total_bytes"]
               if g["memory_total_bytes"] and g["memory_used_bytes"] is not None else None)
        power = (g["power_watts"] / g["power_limit_watts"]
                 if g["power_limit_watts"] and g["power_watts"] is not None else None)
        small = 0 if narrow else 6
        gpu_rows.append([
            g["gpu"], name, bar(g["busy"], percent(g["busy"]), True, 5 if narrow else 10),
            bar(g["sm_active"], percent(g["sm_active"]), True, small),
            bar(g["tensor_active"], percent(g["tensor_active"]), False, small),
            bar(mem, f"{_bytes(g['memory_used_bytes'])}", False, small),
            bar(power, _num(g["power_watts"], ".0f", unit=" W"), False, small),
            f"{_bytes(g['pcie_rx_bytes_per_second'])}/s / "
            f"{_bytes(g['pcie_tx_bytes_per_second'])}/s",
            _num(g["temperature_celsius"], ".0f", unit=" °C"), users])
    gpus = fitted(GPU_COLUMNS, gpu_rows, width)
    if doc["gpus"]:
        parts.append(gpus)
    else:
        why = doc.get("gpu_error")
        parts.append(Text(f"No GPU can be read: {why}. Host metrics only." if why
                          else "No GPU.", style="yellow"))

    h = doc["host"]
    parts.append(Text(
        f"node: CPU {percent(h['cpu_busy'])} busy (iowait {percent(h['iowait'])}"
        f"{', ' + str(h['cpus']) + ' CPUs' if h.get('cpus') else ''}) · memory "
        f"{_bytes(h['memory_available'])} available of {_bytes(h['memory_total_bytes'])} · "
        f"disk read {_bytes(h['disk_read_bytes_per_second'])}/s, busiest "
        f"{percent(h['disk_busy'])} · network receive "
        f"{_bytes(h['network_received_bytes_per_second'])}/s, busiest link "
        f"{percent(h['network_rx_used'])}", style="grey70"))

    if not doc["runs"]:
        parts.append(Text("No training run is pushing to this daemon.", style="grey70"))
    colour = {"fault": "red", "bottleneck": "red", "underutilized": "yellow", "ok": "green",
              "no-gpu-data": "grey50", "stopped": "grey50", "finished": "grey50",
              "hung": "red", "failed": "red"}
    for run in doc["runs"]:
        body: list[Any] = []
        for v in run["verdicts"]:
            ranks = f" (rank {', '.join(v['ranks'])})" if len(run["ranks"]) > 1 else ""
            body.append(Text.assemble((v["summary"], f"bold {colour[v['status']]}"),
                                      (f" {v['verdict']}{ranks}", "grey50")))
            also = f"; also found: {', '.join(v['also'])}" if v["also"] else ""
            body.append(Text(f"  {v['reason']}{also}", style="grey70"))
            body.append(Text.assemble(("  What to change: ", "bold"), v["advice"]))
        body.append(Text(
            f"samples/s {_num(run['samples_per_second'])} · MFU {percent(run['mfu'])} · "
            f"goodput {percent(run['goodput'])} · GPUs idle {_num(run['gpus_idle'], '.2f')}",
            style="grey70"))
        if run.get("hang"):
            body.append(Text(f"hung: {run['hang']}", style="bold red"))
        if run.get("partial"):
            body.append(Text(f"partly visible: {run['partial']}", style="grey50"))
        rank_rows = []
        for r in run["ranks"]:
            push = _ago(r["seconds_since_push"]) + " ago"
            if r.get("failed"):
                detail = f" ({r['exit_detail']})" if r.get("exit_detail") else ""
                last = Text(f"failed {push}{detail}", style="bold red")
            elif r.get("finished"):
                last = Text(f"finished {push}", style="grey50")
            else:
                last = Text(push) if r["pushing"] else Text(f"stopped pushing {push}",
                                                            style="bold red")
            rank_rows.append([
                r["rank"], _num(r["samples_per_second"]),
                _num(r["step_seconds"], ".1f", 1000, " ms"), percent(r["data_wait_ratio"]),
                percent(r.get("comm_exposed_ratio")), percent(r["mfu"]), _memory(r),
                gpu_names(r["gpus"], doc["gpus"]), r["verdict"], last_step(r), last])
        # inside the run's panel: its border and padding take four columns
        ranks = fitted(RANK_COLUMNS, rank_rows, width - 4)
        body.append(ranks)
        for r in run["ranks"]:  # beside the verdict: what py-spy saw the rank run lately
            for line in stacks_lines(r):
                body.append(Text(line, style="grey70"))
        parts.append(Panel(Group(*body), title=Text(f"run {run['run']}"), title_align="left",
                           border_style=colour[run["status"]]))
    for p in doc.get("profiles", [])[:3]:  # the last profiles asked for (newest first)
        parts.append(Text(f"profile {p['id']} of {p['run']}/{p['rank']}: {profile_line(p)}",
                          style="red" if p["state"] in ("failed", "expired") else "grey70"))
    return Group(*parts)


# Each table's columns: (header, the order it is dropped in when the frame is too narrow; 0:
# never, as a GPU's index and the numbers a verdict rests on)
GPU_COLUMNS = (("GPU", 0), ("Name", 4), ("Busy", 0), ("SM", 5), ("Tensor", 8), ("Memory", 3),
               ("Power", 7), ("PCIe RX/TX", 6), ("Temp", 2), ("Used by", 0))
RANK_COLUMNS = (("rank", 0), ("samples/s", 0), ("step", 3), ("data wait", 0), ("comm wait", 5),
                ("MFU", 4), ("memory", 6), ("GPUs", 2), ("verdict", 0), ("last step", 0),
                ("last push", 1))


def last_step(r: dict[str, Any]) -> str:
    """The step in progress as the page shows it: since the rank's last step, what holds it
    (a declared phase, or where a hang's stacks found it)."""
    if r.get("finished") or r.get("failed"):
        return "-"
    phases = r.get("phase_in_progress") or {}
    if phases:
        name, seconds = next(iter(phases.items()))
        return f"in {name} {_ago(seconds)}"
    open_s = r.get("step_in_progress_seconds")
    if open_s is None:
        since = r.get("seconds_since_step")
        return "n/a" if since is None else f"{_ago(since)} ago"
    where = f" · {r['location']} in {r['location_function']}" if r.get("location") else ""
    return f"step open {_ago(open_s)}{where}"
GAP = 2  # columns between two cells of a table
PIPE_COLUMNS = 160  # into a pipe without COLUMNS
FOLDED = 16  # the last column folds its text: it needs this much


def fitted(columns: tuple[tuple[str, int], ...], rows: list[list[Any]], width: int) -> Any:
    """A table of ``rows`` in ``width`` terminal columns: whole columns are dropped, in their
    fixed order, until the rest fits; a cell is never cut short. The last column kept folds
    its text where it alone is too wide."""
    from rich.table import Table
    from rich.text import Text

    # plain text, never markup: names from the network may hold "[link=...]"
    cells = [[Text(c) if isinstance(c, str) else c for c in r] for r in rows]
    wide = [max([len(h)] + [r[i].cell_len for r in cells]) for i, (h, _) in enumerate(columns)]
    keep = list(range(len(columns)))
    def needs(kept: list[int]) -> int:
        folded = min(wide[kept[-1]], FOLDED)
        return sum(wide[k] for k in kept[:-1]) + folded + GAP * (len(kept) - 1)

    for i in sorted(keep, key=lambda i: -columns[i][1]):
        if needs(keep) <= width or not columns[i][1]:
            break
        keep.remove(i)
    table = Table(expand=False, box=None, header_style="bold", pad_edge=False)
    for k in keep:
        last = k == keep[-1]
        table.add_column(columns[k][0], no_wrap=not last, overflow="fold" if last else "ellipsis")
    for r in cells:
        table.add_row(*(r[k] for k in keep))
    return table


def console_width(environ: dict[str, str] | None = None) -> int | None:
    """The width ``top`` lays out for: ``COLUMNS`` when set; else, into a pipe, a wide plain
    frame (160, for logs and scripts), and None in a terminal (rich reads its size)."""
    env = os.environ if environ is None else environ
    try:
        columns = int(env.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    return None if sys.stdout.isatty() else PIPE_COLUMNS


def gpu_users(g: dict[str, Any]) -> str:
    """Who uses a GPU: its ranks, each with its share of the GPU's time where the driver gives
    per-process samples, then the share no rank owns."""
    shares = {(x["run"], x["rank"]): x["busy"] for x in g.get("shares", [])
              if x["run"] is not None}
    parts = [f"{u['run']}/{u['rank']}" + (f" {percent(shares[(u['run'], u['rank'])])}"
                                          if (u["run"], u["rank"]) in shares else "")
             for u in g["ranks"]]
    others = next((x["busy"] for x in g.get("shares", []) if x["run"] is None), None)
    if others:
        parts.append(f"others {percent(others)}")
    return ", ".join(parts)


def gpu_names(gpus: list[dict[str, Any]], known: list[dict[str, Any]]) -> str:
    """A rank's GPUs by name, "GPU 0 (H100 80GB HBM3)": an index alone reads as a count."""
    if not gpus:
        return "none known"
    names = {g["uuid"]: (g.get("name") or "").removeprefix("NVIDIA ") for g in known}
    models = list(dict.fromkeys(n for g in gpus if (n := names.get(g["uuid"]))))
    return ("GPU " if len(gpus) == 1 else "GPUs ") + ", ".join(g["gpu"] for g in gpus) + (
        f" ({', '.join(models)})" if models else "")


def stacks_lines(rank: dict[str, Any]) -> list[str]:
    """A rank's recent py-spy capture (the status document's ``stacks``), in a few lines."""
    s = rank.get("stacks")
    if not s:
        return []
    what = "stacks" if s["mode"] == "record" else "dump"
    return [f"rank {rank['rank']} py-spy {what} {_ago(s['age_seconds'])} ago: {line}"
            for line in s["lines"][:4]]


def profile_line(p: dict[str, Any]) -> str:
    """One profile in a line: where the mean step's time went, or its state; of py-spy
    stacks, the first role's functions or where the main thread is."""
    if p["state"] != "done":
        return p["state"] + (f": {p['error']}" if p.get("error") else "")
    if p.get("kind") == "stacks":
        lines = summary_lines(p)
        return f"py-spy {p['mode']}: {lines[0] if lines else 'nothing'}; file {p['file']}"
    mean = p["mean"]
    seconds = mean.get("seconds") or 0.0
    parts = sorted(STEP_PARTS, key=lambda k: -mean.get(k, 0.0))[:3]
    split = ", ".join(f"{k.replace('_', ' ')} {mean[k] / seconds:.0%}" for k in parts
                      if seconds)
    return f"{_num(seconds, '.1f', 1000, ' ms')} a step: {split}; trace {p['trace']}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="the node's GPUs, runs and verdicts in the terminal, live")
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"the daemon's metrics address (default {DEFAULT_URL}); read-only, no "
                        "token needed")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (1)")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print("gputrain-exporter top: it needs rich: pip install 'gputrain-exporter[top]' "
              "(or pip install rich)", file=sys.stderr)
        return 2
    bad = check_url(ns.url, "--url")
    if bad:
        print(f"gputrain-exporter top: {bad}", file=sys.stderr)
        return 2
    session = requests.Session()
    try:
        doc = fetch(ns.url, session)
    except Unreachable as exc:
        print(printable(f"gputrain-exporter top: {exc}"), file=sys.stderr)
        return 2
    # COLUMNS wide where it is set; a pipe gets a plain frame, a terminal colour
    width = console_width()
    console = Console(width=width) if sys.stdout.isatty() else \
        Console(width=width, color_system=None)
    if ns.once:
        console.print(frame(doc, width=console.width))
        return 0
    interval = max(0.2, ns.interval)
    if not sys.stdout.isatty():  # a pipe or a file: one frame after another, never a screen
        try:
            while True:
                console.print(frame(doc, width=console.width))
                sys.stdout.flush()
                time.sleep(interval)
                try:
                    doc = fetch(ns.url, session)
                except Unreachable as exc:
                    console.print(printable(f"{exc}; showing the last answer"), markup=False)
        except (KeyboardInterrupt, BrokenPipeError):
            return 0
    try:
        with Live(frame(doc, width=console.width), console=console, screen=True,
                  auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                try:
                    doc, error = fetch(ns.url, session), None
                except Unreachable as exc:
                    error = printable(str(exc))
                live.update(frame(doc, error, console.width), refresh=True)
    except KeyboardInterrupt:
        return 0
