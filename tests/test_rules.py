"""The shipped rules: generated from the defaults, valid, and their promtool unit tests pass."""

from __future__ import annotations

import subprocess
import sys

import yaml
from conftest import ROOT, require_binary

from exporter.rules import DEFAULTS, render

RULES = ROOT / "alerts" / "gputrain.rules.yml"
ALERTS = {
    "GpuTrainGPUUnderutilized", "GpuTrainInputBound", "GpuTrainCPUPreprocessingBound",
    "GpuTrainDiskIOBound", "GpuTrainNetworkInputBound", "GpuTrainHostToDeviceBound",
    "GpuTrainGPUMemoryUnderused", "GpuTrainLaunchBound", "GpuTrainTensorCoresIdle",
    "GpuTrainHostOverheadBound", "GpuTrainStepTimeStalls", "GpuTrainStragglerRank",
    "GpuTrainHostMemoryLeak", "GpuTrainGPUMemoryNearLimit", "GpuTrainThrottling",
    "GpuTrainStalled", "GpuTrainGPULost", "GpuTrainXidErrors", "GpuTrainCollectorFailing",
    "GpuTrainExporterDown",
}


def test_shipped_rules_are_the_generator_output_with_defaults():
    assert RULES.read_text() == render(), (
        "alerts/gputrain.rules.yml is stale: python3 -m exporter rules > alerts/gputrain.rules.yml")


def test_every_alert_has_severity_for_and_the_three_annotations():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} == ALERTS
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


def test_promtool_unit_tests_pass():
    promtool = require_binary("promtool")
    tests = sorted(str(p) for p in (ROOT / "alerts" / "tests").glob("*.yml"))
    assert tests
    out = subprocess.run([promtool, "test", "rules", *tests], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


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
    assert ">= 0.1 <" in moderate["expr"]
    assert 'job="gpu-nodes"' in rules["gpu:gputrain_gpu_busy_ratio:rate5m"]["expr"]
    assert DEFAULTS["thresholds"]["input_bound"] == 0.05  # the defaults are untouched


def test_rules_command_names_a_bad_key(tmp_path):
    cfg = tmp_path / "t.yml"
    cfg.write_text("thresholds:\n  input_bund: 0.1\n")
    out = subprocess.run([sys.executable, "-m", "exporter", "rules", "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "thresholds.input_bund" in out.stderr
