"""`gputrain-exporter diagnose`: ask Prometheus what starves each run's GPUs.

For every (run, rank) it reads samples/s, step time, data-wait ratio, phases, the busy / SM /
tensor / memory / power / PCIe ratios of the rank's GPUs (joined through
``gputrain_training_gpu_info``) and the node's CPU, disk and network, then follows the decision
order of the catalogue to one verdict with its advice. It works against any layer: it queries
the raw metrics where they exist (so the recording rules need not be loaded), else the
recording rules' results (a global VictoriaMetrics or Thanos fed only those). It says when a
run's ranks are only partly visible: ranks missing below the highest one it sees, or a
Prometheus with external labels that remote-writes (a shard). Thresholds and the labels that
identify a run (``run_labels``) come from the same file as ``gputrain-exporter rules --config``.

The verdicts come from :mod:`exporter.heuristics.verdict`, the decision order written once: the
daemon's own view (``/``, ``/api/v1/status``, ``top``) judges its history with the same code.

Exit status: 0 nothing to act on (every rank ``ok``); 1 a rank has a bottleneck, or its GPUs are
under-used with no stage to blame; 2 Prometheus unreachable or without gputrain data; 3 no
bottleneck, but a rank whose GPUs the exporter does not know (``no-gpu-data``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import requests
import yaml

from exporter.config import parse_duration
from exporter.heuristics.catalogue import BY_VERDICT
from exporter.heuristics.promql import (
    Identity,
    collector_age,
    identity,
    inline,
    memory_outside,
    new_errors,
    recording_rules,
    restarts,
    tree_growth,
)
from exporter.heuristics.readings import (
    BY_FIELD,
    LEAK_SPANS,
    READINGS,
    REFINED,
    WINDOWS,
    of_scope,
    series_of,
)
from exporter.heuristics.rules import load_overrides, settings
from exporter.heuristics.verdict import (
    GpuReading,
    NodeReport,
    RankReport,
    judge,
    mean,
    node_findings,
    percent,
    rank_order,
    run_key,
    visibility,
    wasted_gpus,
)
from exporter.terminal import check_url, connection_error, printable


class PrometheusError(Exception):
    """Prometheus could not be reached or answered with an error."""


class Prometheus:
    """The few calls of the HTTP API this command needs."""

    def __init__(self, url: str, timeout: float = 10.0, at: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.at = at  # evaluate at this time (unix seconds or RFC 3339), else now
        self.session = requests.Session()

    def external_labels(self) -> tuple[dict[str, str], bool]:
        """This server's external labels and whether it remote-writes: a shard has both.
        ({}, False) where the server does not say (VictoriaMetrics, an old Prometheus)."""
        try:
            r = self.session.get(f"{self.url}/api/v1/status/config", timeout=self.timeout)
            config = yaml.safe_load(r.json()["data"]["yaml"]) or {}
        except (requests.RequestException, ValueError, KeyError, TypeError, yaml.YAMLError):
            return {}, False
        labels = (config.get("global") or {}).get("external_labels") or {}
        return {str(k): str(v) for k, v in labels.items()}, bool(config.get("remote_write"))

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        try:
            params = {"query": expr, **({"time": self.at} if self.at else {})}
            r = self.session.get(f"{self.url}/api/v1/query", params=params,
                                 timeout=self.timeout)
        except requests.RequestException as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: "
                                  f"{connection_error(exc, self.url)}") from None
        try:
            body = r.json()
        except ValueError:
            raise PrometheusError(f"{self.url} answered HTTP {r.status_code} without JSON: "
                                  "is it a Prometheus server?") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus rejected the query {expr!r}: "
                                  f"{body.get('error', body)}")
        out = []
        for item in body["data"]["result"]:
            value = float(item["value"][1])
            if value == value:  # NaN (0/0) means "no activity", not a reading
                out.append((item["metric"], value))
        return out


def _as_ages(q: dict[str, str]) -> None:
    """The readings that are a unix time in their series (``Reading.since``) read as the
    seconds since it."""
    for x in READINGS:
        if x.since:
            q[x.field] = f"time() - {q[x.field]}"


def queries(selector: str, window: str, ids: Identity | None = None) -> dict[str, str]:
    """The PromQL this command runs on the raw series, by name: the recording rules' own
    expressions written inline (their ratios over ``window``), so it needs no rules loaded."""
    ids = ids or Identity()
    records = recording_rules(selector, ids, rate=window)
    s, r = selector, ids.rank
    q = {name: inline(record, records) for name, record in RECORDED.items()}
    # every rank that exports anything (a rank that never stepped too)
    q["ranks"] = f'group by ({r}) ({{__name__=~"gputrain_training_.+", {s}}})'
    _as_ages(q)
    pss = f"gputrain_training_process_proportional_memory_bytes{{{s}}}"
    rss = f"gputrain_training_process_resident_memory_bytes{{{s}}}"
    available = f"gputrain_host_memory_available_bytes{{{s}}}"
    # one process's memory, as the leak alert reads it: none across a restart in the window
    restarted = (f"unless on ({r}) (resets(gputrain_training_steps_total{{{s}}}"
                 f"[{WINDOWS['leak']}]) > 0)")
    for span, (w, o) in LEAK_SPANS.items():
        growth = tree_growth(pss, rss, w, o)
        q[f"rss_growth_{span}"] = f"sum by ({r}) ({growth}) {restarted}"
        q[f"memory_outside_growth_{span}"] = memory_outside(available, growth, ids, w, o)
    # which memory the tree's growth is of: PSS where pushed, else RSS
    q["memory_measure"] = (f'label_replace(max by ({r}) ({pss}), "measure", "pss", "", "") or '
                           f'label_replace(max by ({r}) ({rss}) unless on ({r}) {pss}, '
                           f'"measure", "rss", "", "")')
    # its process replaced: over the crash-loop rule's hour, and inside the rate window
    q["restarts"] = restarts(s, ids, WINDOWS["restart"])
    q["restarts_recent"] = restarts(s, ids, window)
    # a refinement's reading at its highest over the hold range: its hysteresis
    for name, record in REFINED.items():
        q[f"{name}_peak"] = inline(f"max_over_time({record}[{WINDOWS['hold']}])", records)
    return q


def fault_queries(selector: str, ids: Identity, window: str) -> dict[str, str]:
    """What the fault alerts read, per node (``up``, failing collectors) and per GPU (lost,
    Xid and ECC errors, row remaps), from the raw series: they are read on the layer that
    scrapes the node (a global layer fed only recorded series has none of them)."""
    s, node, gpu, fault = selector, ids.node, ids.gpu, WINDOWS["fault"]
    records = recording_rules(selector, ids, rate=window)
    ecc = f'gputrain_gpu_ecc_errors_total{{{s},type="uncorrected"}}'
    xid = f"gputrain_gpu_xid_errors_total{{{s}}}"
    return {
        "exporter_up": f"max by ({node}) (up{{{s}}})",
        "collectors": f"max by ({node}, collector) (gputrain_collector_success{{{s}}})",
        "collector_ages": collector_age(s, ids),
        "up": f"max by ({gpu}) (gputrain_gpu_up{{{s}}})",  # every GPU the node has
        "xid_errors": f"sum by ({gpu}) ({new_errors(xid, fault)})",
        "ecc_uncorrected": f"sum by ({gpu}) ({new_errors(ecc, fault)})",
        "remap_failed": f'max by ({gpu}) (gputrain_gpu_remapped_rows{{{s},state="failed"}})',
        "remap_pending": f'max by ({gpu}) (gputrain_gpu_remapped_rows{{{s},state="pending"}} '
                         f"or gputrain_gpu_retired_pages_pending{{{s}}})",
        **{name: inline(BY_FIELD[name].gpu_record, records) for name in NODE_GPU_READINGS},
        # a rank's GPUs, whether or not their other readings exist (a lost one has none)
        "rank_gpus": f"max by ({ids.rank}, gpu, uuid) (gputrain_training_gpu_info{{{s}}})",
    }


# Every reading, as the recording rule that holds it (over 5m): what a layer fed only the
# rules' results (results-only remote-write, federation of `:`-named series) can answer
RECORDED = {"ranks": BY_FIELD["steps_per_second"].record,
            **{name: x.record for x in READINGS for name in x.names}}
# the readings of a node's GPUs the fault and health findings read, whoever uses the GPU
NODE_GPU_READINGS = tuple(x.field for x in READINGS if x.of_node)


def recorded_queries(selector: str, ids: Identity | None = None) -> dict[str, str]:
    """The same readings from the recorded series alone (their 5m windows), by name."""
    ids = ids or Identity()
    q = {name: f"{record}{{{selector}}}" for name, record in RECORDED.items()}
    _as_ages(q)
    tree = f"{series_of('rss_growth')}{{{selector}}}"
    available = f"{series_of('memory_available')}{{{selector}}}"
    for span, (w, o) in LEAK_SPANS.items():
        growth = f"deriv({tree}[{w}]{' offset ' + o if o else ''})"
        q[f"rss_growth_{span}"] = growth
        q[f"memory_outside_growth_{span}"] = memory_outside(available, growth, ids, w, o)
    for name, record in REFINED.items():
        q[f"{name}_peak"] = f"max_over_time({record}{{{selector}}}[{WINDOWS['hold']}])"
    return q


GPU_READINGS = tuple(x.field for x in of_scope("rank_gpu"))
HOST_READINGS = (*(x.field for x in of_scope("node")),
                 *(f"memory_outside_growth_{s}" for s in LEAK_SPANS),
                 *(f"{name}_peak" for name in REFINED))


def _read(prom: Prometheus, raw: str, recorded: str, key) -> tuple[list, set]:
    """The raw query's results, and the recorded query's for every key the raw lacks; with
    the keys answered only from the recorded series. A reading divided by 0 (+-Inf: no step
    time, no samples in the window) is no reading, as the daemon's history reads it
    (:mod:`exporter.heuristics.expr`)."""
    out = prom.query(raw)
    seen = {key(labels) for labels, _ in out}
    filled = set()
    for labels, value in prom.query(recorded):
        k = key(labels)
        if k not in seen:
            seen.add(k)
            filled.add(k)
            out.append((labels, value))
    return [(labels, value) for labels, value in out if math.isfinite(value)], filled


def collect(prom: Prometheus, selector: str, window: str, run: str | None,
            ids: Identity | None = None) -> tuple[list[RankReport], list[NodeReport]]:
    """One report per (run, rank) active in the window, and one per node the selector
    scrapes, readings filled, no verdict yet."""
    ids = ids or Identity()
    q, qr = queries(selector, window, ids), recorded_queries(selector, ids)

    def rank_key(labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(labels.get(k, "") for k in ids.rank_tuple)

    def node_key(labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(labels.get(k, "") for k in ids.node_tuple)

    reports: dict[tuple, RankReport] = {}
    for labels, _ in _read(prom, q["ranks"], qr["ranks"], rank_key)[0]:
        if run is None or labels.get("run") == run:
            reports[rank_key(labels)] = RankReport(
                labels.get("job", ""), labels.get("instance", ""), labels.get("run", ""),
                labels.get("rank", ""), labels={k: labels.get(k, "") for k in ids.extra})
    for name in (name for x in of_scope("rank") if not x.by for name in x.names):
        results, recorded = _read(prom, q[name], qr[name], rank_key)
        for labels, value in results:
            rep = reports.get(rank_key(labels))
            if name == "regime_changed_seconds" and value >= parse_duration(window):
                continue  # an old change: the rate window holds the new regime alone
            if rep:
                # a flag (finished, failed, process_running) is its field's type: a bool
                value = value > 0 if isinstance(getattr(rep, name), bool) else value
                setattr(rep, name, value)
                if name == "steps_per_second" and rank_key(labels) in recorded:
                    rep.source = "recorded"
    for name in ("restarts", "restarts_recent"):  # from the raw counters only
        for labels, value in prom.query(q[name]):
            rep = reports.get(rank_key(labels))
            if rep:
                setattr(rep, name, value)
    for labels, _ in prom.query(q["memory_measure"]):  # the raw series name it
        rep = reports.get(rank_key(labels))
        if rep:
            rep.memory_measure = labels.get("measure")
    for keyed in of_scope("rank"):  # a reading of several values, by a label (phase, cause)
        if keyed.by:
            by = keyed.by
            for labels, value in _read(prom, q[keyed.field], qr[keyed.field],
                                       lambda k, by=by: (*rank_key(k), k.get(by, "")))[0]:
                rep = reports.get(rank_key(labels))
                if rep:
                    getattr(rep, keyed.field)[labels.get(by, "")] = value
                    if keyed.detail:
                        setattr(rep, f"{keyed.field}_detail", labels.get(keyed.detail))
    def gpu_key(labels: dict[str, str]) -> tuple[str, ...]:
        return (*rank_key(labels), labels.get("gpu", ""), labels.get("uuid", ""))

    def reading(rep: RankReport, labels: dict[str, str]) -> GpuReading:
        found = next((x for x in rep.gpus if x.uuid == labels.get("uuid")
                      and x.gpu == labels.get("gpu")), None)
        if found is None:
            found = GpuReading(labels.get("gpu", ""), labels.get("uuid", ""))
            rep.gpus.append(found)
        return found

    for name in GPU_READINGS:
        for labels, value in _read(prom, q[name], qr[name], gpu_key)[0]:
            rep = reports.get(rank_key(labels))
            if rep:
                setattr(reading(rep, labels), name, value)
    by_node: dict[tuple, list[RankReport]] = {}
    for key, rep in reports.items():
        by_node.setdefault(key[:len(ids.node_tuple)], []).append(rep)
    host: dict[tuple, dict[str, float]] = {}
    for name in HOST_READINGS:
        for labels, value in _read(prom, q[name], qr[name], node_key)[0]:
            host.setdefault(node_key(labels), {})[name] = value
            for rep in by_node.get(node_key(labels), []):
                rep.host[name] = value
    nodes = _nodes(prom, selector, ids, window, node_key)
    for key, node in nodes.items():  # a node's own readings (its clock), whoever runs on it
        node.host.update(host.get(key, {}))
    if run is not None:  # the run's nodes, and those it may be on that cannot be scraped
        nodes = {k: n for k, n in nodes.items() if k in by_node or n.up is False}
    for labels, _ in prom.query(fault_queries(selector, ids, window)["rank_gpus"]):
        rep = reports.get(rank_key(labels))
        if rep:
            reading(rep, labels)
    # a run's reading of a GPU (its foreign share) is the same for each of its ranks on it
    run_gpu = [*ids.run_labels, *ids.node_tuple, "gpu", "uuid"]
    for of_run in of_scope("run_gpu"):
        shared = {tuple(labels.get(k, "") for k in run_gpu): value for labels, value in
                  _read(prom, q[of_run.field], qr[of_run.field],
                        lambda x: tuple(x.get(k, "") for k in run_gpu))[0]}
        for rep in reports.values():
            labels = {**rep.labels, "run": rep.run, "job": rep.job, "instance": rep.instance}
            for x in rep.gpus:
                found = shared.get(tuple({**labels, "gpu": x.gpu, "uuid": x.uuid}.get(k, "")
                                         for k in run_gpu))
                if found is not None:
                    setattr(x, of_run.field, found)
    for key, node in nodes.items():  # a rank's GPUs and node carry their faults
        gpus = {(g.gpu, g.uuid): g for g in node.gpus}
        for rep in by_node.get(key, []):
            rep.collectors_failing = list(node.collectors_failing)
            rep.collector_ages = dict(node.collector_ages)
            for x in rep.gpus:
                if (g := gpus.get((x.gpu, x.uuid))) is not None:
                    x.up, x.xid_errors, x.ecc_uncorrected = g.up, g.xid_errors, g.ecc_uncorrected
                    x.remap_failed, x.remap_pending = g.remap_failed, g.remap_pending
    for rep in reports.values():
        rep.gpus.sort(key=lambda x: (len(x.gpu), x.gpu))
    ranks = sorted(reports.values(), key=lambda r: (r.run, sorted(r.labels.items()),
                                                   rank_order(r.rank), r.instance))
    return ranks, sorted(nodes.values(), key=lambda n: (sorted(n.labels.items()), n.job,
                                                         n.instance))


def _nodes(prom: Prometheus, selector: str, ids: Identity, window: str,
           node_key) -> dict[tuple, NodeReport]:
    """Every node the selector scrapes, with its GPUs' fault readings and failing collectors."""
    q = fault_queries(selector, ids, window)
    nodes: dict[tuple, NodeReport] = {}

    def node(labels: dict[str, str]) -> NodeReport:
        key = node_key(labels)
        if key not in nodes:
            nodes[key] = NodeReport(labels.get("job", ""), labels.get("instance", ""),
                                    labels={k: labels.get(k, "") for k in ids.extra})
        return nodes[key]

    for labels, value in prom.query(q["exporter_up"]):
        node(labels).up = value == 1
    for labels, value in prom.query(q["collectors"]):
        if value == 0:
            node(labels).collectors_failing.append(labels.get("collector", ""))
    for labels, value in prom.query(q["collector_ages"]):
        node(labels).collector_ages[labels.get("collector", "")] = value
    gpus: dict[tuple, GpuReading] = {}
    for labels, value in prom.query(q["up"]):
        g = GpuReading(labels.get("gpu", ""), labels.get("uuid", ""), up=value == 1)
        key = (*node_key(labels), g.gpu, g.uuid)
        gpus[key] = g
        node(labels).gpus.append(g)
    for name, convert in (("xid_errors", float),
                          ("ecc_uncorrected", float), ("remap_failed", lambda v: v > 0),
                          ("remap_pending", lambda v: v > 0),
                          *((name, float) for name in NODE_GPU_READINGS)):
        for labels, value in prom.query(q[name]):
            known = gpus.get((*node_key(labels), labels.get("gpu", ""), labels.get("uuid", "")))
            if known is not None:
                setattr(known, name, convert(value))
    for n in nodes.values():
        n.collectors_failing.sort()
        n.gpus.sort(key=lambda x: (len(x.gpu), x.gpu))
    return nodes


