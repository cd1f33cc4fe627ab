"""The three Grafana dashboards, as code: ``gputrain-exporter dashboards [--config FILE]``
writes them with your thresholds and selector; ``scripts/generate.py`` writes the
committed ``grafana/dashboards/*.json`` and their Kubernetes ConfigMap (a test keeps them equal
to this output).

overview -> run -> node: "which runs waste GPUs" to "why" in two clicks. Every panel uses the
``datasource`` variable; the threshold lines are the catalogue's thresholds
(:mod:`exporter.heuristics.catalogue`), the same the alerts use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from exporter.config import parse_duration
from exporter.heuristics.catalogue import CATALOGUE, derived, show
from exporter.heuristics.promql import (
    COMM_BYTES,
    CPU_CORES,
    ENERGY_PER_SAMPLE,
    RANK_BUSY_AVG,
    WASTED_SECONDS,
    Identity,
    identity,
    new_errors,
)
from exporter.heuristics.readings import READINGS, RUN_GPU_BUSY, UNATTRIBUTED_BUSY
from exporter.heuristics.rules import settings

# the recorded series of each reading, by its field (a GPU's own by gpu:<field>): named in
# readings.READINGS once
R = {x.field: x.record for x in READINGS} | {
    f"gpu:{x.field}": x.gpu_record for x in READINGS if x.scope == "rank_gpu"}

DS = {"type": "prometheus", "uid": "${datasource}"}
TAGS = ["gputrain"]
# the catalogue's alerts (a user's own GpuTrain-named rule is not one of them)
ALERT_NAMES = "|".join(sorted({e.alert for e in CATALOGUE}))
ALERTS = f'ALERTS{{alertname=~"{ALERT_NAMES}", alertstate="firing"}}'


class Layout:
    """Places panels left to right on Grafana's 24-column grid."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, panel: dict, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + self.row_h
            self.row_h = 0
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        panel["id"] = self.next_id
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)
        return panel

    def row(self, title: str) -> dict:
        self.x, self.y = 0, self.y + self.row_h
        self.row_h = 0
        panel = self.place({"type": "row", "title": title, "collapsed": False, "panels": []},
                           24, 1)
        self.x, self.y, self.row_h = 0, self.y + 1, 0
        return panel


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False,
           table: bool = False) -> dict:
    t: dict[str, Any] = {"datasource": DS, "refId": ref, "expr": expr,
                         "legendFormat": legend or "__auto"}
    if instant:
        t["instant"], t["range"] = True, False
    if table:
        t["format"] = "table"
    return t


def thresholds(*steps: tuple[float | None, str]) -> dict:
    return {"mode": "absolute",
            "steps": [{"value": v, "color": c} for v, c in steps]}


def timeseries(title: str, targets: list[dict], unit: str, description: str = "",
               lines: list[tuple[float, str]] | None = None, max_: float | None = None,
               stack: bool = False, bars: bool = False) -> dict:
    """A time series; ``lines`` draws thresholds (value, colour) as dashed lines; ``bars``
    draws stacked bars."""
    custom: dict[str, Any] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if stack or bars:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    if bars:
        custom.update(drawStyle="bars", fillOpacity=80)
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if lines:
        custom["thresholdsStyle"] = {"mode": "dashed"}
        defaults["thresholds"] = thresholds((None, "transparent"), *lines)
    if max_ is not None:
        defaults["min"], defaults["max"] = 0, max_
    return {"type": "timeseries", "title": title, "description": description,
            "datasource": DS, "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["mean", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, expr: str, unit: str, steps: list[tuple[float | None, str]],
         description: str = "") -> dict:
    return {"type": "stat", "title": title, "description": description, "datasource": DS,
            "targets": [target(expr, instant=True)],
            "fieldConfig": {"defaults": {"unit": unit, "thresholds": thresholds(*steps)},
                            "overrides": []},
            "options": {"colorMode": "background", "graphMode": "none",
                        "reduceOptions": {"calcs": ["lastNotNull"]}}}


def bargauge(title: str, expr: str, legend: str, unit: str, description: str = "",
             links: list[dict] | None = None) -> dict:
    """Horizontal bars, one per series of an instant query, largest first."""
    return {"type": "bargauge", "title": title, "description": description, "datasource": DS,
            "targets": [target(expr, legend, instant=True)],
            "fieldConfig": {"defaults": {"unit": unit, "min": 0, "links": links or [],
                                         "thresholds": thresholds((None, "orange"))},
                            "overrides": []},
            "options": {"orientation": "horizontal", "displayMode": "basic",
                        "reduceOptions": {"calcs": ["lastNotNull"], "values": False},
                        "showUnfilled": True}}


