"""A fleet, measured: N nodes' worth of exporters through vmagent into VictoriaMetrics, the node
rules in one vmalert and the global rules in another, a real Alertmanager; the cost per node of
every series and rule, beside the anchors measured in the same run (node_exporter's page on
this machine) and counted from dcgm-exporter's default counter lists.

    python bench/bench_fleet.py --nodes 200 [--minutes 5] [--shard-nodes 50] [--out run.json]
    python bench/bench_fleet.py --fit run50.json run200.json run500.json

The fleet is bench/fleet.py's: real demo daemons (8 GPUs) with real training clients (8 ranks)
as templates, one page server serving every node on its own port; planted: one straggler rank
(run-000), one input-bound run (8 ranks), one node whose page goes away, beside a run that
finishes, one that starts late and idle nodes. Production intervals: 15 s scrapes, the
shipped rules' 10 s liveness and 30 s recording groups, 30 s alert evaluation; the planted
alerts' `for` 1 m (every other alert's as shipped) so that they fire within the run.

--shard-nodes M also runs a real Prometheus shard (deploy/scale-out/prometheus-shard.yml,
results-only remote_write) over M of the nodes, into a sink that counts its bytes: what leaves
a shard per node, and Prometheus' own memory and rule time per node.

--fit reads the JSON of runs at several N and prints each figure's slope per node, a power-law
exponent for each rule's evaluation time, and the extrapolation to 1,000 and 10,000 nodes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import fleet as F  # noqa: E402

# dcgm-exporter's default counter sets, as shipped in NVIDIA/dcgm-exporter (etc/*.csv): the
# uncommented fields of each file, one series per GPU each (its labels, gpu, UUID, device,
# modelName, Hostname, add none). Written down here from the files at the commits named (this
# machine has no network); DCGM_FI_DRIVER_VERSION is a label there, not a series.
DCGM_DEFAULT_COUNTERS = {  # etc/default-counters.csv @ 00d6d344ea4a39112b211b9ff5af3d97e0bb51c2
    "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
}
DCGM_DCP_INCLUDED = {  # etc/dcp-metrics-included.csv @ 084a245dc715966ea2c72b00fde311b6795a6ffb
    "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES",
}
PRODUCTION = F.Timings(scrape="15s", evaluation="30s", recording="30s", liveness="10s",
                       for_="1m", latency_offset="30s", refresh=1.0)
RAW = '__name__=~"gputrain_.+|up|scrape_.+"'
RECORDED = '__name__=~".+:.+"'  # the rules' results


# --------------------------------------------------------------------------------------------
# anchors


def node_exporter_anchor(tmp: Path) -> dict:
    """node_exporter's page on this machine, scraped as Prometheus does: series and bytes."""
    import requests

    c = F._conftest()
    binary = c.require_binary("prometheus-node-exporter", "node_exporter",
                              package="prometheus-node-exporter")
    port = c.free_port()
    d = tmp / "node-exporter"
    d.mkdir()
    server = c.Server([binary, f"--web.listen-address=127.0.0.1:{port}"], d,
                      f"http://127.0.0.1:{port}", "/metrics").start()
    try:
        r = requests.get(server.url + "/metrics", headers={"Accept-Encoding": "gzip"},
                         timeout=30, stream=True)
        raw = r.raw.read(decode_content=False)
        body = gzip.decompress(raw) if r.headers.get("Content-Encoding") == "gzip" else raw
    finally:
        server.stop()
    series = sum(1 for ln in body.splitlines() if ln and not ln.startswith(b"#"))
    return {"series": series, "bytes": len(body), "gzip_bytes": len(raw)}


def dcgm_anchor(gpus: int = 8) -> dict:
    return {"default_counters_per_gpu": len(DCGM_DEFAULT_COUNTERS),
            "dcp_included_per_gpu": len(DCGM_DCP_INCLUDED),
            "default_counters_per_node": gpus * len(DCGM_DEFAULT_COUNTERS),
            "dcp_included_per_node": gpus * len(DCGM_DCP_INCLUDED)}