def _fmt(x: float | None, scale: float = 100, unit: str = "%", digits: int = 1) -> str:
    if unit == "%" and scale == 100:
        return percent(x)
    return "n/a" if x is None else f"{x * scale:.{digits}f}{unit}"


def node_lines(nodes: list[NodeReport]) -> list[str]:
    """The nodes with a fault or health finding (a lost GPU, Xid or memory errors, a failing
    collector, an exporter Prometheus cannot scrape), whoever uses their GPUs."""
    lines = []
    for n in nodes:
        if not n.findings:
            continue
        where = "".join(f" ({k} {v})" for k, v in sorted(n.labels.items()))
        lines.append(f"== node {n.instance}{where} (job {n.job}): {len(n.findings)} "
                     "finding(s)")
        for gpu, severity, f in n.findings:
            lines.append(f"  {'GPU ' + gpu if gpu else 'node'}: {f.name} ({severity}): "
                         f"{f.reason}")
            lines.append(f"    advice: {f.advice}")
        lines.append("")
    return lines


def daemon_stacks(url: str, timeout: float = 5.0) -> dict[tuple[str, str], dict[str, Any]]:
    """The recent py-spy captures a daemon holds (its ``/api/v1/status``), by (run, rank);
    raises PrometheusError (the caller says it and goes on without them)."""
    try:
        r = requests.get(url.rstrip("/") + "/api/v1/status", timeout=timeout)
        doc = r.json()
        return {(run["run"], rank["rank"]): rank["stacks"] for run in doc["runs"]
                for rank in run["ranks"] if rank.get("stacks")}
    except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
        raise PrometheusError(f"cannot read the daemon's status at {url}: "
                              f"{type(exc).__name__}") from None