def table(title: str, targets: list[dict], unit_by_field: dict[str, str],
          description: str = "", links: dict[str, str] | None = None,
          sort: str | None = None, hide: tuple[str, ...] = ("Time",),
          busy_steps: tuple[float, float] | None = None) -> dict:
    """An instant table that merges its queries on their labels; ``Value #X`` columns renamed.
    Ratio cells are coloured by ``busy_steps`` (the GPU-busy thresholds: low, target)."""
    overrides = []
    for field_name, unit in unit_by_field.items():
        props: list[dict] = [{"id": "unit", "value": unit}]
        if unit == "percentunit":
            props.append({"id": "custom.cellOptions",
                          "value": {"type": "color-background", "mode": "basic"}})
        overrides.append({"matcher": {"id": "byName", "options": field_name},
                          "properties": props})
    for field_name, url in (links or {}).items():
        overrides.append({"matcher": {"id": "byName", "options": field_name}, "properties": [
            {"id": "links", "value": [{"title": "open", "url": url}]}]})
    rename = {f"Value #{t['refId']}": t["legendFormat"] for t in targets}
    return {"type": "table", "title": title, "description": description, "datasource": DS,
            "targets": [{**t, "instant": True, "range": False, "format": "table"}
                        for t in targets],
            "transformations": [
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {
                    "excludeByName": {h: True for h in (*hide, "__name__")},
                    "renameByName": rename}}],
            "fieldConfig": {"defaults": {"unit": "none", "thresholds": thresholds(
                (None, "red"), (busy_steps[0], "orange"), (busy_steps[1], "green"))
                if busy_steps else thresholds((None, "green"))}, "overrides": overrides},
            "options": {"showHeader": True, "cellHeight": "sm",
                        "sortBy": [{"displayName": sort, "desc": False}] if sort else []}}


def variable(name: str, query: str, label: str, multi: bool = False,
             include_all: bool = False) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"var-{name}"}, "definition": query,
            "refresh": 2, "sort": 1, "multi": multi, "includeAll": include_all,
            "allValue": ".*" if include_all else None, "current": {}, "options": [],
            "hide": 0}


DATASOURCE_VAR = {"name": "datasource", "label": "Prometheus", "type": "datasource",
                  "query": "prometheus", "current": {}, "hide": 0, "refresh": 1,
                  "regex": "", "options": []}


def dashboard(uid: str, title: str, description: str, variables: list[dict],
              panels: list[dict], alert_filter: str) -> dict:
    return {
        "uid": uid, "title": title, "description": description, "tags": TAGS,
        "editable": True, "schemaVersion": 39, "version": 1, "timezone": "",
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "graphTooltip": 1,
        "templating": {"list": [DATASOURCE_VAR, *variables]},
        "annotations": {"list": [
            {"builtIn": 1, "name": "Annotations & Alerts", "type": "dashboard", "enable": True,
             "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
             "datasource": {"type": "grafana", "uid": "-- Grafana --"}},
            {"name": "GpuTrain alerts", "enable": True, "iconColor": "red", "datasource": DS,
             "expr": f'ALERTS{{alertname=~"{ALERT_NAMES}", alertstate="firing"{alert_filter}}}',
             "step": "60s", "titleFormat": "{{alertname}}",
             "textFormat": "{{severity}}: run {{run}} rank {{rank}} gpu {{gpu}}",
             "useValueForTime": False}]},
        "links": [{"title": "GpuTrain dashboards", "type": "dashboards", "tags": TAGS,
                   "asDropdown": False, "includeVars": True, "keepTime": True}],
        "panels": panels,
    }


def pct(t: dict[str, float], name: str) -> str:
    """Threshold ``name`` as the panel texts write it (``5 %``, ``1x``)."""
    return show(name, t[name])


def busy_pair(t: dict[str, float]) -> tuple[float, float]:
    """The GPU-busy thresholds (low, target) that colour tables and draw busy lines."""
    return t["gpu_busy_low"], t["gpu_busy_target"]


def busy_lines(t: dict[str, float]) -> list[tuple[float, str]]:
    low, target_ = busy_pair(t)
    return [(low, "red"), (target_, "green")]


def gpu_join(expr: str, sel: str, ids: Identity) -> str:
    """``expr`` (per GPU) for the GPUs of the selected run and ranks (``sel``)."""
    return (f"({expr}) * on ({ids.gpu}) group_left (run, rank) "
            f'max by ({ids.gpu}, run, rank) (gputrain_training_gpu_info{{{sel}}})')


# --- overview ----------------------------------------------------------------------------------