# --------------------------------------------------------------------------------------------
# one run


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as fh:
        fields = [float(x) for x in fh.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / tick, sum(fields) / tick


class Snapshot:
    """What the window's figures are differences of."""

    def __init__(self, fleet: F.Fleet) -> None:
        self.at = time.time()
        self.usage: dict[str, tuple[float, int]] = {}
        parts = fleet.processes()
        for part, pids in parts.items():
            cpu, rss = 0.0, 0
            for pid in pids:
                try:
                    c, r = F.proc_usage(pid)
                except OSError:
                    continue
                cpu, rss = cpu + c, rss + r
            self.usage[part] = (cpu, rss)
        self.machine = machine_cpu()
        self.vm = F.metrics(fleet.vm.url)
        self.vmagent = F.metrics(fleet.vmagent.url)
        self.node_ruler = F.metrics(fleet.node_ruler.url)
        self.global_ruler = F.metrics(fleet.global_ruler.url)
        self.pages = fleet.page_stats()
        self.sink = fleet.sink.bytes if fleet.sink else 0
        self.shard = F.metrics(fleet.shard.url) if fleet.shard else {}


class RuleTimes:
    """Each rule's evaluation time on a ruler, every evaluation seen while polled."""

    def __init__(self) -> None:
        self.seen: dict[tuple, dict] = {}

    def poll(self, url: str, ruler: str) -> None:
        import requests

        groups = requests.get(url + "/api/v1/rules", timeout=60).json()["data"]["groups"]
        for g in groups:
            # vmalert 1.79 gives each recording rule of a group the group's start as its
            # lastEvaluation and the time since that start as its evaluationTime (a running
            # total, in file order): a rule's own time is the difference from the one before
            # it in the same evaluation (a rule whose predecessor is still at the previous
            # evaluation, polled mid-way, is read at a later poll)
            cumulative = ruler.startswith("vmalert") and all(
                r.get("type") == "recording" for r in g["rules"])
            before: tuple[str | None, float] = (None, 0.0)
            for i, r in enumerate(g["rules"]):
                key = (ruler, g["name"], r["name"], i)
                entry = self.seen.setdefault(key, {"ruler": ruler, "group": g["name"],
                                                   "index": i, "rule": r["name"],
                                                   "type": r.get("type"), "evals": {},
                                                   "samples": 0})
                stamp, took = r.get("lastEvaluation"), r.get("evaluationTime")
                entry["samples"] = max(entry["samples"], int(r.get("lastSamples") or 0))
                if not stamp or took is None:
                    continue
                took = float(took)
                if not cumulative:
                    entry["evals"][stamp] = took
                elif i == 0 or before[0] == stamp:
                    entry["evals"][stamp] = took - before[1]
                before = (stamp, took)

    def table(self) -> list[dict]:
        out = []
        for e in self.seen.values():
            times = list(e["evals"].values())
            out.append({k: v for k, v in e.items() if k != "evals"} | {
                "evaluations": len(times),
                "mean_s": sum(times) / len(times) if times else None,
                "max_s": max(times) if times else None})
        return sorted(out, key=lambda e: -(e["mean_s"] or 0))


def probe(url: str, rule_files: dict[str, Path], at: float) -> list[dict]:
    """Each rule's expression as one instant query to VictoriaMetrics at ``at`` (after the
    pipeline stopped: VictoriaMetrics alone on the machine, holding the run's data), the best
    of 3 (wall seconds, HTTP included): what an evaluation of it costs the TSDB, apart from
    the ruler's scheduling and the machine's other work."""
    import yaml

    out = []
    for level in ("node", "global"):
        for g in yaml.safe_load(rule_files[level].read_text())["groups"]:
            for i, rule in enumerate(g["rules"]):
                took, result = timed(url, rule["expr"], at)
                out.append({"level": level, "group": g["name"], "index": i,
                            "rule": rule.get("record") or rule.get("alert"),
                            "seconds": took, "series": len(result)})
    return sorted(out, key=lambda e: -e["seconds"])


# ---- what the measurement proposes: two guards every alert repeats, recorded once instead

# the two guards a run before 2026-11-29 03:40 recorded with a third vmalert, as a proposal
# (since shipped, in the recording group): --fit takes them out of such a run's results
PROPOSED = ("run_rank:gputrain_training_stepping:rate5m",
            "instance:gputrain_collector_age:max_intervals")


def timed(url: str, expr: str, at: float, repeats: int = 3) -> tuple[float, list]:
    """An instant query at ``at``: best wall seconds of ``repeats``, and its result. Each
    repeat a second earlier, so that none is answered from VictoriaMetrics' result cache."""
    import requests

    best, result = math.inf, []
    for k in range(repeats):
        t = time.perf_counter()
        body = requests.get(url + "/api/v1/query", params={
            "query": expr, "time": f"{at - k:.3f}"}, timeout=300).json()
        best = min(best, time.perf_counter() - t)
        result = body.get("data", {}).get("result", [])
    return best, result


def rate(a: dict, b: dict, seconds: float, name: str, **labels: str) -> float:
    return (F.total(b, name, **labels) - F.total(a, name, **labels)) / seconds


def groups_of(a: dict, b: dict) -> dict[str, dict]:
    """vmalert's groups over the window: mean and worst iteration, missed iterations."""
    out: dict[str, dict] = {}
    for key in b:
        if not key.startswith("vmalert_iteration_duration_seconds_count"):
            continue
        group = key.split('group="', 1)[1].split('"', 1)[0]
        count = b[key] - a.get(key, 0.0)
        total = b[key.replace("_count", "_sum")] - a.get(key.replace("_count", "_sum"), 0.0)
        worst = max((v for k, v in b.items() if k.startswith("vmalert_iteration_duration_"
                                                              "seconds{")
                     and f'group="{group}"' in k and 'quantile="1"' in k), default=None)
        missed = sum(v - a.get(k, 0.0) for k, v in b.items()
                     if k.startswith("vmalert_iteration_missed_total") and
                     f'group="{group}"' in k)
        out[group] = {"iterations": count, "mean_s": total / count if count else None,
                      "max_s": worst, "missed": missed}
    return out


def counts(url: str, selector: str) -> dict[str, float]:
    """The most series one node, one of its GPUs, one of its ranks has (test_scaleout's
    parts, conftest.series_parts)."""
    out = {}
    for part, q in F._conftest().series_parts(selector).items():
        values = [float(r["value"][1]) for r in F.query(url, q)]
        out[part] = max(values) if values else 0.0
    return out


def run(ns: argparse.Namespace) -> dict:
    os.nice(ns.nice)  # children inherit it: the other work on this machine goes first
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-fleet-{ns.nodes}-"))
    anchors = {"node_exporter": node_exporter_anchor(tmp), "dcgm_exporter": dcgm_anchor()}
    plan = F.make_plan(ns.nodes)
    t = PRODUCTION
    total_s = ns.minutes * 60
    finish = int(total_s / 2 / 0.1)  # the finishing run ends halfway (steps of about 0.1 s)
    started = time.time()
    fleet = F.start_pipeline(tmp, plan, t, finish_steps=finish, shard_nodes=ns.shard_nodes,
                             vmalert_queue=ns.vmalert_queue)
    up_after = time.time() - started
    print(f"{ns.nodes} nodes up after {up_after:.0f} s ({tmp})", flush=True)
    rules = RuleTimes()
    try:
        t0 = time.time()
        end = t0 + total_s
        warm = t0 + min(ns.warm, total_s / 2)
        events = [(t0 + 30, "kill"), (t0 + 30, "start")]
        a = None
        while time.time() < end:
            now = time.time()
            for at, what in list(events):
                if now >= at:
                    events.remove((at, what))
                    if what == "kill":
                        fleet.kill(plan.dead)
                    else:
                        fleet.start_late()
            if a is None and now >= warm:
                a = Snapshot(fleet)
            if a is not None:
                rules.poll(fleet.node_ruler.url, "vmalert-node")
                rules.poll(fleet.global_ruler.url, "vmalert-global")
                if fleet.shard is not None:
                    rules.poll(fleet.shard.url, "prometheus-shard")
            time.sleep(min(10.0, max(0.0, end - time.time())))
        b = Snapshot(fleet)
        assert a is not None
        # the planted alerts may still be on their way (for: 1m behind 30 s of latency offset)
        deadline = time.time() + ns.grace
        while not plan.expected <= set(F.received(fleet.hook)) and time.time() < deadline:
            time.sleep(2)
        F.settle(fleet, 35, timeout=300)  # one more evaluation of every rule, then delivered
        verdict = F.verdict(F.received(fleet.hook), plan.expected)
        fired = sorted({k[0] for k in F.received(fleet.hook)})
        figures = measure(fleet, plan, a, b, rules, ns)
        # the queries alone: everything but VictoriaMetrics stopped, at a time it holds
        quiet = time.time()
        for proc in (fleet.pages, *fleet.clients):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in (fleet.vmagent, fleet.node_ruler, fleet.global_ruler,
                       fleet.shard, *fleet.daemons.values()):
            if server is not None:
                server.stop()
        at = quiet - 40  # past the latency offset: every sample of the run is visible
        figures["probes"] = probe(fleet.vm.url, fleet.rules, at) if ns.probe else []
    finally:
        fleet.stop()
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "nodes": ns.nodes,
            "command": " ".join(sys.argv), "up_after_s": round(up_after, 1),
            "window_s": round(b.at - a.at, 1), "anchors": anchors, "alerts": {
                "expected": len(plan.expected), "fired_names": fired,
                "received": sum(len(v) for v in F.received(fleet.hook).values()),
                **{k: [list(x) for x in v] for k, v in verdict.items()}},
            **figures}


