"""Flags and the YAML file: precedence, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, free_port

from exporter.cli.main import build_parser
from exporter.config import ConfigError, parse_duration, parse_listen_address, resolve


def settings(*argv: str):
    return resolve(build_parser().parse_args(["serve", *argv]))


def test_defaults():
    s = settings()
    assert s["web.listen-address"] == ":19400"
    assert s["ingest.listen-address"] == "127.0.0.1:19401"
    assert s["sampler.interval"] == 1.0
    assert s["gpu.backend"] == "nvml"
    assert s["demo.gpus"] == 8
    assert s["demo.load"] is None
    assert s["ingest.ttl"] == 600.0
    assert s["ingest.max-series"] == 1024
    assert s.collectors == {"gpu", "cpu", "memory", "disk", "network", "training"}


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    f = tmp_path / "c.yml"
    f.write_text("sampler:\n  interval: 500ms\ngpu.backend: demo\ndemo:\n  gpus: 2\n"
                 "collector:\n  disk: false\n")
    s = settings(f"--config.file={f}", "--demo.gpus=4", "--no-collector.network")
    assert s["sampler.interval"] == 0.5
    assert s["gpu.backend"] == "demo"
    assert s["demo.gpus"] == 4
    assert "disk" not in s.collectors and "network" not in s.collectors
    assert "gpu" in s.collectors


@pytest.mark.parametrize("text, key", [
    ("sampler:\n  intervl: 1s\n", "sampler.intervl"),
    ("sampler:\n  interval: soon\n", "sampler.interval"),
    ("demo:\n  gpus: -3\n", "demo.gpus"),
    ("demo:\n  load: 1.5\n", "demo.load"),
    ("gpu:\n  backend: rocm\n", "gpu.backend"),
    ("web:\n  listen-address: 19400\n", "web.listen-address"),
    ("collector:\n  gpu: maybe\n", "collector.gpu"),
])
def test_a_bad_file_is_an_error_naming_the_key(tmp_path, text, key):
    f = tmp_path / "bad.yml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"'{key}'"):
        settings(f"--config.file={f}")


def test_unparsable_yaml_and_missing_file(tmp_path):
    f = tmp_path / "broken.yml"
    f.write_text("sampler: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        settings(f"--config.file={f}")
    with pytest.raises(ConfigError, match="cannot read"):
        settings(f"--config.file={tmp_path / 'nope.yml'}")
    f.write_text("- sampler\n- interval\n")
    with pytest.raises(ConfigError, match=f"{f}: expected a mapping"):
        settings(f"--config.file={f}")


def test_help_shows_the_serve_flags_and_defaults_as_the_readme_writes_them(capsys):
    from exporter.cli.main import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--sampler.interval" in out and "--collector.gpu" in out and "diagnose" in out
    assert "(default: 1s)" in out and "(default: 10m)" in out


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match=r"--sampler\.interval"):
        settings("--sampler.interval=0s")


@pytest.mark.parametrize("text, seconds", [("1s", 1), ("500ms", 0.5), ("10m", 600), ("1h", 3600),
                                           ("2.5", 2.5), (3, 3)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text, parsed", [(":19400", ("", 19400)),
                                          ("127.0.0.1:19401", ("127.0.0.1", 19401)),
                                          ("[::1]:9", ("::1", 9))])
def test_listen_addresses(text, parsed):
    assert parse_listen_address(text) == parsed


def test_peak_flops_from_the_readme_example_and_the_flag(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "docs" / "flags.md").read_text()
    example = re.search(r"Example `gputrain.yml`[^\n]*:\n\n```yaml\n(.*?)```", readme, re.S)[1]
    f = tmp_path / "gputrain.yml"
    f.write_text(example)
    s = settings(f"--config.file={f}")
    assert s["gpu.peak-flops"] == {"rtx 6000 ada generation": {
        "bf16": 364.2e12, "fp16": 364.2e12, "fp32": 91.1e12}}
    assert s["sampler.interval"] == 2.0
    s = settings("--gpu.peak-flops=NVIDIA L40:bf16=181T")
    assert s["gpu.peak-flops"] == {"l40": {"bf16": 181e12}}
    with pytest.raises(ConfigError, match=r"gpu\.peak-flops.*unknown precision 'int4'"):
        settings("--gpu.peak-flops=NVIDIA L40:int4=1P")


@pytest.mark.parametrize(("argv", "message"), [
    (["diagnos"], "unknown command diagnos; did you mean diagnose?"),
    (["--web.listen-adress=:19400"], "unknown flag --web.listen-adress for serve; did you mean "
                                     "--web.listen-address?"),
    (["diagnose", "--promtheus", "http://x"], "unknown flag --promtheus for diagnose; did you "
                                              "mean --prometheus?"),
    (["rules", "--levle", "node"], "did you mean --level?"),
])
def test_a_mistyped_command_or_flag_gets_a_did_you_mean(capsys, argv, message):
    from exporter.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("command", "flag"), [("diagnose", "--prometheus"), ("top", "--url"),
                                               ("profile", "--url")])
def test_a_url_without_its_scheme_is_named_with_the_fix(command, flag):
    extra = ["--run", "r"] if command == "profile" else []
    out = subprocess.run([sys.executable, "-m", "exporter", command, *extra, flag,
                          "127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"{flag} 127.0.0.1:9: give the scheme, as in {flag} http://127.0.0.1:9" in out.stderr


@pytest.mark.parametrize("command", ["diagnose", "top", "profile"])
def test_a_refused_connection_is_said_in_words(command):
    flag = "--prometheus" if command == "diagnose" else "--url"
    extra = ["--run", "r"] if command == "profile" else []
    url = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "exporter", command, *extra, flag, url],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"nothing listens on {url[7:]} (connection refused)" in out.stderr
    assert "Max retries" not in out.stderr and "urllib3" not in out.stderr
