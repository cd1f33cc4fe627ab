"""Scaling out, end to end with real servers only (no cluster needed), from the shipped configs
in deploy/scale-out/ with only targets, URLs and timings replaced:

- four demo daemons: node-1, node-2 and node-3 of cluster ``a``, and a node-1 of cluster ``b``
  (the same instance name, so only the ``cluster`` label tells them apart);
- two Prometheus shards for cluster a (a1 scrapes node-1 and node-2 as job ``gputrain``, a2
  scrapes node-3 as job ``gputrain-rack3``) and one for cluster b, each with the node rules and
  its own external labels, remote-writing the results to Debian's ``victoria-metrics``;
- ``vmalert`` evaluating the global rules against it; shards and vmalert deliver to one real
  Alertmanager, which posts to a webhook here; a federating Prometheus as the other global
  layer the README offers.

Runs: ``llm`` in cluster a, six ranks over the three nodes (so over both shards and both job
names), rank 5 waiting for data; ``starved``, input-bound on node-1 and node-3; and ``llm`` in
cluster b, two ranks that both wait (no straggler among themselves, but every one of them a
straggler if the two clusters' runs were merged).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import requests
import yaml
from conftest import (
    NO_HOST,
    ROOT,
    Alertmanager,
    Daemon,
    Prometheus,
    Server,
    Webhook,
    free_port,
    require_binary,
    series_parts,
    stop_all,
    synthetic_client,
    wait_until,
)

DEPLOY = ROOT / "deploy" / "scale-out"
# what the test shortens, through the thresholds file as a user would; run_labels as the
# README says for several clusters
THRESHOLDS = {
    "run_labels": ["cluster", "run"],
    "recording_interval": "1s",
    # sleeps on a busy 2-core machine vary more than a real step's compute time
    "thresholds": {"straggler_compute_factor": 2.0},
    "for": {"GpuTrainStragglerRank": "5s", "GpuTrainInputBound": "5s",
            "GpuTrainExporterDown": "5s"},
}
SETTLE_S = 10  # how long the rules are evaluated, after an alert's first copy, for a second


def exporter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def victoria_metrics(tmp: Path) -> Server:
    """Debian's victoria-metrics with the shipped ARGS, its data in ``tmp``."""
    binary = require_binary("victoria-metrics", package="victoria-metrics")
    text = (DEPLOY / "victoria-metrics.default").read_text()
    args = shlex.split(re.search(r'^ARGS="(.*)"$', text, re.M).group(1))
    port = free_port()
    changed = {"-storageDataPath": str(tmp / "data"), "-search.latencyOffset": "1s"}
    args = [f"{a.split('=')[0]}={changed[a.split('=')[0]]}" if a.split("=")[0] in changed
            else a for a in args]
    args += [f"-httpListenAddr=127.0.0.1:{port}", "-search.disableCache"]
    return Server([binary, *args], tmp, f"http://127.0.0.1:{port}", "/health")


def vmalert(tmp: Path, rules: Path, vm: str, alertmanager: str) -> Server:
    """vmalert with the shipped unit's flags, the URLs pointed at this test's servers."""
    binary = require_binary("vmalert", package="victoria-metrics")
    unit = (DEPLOY / "vmalert.service").read_text().replace("\\\n", " ")
    exec_start = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))
    port = free_port()
    changed = {"-rule": str(rules), "-datasource.url": vm, "-remoteWrite.url": vm,
               "-remoteRead.url": vm, "-notifier.url": alertmanager,
               "-evaluationInterval": "1s", "-httpListenAddr": f"127.0.0.1:{port}"}
    flags = {a.split("=", 1)[0] for a in exec_start[1:]}
    assert set(changed) <= flags, f"the shipped unit lost a flag: {set(changed) - flags}"
    args = [f"{a.split('=', 1)[0]}={changed[a.split('=', 1)[0]]}" for a in exec_start[1:]]
    return Server([binary, *args], tmp, f"http://127.0.0.1:{port}", "/health")