def measure(fleet: F.Fleet, plan: F.Plan, a: Snapshot, b: Snapshot, rules: RuleTimes,
            ns: argparse.Namespace) -> dict:
    seconds = b.at - a.at
    vm = fleet.vm.url
    live = len(plan.nodes) - 1  # the dead node's page went away
    ranks_live = sum(8 for n in plan.nodes if n.run is not None and n.name != plan.dead)
    raw_total = F.scalar(vm, f'count({{job="gputrain", {RAW}}})')
    recorded_total = F.scalar(vm, f"count({{{RECORDED}}})")
    alerts_total = F.scalar(vm, 'count({__name__=~"ALERTS|ALERTS_FOR_STATE"})')
    healthy = 'instance="node-0000"'  # run-000's first node: 8 GPUs, 8 healthy ranks
    raw_parts = counts(vm, f'job="gputrain", {RAW}, {healthy}')
    rec_parts = counts(vm, f'{RECORDED}, {healthy}')
    by_name = {r["metric"]["__name__"]: float(r["value"][1]) for r in F.query(
        vm, f'count by (__name__) ({{{RECORDED}}})')}
    proposed: dict[str, float] = {}  # nothing beside the shipped rules (normalize)
    raw_by_name = {r["metric"]["__name__"]: float(r["value"][1]) for r in F.query(
        vm, f'count by (__name__) ({{job="gputrain", {RAW}}})')}
    usage = {part: {"cpu_cores": round((b.usage[part][0] - a.usage[part][0]) / seconds, 4),
                    "rss_bytes": b.usage[part][1]}
             for part in b.usage if part in a.usage}
    busy = (b.machine[0] - a.machine[0]) / (b.machine[1] - a.machine[1])
    rows_in = rate(a.vm, b.vm, seconds, "vm_rows_inserted_total")
    raw_rows = rate(a.vmagent, b.vmagent, seconds, "vmagent_remotewrite_block_size_rows_sum")
    rec_rows = rate(a.node_ruler, b.node_ruler, seconds, "vmalert_remotewrite_sent_rows_total")
    glob_rows = rate(a.global_ruler, b.global_ruler, seconds,
                     "vmalert_remotewrite_sent_rows_total")
    raw_bytes = rate(a.vmagent, b.vmagent, seconds, "vmagent_remotewrite_bytes_sent_total")
    rec_bytes = rate(a.node_ruler, b.node_ruler, seconds, "vmalert_remotewrite_sent_bytes_total")
    scrapes = b.pages["scrapes"] - a.pages["scrapes"]
    page = {"scrapes_per_s": scrapes / seconds,
            "bytes_per_scrape": (b.pages["bytes"] - a.pages["bytes"]) / max(1, scrapes),
            "gzip_bytes_per_scrape": (b.pages["gzip_bytes"] - a.pages["gzip_bytes"])
            / max(1, scrapes),
            "render_ms": 1e3 * (b.pages["render_seconds"] - a.pages["render_seconds"])
            / max(1, scrapes),
            "fetch_errors": b.pages["fetch_errors"]}
    import requests

    requests.get(vm + "/internal/force_flush", timeout=60)
    vmm = F.metrics(vm)
    size = F.total(vmm, "vm_data_size_bytes")
    rows = F.total(vmm, "vm_rows", type="storage/big") + F.total(vmm, "vm_rows",
                                                                 type="storage/small")
    out: dict[str, Any] = {
        "nodes_live": live, "ranks_live": ranks_live, "gpus_live": 8 * live,
        "machine_busy": round(busy, 3),
        "series": {"raw": raw_total, "recorded": recorded_total, "alerts": alerts_total,
                   "raw_per_node": raw_total / live, "recorded_per_node": recorded_total / live,
                   "raw_parts": raw_parts, "recorded_parts": rec_parts,
                   "recorded_by_rule": by_name, "raw_by_name": raw_by_name,
                   "proposed": proposed,
                   "vm_active": F.total(vmm, "vm_cache_entries",
                                        type="storage/hour_metric_ids")},
        "samples_per_s": {"ingested": rows_in, "raw": raw_rows, "recorded": rec_rows,
                          "global_ruler": glob_rows},
        "remote_write": {"raw_bytes_per_node_min": raw_bytes * 60 / live,
                         "results_bytes_per_node_min": rec_bytes * 60 / live,
                         "raw_bytes_per_sample": raw_bytes / raw_rows if raw_rows else None,
                         "vmalert_dropped_rows": F.total(b.node_ruler,
                                                         "vmalert_remotewrite_dropped_rows_"
                                                         "total")},
        "vm": {"data_bytes": size, "rows": rows,
               "bytes_per_sample": size / rows if rows else None,
               "rss_peak_bytes": F.total(vmm, "process_resident_memory_peak_bytes")},
        "usage": usage,
        "rulers": {"vmalert-node": groups_of(a.node_ruler, b.node_ruler),
                   "vmalert-global": groups_of(a.global_ruler, b.global_ruler)},
        "rules": rules.table(),
        "page": page,
        "scrape": {"scrape_duration_mean_s": (
            (F.total(b.vmagent, "vm_promscrape_scrape_duration_seconds_sum")
             - F.total(a.vmagent, "vm_promscrape_scrape_duration_seconds_sum"))
            / max(1.0, F.total(b.vmagent, "vm_promscrape_scrape_duration_seconds_count")
                  - F.total(a.vmagent, "vm_promscrape_scrape_duration_seconds_count"))),
            "scrapes_failed": F.total(b.vmagent, "vm_promscrape_scrapes_failed_total")},
    }
    if fleet.shard is not None:
        m = len(fleet.shard_nodes)
        shard_bytes = (b.sink - a.sink) / seconds
        head = F.total(F.metrics(fleet.shard.url), "prometheus_tsdb_head_series")
        out["shard"] = {
            "nodes": m, "results_bytes_per_node_min": shard_bytes * 60 / m,
            "samples_sent_per_s": rate(a.shard, b.shard, seconds,
                                       "prometheus_remote_storage_samples_total"),
            "head_series": head, "head_series_per_node": head / m,
            "rss_bytes": usage["prometheus shard"]["rss_bytes"],
            "rss_bytes_per_series": usage["prometheus shard"]["rss_bytes"] / head if head
            else None,
            "cpu_cores": usage["prometheus shard"]["cpu_cores"], "groups": {}}
        for key, value in b.shard.items():  # rule_group="<file>;<group>"
            if key.startswith("prometheus_rule_group_last_duration_seconds{"):
                group = key.split('rule_group="', 1)[1].split('"', 1)[0].rsplit(";", 1)[-1]
                out["shard"]["groups"][group] = {"last_s": value}
    return out


