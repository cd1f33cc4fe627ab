"""The Grafana dashboards: generated, provisionable, and every query proven against a real
Prometheus scraping the daemon (demo GPUs) fed by a real client loop, with the rules loaded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml
from conftest import ROOT, Daemon, Prometheus, rules_file, synthetic_client, wait_until

from exporter.client import TrainingMonitor
from exporter.heuristics import dashboards as generate
from exporter.heuristics.catalogue import THRESHOLDS

DASHBOARDS = ROOT / "grafana" / "dashboards"
def load() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(d: dict) -> list[dict]:
    return [p for p in d["panels"] if p["type"] != "row"]


def exprs(d: dict) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and annotation."""
    out = [(f"{d['uid']} / {p['title']} / {t['refId']}", t["expr"])
           for p in panels(d) for t in p["targets"]]
    out += [(f"{d['uid']} / annotation {a['name']}", a["expr"])
            for a in d["annotations"]["list"] if "expr" in a]
    return out


def test_committed_json_is_the_generator_output():
    generated = generate.dashboards()
    assert set(generated) == {p.name for p in DASHBOARDS.glob("*.json")}
    for name, d in generated.items():
        assert (DASHBOARDS / name).read_text() == generate.render(d), (
            f"grafana/dashboards/{name} is stale: .venv/bin/python scripts/generate.py")


def test_uids_datasource_variable_units_and_links():
    boards = load()
    assert {d["uid"] for d in boards.values()} == {"gputrain-overview", "gputrain-run",
                                                  "gputrain-node"}
    for d in boards.values():
        text = json.dumps(d)
        assert "${DS_" not in text and "__inputs" not in d, "inputs break provisioning"
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for v in variables.values():
            if v["type"] == "query":
                assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for p in panels(d):
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
            assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']} has no unit"
        assert d["links"][0]["tags"] == ["gputrain"] and d["links"][0]["includeVars"]
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids))
    assert {"run", "instance", "rank"} <= {v["name"] for v in
                                           boards["run.json"]["templating"]["list"]}
    assert "instance" in {v["name"] for v in boards["node.json"]["templating"]["list"]}
    overview_links = json.dumps(boards["overview.json"])
    assert "/d/gputrain-run/" in overview_links and "/d/gputrain-node/" in overview_links