def text_report(reports: list[RankReport], window_seconds: float = 300.0,
                nodes: Sequence[NodeReport] = (),
                stacks: dict[tuple[str, str], dict[str, Any]] | None = None) -> str:
    """The human report; ``window_seconds`` turns idle GPU-seconds per second into hours;
    ``stacks``, a daemon's recent py-spy captures by (run, rank), are said under their rank."""
    lines = node_lines(list(nodes))
    last_run = None
    for rep in reports:
        if run_key(rep) != last_run:
            last_run = run_key(rep)
            where = "".join(f" ({k} {v})" for k, v in sorted(rep.labels.items()))
            ranks = [r for r in reports if run_key(r) == last_run]
            lines.append(f"== run {rep.run}{where}: {len(ranks)} rank(s) visible")
            mfu = mean([r.mfu for r in ranks])
            goodput = mean([r.goodput for r in ranks])
            wasted = wasted_gpus(ranks)
            lines.append(
                f"   MFU {_fmt(mfu)}   goodput {_fmt(goodput)}   wasted "
                + ("n/a" if wasted is None else
                   f"{wasted * window_seconds / 3600:.3g} GPU-hours over the window "
                   f"({wasted:.2f} GPUs idle on average)"))
            if rep.partial:
                lines.append(f"   partly visible: {rep.partial}. The straggler comparison "
                             "covers only the ranks seen here.")
            lines.append("")
        source = ", from the recorded series (5m)" if rep.source == "recorded" else ""
        lines.append(f"run {rep.run} rank {rep.rank} on {rep.instance} (job {rep.job}"
                     f"{source}): {rep.status}")
        lines.append(f"  samples/s {_fmt(rep.samples_per_second, 1, '', 1)}   step time "
                     f"{_fmt(rep.step_seconds, 1000, ' ms', 1)}   data wait "
                     f"{_fmt(rep.data_wait_ratio)}   MFU {_fmt(rep.mfu)}")
        if rep.comm_exposed_ratio is not None:
            lines.append(f"  gradient communication {_fmt(rep.comm_ratio)} of each step, "
                         f"{_fmt(rep.comm_exposed_ratio)} exposed (the step waited for it)")
        if rep.goodput is not None:
            lost = ", ".join(f"{cause} {_fmt(v)}" for cause, v in
                             sorted(rep.badput.items(), key=lambda kv: -kv[1]))
            lines.append(f"  goodput {_fmt(rep.goodput)} of wall time; lost to {lost or 'n/a'}")
        for p, v in sorted(rep.phases.items()):
            lines.append(f"  phase {p}: {_fmt(v)} of each step")
        for x in rep.gpus:
            if x.up is False:
                lines.append(f"  GPU {x.gpu} ({x.uuid}): lost, it does not answer NVML")
                continue
            lines.append(f"  GPU {x.gpu} ({x.uuid}): busy {_fmt(x.busy)}  SM {_fmt(x.sm_active)}"
                         f"  tensor {_fmt(x.tensor_active)}  memory {_fmt(x.memory_used)}  "
                         f"power {_fmt(x.power_used)} of limit  PCIe RX "
                         f"{_fmt(x.pcie_rx_used)} of link")
        h = rep.host
        lines.append(f"  node: CPU {_fmt(h.get('cpu_busy'))} busy, iowait "
                     f"{_fmt(h.get('iowait'))}, busiest disk {_fmt(h.get('disk_busy'))}, "
                     f"network RX {_fmt(h.get('network_rx_used'))} of link")
        lines.append(f"  verdict: {rep.verdict} ({rep.reason})")
        lines.append(f"  advice: {rep.advice}")
        for f in rep.also:
            lines.append(f"  also: {f.name} ({f.reason})")
            lines.append(f"    advice: {f.advice}")
        capture = (stacks or {}).get((rep.run, rep.rank))
        if capture:
            what = "stacks" if capture["mode"] == "record" else "dump"
            lines.append(f"  py-spy {what} of the daemon, {capture['age_seconds'] / 60:.0f} "
                         "min ago:")
            lines += [f"    {line}" for line in capture["lines"]]
        lines.append("")
    return "\n".join(lines)


