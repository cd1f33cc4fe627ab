"""What the GPU proof (scripts/gpu-proof.sh on an H200, tests/data/gpu/) taught, kept in CI:
the fake driver's H200 answers every NVML call as the real one did, the exporter reads the
same fields from both, and the recordings replay through the shipped rules and `diagnose` to
the same verdicts (tests/data/gpu/README.md has the run)."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest
from conftest import ROOT, require_binary
from gpu.preflight import preflight
from gpu.replay import Replay, diagnose, inline_alerts, status_agreement
from gpu.scenarios import expected_on
from packaging import version

from exporter.heuristics.catalogue import BY_ALERT

DATA = ROOT / "tests" / "data" / "gpu"
REAL = json.loads((DATA / "preflight.json").read_text())
RECORDINGS = sorted(DATA.glob("*.prom.gz"))


# calls the exporter makes under one name or another, by the binding's release (a versioned
# call, a renamed one): compared as one family
# (nvmlDeviceGetTemperatureV, which older bindings lack, the exporter calls through its own
# shim: not a call of the binding's, so not compared there)
RENAMED = {"nvmlDeviceGetCurrentClocksThrottleReasons": "nvmlDeviceGetCurrentClocksEventReasons"}


def family(call: str) -> str:
    """A call's family: without its version suffix, under its newest name."""
    base = re.sub(r"_v\d+$", "", call)
    return RENAMED.get(base, base)


def offered(calls: list[str]) -> set[str]:
    """The families of ``calls`` that the binding under test has some call of (an older
    nvidia-ml-py lacks the newest: the real GPU was read through 13.610)."""
    import pynvml

    names = [n for n in dir(pynvml) if n.startswith("nvml")]
    have = {family(n) for n in names}
    return {family(c) for c in calls} & have


def pattern(reading: dict) -> dict:
    """Which of a reading's fields the source answered: None, or the keys of a dict."""
    return {k: (None if v is None else sorted(v) if isinstance(v, dict) else "value")
            for k, v in reading.items() if k != "timestamp"}


@pytest.fixture(scope="module")
def fake() -> dict:
    return preflight(cycles=3, fake=True, model="h200_vm", child=False)


@pytest.mark.nvml
def test_the_fake_h200_answers_the_calls_the_real_one_answers_and_refuses_the_rest(fake):
    assert fake["driver_version"] == REAL["driver_version"]
    assert fake["gpus"][0]["name"] == REAL["gpus"][0]["name"]
    # the same families of calls answer and are refused, as far as this binding has them
    known = offered(REAL["answering"] + list(REAL["refused"]))
    assert known >= {"nvmlDeviceGetFieldValues", "nvmlDeviceGetSamples", "nvmlDeviceGetPowerUsage",
                     "nvmlDeviceGetComputeRunningProcesses"}
    assert {family(c) for c in fake["answering"]} & known == \
        {family(c) for c in REAL["answering"]} & known
    assert {family(c) for c in fake["refused"]} & known == \
        {family(c) for c in REAL["refused"]} & known
    per_cycle = {family(name): c["calls_per_cycle"] for name, c in fake["calls"].items()}
    for name, real in REAL["calls"].items():  # each call as often per sampler cycle
        if real["calls_per_cycle"] >= 1 and family(name) in known:
            assert per_cycle.get(family(name)) == real["calls_per_cycle"], name


@pytest.mark.nvml
def test_the_exporter_reads_the_same_fields_from_the_fake_h200_as_from_the_real_one(fake):
    # e.g. PCIe bytes as rates (its counters are 32-bit), no NVLink series, the hardware
    # slowdown from the reasons bitmask, no per-process samples of an idle GPU
    assert pattern(fake["last_reading"]["0"]) == pattern(REAL["last_reading"]["0"])