def overview(t: dict[str, float], js: str, ids: Identity, extra: list[dict],
             every: float = 30.0) -> dict:
    """``every``: the recording rules' interval in seconds (each recorded sample stands for
    that long)."""
    lay = Layout()
    low_t, target_t = busy_pair(t)
    busy = [(None, "red"), (low_t, "orange"), (target_t, "green")]
    # a run's series are summed over its jobs and nodes: only the labels beyond `run` remain
    per_run = ", ".join(f'{x}=~"${x}"' for x in ids.extra)
    low, target_ = pct(t, "gpu_busy_low"), pct(t, "gpu_busy_target")
    run_link = ("/d/gputrain-run/gputrain-run?${__url_time_range}&var-datasource=${datasource}"
                "&var-run=${__data.fields.run}&var-instance=$__all&var-rank=$__all")
    node_link = ("/d/gputrain-node/gputrain-node?${__url_time_range}&var-datasource="
                 "${datasource}&var-instance=${__data.fields.instance}")
    panels = [
        lay.place(stat("Fleet GPU busy", f"avg({R['gpu:busy']}{{{js}}})",
                       "percentunit", busy,
                       f"Mean busy ratio of every GPU over 5m. Under {target_} is wasted money "
                       "(a TensorFlow performance study)."), 6, 4),
        lay.place(stat("Busy of GPUs that runs use",
                       f"avg({R['busy']}{{{js}}})", "percentunit",
                       busy), 6, 4),
        lay.place(stat("GPUs no run uses",
                       f"count(gputrain_gpu_up{{{js}}} == 1 unless on ({ids.gpu}) "
                       f"gputrain_training_gpu_info{{{js}}}) or vector(0)", "none",
                       [(None, "green"), (1, "orange")]), 6, 4),
        lay.place(stat("Firing GpuTrain alerts", f"count({ALERTS}) or vector(0)", "none",
                       [(None, "green"), (1, "red")]), 6, 4),
        lay.place(table("Runs", [
            target(f"{R['samples_per_second']}{{{js}}}", "samples/s",
                   "A"),
            target(f"{R['step_seconds']}{{{js}}}", "step time", "B"),
            target(f"{R['data_wait_ratio']}{{{js}}}", "data wait", "C"),
            target(f"{RANK_BUSY_AVG}{{{js}}}", "GPU busy", "D"),
            target(f"{R['mfu']}{{{js}}}", "MFU", "E"),
            target(f"{R['goodput']}{{{js}}}", "goodput", "F")],
            {"samples/s": "none", "step time": "s", "data wait": "percentunit",
             "GPU busy": "percentunit", "MFU": "percentunit", "goodput": "percentunit"},
            "Every (run, rank) on every node over 5m. Click a run for its dashboard, a node "
            "for its instance metrics. Sort by GPU busy to find the waste. MFU shows where the "
            "client reports its FLOPs and the GPU's peak is known.",
            links={"run": run_link, "instance": node_link}, sort="GPU busy",
            hide=("Time", "job"), busy_steps=busy_pair(t)),
            24, 9),
        lay.place(bargauge(
            "Wasted GPU-hours by run",
            f"sort_desc(sum by ({ids.run}) (sum_over_time("
            f"{WASTED_SECONDS}{{{per_run}}}[$__range])) * {every:g} / 3600)",
            "{{run}}", "none",
            "GPU-hours each run's GPUs sat idle while it held them, over the dashboard's time "
            "range (1 - busy, summed over its GPUs). Click a run for its dashboard.",
            links=[{"title": "open run", "url": run_link.replace(
                "${__data.fields.run}", "${__field.labels.run}")}]), 24, 7),
        lay.place(table("Firing GpuTrain alerts", [target(ALERTS, "firing", "A")],
                        {}, "What the rules say, with the labels that locate it.",
                        links={"run": run_link, "instance": node_link},
                        hide=("Time", "Value #A", "alertstate", "job")), 12, 8),
        lay.place(table("GPUs no run uses", [target(
            f"{R['gpu:busy']}{{{js}}} unless on ({ids.gpu}) "
            f"gputrain_training_gpu_info{{{js}}}", "busy", "A")], {"busy": "percentunit"},
            "GPUs with no training client reporting them: idle capacity, or a job that does "
            "not use the client.", links={"instance": node_link}, hide=("Time", "job"),
            busy_steps=busy_pair(t)),
            12, 8),
        lay.place(table("Idle GPUs and who holds them", [target(
            _owners(f"{R['gpu:busy']}{{{js}}} < {t['gpu_busy_low']}",
                    js, ids.gpu), "busy", "A")], {"busy": "percentunit"},
            f"Every GPU busy under {low}, with what holds it: a run and rank (the client), a "
            "Kubernetes pod (--collector.kubernetes) or a Slurm job (--collector.slurm, "
            "exported_job); a row with none of them is held by nobody we know of.",
            links={"run": run_link, "instance": node_link}, hide=("Time", "job"),
            busy_steps=busy_pair(t)), 24, 8),
        lay.place(timeseries("GPU busy by run", [target(
            f"{RANK_BUSY_AVG}{{{js}}}", "{{run}} rank {{rank}}")],
            "percentunit", f"{target_} is the goal; under {low} the GPU is badly used.",
            lines=busy_lines(t), max_=1), 12, 8),
        lay.place(timeseries("Data wait by run", [target(
            f"{R['data_wait_ratio']}{{{js}}}", "{{run}} rank {{rank}}")],
            "percentunit", "Share of each step blocked on the data loader: "
            f"{pct(t, 'input_bound')} is moderately, "
            f"{pct(t, 'input_bound_high')} highly input-bound (TF "
            "Profiler).", lines=[(t["input_bound"], "orange"), (t["input_bound_high"], "red")],
            max_=1), 12, 8),
        lay.place(timeseries("GPU shares by run", [
            target(f"{RUN_GPU_BUSY}{{{js}}}",
                   "{{instance}} GPU {{gpu}}: {{run}}", "A"),
            target(f"{UNATTRIBUTED_BUSY}{{{js}}}",
                   "{{instance}} GPU {{gpu}}: no run (unattributed)", "B")],
            "percentunit", "Of each GPU's time, the share each run's processes kept it busy and "
            "the share processes no run owns did (NVML's per-process utilisation; absent where "
            "the driver gives none). Over "
            f"{pct(t, 'gpu_foreign_busy')} not a run's own is GpuTrainGPUShared.",
            max_=1), 24, 8),
    ]
    return dashboard("gputrain-overview", "GpuTrain / Overview",
                     "Every run on every node: which runs waste GPUs.", extra, panels, "")