EXIT_OK, EXIT_ACT, EXIT_NO_DATA, EXIT_NO_GPU_DATA = 0, 1, 2, 3


def diagnose(url: str, run: str | None = None, window: str = "5m",
             overrides: dict[str, Any] | None = None, at: str | None = None) -> \
        tuple[list[RankReport], list[NodeReport]]:
    """Reports with verdicts for every (run, rank) in the window ending ``at`` (default now),
    each marked where its run is only partly visible, and every node with its faults; raises
    PrometheusError."""
    cfg = settings(overrides)
    prom = Prometheus(url, at=at)
    prom.query("vector(1)")  # reachable and a Prometheus at all
    reports, nodes = collect(prom, cfg["selector"], window, run, identity(cfg))
    external, remote_writes = prom.external_labels()
    shard = ""
    if external and remote_writes:
        shown = ", ".join(f'{k}="{v}"' for k, v in sorted(external.items()))
        shard = (f"this server has external labels ({shown}) and remote-writes, so it is "
                 "likely one shard of several: ranks scraped by the other shards are missing; "
                 "run diagnose against the layer that sees them all")
    for n in nodes:
        node_findings(n, cfg["thresholds"])
    return judge(visibility(reports, shard), cfg["thresholds"]), nodes


def json_document(reports: list[RankReport], nodes: Sequence[NodeReport],
                  stacks: dict[tuple[str, str], dict[str, Any]] | None = None) -> dict:
    """What ``diagnose --json`` prints: every rank's report (its verdict, findings and
    readings) and every node's faults."""
    stacks = stacks or {}
    return {"ranks": [{**asdict(r), "bottleneck": r.bottleneck, "findings": r.findings(),
                       "stacks": stacks.get((r.run, r.rank))} for r in reports],
            "nodes": [{"job": n.job, "instance": n.instance, "labels": n.labels, "up": n.up,
                       "collectors_failing": n.collectors_failing,
                       "findings": [{"gpu": gpu, "severity": severity, **asdict(f)}
                                    for gpu, severity, f in n.findings]}
                      for n in nodes]}