@pytest.mark.nvml
def test_the_fake_h200_answers_each_raw_call_and_field_as_the_real_one(fake):
    def answer(x: dict) -> object:
        return ("ok", type(x["ok"]).__name__) if "ok" in x else ("error", x.get("error"))

    real, ours = REAL["raw"], fake["raw"]
    for call in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetComputeRunningProcesses",
                 "nvmlGpmQueryDeviceSupport", "nvmlDeviceGetPerformanceState",
                 "nvmlDeviceGetProcessUtilization"):
        if call in ours:  # (asked only where this binding has it)
            assert answer(ours[call]) == answer(real[call]), call
    assert {k: answer(v) for k, v in ours["nvlink_state"].items()} == \
        {k: answer(v) for k, v in real["nvlink_state"].items() if k in ours["nvlink_state"]}
    # the field ids this binding names (an older one names fewer): each answered alike, all
    # of them under the release the GPU was read through and later ones
    compared = [name for name in real["field_values"] if name in ours["field_values"]]
    assert len(compared) >= 4, compared
    if version.parse(metadata.version("nvidia-ml-py")) >= version.parse("13.610"):
        assert compared == list(real["field_values"])
    for name in compared:
        field, got = real["field_values"][name], ours["field_values"][name]
        assert got["return"] == field["return"], name
        if field["return"] == 0:  # the value's type: a 32-bit PCIe counter wraps at 4 GiB
            assert got["valueType"] == field["valueType"], name


def test_the_real_gpu_saw_the_trainer_and_py_spy_read_its_stacks():
    child = REAL["cuda_child"]
    assert child["ready"] == "ready cuda"
    assert child["pid_in_nvml_list"]  # the daemon's pid namespace is the trainer's there
    assert child["py_spy_dump"]["returncode"] == 0
    assert "<module>" in child["py_spy_dump"]["stdout"]
    # NVML's per-process samples come a second apart and the sampler weighs them by it
    busy = [r["process_seconds"][str(child["pid"])][0] for r in child["sampler_readings"][1:]]
    assert all(0.9 < b < 1.1 for b in busy), busy


def recorded_gpu(recording: Path) -> str:
    from gpu.harness import read_recording

    for _, samples in read_recording(recording)[-1:]:
        for (name, labels) in samples:
            if name == "gputrain_gpu_info":
                return dict(labels).get("name", "")
    return ""


@pytest.mark.parametrize("recording", RECORDINGS, ids=[p.name for p in RECORDINGS])
def test_a_gpu_recording_fires_what_it_must_and_diagnose_says_the_same(recording, tmp_path):
    require_binary("promtool")
    require_binary("prometheus")
    run = recording.name.removesuffix(".prom.gz")
    scenario = expected_on(run, recorded_gpu(recording))
    rules_text = (ROOT / "alerts" / "gputrain.rules.yml").read_text()
    r = Replay(recording, tmp_path)
    try:
        fired = r.firing(rules_text)
        at = r.end_time - 2
        (rep,) = diagnose(r.url, run, at)
        now = {a["alert"] for a in inline_alerts(rules_text)
               if any(x["metric"].get("run") == run for x in r.query(a["inlined"], at))}
    finally:
        r.stop()
    names = {a.removeprefix("GpuTrain") for a in fired}
    assert scenario.fire <= names, f"{run}: expected {sorted(scenario.fire)}, fired {names}"
    assert not scenario.silent & names, f"{run}: must not fire {scenario.silent & names}"
    want = {BY_ALERT[a].verdict for a in now if BY_ALERT[a].kind != "symptom"}
    assert set(rep["findings"]) == want, f"{run}: diagnose {rep['findings']} ({rep['reason']})"
    status = recording.with_name(f"{run}.status.json")  # recorded by harnesses since 50's
    if status.is_file():
        page, told = status_agreement(recording, json.loads(status.read_text()))
        assert page == told, f"{run}: the page said {page}, diagnose {told}"


def test_the_committed_run_passes_the_proofs_checks():
    from gpu.checks import check

    summary = json.loads((DATA / "summary.json").read_text())
    assert check(summary["scenarios"]) == []
    assert {r["scenario"] for r in summary["scenarios"]} == \
        {p.name.removesuffix(".prom.gz") for p in RECORDINGS}


def test_the_docs_table_is_the_recordings_table():
    require_binary("promtool")
    require_binary("prometheus")
    from gpu.replay import table

    docs = (ROOT / "docs" / "gpu-proof.md").read_text()
    shown = docs.split("<!-- generated: gpu table -->\n")[1].split("<!-- end: gpu table -->")[0]
    assert shown == table(DATA), "docs/gpu-proof.md is stale: paste `.venv/bin/python " \
        "tests/gpu/replay.py --table tests/data/gpu` between its gpu table markers"