def test_heuristics_thresholds_are_drawn():
    run = {p["title"]: p for p in panels(load()["run.json"])}

    def lines(title: str) -> list[float]:
        steps = run[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        return [s["value"] for s in steps if s["value"] is not None]

    t = {name: th.default for name, th in THRESHOLDS.items()}
    assert lines("Data wait") == [t["input_bound"], t["input_bound_high"]]
    assert lines("GPU busy") == [t["gpu_busy_low"], t["gpu_busy_target"]]
    assert lines("PCIe host-to-device against the link") == [t["pcie_rx_high"]]


def test_the_users_thresholds_and_selector_reach_the_dashboards(tmp_path):
    """`dashboards --config` (the file `rules --config` takes) moves the threshold lines and
    the words beside them, and scopes the raw queries to the user's scrape job."""
    cfg = tmp_path / "mine.yml"
    cfg.write_text("selector: 'job=\"gpu-nodes\"'\nthresholds:\n  input_bound: 0.1\n"
                   "  gpu_busy_target: 0.8\n")
    out = subprocess.run([sys.executable, "-m", "exporter", "dashboards", "--config", str(cfg),
                          "--out", str(tmp_path / "d")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    run = json.loads((tmp_path / "d" / "run.json").read_text())
    by_title = {p["title"]: p for p in panels(run)}
    steps = by_title["Data wait"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps if s["value"] is not None] == [0.1, 0.2]
    assert "10 % moderately" in by_title["Data wait"]["description"]
    steps = by_title["GPU busy"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps if s["value"] is not None] == [0.5, 0.8]
    variables = {v["name"]: v for v in run["templating"]["list"]}
    assert 'job="gpu-nodes"' in variables["run"]["query"]["query"]
    raw = [e for _, e in exprs(run) if "gputrain_training_process_resident_memory_bytes" in e]
    assert raw and all('job="gpu-nodes"' in e for e in raw)
    bad = tmp_path / "bad.yml"
    bad.write_text("thresholds:\n  input_boundd: 0.1\n")
    out = subprocess.run([sys.executable, "-m", "exporter", "dashboards", "--config", str(bad),
                          "--out", str(tmp_path / "e")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "input_boundd" in out.stderr
    assert not (tmp_path / "e").exists()


def test_run_labels_become_a_variable_and_part_of_every_selector():
    """With run_labels [cluster, run], two clusters' same-named runs are apart on every
    dashboard: a `cluster` variable, and every query of a gputrain series filters on it."""
    for name, d in generate.dashboards({"run_labels": ["cluster", "run"]}).items():
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[:2] == ["datasource", "cluster"], name
        # a run or a node is in one cluster; the overview may show them all
        assert d["templating"]["list"][1]["includeAll"] == (name == "overview.json")
        exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
        for expr in exprs:
            if re.search(r"\bgputrain_|:gputrain_", expr) and "ALERTS" not in expr:
                assert 'cluster=~"$cluster"' in expr, (name, expr)
        joins = [e for e in exprs if "on (job, instance" in e or "by (job, instance" in e]
        assert not joins, (name, joins)


def test_provisioning_points_at_the_dashboards():
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/gputrain.yml")
                              .read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


def substitute(expr: str, instance: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "5m")
            .replace("$run", "tour")
            .replace('rank=~"$rank"', 'rank=~".*"').replace("$instance", instance))


class _Allreduce:
    """Stands in for a DDP model's meter (no torch here): 40 % of the wall time in the
    all-reduce, half of it exposed, 100 MB a second."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def totals(self) -> dict[str, float]:
        s = time.monotonic() - self.t0
        return {"comm_seconds": 0.4 * s, "comm_exposed_seconds": 0.2 * s, "comm_bytes": 1e8 * s}


def _ddp_rank(endpoint: str, stop: threading.Event) -> None:
    """Rank 2 of the run 'tour' (on demo GPU 2 of 3: one rank a GPU, and GPU 1 stays
    unused), stepping every 20 ms, with its gradient communication."""
    m = TrainingMonitor(run="tour", rank=2, endpoint=endpoint, push_interval=0.5)
    with m.step(samples=32):
        time.sleep(0.02)
    m._comm.append(_Allreduce())
    while not stop.is_set():
        with m.step(samples=32):
            time.sleep(0.02)
    m.close()


@pytest.fixture(scope="module")
def fed_prometheus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    # This machine's NIC reports no speed (as cloud NICs do): configure one, as users would.
    # a process no client reports shares GPU 0 with the run, as on a time-sliced GPU
    # NCCL Inspector's textfiles, as its README documents them, for the bus bandwidth panel
    daemon = Daemon("--gpu.backend=demo", "--demo.gpus=3", "--demo.load=0.3",
                    "--demo.foreign-load=0.1", "--host.netdev-speed=10Gbit",
                    "--collector.nccl",
                    f"--nccl.inspector-dir={ROOT / 'tests' / 'data' / 'nccl_inspector'}").start()
    stop = threading.Event()
    ddp = threading.Thread(target=_ddp_rank, args=(daemon.ingest_url, stop), daemon=True)
    ddp.start()
    client = synthetic_client("tour", daemon.ingest_url, "--batch-size", "32",
                              "--data-wait-ms", "20", "--compute-ms", "10", "--callback-ms", "5",
                              "--flops-per-sample", "1e9")
    rules = rules_file(tmp, {"recording_interval": "1s", "for": {"GpuTrainInputBound": "1s"}})
    prom = Prometheus(tmp, [daemon.url.removeprefix("http://")], rule_files=[str(rules)])
    try:
        prom.start()
        wait_until(lambda: prom.query("run_rank_gpu:gputrain_gpu_busy_ratio:rate5m >= 0")
                   and prom.query('ALERTS{alertstate="firing"}')
                   and prom.query("run_rank_phase:gputrain_training_phase_ratio:rate5m"),
                   timeout=90, what="recording rules and a firing alert")
        yield prom, daemon
    finally:
        stop.set()
        ddp.join(timeout=10)
        client.kill()
        client.wait()
        prom.stop()
        daemon.stop()


def test_every_panel_query_parses_and_returns_data(fed_prometheus):
    prom, daemon = fed_prometheus
    instance = daemon.url.removeprefix("http://")
    empty = []
    for d in load().values():
        for where, expr in exprs(d):
            if not prom.query(substitute(expr, instance)):
                empty.append(f"{where}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_variable_query_finds_values(fed_prometheus):
    prom, daemon = fed_prometheus
    instance = daemon.url.removeprefix("http://")
    for d in load().values():
        for v in d["templating"]["list"]:
            if v["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
            assert m, v["query"]
            result = prom.query(substitute(m[1], instance))
            assert any(m[2] in r["metric"] for r in result), f"{d['uid']} ${v['name']}"


def test_no_metric_name_that_nothing_produces(fed_prometheus):
    _, daemon = fed_prometheus
    text = daemon.metrics()
    produced = set(re.findall(r"^(\w+)[{ ]", text, re.M))
    # families with no series yet (Xid errors) are declared in the collectors and the GPU
    # metric descriptors
    reading = ROOT / "exporter" / "reading"
    for path in [*(reading / "collectors").glob("*.py"), reading / "gpu_metrics.py"]:
        produced |= set(re.findall(r'"(gputrain_\w+)"', path.read_text()))
    rules = yaml.safe_load((ROOT / "alerts" / "gputrain.rules.yml").read_text())
    produced |= {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    produced |= {"ALERTS"}
    for d in load().values():
        for where, expr in exprs(d):
            for name in re.findall(r"\b(gputrain_\w+|\w+:\w+:\w+|ALERTS)\b", expr):
                assert name in produced, f"{where}: {name} is produced by nothing"


def test_the_panels_the_runbook_points_to_exist():
    titles = {p["title"] for d in load().values() for p in panels(d)}
    runbook = (ROOT / "alerts" / "runbook.md").read_text()
    lines = [line for line in runbook.splitlines() if line.startswith("Dashboard:")]
    assert len(lines) == runbook.count("\n## ")
    named = {t for line in lines for t in re.findall(r'(?<![=~])"([^"]+)"', line)}
    assert named and named <= titles, f"not a panel: {sorted(named - titles)}"