def _owners(idle: str, js: str, gpu: str) -> str:
    """``idle`` (a per-GPU query) with who holds each GPU as labels: a row per run and rank,
    pod or Slurm job, and the GPUs none of them claims."""
    held = [("run, rank", "gputrain_training_gpu_info"),
            ("namespace, pod, container", "gputrain_gpu_pod_info"),
            ("exported_job", "gputrain_gpu_job_info")]
    rows = [f"({idle}) * on ({gpu}) group_left ({labels}) max by ({gpu}, {labels}) "
            f"({metric}{{{js}}})" for labels, metric in held]
    anyone = " or ".join(f"{metric}{{{js}}}" for _, metric in held)
    return " or ".join(rows) + f" or (({idle}) unless on ({gpu}) ({anyone}))"


# --- run ---------------------------------------------------------------------------------------

def run(t: dict[str, float], js: str, ids: Identity, extra: list[dict]) -> dict:
    lay = Layout()
    sel = f'{js}, run="$run", rank=~"$rank", instance=~"$instance"'
    node = f'{js}, instance=~"$instance"'

    dominating = derived(t)["phase_share"]
    q = "sum by (instance, rank, le) (rate(gputrain_training_step_duration_seconds_bucket" \
        f"{{{sel}}}[$__rate_interval]))"
    panels = [
        lay.row("Training loop"),
        lay.place(timeseries("Samples per second", [target(
            f"{R['samples_per_second']}{{{sel}}}", "rank {{rank}}")],
            "none", "Throughput per second of step time (compare runs in samples, "
            "not steps)."), 8, 8),
        lay.place(timeseries("Step time", [
            target(f"histogram_quantile(0.5, {q})", "p50 rank {{rank}}", "A"),
            target(f"histogram_quantile(0.95, {q})", "p95 rank {{rank}}", "B"),
            target(f"histogram_quantile(1, {q})", "max (bucket bound) rank {{rank}}", "C")],
            "s", "Wall time of a step, data wait included. A max far above p50 is a periodic "
            "stall (checkpoints)."), 8, 8),
        lay.place(timeseries("Data wait", [target(
            f"{R['data_wait_ratio']}{{{sel}}}", "rank {{rank}}")],
            "percentunit", f"{pct(t, 'input_bound')} moderately, {pct(t, 'input_bound_high')} "
            "highly input-bound.",
            lines=[(t["input_bound"], "orange"), (t["input_bound_high"], "red")], max_=1), 8, 8),
        lay.place(timeseries("Phases", [target(
            f"{R['phases']}{{{sel}}}",
            "{{phase}} rank {{rank}}")], "percentunit",
            f"Share of the step in each named phase; a phase of the step over "
            f"{dominating:.0%} ({pct(t, 'phase_dominates')} the rest) is host overhead; checkpoint "
            f"saves over {pct(t, 'checkpoint_share')} are stalls.",
            lines=[(dominating, "red")], max_=1), 12, 8),
        lay.row("Gradient communication"),
        lay.place(timeseries("Gradient communication", [
            target(f"{R['comm_exposed_ratio']}{{{sel}}}",
                   "exposed rank {{rank}}", "A"),
            target(f"{R['comm_ratio']}{{{sel}}}",
                   "ran rank {{rank}}", "B")], "percentunit",
            "Of each step, the gradient all-reduce that ran (DDP's reducer timers, where the "
            "client watches a DDP model) and the part the step waited for (exposed). Over "
            f"{pct(t, 'comm_bound')} exposed: communication-bound. In synchronous training the "
            "rank that waits least is the one the others wait for.",
            lines=[(t["comm_bound"], "red")], max_=1), 12, 8),
        lay.place(timeseries("Bytes all-reduced", [target(
            f"{COMM_BYTES}{{{sel}}}", "rank {{rank}}")],
            "Bps", "Gradient bytes all-reduced per second (the size of DDP's buckets times "
            "the synchronised steps)."), 12, 8),
        lay.place(timeseries("NCCL bus bandwidth", [target(
            f"gputrain_nccl_bus_bandwidth_bytes_per_second{{{node}}}",
            "{{collective}} {{comm_id}} rank {{nccl_rank}} {{instance}}")], "Bps",
            "The bus bandwidth each NCCL communicator's latest collective achieved (NCCL "
            "Inspector, `--collector.nccl`): far under the fabric's speed (3 GB/s on a "
            "400 Gb/s InfiniBand) is NCCL on TCP sockets; NCCL_DEBUG=INFO names the "
            "transport."), 24, 8),
        lay.place(timeseries("Goodput and badput", [
            target(f"avg({R['goodput']}{{{sel}}})",
                   "productive steps", "A"),
            target(f"avg by (cause) ({R['badput']}"
                   f"{{{sel}}})", "{{cause}}", "B")], "percentunit",
            "Where the wall time of the selected ranks went (their mean): productive step time "
            "(less data wait and the step's named phases), data wait, each phase, and time "
            "outside steps (start-up, restarts: the gap until a restarted process reports "
            "counts). The bars add up to 100 %.", bars=True, max_=1), 12, 8),
        lay.place(timeseries("Training processes", [
            target(f"{CPU_CORES}{{{sel}}}",
                   "CPU cores rank {{rank}}", "A")], "none",
            "CPU cores the training process and its DataLoader workers use."), 6, 8),
        lay.place(timeseries("Training process memory", [
            target(f"gputrain_training_process_resident_memory_bytes{{{sel}}}",
                   "RSS rank {{rank}}", "A"),
            target(f"gputrain_training_process_proportional_memory_bytes{{{sel}}}",
                   "PSS rank {{rank}}", "B")], "bytes",
            "Memory of the process tree: RSS, and PSS where the client reads it (pages its "
            "DataLoader workers share count once, pages they copy on access count). A steady "
            "rise is a leak; so is the node's available memory falling while these stay flat "
            "(the node dashboard's memory panel)."), 6, 8),
        lay.row("GPUs of the run"),
        lay.place(timeseries("GPU busy", [target(
            f"{R['busy']}{{{sel}}}",
            "GPU {{gpu}} rank {{rank}}")], "percentunit", "Any kernel running.",
            lines=busy_lines(t), max_=1), 8, 8),
        lay.place(timeseries("SM and tensor activity", [
            target(f"{R['sm_active']}{{{sel}}}",
                   "SM GPU {{gpu}}", "A"),
            target(f"{R['tensor_active']}{{{sel}}}",
                   "tensor GPU {{gpu}}", "B")], "percentunit",
            f"GPM (Hopper and newer). SM active < {pct(t, 'launch_sm_active_below')} while busy is "
            f"launch-bound; tensor < {pct(t, 'tensor_active_below')} with SMs busy means no AMP.",
            lines=[(t["launch_sm_active_below"], "orange")], max_=1), 8, 8),
        lay.place(timeseries("Model FLOPs utilisation", [target(
            f"{R['mfu']}{{{sel}}}", "rank {{rank}}")],
            "percentunit",
            "The model's FLOPs per second of wall time over the dense peak of the rank's GPUs "
            "at the precision it trains in (gputrain_gpu_peak_flops). Needs flops_per_sample "
            f"in the client. Busy GPUs under {pct(t, 'mfu_low')} do little useful math; "
            "torchtitan reaches 33-39 % on Llama 3.1 8B.",
            lines=[(t["mfu_low"], "orange")], max_=1), 8, 8),
        lay.place(timeseries("GPU memory used", [target(
            f"{R['memory_used']}{{{sel}}}", "GPU {{gpu}}")],
            "percentunit", f"Under {pct(t, 'memory_underused')} the batch is likely too small; "
            f"over {pct(t, 'memory_near_limit')} is near OOM.",
            lines=[(t["memory_underused"], "orange"), (t["memory_near_limit"], "red")],
            max_=1), 8, 8),
        lay.place(timeseries("Power against the limit", [target(
            f"{R['power_used']}{{{sel}}}",
            "GPU {{gpu}}")], "percentunit", "Low power while busy: the SMs idle.",
            lines=[(t["launch_power_below"], "orange")], max_=1), 8, 8),
        lay.place(timeseries("PCIe host-to-device against the link", [target(
            f"{R['pcie_rx_used']}{{{sel}}}",
            "GPU {{gpu}}")], "percentunit", f"Over {pct(t, 'pcie_rx_high')} of the link with the "
            f"GPU under {pct(t, 'h2d_gpu_busy_below')} busy: the copy is the bottleneck.",
            lines=[(t["pcie_rx_high"], "red")], max_=1), 8, 8),
        lay.place(timeseries("SM clock", [target(
            gpu_join(f'gputrain_gpu_clock_hertz{{clock="sm", {node}}}', sel, ids),
            "GPU {{gpu}}")],
            "hertz", "A clock well under its boost while busy is throttled: see the next "
            "panel."), 8, 8),
        lay.place(timeseries("Throttled time", [target(
            gpu_join(f"sum by ({ids.gpu}, reason) (rate("
                     f"gputrain_gpu_clock_event_seconds_total{{{node}}}[$__rate_interval]))",
                     sel, ids),
            "{{reason}} GPU {{gpu}}")], "percentunit",
            f"Share of time the clocks were held down, by reason; over {pct(t, 'throttle_ratio')} "
            "for power or thermal reasons is throttling.",
            lines=[(t["throttle_ratio"], "red")], max_=1), 8, 8),
        lay.place(timeseries("Energy per sample", [target(
            f"{ENERGY_PER_SAMPLE}{{{sel}}}",
            "rank {{rank}}")], "joule",
            "Joules the rank's GPUs drew per training sample (their energy counters over the "
            "samples per second of wall time). Idle GPUs still draw power, so waiting raises it."),
            8, 8),
        lay.row("Node"),
        lay.place(timeseries("CPU by mode", [target(
            f"sum by (instance, mode) (rate(gputrain_host_cpu_seconds_total{{{node}}}"
            f"[$__rate_interval])) / on (instance) group_left sum by (instance) "
            f"(rate(gputrain_host_cpu_seconds_total{{{node}}}[$__rate_interval]))",
            "{{mode}} {{instance}}")], "percentunit",
            f"{pct(t, 'cpu_saturated')} busy with data wait is preprocessing-bound; iowait over "
            f"{pct(t, 'iowait_high')} is disk-bound.",
            stack=True, max_=1), 8, 8),
        lay.place(timeseries("Disk I/O", [
            target(f"sum by (instance, device) (rate(gputrain_host_disk_read_bytes_total"
                   f"{{{node}}}[$__rate_interval]))", "read {{device}}", "A"),
            target(f"sum by (instance, device) (rate(gputrain_host_disk_written_bytes_total"
                   f"{{{node}}}[$__rate_interval]))", "write {{device}}", "B")],
            "Bps"), 8, 8),
        lay.place(timeseries("Network receive against link speed", [target(
            f"rate(gputrain_host_network_received_bytes_total{{{node}}}[$__rate_interval]) "
            f"/ gputrain_host_network_speed_bytes_per_second{{{node}}}",
            "{{interface}} {{instance}}")], "percentunit",
            f"Over {pct(t, 'network_saturated')} of the interface with data wait: network input "
            "bound.", lines=[(t["network_saturated"], "red")], max_=1), 8, 8),
    ]
    variables = [
        *extra,
        variable("run", f"label_values(gputrain_training_steps_total{{{js}}}, run)", "Run"),
        variable("instance",
                 f'label_values(gputrain_training_steps_total{{{js}, run="$run"}}, instance)',
                 "Node", multi=True, include_all=True),
        variable("rank", f'label_values(gputrain_training_steps_total{{{js}, run="$run", '
                 'instance=~"$instance"}, rank)', "Rank", multi=True, include_all=True),
    ]
    return dashboard("gputrain-run", "GpuTrain / Run",
                     "One run per rank: the training loop, its GPUs and its nodes.",
                     variables, panels, ', run="$run"')


