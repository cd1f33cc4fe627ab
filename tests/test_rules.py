"""The shipped rules: generated from the defaults, valid, and their promtool unit tests pass."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import rule_cases
import yaml
from conftest import ROOT, require_binary

from exporter.heuristics.catalogue import BY_ALERT
from exporter.heuristics.rules import DEFAULTS, render

RULES = ROOT / "alerts" / "gputrain.rules.yml"
# Alert names users route and silence by: they never disappear (new ones may come)
KEPT_ALERTS = {
    "GpuTrainGPUUnderutilized", "GpuTrainInputBound", "GpuTrainCPUPreprocessingBound",
    "GpuTrainDiskIOBound", "GpuTrainNetworkInputBound", "GpuTrainHostToDeviceBound",
    "GpuTrainGPUMemoryUnderused", "GpuTrainLaunchBound", "GpuTrainTensorCoresIdle",
    "GpuTrainHostOverheadBound", "GpuTrainStepTimeStalls", "GpuTrainStragglerRank",
    "GpuTrainHostMemoryLeak", "GpuTrainGPUMemoryNearLimit", "GpuTrainThrottling",
    "GpuTrainStalled", "GpuTrainGPULost", "GpuTrainXidErrors", "GpuTrainCollectorFailing",
    "GpuTrainExporterDown", "GpuTrainLowMFU", "GpuTrainGPUMemoryFault",
}


def test_shipped_rules_are_the_generator_output_with_defaults():
    assert RULES.read_text() == render(), (
        "alerts/gputrain.rules.yml is stale: .venv/bin/python scripts/generate.py")


def test_every_alert_has_severity_for_and_the_three_annotations():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    names = {a["alert"] for a in alerts}
    assert names == set(BY_ALERT), "one alert name per catalogue entry"
    assert names >= KEPT_ALERTS, sorted(KEPT_ALERTS - names)
    for a in alerts:
        assert a["labels"]["severity"] in ("info", "warning", "critical"), a["alert"]
        assert a["for"], a["alert"]
        assert set(a["annotations"]) == {"summary", "description", "runbook_url"}, a["alert"]
        assert "{{" not in a["annotations"]["summary"], "summary is static"
        assert "{{" in a["annotations"]["description"], "description is templated"
        assert a["annotations"]["runbook_url"].endswith("#" + a["alert"].lower())
    records = [r["record"] for g in groups for r in g["rules"] if "record" in r]
    assert all(len(r.split(":")) == 3 for r in records), "level:metric:operation"


def test_promtool_check_rules_is_clean():
    promtool = require_binary("promtool")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_test_files_are_the_generator_output():
    for path, text in rule_cases.files().items():
        assert path.read_text() == text, (
            f"{path.name} is stale: .venv/bin/python scripts/generate.py")


def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not():
    names = rule_cases.alert_names()
    cases = rule_cases.alert_cases()
    for name in names:
        firing = [c for c in cases if any(f.alert == name for f in c.fires)]
        assert any(c.quiet_at for c in firing), f"{name}: no case where it must not fire yet"
    seeds = rule_cases.seed_cases()
    assert len(seeds) == 13
    assert any(not c.fires for c in seeds), "a scenario where the rules must stay silent"


def test_promtool_unit_tests_pass_for_both_rule_layouts(tmp_path):
    """Every case through the single file, and every case a global alert fires in through
    the node + global files (a shard's and the global layer's: the layout only matters where
    the global group reads what the node groups recorded; test_levels_split_... holds the two
    layouts to the same rules), the two promtool runs side by side."""
    promtool = require_binary("promtool")
    tests = sorted((ROOT / "alerts" / "tests").glob("*.test.yml"))
    assert len(tests) == len(rule_cases.files()) == 4
    split = tmp_path / "tests"
    split.mkdir()
    layout = [f"{ROOT}/alerts/gputrain.{level}.rules.yml" for level in ("node", "global")]
    global_alerts = {r["alert"] for r in _rules_of("global")}
    kept = 0
    for path in tests:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../gputrain.rules.yml"]
        doc["rule_files"] = layout
        doc["tests"] = [t for t in doc["tests"] if any(
            check["alertname"] in global_alerts and check.get("exp_alerts")
            for check in t.get("alert_rule_test", []))]
        kept += len(doc["tests"])
        if doc["tests"]:
            (split / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    assert kept >= 10  # the global alerts' cases, each with its near misses
    layouts = {"single": tests, "node + global": sorted(split.iterdir())}
    runs = {name: subprocess.Popen([promtool, "test", "rules", *map(str, files)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name, files in layouts.items()}
    for name, run in runs.items():
        files = layouts[name]
        out = run.communicate()[0]
        assert run.returncode == 0, f"{name}: {out}"
        assert out.count("SUCCESS") == len(files), f"{name}: {out}"


@pytest.mark.parametrize("threshold, value, failing_case", [
    ("tensor_active_below", 0.3, "PyTorch ladder step 6"),   # AMP's 26.3% would read as idle
    ("cpu_saturated", 0.97, "TensorFlow study, preprocessing overload"),
    ("gpu_busy_target", 0.98, "TensorFlow study, inefficient GPU graph"),
])
def test_the_cases_catch_a_wrong_threshold(tmp_path, threshold, value, failing_case):
    """The promtool cases are not vacuous: rules with one threshold moved fail them. Only
    the case expected to fail runs (each case is a group of its own)."""
    promtool = require_binary("promtool")
    (tmp_path / "gputrain.rules.yml").write_text(render({"thresholds": {threshold: value}}))
    (tmp_path / "tests").mkdir()
    picked = 0
    for path in (ROOT / "alerts" / "tests").glob("*.test.yml"):
        doc = yaml.safe_load(path.read_text())
        doc["tests"] = [t for t in doc["tests"] if failing_case in t.get("name", "")]
        picked += len(doc["tests"])
        if doc["tests"]:
            (tmp_path / "tests" / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    assert picked == 1, f"{failing_case!r} names {picked} cases"
    files = [str(p) for p in (tmp_path / "tests").iterdir()]
    moved = subprocess.run([promtool, "test", "rules", *files], capture_output=True,
                           text=True)
    assert moved.returncode != 0
    assert failing_case in moved.stdout + moved.stderr
    # ... and the same case passes with the shipped rules: it fails for the threshold
    (tmp_path / "gputrain.rules.yml").write_text(RULES.read_text())
    shipped = subprocess.run([promtool, "test", "rules", *files], capture_output=True,
                             text=True)
    assert shipped.returncode == 0, shipped.stdout + shipped.stderr


def test_rules_command_applies_user_thresholds(tmp_path):
    cfg = tmp_path / "t.yml"
    cfg.write_text('selector: \'job="gpu-nodes"\'\nthresholds:\n  input_bound: 0.1\n'
                   "for:\n  GpuTrainInputBound: 2m\n")
    out = subprocess.run([sys.executable, "-m", "exporter", "rules", "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    all_rules = [r for g in yaml.safe_load(out)["groups"] for r in g["rules"]]
    rules = {r.get("alert") or r.get("record"): r for r in all_rules}
    moderate = next(r for r in all_rules if r.get("alert") == "GpuTrainInputBound"
                    and r["labels"]["severity"] == "info")
    assert moderate["for"] == "2m"
    assert "rate5m >= 0.1)" in moderate["expr"]
    assert 'job="gpu-nodes"' in rules["gpu:gputrain_gpu_busy_ratio:rate5m"]["expr"]
    assert DEFAULTS["thresholds"]["input_bound"] == 0.05  # the defaults are untouched


def test_rules_command_names_a_bad_key(tmp_path):
    cfg = tmp_path / "t.yml"
    cfg.write_text("thresholds:\n  input_bund: 0.1\n")
    out = subprocess.run([sys.executable, "-m", "exporter", "rules", "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "thresholds.input_bund" in out.stderr


def test_inlining_leaves_no_recording_rule_names():
    """diagnose and the GPU replay run the alerts' formulas without the rules loaded."""
    from exporter.heuristics.promql import inline, recording_rules

    records = recording_rules(DEFAULTS["selector"])
    groups = yaml.safe_load(render())["groups"]
    for alert in (r for g in groups for r in g["rules"] if "alert" in r):
        inlined = inline(alert["expr"], records)
        assert not any(name in inlined for name in records), alert["alert"]
        assert "group_left (sum" not in inlined  # would parse as a label list