def _to_act(nodes: Sequence[NodeReport]) -> bool:
    """Whether a node has a finding to act on (a note, its clock off, is said, not acted on)."""
    return any(BY_VERDICT[f.name].kind != "note" for n in nodes for _, _, f in n.findings)


def exit_status(reports: list[RankReport], nodes: Sequence[NodeReport] = ()) -> int:
    """1 when any rank or node has something to act on (a run that stopped without
    finishing too: its job died; a node's note, its clock off, is said but is no fault),
    else 3 when a rank's GPUs are unknown, else 0."""
    if any(r.bottleneck or r.status == "stopped" for r in reports) or _to_act(nodes):
        return EXIT_ACT
    if any(r.status == "no-gpu-data" for r in reports):
        return EXIT_NO_GPU_DATA
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="say what starves each run's GPUs, from Prometheus")
    p.add_argument("--prometheus", metavar="URL", default="http://localhost:9090",
                   help="the Prometheus server that scrapes the exporters "
                        "(default http://localhost:9090)")
    p.add_argument("--run", metavar="NAME", help="only this run")
    p.add_argument("--window", default="5m", help="the range the ratios average over (5m)")
    p.add_argument("--time", metavar="TIME",
                   help="judge the window ending at TIME (unix seconds or RFC 3339), not now")
    p.add_argument("--config", metavar="FILE", help="thresholds file, as for `rules --config`")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--daemon", metavar="URL",
                   help="also say what the recent py-spy captures this daemon holds show of "
                        "each rank (its metrics address, e.g. http://node-1:19400)")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    daemon = getattr(ns, "daemon", None)
    bad = check_url(ns.prometheus, "--prometheus") or (
        check_url(daemon, "--daemon") if daemon else None)
    if bad:
        print(f"gputrain-exporter diagnose: {bad}", file=sys.stderr)
        return EXIT_NO_DATA
    try:
        reports, nodes = diagnose(ns.prometheus, ns.run, ns.window, load_overrides(ns.config),
                                  ns.time)
    except (PrometheusError, ValueError) as exc:
        print(printable(f"gputrain-exporter diagnose: {exc}"), file=sys.stderr)
        return EXIT_NO_DATA
    if not reports:
        what = f"run '{ns.run}'" if ns.run else "gputrain training data"
        down = [n.instance for n in nodes if n.up is False]
        # instances and label values come from Prometheus: escaped before a terminal
        print(printable(f"gputrain-exporter diagnose: Prometheus at {ns.prometheus} holds no "
                        f"{what} in the last {ns.window} (no gputrain_training_* series of a "
                        "run and rank). "
                        + (f"It cannot scrape the exporter on {', '.join(down)}: is it "
                           "running? " if down else "")
                        + "Is it scraping the exporter, and is a training client pushing to "
                        "it?"), file=sys.stderr)
        if not _to_act(nodes):
            return EXIT_NO_DATA
    stacks: dict[tuple[str, str], dict[str, Any]] = {}
    if daemon:
        try:
            stacks = daemon_stacks(daemon)
        except PrometheusError as exc:  # the verdicts stand without the captures
            print(printable(f"gputrain-exporter diagnose: {exc}"), file=sys.stderr)
    if ns.json:
        json.dump(json_document(reports, nodes, stacks), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        # label values come from Prometheus: escaped before the terminal sees them
        sys.stdout.write(printable(text_report(reports, parse_duration(ns.window), nodes,
                                               stacks), newlines=True))
    return exit_status(reports, nodes)