# --- node --------------------------------------------------------------------------------------

def node(t: dict[str, float], js: str, ids: Identity, extra: list[dict]) -> dict:
    lay = Layout()
    n = f'{js}, instance="$instance"'
    r = "[$__rate_interval]"
    per_gpu = "GPU {{gpu}}"
    # errors new in the last hour, as the alerts count them, and 0 for the GPUs without any
    xid = f"gputrain_gpu_xid_errors_total{{{n}}}"
    ecc = f'gputrain_gpu_ecc_errors_total{{{n},type="uncorrected"}}'
    no_errors = f"sum by (gpu, uuid) (0 * gputrain_gpu_up{{{n}}})"
    panels = [
        lay.row("GPUs"),
        lay.place(timeseries("GPU busy", [target(
            f"sum by (gpu, uuid) (rate(gputrain_gpu_busy_seconds_total{{{n}}}{r})) / "
            f"sum by (gpu, uuid) (rate(gputrain_gpu_sampled_seconds_total{{{n}}}{r}))",
            per_gpu)], "percentunit", lines=busy_lines(t), max_=1), 8, 8),
        lay.place(timeseries("SM active", [target(
            f"gputrain_gpu_sm_active_ratio{{{n}}}", per_gpu)], "percentunit", max_=1), 8, 8),
        lay.place(timeseries("Tensor active", [target(
            f"gputrain_gpu_tensor_active_ratio{{{n}}}", per_gpu)], "percentunit", max_=1),
            8, 8),
        lay.place(timeseries("GPU memory", [
            target(f"gputrain_gpu_memory_used_bytes{{{n}}}", "used GPU {{gpu}}", "A"),
            target(f"gputrain_gpu_memory_total_bytes{{{n}}}", "total GPU {{gpu}}", "B")],
            "bytes"), 8, 8),
        lay.place(timeseries("Power", [
            target(f"gputrain_gpu_power_watts{{{n}}}", "GPU {{gpu}}", "A"),
            target(f"gputrain_gpu_power_limit_watts{{{n}}}", "limit GPU {{gpu}}", "B")],
            "watt"), 8, 8),
        lay.place(timeseries("PCIe", [
            target(f"rate(gputrain_gpu_pcie_received_bytes_total{{{n}}}{r})",
                   "host-to-device GPU {{gpu}}", "A"),
            target(f"rate(gputrain_gpu_pcie_transmitted_bytes_total{{{n}}}{r})",
                   "device-to-host GPU {{gpu}}", "B"),
            target(f"gputrain_gpu_pcie_link_max_bytes_per_second{{{n}}}",
                   "link max GPU {{gpu}}", "C")], "Bps"), 8, 8),
        lay.place(timeseries("Network both ways", [target(
            f"{R['network_duplex_used']}{{{n}}}",
            "busiest NIC, lesser direction")], "percentunit",
            f"The busiest interface's lesser direction against its speed: over "
            f"{pct(t, 'network_saturated')} both ways with little data wait is an all-reduce "
            "on the wire (communication-bound, inferred).",
            lines=[(t["network_saturated"], "red")], max_=1), 8, 8),
        lay.place(timeseries("NVLink", [
            target(f"rate(gputrain_gpu_nvlink_received_bytes_total{{{n}}}{r})",
                   "received GPU {{gpu}}", "A"),
            target(f"rate(gputrain_gpu_nvlink_transmitted_bytes_total{{{n}}}{r})",
                   "sent GPU {{gpu}}", "B"),
            target(f"gputrain_gpu_nvlink_links{{{n}}} * "
                   f"gputrain_gpu_nvlink_link_max_bytes_per_second{{{n}}}",
                   "all links max GPU {{gpu}}", "C")], "Bps",
            "Data over NVLink (the gradients' all-reduce inside the node): busy GPUs and flat "
            "NVLink while a run waits points at the input, not the collectives."), 8, 8),
        lay.place(timeseries("Temperature", [target(
            f"gputrain_gpu_temperature_celsius{{{n}}}", per_gpu)], "celsius"), 8, 8),
        lay.place(timeseries("Clocks", [target(
            f"gputrain_gpu_clock_hertz{{{n}}}", "{{clock}} GPU {{gpu}}")], "hertz"), 8, 8),
        lay.place(timeseries("Throttled time", [target(
            f"rate(gputrain_gpu_clock_event_seconds_total{{{n}}}{r})",
            "{{reason}} GPU {{gpu}}")], "percentunit", "Share of time the clocks were held "
            f"down; over {pct(t, 'throttle_ratio')} for power or thermal "
            "reasons is throttling.", lines=[(t["throttle_ratio"], "red")], max_=1), 8, 8),
        lay.place(table("GPU health", [
            target(f"gputrain_gpu_up{{{n}}}", "up", "A"),
            target(f"sum by (gpu, uuid) ({new_errors(xid, '1h')}) or {no_errors}",
                   "Xid errors 1h", "B"),
            target(f"sum by (gpu, uuid) ({new_errors(ecc, '1h')}) or {no_errors}",
                   "uncorrected ECC 1h", "C"),
            target(f"sum by (gpu, uuid) (increase(gputrain_gpu_ecc_errors_total{{{n},"
                   f'type="corrected"}}[1h]))', "corrected ECC 1h", "D"),
            target(f'max by (gpu, uuid) (gputrain_gpu_remapped_rows{{{n},state="pending"}}) '
                   f"or max by (gpu, uuid) (gputrain_gpu_retired_pages_pending{{{n}}})",
                   "remap pending", "E"),
            target(f'max by (gpu, uuid) (gputrain_gpu_remapped_rows{{{n},state="failed"}})',
                   "remap failed", "F"),
            # the model, and for a MIG instance its GPU and profile
            target(f"max by (gpu, uuid, name, parent, profile) (gputrain_gpu_info{{{n}}})",
                   "info", "G"),
        ], {"up": "none", "Xid errors 1h": "none", "uncorrected ECC 1h": "none",
            "corrected ECC 1h": "none", "remap pending": "none", "remap failed": "none"},
            "up 0: the GPU fell off the bus. An uncorrected ECC error or a failed remap: drain "
            "the node; a pending remap (or page retirement): reset the GPU when the job ends. "
            "A MIG instance is a row of its own (gpu 0/1), with its GPU (parent) and profile.",
            hide=("Time", "job", "instance", "info")), 12, 7),
        lay.place(table("Runs on this node", [
            target(f"{R['samples_per_second']}{{{n}}}",
                   "samples/s", "A"),
            target(f"{R['data_wait_ratio']}{{{n}}}",
                   "data wait", "B"),
            target(f"{RANK_BUSY_AVG}{{{n}}}", "GPU busy", "C")],
            {"samples/s": "none", "data wait": "percentunit", "GPU busy": "percentunit"},
            links={"run": "/d/gputrain-run/gputrain-run?${__url_time_range}&var-datasource="
                          "${datasource}&var-run=${__data.fields.run}&var-instance=$instance"
                          "&var-rank=$__all"},
            hide=("Time", "job", "instance"),
            busy_steps=busy_pair(t)), 12, 7),
        lay.row("Host"),
        lay.place(timeseries("CPU by mode", [target(
            f"sum by (mode) (rate(gputrain_host_cpu_seconds_total{{{n}}}{r})) / scalar("
            f"sum(rate(gputrain_host_cpu_seconds_total{{{n}}}{r})))", "{{mode}}")],
            "percentunit", stack=True, max_=1), 8, 8),
        lay.place(timeseries("Memory", [
            target(f"gputrain_host_memory_total_bytes{{{n}}} - "
                   f"gputrain_host_memory_available_bytes{{{n}}}", "used", "A"),
            target(f"gputrain_host_memory_total_bytes{{{n}}}", "total", "B")], "bytes"),
            8, 8),
        lay.place(timeseries("Disk busy", [target(
            f"rate(gputrain_host_disk_io_time_seconds_total{{{n}}}{r})", "{{device}}")],
            "percentunit", lines=[(t["disk_busy_high"], "red")], max_=1), 8, 8),
        lay.place(timeseries("Disk I/O", [
            target(f"rate(gputrain_host_disk_read_bytes_total{{{n}}}{r})", "read {{device}}",
                   "A"),
            target(f"rate(gputrain_host_disk_written_bytes_total{{{n}}}{r})",
                   "write {{device}}", "B")], "Bps"), 12, 8),
        lay.place(timeseries("Network I/O", [
            target(f"rate(gputrain_host_network_received_bytes_total{{{n}}}{r})",
                   "in {{interface}}", "A"),
            target(f"rate(gputrain_host_network_transmitted_bytes_total{{{n}}}{r})",
                   "out {{interface}}", "B"),
            target(f"gputrain_host_network_speed_bytes_per_second{{{n}}}",
                   "speed {{interface}}", "C")], "Bps"), 12, 8),
    ]
    variables = [*extra,
                 variable("instance", f"label_values(gputrain_build_info{{{js}}}, instance)",
                          "Node")]
    return dashboard("gputrain-node", "GpuTrain / Node",
                     "The instance metrics of one node: all its GPUs and its host.",
                     variables, panels, ', instance="$instance"')