def test_every_recording_rule_reads_only_series_recorded_before_it():
    """A group evaluates its rules in turn: a series read before its rule runs is a cycle old
    (issue 36: the rules are made from the readings' table and ordered by what they read)."""
    (group,) = [g for g in yaml.safe_load(render())["groups"] if g["name"] == "gputrain.recording"]
    names = [r["record"] for r in group["rules"]]
    assert len(set(names)) == len(names)
    for i, rule in enumerate(group["rules"]):
        later = [n for n in names[i:] if re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])",
                                                   rule["expr"])]
        assert later == [], f"{rule['record']} reads {later}, recorded after it"


def test_every_generated_file_is_current():
    """`scripts/generate.py --check`: rules, PrometheusRule, promtool tests, dashboards,
    their ConfigMap, runbook and README tables all match the catalogue."""
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" /
                                                  "generate.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    stale = [str(p.relative_to(ROOT)) for p in script.stale(ROOT)]
    assert stale == [], f"stale (run `.venv/bin/python scripts/generate.py`): {stale}"


def test_a_catalogue_change_reaches_every_surface():
    """One threshold, changed once, moves the rule, the runbook, the README table, the
    dashboards' line and diagnose's verdict."""
    from exporter.heuristics import dashboards, diagnose, generate
    from exporter.heuristics.rules import render as render_rules

    mine = {"thresholds": {"input_bound": 0.12}}
    assert ">= 0.12" in render_rules(mine)
    assert "12 %" in generate.runbook(mine) and "12 %" in generate.alert_table(mine)
    data_wait = next(p for p in dashboards.dashboards(mine)["run.json"]["panels"]
                     if p["title"] == "Data wait")
    assert data_wait["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == 0.12
    rep = diagnose.RankReport("gputrain", "n1", "r", "0", steps_per_second=1,
                              data_wait_ratio=0.1)
    rep.gpus = [diagnose.GpuReading("0", "GPU-0", busy=0.95, memory_used=0.6, power_used=0.7)]
    t = {**DEFAULTS["thresholds"], **mine["thresholds"]}
    (judged,) = diagnose.judge([rep], t)
    assert judged.verdict == "gpu-bound"  # 10 % data wait is under the user's 12 %


def _rules_of(level: str, config: str | None = None, fmt: str = "rules") -> list[dict]:
    args = [sys.executable, "-m", "exporter", "rules", "--level", level, "--format", fmt]
    out = subprocess.run(args + (["--config", config] if config else []), cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    doc = yaml.safe_load(out)
    return [r for g in (doc.get("spec") or doc)["groups"] for r in g["rules"]]


@pytest.mark.parametrize("fmt", ["rules", "prometheusrule"])
def test_levels_split_the_rules_by_where_they_are_evaluated(fmt):
    """A shard loads --level node (records and one-node alerts), the global ruler --level
    global (rank comparisons, no records: vmalert refuses records without remote-write); the
    two together are exactly the single-Prometheus file."""
    node, glob, every = (_rules_of(level, fmt=fmt) for level in ("node", "global", "all"))
    # the alerts that span a run's ranks, and so its nodes
    across = {"GpuTrainStragglerRank", "GpuTrainRunVanished", "GpuTrainCommunicationBound",
              "GpuTrainRunHung", "GpuTrainRunFailed", "GpuTrainStalled", "GpuTrainRunNameShared",
              "GpuTrainCollectiveTimeoutRisk"}
    assert {r["alert"] for r in glob} == across
    assert not [r for r in glob if "record" in r]
    assert not across & {r.get("alert") for r in node}
    assert {r.get("alert") for r in node if "alert" in r} == set(BY_ALERT) - across
    assert node + glob == every
    assert every == [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_alert_of_the_global_level_reads_only_recorded_series():
    """The global layer may hold only the recording rules' results."""
    for rule in _rules_of("global"):
        names = set(re.findall(r"[a-z_]+:[a-z_:0-9]+", rule["expr"]))
        bare = re.sub(r"[a-z_]+:[a-z_:0-9]+", "", rule["expr"])
        assert names and "gputrain_" not in bare, rule["alert"]


def test_run_labels_group_runs_and_never_job(tmp_path):
    cfg = tmp_path / "t.yml"
    cfg.write_text("run_labels: [cluster, run]\n")
    rules = {r.get("alert") or r.get("record"): r for r in _rules_of("all", str(cfg))}
    straggler = rules["GpuTrainStragglerRank"]["expr"]
    # the run's medians group by the run labels, never by job (a rank is matched with its
    # own series on every label it has, job included)
    assert set(re.findall(r"quantile by \(([^)]*)\)", straggler)) == {"cluster, run"}
    assert set(re.findall(r"on \(([^)]*)\) group_left", straggler)) == {"cluster, run"}
    assert "sum by (cluster, job, instance, run, rank)" in \
        rules["run_rank:gputrain_training_data_wait_ratio:rate5m"]["expr"]
    assert "(cluster {{ $labels.cluster }})" in \
        rules["GpuTrainStragglerRank"]["annotations"]["description"]
    default = {r.get("alert"): r for r in _rules_of("global")}
    assert "quantile by (run)" in default["GpuTrainStragglerRank"]["expr"]


@pytest.mark.parametrize("value, message", [
    ("[cluster]", "'run_labels' must include 'run'"),
    ("[run, rank]", "must not include 'rank'"),
    ("[run, 'a-b']", "'a-b' is not a label name"),
    ("{a: 1}", "must be a list of label names"),
])
def test_a_bad_run_labels_setting_is_named(tmp_path, value, message):
    cfg = tmp_path / "t.yml"
    cfg.write_text(f"run_labels: {value}\n")
    out = subprocess.run([sys.executable, "-m", "exporter", "rules", "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_the_generate_script_checks_a_checkout_as_a_developer_runs_it():
    """`scripts/generate.py --check` from a checkout: exit 0 with nothing stale; the installed
    command has no `generate` (it needs the repository's tests/rule_cases.py)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr
    cli = subprocess.run([sys.executable, "-m", "exporter", "generate"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2, cli.stdout + cli.stderr