# --------------------------------------------------------------------------------------------
# printing


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def show(r: dict) -> None:
    s, sp, rw = r["series"], r["samples_per_s"], r["remote_write"]
    an = r["anchors"]
    print(f"\n{r['date']}  {r['nodes']} nodes ({r['nodes_live']} live after the planted death), "
          f"{r['ranks_live']} ranks, {r['gpus_live']} GPUs; window {r['window_s']:.0f} s; "
          f"machine busy {100 * r['machine_busy']:.0f} % of 2 cores")
    print(f"{'':34} {'total':>10} {'per node':>9} {'per GPU':>8} {'per rank':>9}")
    rp, cp = s["raw_parts"], s["recorded_parts"]
    print(f"{'raw series (scraped)':34} {s['raw']:10,.0f} {s['raw_per_node']:9.1f} "
          f"{rp['gpu']:8.0f} {rp['rank']:9.0f}   (a node's own: {rp['node']:.0f})")
    print(f"{'recorded series (node rules)':34} {s['recorded']:10,.0f} "
          f"{s['recorded_per_node']:9.1f} {cp['gpu']:8.0f} {cp['rank']:9.0f}   "
          f"(a node's own: {cp['node']:.0f})")
    print(f"{'  anchor: node_exporter page here':34} {'':10} {an['node_exporter']['series']:9}")
    dc = an["dcgm_exporter"]
    print(f"{'  anchor: dcgm-exporter default':34} {'':10} "
          f"{dc['default_counters_per_node']:9} {dc['default_counters_per_gpu']:8}   "
          f"(dcp-metrics-included: {dc['dcp_included_per_gpu']} per GPU)")
    print(f"samples/s into VictoriaMetrics: {sp['ingested']:,.0f} (raw {sp['raw']:,.0f}, "
          f"recorded {sp['recorded']:,.0f}, global ruler {sp['global_ruler']:,.0f}); "
          f"{sp['ingested'] / r['nodes_live']:.1f} per node")
    print(f"remote-write per node per minute: raw {rw['raw_bytes_per_node_min'] / 1024:.1f} KiB"
          f" (vmagent), results {rw['results_bytes_per_node_min'] / 1024:.1f} KiB (vmalert); "
          f"vmalert dropped {rw['vmalert_dropped_rows']:.0f} rows")
    if "shard" in r:
        sh = r["shard"]
        print(f"prometheus shard over {sh['nodes']} nodes: results remote-written "
              f"{sh['results_bytes_per_node_min'] / 1024:.1f} KiB per node per minute; "
              f"{sh['head_series_per_node']:.0f} head series per node (raw + recorded), "
              f"{mib(sh['rss_bytes'])} RSS ({sh['rss_bytes_per_series'] or 0:.0f} B/series), "
              f"{sh['cpu_cores']:.3f} cores")
    vm = r["vm"]
    print(f"victoria-metrics: {r['usage']['victoria-metrics']['cpu_cores']:.3f} cores, RSS "
          f"{mib(r['usage']['victoria-metrics']['rss_bytes'])} (peak {mib(vm['rss_peak_bytes'])}),"
          f" {vm['bytes_per_sample'] or 0:.2f} bytes/sample on disk after the run")
    for part in ("vmagent", "vmalert-node", "vmalert-global", "alertmanager",
                 "page server", "template daemons", "training clients"):
        u = r["usage"].get(part)
        if u:
            print(f"  {part:18} {u['cpu_cores']:.3f} cores  RSS {mib(u['rss_bytes'])}")
    for ruler, groups in r["rulers"].items():
        for g, v in sorted(groups.items()):
            mean = f"{v['mean_s']:.3f}" if v["mean_s"] is not None else "-"
            print(f"  {ruler:15} {g:24} mean {mean} s  worst {v['max_s'] or 0:.3f} s  "
                  f"iterations {v['iterations']:.0f}  missed {v['missed']:.0f}")
    print("slowest rules (mean evaluation, s; samples they return):")
    for e in [e for e in r["rules"] if e["ruler"] != "prometheus-shard"][:8]:
        print(f"  {e['ruler']:15} {e['rule'][:62]:62} {e['mean_s'] or 0:7.3f} "
              f"{e['samples']:8}")
    if r.get("probes"):
        total = sum(e["seconds"] for e in r["probes"])
        print(f"each rule's query alone, best of 3 (s; series returned); all {len(r['probes'])}"
              f" rules: {total:.2f} s:")
        for e in r["probes"][:8]:
            print(f"  {e['level']:6} {e['rule'][:70]:70} {e['seconds']:7.3f} {e['series']:7}")
    pr = r.get("proposals") or {}
    if pr.get("rules"):
        for level in ("node", "global"):
            rows = [e for e in pr["rules"] if e["level"] == level]
            before = sum(e["before_s"] for e in rows)
            after = sum(e["after_s"] for e in rows)
            same = all(e["same"] for e in rows)
            print(f"proposal, {level} alerts reading the two recorded guards: {len(rows)} "
                  f"alerts {before:.3f} s -> {after:.3f} s "
                  f"({'the same answers' if same else 'ANSWERS DIFFER'})")
        strag = [e for e in pr["rules"] if e["alert"] == "GpuTrainStragglerRank"]
        for e in strag:
            print(f"  GpuTrainStragglerRank: {e['before_s']:.3f} s -> {e['after_s']:.3f} s, "
                  f"{e['chars_before']:,} -> {e['chars_after']:,} characters")
        for e in pr["added"]:
            print(f"  + {e['record']}: {e['seconds']:.3f} s, {e['series']} series")
    p = r["page"]
    print(f"page server: {p['scrapes_per_s']:.1f} scrapes/s, {p['bytes_per_scrape'] / 1024:.0f} "
          f"KiB a page ({p['gzip_bytes_per_scrape'] / 1024:.1f} KiB gzipped), "
          f"{p['render_ms']:.2f} ms a page; node_exporter's page here: "
          f"{an['node_exporter']['bytes'] / 1024:.0f} KiB "
          f"({an['node_exporter']['gzip_bytes'] / 1024:.1f} KiB gzipped)")
    al = r["alerts"]
    ok = not (al["missing"] or al["unexpected"] or al["duplicated"])
    print(f"planted faults: {'exactly these fired, once each' if ok else 'MISMATCH'} "
          f"({al['expected']} expected: 1 straggler, 8 ranks x 2 tiers input-bound, 1 exporter "
          f"down; {al['received']} received; missing {len(al['missing'])}, unexpected "
          f"{len(al['unexpected'])}, duplicated {len(al['duplicated'])})")
    for k in ("missing", "unexpected", "duplicated"):
        for x in al[k][:10]:
            print(f"  {k}: {x}")


