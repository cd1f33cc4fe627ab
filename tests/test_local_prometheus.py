"""deploy/prometheus/local.yml, the README's one-command Prometheus: valid from the repository
root as written, and Debian's real prometheus started with it scrapes the exporter (`up` is 1)
and loads every group of the shipped rules."""

from __future__ import annotations

import re
import subprocess

import yaml
from conftest import ROOT, Prometheus, require_binary, wait_until

LOCAL = ROOT / "deploy" / "prometheus" / "local.yml"


def test_the_local_config_passes_promtool_from_the_repository_root():
    promtool = require_binary("promtool")
    out = subprocess.run([promtool, "check", "config", "deploy/prometheus/local.yml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 1 rule files found" in out.stdout
    assert "alerts/gputrain.rules.yml" in out.stdout


def test_the_local_config_scrapes_the_exporter_and_loads_the_rules(tmp_path, daemon_factory):
    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    # The config as shipped, beside a link to the repository's alerts/ so that its relative
    # rule path reads the same files; only the exporter's port is the test's own.
    folder = tmp_path / "deploy" / "prometheus"
    folder.mkdir(parents=True)
    (tmp_path / "alerts").symlink_to(ROOT / "alerts")
    text, n = re.subn(r'targets: \["localhost:19400"\]', f'targets: ["localhost:{daemon.port}"]',
                      LOCAL.read_text())
    assert n == 1, "the shipped config scrapes localhost:19400"
    (folder / "local.yml").write_text(text)
    prometheus = Prometheus(tmp_path, [], config_file=folder / "local.yml").start()
    try:
        up = wait_until(lambda: prometheus.query('up{job="gputrain"} == 1'), timeout=120,
                        what="Prometheus to scrape the exporter")
        assert up[0]["metric"]["instance"] == f"localhost:{daemon.port}"
        groups = prometheus_rule_groups(prometheus)
    finally:
        prometheus.stop()
    shipped = yaml.safe_load((ROOT / "alerts" / "gputrain.rules.yml").read_text())["groups"]
    assert groups == {g["name"]: len(g["rules"]) for g in shipped}


def prometheus_rule_groups(prometheus: Prometheus) -> dict[str, int]:
    import requests

    body = requests.get(prometheus.url + "/api/v1/rules", timeout=10).json()
    return {g["name"]: len(g["rules"]) for g in body["data"]["groups"]}