def dashboards(overrides: dict | None = None) -> dict[str, dict]:
    """The dashboards by file name, with the thresholds and selector of ``overrides`` (a
    thresholds file's content, as for ``rules --config``)."""
    cfg = settings(overrides)
    t, ids = cfg["thresholds"], identity(cfg)
    # a run label beyond `run` (cluster) is a variable of every dashboard and part of every
    # selector, so same-named runs of two clusters stay apart
    js = cfg["selector"] + "".join(f', {x}=~"${x}"' for x in ids.extra)
    def extra(include_all: bool) -> list[dict]:
        return [variable(x, f"label_values({x})", x.capitalize(), include_all=include_all)
                for x in ids.extra]

    # the overview may show every cluster; a run or a node is in one
    every = parse_duration(cfg["recording_interval"])
    return {"overview.json": overview(t, js, ids, extra(True), every),
            "run.json": run(t, js, ids, extra(False)), "node.json": node(t, js, ids, extra(False))}


def render(d: dict) -> str:
    return json.dumps(d, indent=2, sort_keys=False) + "\n"


def configmap(overrides: dict | None = None) -> str:
    """The dashboards as a ConfigMap the Grafana sidecar (kube-prometheus-stack) picks up."""
    import yaml

    doc = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "gputrain-dashboards",
                        "labels": {"grafana_dashboard": "1",
                                   "app.kubernetes.io/name": "gputrain-exporter"},
                        "annotations": {"grafana_folder": "GpuTrain"}},
           "data": {name: json.dumps(d, separators=(",", ":"))
                    for name, d in dashboards(overrides).items()}}
    return ("# Generated by `scripts/generate.py` from "
            "exporter/heuristics/dashboards.py: do not edit.\n"
            + yaml.safe_dump(doc, sort_keys=False, width=1 << 20))


def write(out: Path, overrides: dict | None = None) -> list[Path]:
    """Write the dashboards into ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, d in dashboards(overrides).items():
        (out / name).write_text(render(d))
        written.append(out / name)
    return written