def shard(tmp: Path, name: str, cluster: str, job: str, nodes: dict[str, Daemon],
          rules: Path, vm: str, alertmanager: str) -> Prometheus:
    """A Prometheus shard from deploy/scale-out/prometheus-shard.yml: its nodes in a file_sd
    file as the comments say, its external labels, its rules, remote-write to ``vm``."""
    d = tmp / f"shard-{name}"
    (d / "targets").mkdir(parents=True)
    (d / "targets" / "gputrain-nodes.yml").write_text(yaml.safe_dump(
        [{"targets": [n.url.removeprefix("http://")], "labels": {"instance": inst}}
         for inst, n in nodes.items()]))
    cfg = yaml.safe_load((DEPLOY / "prometheus-shard.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s",
                         external_labels={"cluster": cluster, "shard": name})
    cfg["rule_files"] = [str(rules)]
    cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
        alertmanager.removeprefix("http://")]
    (scrape,) = cfg["scrape_configs"]
    scrape["job_name"] = job
    scrape["file_sd_configs"][0]["files"] = [str(d / "targets" / "gputrain-*.yml")]
    (remote,) = cfg["remote_write"]
    remote["url"] = f"{vm}/api/v1/write"
    remote["queue_config"]["batch_send_deadline"] = "1s"
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    return Prometheus(d, [], config_file=d / "prometheus.yml")