# --------------------------------------------------------------------------------------------
# the fit


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """The power-law exponent of y against x (log-log least squares)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    return fit([p[0] for p in pts], [p[1] for p in pts])[1]


FIGURES = [
    ("raw series", lambda r: r["series"]["raw"], "{:,.0f}"),
    ("recorded series", lambda r: r["series"]["recorded"], "{:,.0f}"),
    ("samples/s into VM", lambda r: r["samples_per_s"]["ingested"], "{:,.0f}"),
    ("VM RSS (MiB)", lambda r: r["usage"]["victoria-metrics"]["rss_bytes"] / 2**20, "{:,.0f}"),
    ("VM cores", lambda r: r["usage"]["victoria-metrics"]["cpu_cores"], "{:.3f}"),
    ("vmagent RSS (MiB)", lambda r: r["usage"]["vmagent"]["rss_bytes"] / 2**20, "{:,.0f}"),
    ("vmagent cores", lambda r: r["usage"]["vmagent"]["cpu_cores"], "{:.3f}"),
    ("vmalert-node cores", lambda r: r["usage"]["vmalert-node"]["cpu_cores"], "{:.3f}"),
    ("raw remote-write (KiB/min)", lambda r: r["remote_write"]["raw_bytes_per_node_min"]
     * r["nodes_live"] / 1024, "{:,.0f}"),
    ("results remote-write (KiB/min)", lambda r: r["remote_write"]["results_bytes_per_node_min"]
     * r["nodes_live"] / 1024, "{:,.0f}"),
    ("recording group (s)", lambda r: r["rulers"]["vmalert-node"]["gputrain.recording"]
     ["mean_s"], "{:.3f}"),
    ("liveness group (s)", lambda r: r["rulers"]["vmalert-node"]["gputrain.liveness"]["mean_s"],
     "{:.3f}"),
    ("node alerts group (s)", lambda r: r["rulers"]["vmalert-node"]["gputrain.alerts"]
     ["mean_s"], "{:.3f}"),
    ("global alerts group (s)", lambda r: r["rulers"]["vmalert-global"]
     ["gputrain.global.alerts"]["mean_s"], "{:.3f}"),
]


def normalize(r: dict) -> dict:
    """A run recorded before the proposals' series were told apart from the shipped rules'
    results: take them out (their series counted exactly, their samples as one a series per
    liveness interval, 10 s, which is how their vmalert writes them)."""
    s = r["series"]
    if "proposed" in s:
        return r
    proposed = {k: s["recorded_by_rule"].pop(k) for k in PROPOSED if k in s["recorded_by_rule"]}
    s["proposed"] = proposed
    s["recorded"] -= sum(proposed.values())
    s["recorded_per_node"] = s["recorded"] / r["nodes_live"]
    if PROPOSED[0] in proposed:
        s["recorded_parts"]["rank"] -= 1
    if PROPOSED[1] in proposed:
        s["recorded_parts"]["node"] -= 1
    rows = sum(proposed.values()) / 10.0
    r["samples_per_s"]["ingested"] -= rows
    r["samples_per_s"]["proposals (not counted)"] = rows
    r["normalized"] = True
    return r


def show_fit(runs: list[dict]) -> None:
    runs = sorted(runs, key=lambda r: r["nodes"])
    xs = [float(r["nodes_live"]) for r in runs]
    print("figure against live nodes: the runs, a + b*N by least squares, the power-law "
          "exponent, and the line at 1,000 and 10,000 nodes")
    head = "".join(f"{'N=' + str(int(x)):>12}" for x in xs)
    print(f"{'figure':32}{head}{'b (per node)':>14}{'exp':>6}{'1,000':>12}{'10,000':>12}")
    for name, get, fmt in FIGURES:
        try:
            ys = [float(get(r)) for r in runs]
        except (KeyError, TypeError):
            continue
        a, b = fit(xs, ys)
        e = exponent(xs, ys)
        cells = "".join(f"{fmt.format(y):>12}" for y in ys)
        print(f"{name:32}{cells}{b:14.4g}{(f'{e:.2f}' if e is not None else '-'):>6}"
              f"{fmt.format(a + b * 1000):>12}{fmt.format(a + b * 10000):>12}")
    # each rule's cost against N: which grows faster than the fleet. The probes (each query
    # alone, best of 3) where the runs have them, else vmalert's own times (noisier)
    per_rule: dict[tuple, list[tuple[float, float, int]]] = {}
    probed = all(r.get("probes") for r in runs)
    for r, x in zip(runs, xs, strict=True):
        if probed:
            for e in r["probes"]:
                key = (e["level"], e["group"], e["index"], e["rule"])
                per_rule.setdefault(key, []).append((x, e["seconds"], e["series"]))
        else:
            for e in r["rules"]:
                if e["mean_s"] and e["ruler"] != "prometheus-shard":
                    key = (e["ruler"], e["group"], e["index"], e["rule"])
                    per_rule.setdefault(key, []).append((x, e["mean_s"], e["samples"]))
    rows = []
    for key, pts in per_rule.items():
        if len(pts) == len(runs):
            e = exponent([p[0] for p in pts], [p[1] for p in pts])
            rows.append((pts[-1][1], e if e is not None else 0.0, key, pts))
    rows.sort(key=lambda row: -row[0])
    what = "its query alone, best of 3" if probed else "vmalert's evaluation time"
    print(f"\nrules by their cost at the largest N ({what}, s), the exponent of cost against N "
          "(1: linear) and the series they return at each N:")
    for _last, e, key, pts in rows[:15]:
        times = " ".join(f"{p[1]:.3f}" for p in pts)
        series = "/".join(str(p[2]) for p in pts)
        print(f"  {key[0]:6} {key[3][:58]:58} {times}  exp {e:.2f}  series {series}")
    steep = [row for row in rows if row[1] > 1.15 and row[0] > 0.02]
    print(f"\nrules whose cost grows faster than N (exponent > 1.15, over 20 ms at the largest "
          f"N): {len(steep)}")
    for last, e, key, _ in steep:
        print(f"  {key[3]} ({key[0]}, {key[1]} #{key[2]}): exp {e:.2f}, {last:.3f} s")
    total = [sum(p[1] for key, pts in per_rule.items() for p in pts if p[0] == x) for x in xs]
    print("all rules together: " + ", ".join(f"{t:.2f} s at N={int(x)}"
                                            for t, x in zip(total, xs, strict=True))
          + f" (exponent {exponent(xs, total) or 0:.2f})")
    sizing(runs, xs, total)


def sizing(runs: list[dict], xs: list[float], rule_seconds: list[float]) -> None:
    """The platform team's table: per-node figures (flat in N: their mean over the runs)
    times N, and the lines fitted to what grows with a constant (memory, cores, rule time)."""
    def mean(get: Any) -> float:
        return sum(get(r) for r in runs) / len(runs)

    def line(get: Any) -> tuple[float, float]:
        return fit(xs, [float(get(r)) for r in runs])

    raw_node = mean(lambda r: r["series"]["raw_per_node"])
    rec_node = mean(lambda r: r["series"]["recorded_per_node"])
    raw_sps = mean(lambda r: r["samples_per_s"]["raw"] / r["nodes_live"])
    rec_sps = mean(lambda r: r["samples_per_s"]["recorded"] / r["nodes_live"])
    shard_bw = mean(lambda r: r["shard"]["results_bytes_per_node_min"]) if all(
        "shard" in r for r in runs) else float("nan")
    raw_bw = mean(lambda r: r["remote_write"]["raw_bytes_per_node_min"])
    vm_rss = line(lambda r: r["usage"]["victoria-metrics"]["rss_bytes"] / 2**30)
    vm_cores = line(lambda r: r["usage"]["victoria-metrics"]["cpu_cores"])
    ruler_cores = line(lambda r: r["usage"]["vmalert-node"]["cpu_cores"]
                       + r["usage"]["vmalert-global"]["cpu_cores"]
                       + r["usage"]["vmagent"]["cpu_cores"])
    rules_line = fit(xs, rule_seconds) if rule_seconds and all(rule_seconds) else (0.0, 0.0)
    print(f"\nper node (mean of the runs): {raw_node:.0f} raw series, {rec_node:.0f} results, "
          f"{raw_sps:.1f} raw and {rec_sps:.1f} results samples/s, remote-write "
          f"{raw_bw / 1024:.1f} KiB/min raw (vmagent), {shard_bw / 1024:.1f} KiB/min results "
          "(a shard)")
    print(f"{'nodes':>7} {'raw series':>11} {'results':>10} {'VM GiB*':>8} {'VM cores*':>10} "
          f"{'agent+rulers cores*':>20} {'results MB/min':>15} {'raw MB/min':>11} "
          f"{'rules s/pass*':>14}")
    for n in (100, 1000, 10000):
        print(f"{n:7,} {raw_node * n:11,.0f} {rec_node * n:10,.0f} "
              f"{vm_rss[0] + vm_rss[1] * n:8.1f} {vm_cores[0] + vm_cores[1] * n:10.2f} "
              f"{ruler_cores[0] + ruler_cores[1] * n:20.2f} {shard_bw * n / 1e6:15.1f} "
              f"{raw_bw * n / 1e6:11.1f} {rules_line[0] + rules_line[1] * n:14.1f}")
    print("* a line through the runs (one VictoriaMetrics holding raw and results, this "
          "machine's cores): an extrapolation past the largest N")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=50)
    p.add_argument("--minutes", type=float, default=5.0,
                   help="how long the fleet is watched once every node was scraped")
    p.add_argument("--warm", type=float, default=90.0,
                   help="seconds before the measured window opens")
    p.add_argument("--grace", type=float, default=180.0,
                   help="seconds past the window to wait for a planted alert still on its way")
    p.add_argument("--shard-nodes", type=int, default=0,
                   help="a Prometheus shard over this many nodes too (results-only remote "
                        "write into a byte-counting sink)")
    p.add_argument("--vmalert-queue", type=int, default=None,
                   help="the node vmalert's -remoteWrite.maxQueueSize (default: vmalert's)")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="skip timing each rule's query against VictoriaMetrics at the end")
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--out", type=Path, help="write the figures here (JSON)")
    p.add_argument("--fit", type=Path, nargs="+", help="runs' JSON: slopes and extrapolation")
    ns = p.parse_args()
    if ns.fit:
        runs = [normalize(json.loads(f.read_text())) for f in ns.fit]
        for r in sorted(runs, key=lambda r: r["nodes"]):
            show(r)
        print()
        show_fit(runs)
        return
    result = run(ns)
    show(result)
    out = ns.out or Path(tempfile.gettempdir()) / f"bench-fleet-{ns.nodes}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nfigures: {out}")


if __name__ == "__main__":
    main()