def federation(tmp: Path, shards: list[Prometheus], rules: Path) -> Prometheus:
    """The federating global Prometheus of deploy/scale-out/prometheus-global-federate.yml
    (its alerts read from ALERTS here, so Alertmanager counts vmalert's alone)."""
    d = tmp / "federate"
    d.mkdir()
    cfg = yaml.safe_load((DEPLOY / "prometheus-global-federate.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(rules)]
    del cfg["alerting"]
    (scrape,) = cfg["scrape_configs"]
    assert scrape["honor_labels"] is True
    scrape["static_configs"][0]["targets"] = [s.url.removeprefix("http://") for s in shards]
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    return Prometheus(d, [], config_file=d / "prometheus.yml")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaleout")
    started: list = []
    try:
        thresholds = tmp / "thresholds.yml"
        thresholds.write_text(yaml.safe_dump(THRESHOLDS))
        rules = {}
        for level in ("node", "global"):
            out = exporter("rules", "--level", level, "--config", str(thresholds))
            assert out.returncode == 0, out.stderr
            rules[level] = tmp / f"gputrain.{level}.rules.yml"
            rules[level].write_text(out.stdout)

        vm = victoria_metrics(tmp).start()
        started.append(vm)
        hook = Webhook()
        am_config = tmp / "alertmanager.yml"
        am_config.write_text(yaml.safe_dump({
            # every alert its own group: a copy from a second server is a second notification
            "route": {"receiver": "hook", "group_by": ["..."], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": hook.url}]}],
        }))
        am = Alertmanager(tmp, am_config).start()
        started.append(am)

        nodes = {}
        for name in ("a/node-1", "a/node-2", "a/node-3", "b/node-1"):
            # cluster b's node without its host collectors, so that its ranks' verdict is
            # theirs alone (cluster a's nodes keep them: the sizes are measured there)
            host = NO_HOST if name.startswith("b/") else ()
            nodes[name] = Daemon("--gpu.backend=demo", "--demo.gpus=2", *host).start()
            started.append(nodes[name])
        flops = ("--flops-per-sample", "1e9")  # so MFU reaches the global layer too
        fast = ("--batch-size", "16", "--data-wait-ms", "0", "--compute-ms", "20", *flops)
        waits = ("--batch-size", "16", "--data-wait-ms", "20", "--compute-ms", "20", *flops)
        starved = ("--batch-size", "16", "--data-wait-ms", "30", "--compute-ms", "10", *flops)
        for run, node, rank, args in [
            ("llm", "a/node-1", 0, fast), ("llm", "a/node-1", 1, fast),
            ("llm", "a/node-2", 2, fast), ("llm", "a/node-2", 3, fast),
            ("llm", "a/node-3", 4, fast), ("llm", "a/node-3", 5, waits),
            ("starved", "a/node-1", 0, starved), ("starved", "a/node-3", 1, starved),
            ("llm", "b/node-1", 0, waits), ("llm", "b/node-1", 1, waits),
        ]:
            started.append(synthetic_client(run, nodes[node].ingest_url, *args, rank=rank,
                                            gpu=rank % 2))

        shards = {
            "a1": shard(tmp, "a1", "a", "gputrain", {"node-1": nodes["a/node-1"],
                                                     "node-2": nodes["a/node-2"]},
                        rules["node"], vm.url, am.url),
            "a2": shard(tmp, "a2", "a", "gputrain-rack3", {"node-3": nodes["a/node-3"]},
                        rules["node"], vm.url, am.url),
            "b1": shard(tmp, "b1", "b", "gputrain", {"node-1": nodes["b/node-1"]},
                        rules["node"], vm.url, am.url),
        }
        for s in shards.values():
            started.append(s.start())
        ruler = vmalert(tmp, rules["global"], vm.url, am.url).start()
        started.append(ruler)
        federate = federation(tmp, list(shards.values()), rules["global"]).start()
        started.append(federate)
        yield {"hook": hook, "am": am, "vm": vm, "vmalert": ruler, "shards": shards,
               "nodes": nodes,
               "federate": federate, "thresholds": thresholds, "tmp": tmp}
    finally:
        stop_all(started)


def firing(hook: Webhook, alertname: str) -> dict[tuple, set]:
    """The distinct label sets of every firing ``alertname`` received, by (cluster, run, rank,
    instance): two label sets for one key is one alert fired twice (by two servers)."""
    out: dict[tuple, set] = {}
    for a in hook.find(alertname):
        if a.get("status") == "firing":
            lab = a["labels"]
            key = (lab.get("cluster"), lab.get("run"), lab.get("rank"), lab.get("instance"))
            out.setdefault(key, set()).add(tuple(sorted(lab.items())))
    return out


def _epoch(stamp: str) -> float:
    """An RFC 3339 time of Prometheus' or vmalert's API (nanoseconds, Z or an offset)."""
    m = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, stamp
    zone = "+00:00" if m[3] == "Z" else m[3]
    return datetime.fromisoformat(m[1] + zone).timestamp() + float(m[2] or 0)


def evaluated_since(server: Server, t: float) -> bool:
    """Every rule of ``server`` (a Prometheus shard or vmalert) was evaluated at ``t`` or
    later."""
    groups = requests.get(server.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    stamps = [r.get("lastEvaluation") for g in groups for r in g["rules"]]
    return bool(stamps) and all(st and _epoch(st) >= t for st in stamps)


def held(am: Alertmanager, alertname: str) -> set:
    """The label sets of every ``alertname`` Alertmanager holds."""
    alerts = requests.get(am.url + "/api/v2/alerts", timeout=10,
                          params={"filter": f'alertname="{alertname}"'}).json()
    return {tuple(sorted(a["labels"].items())) for a in alerts}


def settle(world: dict, alertname: str, expected: set) -> dict[tuple, set]:
    """Wait for ``expected`` keys to fire, then for any copy: every server that evaluates
    rules (the shards, vmalert) has evaluated them SETTLE_S after the first copies arrived
    (and once more, for a copy to reach Alertmanager), and Alertmanager has delivered every
    ``alertname`` it holds. Those events end the window, not a sleep: a busy machine delays
    them, and a copy is never missed for it."""
    hook = world["hook"]
    wait_until(lambda: expected <= set(firing(hook, alertname)), timeout=240,
               what=f"{alertname} for {sorted(expected)} (got {sorted(firing(hook, alertname))})")
    until = time.time() + SETTLE_S
    for server in [*world["shards"].values(), world["vmalert"]]:
        wait_until(lambda server=server: evaluated_since(server, until + 2), timeout=120,
                   what=f"an evaluation of every rule {SETTLE_S + 2} s later on {server.url}")

    def delivered() -> bool:
        got = {labels for copies in firing(hook, alertname).values() for labels in copies}
        return held(world["am"], alertname) <= got

    wait_until(delivered, timeout=60, what=f"Alertmanager to deliver every {alertname}")
    return firing(hook, alertname)


def test_the_straggler_of_a_run_spanning_both_shards_fires_once_at_the_global_layer(world):
    got = settle(world, "GpuTrainStragglerRank", {("a", "llm", "5", "node-3")})
    assert set(got) == {("a", "llm", "5", "node-3")}, (
        "only rank 5 of cluster a's llm lags; cluster b's llm ranks all wait alike, so any of "
        f"them firing means the clusters' runs merged: {got}")
    (labels,) = got[("a", "llm", "5", "node-3")]
    labels = dict(labels)
    assert labels["job"] == "gputrain-rack3" and labels["shard"] == "a2"
    # vmalert evaluates it, not a shard: the shards load no rule comparing ranks
    for s in world["shards"].values():
        loaded = requests.get(s.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert "GpuTrainStragglerRank" not in {r["name"] for g in loaded for r in g["rules"]}


def test_an_input_bound_run_fires_once_per_rank_not_twice(world):
    expected = {("a", "starved", "0", "node-1"), ("a", "starved", "1", "node-3"),
                ("a", "llm", "5", "node-3"), ("b", "llm", "0", "node-1"),
                ("b", "llm", "1", "node-1")}
    got = settle(world, "GpuTrainInputBound", expected)
    assert set(got) == expected
    # one copy of each tier (the info tier covers the warning's range): never a shard's twice
    for copies in got.values():
        severities = sorted(dict(labels)["severity"] for labels in copies)
        assert severities in (["info"], ["info", "warning"]), got


def test_the_federating_global_prometheus_sees_the_same_straggler(world):
    def stragglers():
        return world["federate"].query(
            'ALERTS{alertname="GpuTrainStragglerRank", alertstate="firing"}')

    wait_until(stragglers, timeout=120, what="the straggler on the federating Prometheus")
    got = {(s["metric"].get("cluster"), s["metric"]["run"], s["metric"]["rank"],
            s["metric"]["instance"], s["metric"]["job"]) for s in stragglers()}
    # honor_labels kept each node's job and instance, not the shard's
    assert got == {("a", "llm", "5", "node-3", "gputrain-rack3")}


def diagnose(url: str, thresholds: Path, *args: str) -> subprocess.CompletedProcess:
    return exporter("diagnose", "--prometheus", url, "--config", str(thresholds), "--json",
                    *args)


def test_diagnose_against_victoriametrics_sees_the_whole_run_and_names_the_straggler(world):
    def answer():
        out = diagnose(world["vm"].url, world["thresholds"], "--run", "llm")
        reports = json.loads(out.stdout or "{}").get("ranks", [])
        lagging = [(r["labels"]["cluster"], r["rank"]) for r in reports
                   if "straggler" in r["findings"]]
        return out.returncode == 1 and lagging and (reports, lagging)

    reports, lagging = wait_until(answer, timeout=120, what="diagnose to name the straggler")
    assert lagging == [("a", "5")]
    by_cluster: dict[str, list[str]] = {}
    for r in reports:
        by_cluster.setdefault(r["labels"]["cluster"], []).append(r["rank"])
    assert by_cluster == {"a": ["0", "1", "2", "3", "4", "5"], "b": ["0", "1"]}
    # VictoriaMetrics holds the recorded series only (results-only remote-write)
    assert {r["source"] for r in reports} == {"recorded"}
    assert all(r["partial"] == "" for r in reports)
    # cluster b's ranks wait for data (their node reads no host: nothing refines it)
    assert [r["verdict"] for r in reports if r["labels"]["cluster"] == "b"] == \
        ["input-bound", "input-bound"], reports


def test_diagnose_against_one_shard_says_it_sees_part_of_the_run(world):
    out = diagnose(world["shards"]["a1"].url, world["thresholds"], "--run", "llm")
    reports = json.loads(out.stdout)["ranks"]
    assert sorted(r["rank"] for r in reports) == ["0", "1", "2", "3"]
    assert all("external labels" in r["partial"] and 'shard="a1"' in r["partial"]
               for r in reports), reports[0]["partial"]
    text = exporter("diagnose", "--prometheus", world["shards"]["a1"].url, "--config",
                    str(world["thresholds"]), "--run", "llm").stdout
    assert "partly visible" in text


def test_the_overview_dashboard_reads_the_global_layer(world):
    """Its queries need only what the shards send (results and info series): each answers on
    VictoriaMetrics, and the Runs table lists both clusters' ranks."""
    from exporter.heuristics.dashboards import dashboards

    overview = dashboards(THRESHOLDS)["overview.json"]
    assert overview["templating"]["list"][1]["name"] == "cluster"

    def query(expr: str) -> list[dict]:
        expr = expr.replace("$cluster", ".*").replace("$__range", "5m")
        body = requests.get(world["vm"].url + "/api/v1/query", params={"query": expr},
                            timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    runs = next(p for p in overview["panels"] if p["title"] == "Runs")
    for t in runs["targets"]:
        rows = wait_until(lambda t=t: query(t["expr"]), timeout=60, what=t["expr"])
        assert {r["metric"].get("cluster") for r in rows} == {"a", "b"}, t["expr"]
    for panel in overview["panels"]:
        for t in panel.get("targets", []):
            query(t["expr"])


def test_sizes_at_the_global_layer(world):
    """Series per node, per GPU and per rank, raw on a shard and recorded at the global
    layer, and VictoriaMetrics' bytes per sample: the README's sizing note comes from here
    (GPUTRAIN_SCALEOUT_FIGURES=file writes them)."""
    a1 = world["shards"]["a1"]

    def counts(prom_query, selector: str) -> dict[str, float]:
        out = {}
        for part, q in series_parts(selector).items():
            values = [float(r["value"][1]) for r in prom_query(q)]
            assert values, q
            out[part] = max(values)
        return out

    vm = world["vm"]

    def vm_query(q: str) -> list[dict]:
        body = requests.get(vm.url + "/api/v1/query", params={"query": q}, timeout=10).json()
        return body["data"]["result"]

    # Count only once every series exists: the straggler fires 5 s after the rules' first
    # results, by when each rule that has data has recorded; then VictoriaMetrics must hold
    # every recorded series the shard holds for that rank (remote-write lags a little).
    wait_until(lambda: firing(world["hook"], "GpuTrainStragglerRank"), timeout=240,
               what="the straggler, as a sign that every rule has recorded")

    def names(prom_query, selector: str) -> set[str]:
        return {r["metric"]["__name__"] for r in prom_query(f'{{__name__=~".+:.+", {selector}}}')}

    a2 = world["shards"]["a2"]
    wait_until(lambda: names(vm_query, 'cluster="a", run="llm", rank="5"')
               == names(a2.query, 'run="llm", rank="5"'), timeout=60,
               what="VictoriaMetrics to hold every recorded series of rank 5")
    raw = counts(a1.query, 'job=~"gputrain.*", __name__!~".+:.+"')

    recorded = counts(vm_query, 'cluster="a", job=~"gputrain.*"')
    # what the global layer saves is per node: a rank's results (the quantiles, the shares of
    # each phase, the regime) may number as many as its raw series, a node's and a GPU's fewer
    assert recorded["rank"] > 0 and raw["gpu"] > recorded["gpu"] > 0
    assert raw["node"] > recorded["node"]
    requests.get(vm.url + "/internal/force_flush", timeout=30)
    text = requests.get(vm.url + "/metrics", timeout=10).text
    size = sum(float(v) for v in re.findall(r'^vm_data_size_bytes\{type="storage/[^"]+"\} (\S+)',
                                             text, re.M))
    rows = sum(float(v) for v in re.findall(r'^vm_rows\{type="storage/[^"]+"\} (\S+)', text,
                                            re.M))
    assert rows > 0 and size > 0

    def per_node(c: dict[str, float], gpus: int = 8, ranks: int = 8) -> float:
        return c["node"] + gpus * c["gpu"] + ranks * c["rank"]

    assert per_node(recorded) < per_node(raw)
    figures = {
        "raw_series": raw, "recorded_series": recorded,
        "raw_series_per_node_8x8": per_node(raw),
        "recorded_series_per_node_8x8": per_node(recorded),
        "global_series_1000_nodes": 1000 * per_node(recorded),
        "bytes_per_sample": round(size / rows, 2), "samples_stored": rows,
    }
    print(json.dumps(figures))
    if os.environ.get("GPUTRAIN_SCALEOUT_FIGURES"):
        Path(os.environ["GPUTRAIN_SCALEOUT_FIGURES"]).write_text(json.dumps(figures, indent=2))


def test_killing_one_daemon_fires_exporter_down_once(world):
    world["nodes"]["a/node-2"].kill()
    got = settle(world, "GpuTrainExporterDown", {("a", None, None, "node-2")})
    assert set(got) == {("a", None, None, "node-2")}, got
    (labels,) = got[("a", None, None, "node-2")]
    assert dict(labels)["shard"] == "a1"
