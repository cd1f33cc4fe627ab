"""A node's clock is no evidence (issue 46, principle 8), end to end: two exporters (demo GPUs,
idle) each with a starved run, one on a node whose wall clock runs 10 minutes behind (the
daemon under libfaketime, its monotonic clock left alone), scraped by a real Prometheus with
the shipped rules. The skewed node's run is judged as the other's (input-bound), nothing reads
frozen or silent, and the offset is said as an offset: GpuTrainClockOffset and diagnose's
``clock-offset`` for that node only, and the rank's clock skew on the daemon's page."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import (
    NO_HOST,
    ROOT,
    Daemon,
    Prometheus,
    rules_file,
    sample_value,
    stop_all,
    synthetic_client,
    wait_until,
)

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")  # Debian's faketime
OFFSET = -600  # seconds: the skewed node's clock against the real one
# what a node's clock used to make of its readings and ranks: never here
NEVER = ("GpuTrainCollectorStale", "GpuTrainRunVanished", "GpuTrainStalled", "GpuTrainRunHung",
         "GpuTrainRunFailed")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not FAKETIME.exists():
        pytest.fail(f"{FAKETIME} is missing: apt-get install faketime (scripts/test.sh does)")
    tmp = tmp_path_factory.mktemp("clocks")
    started: list = []
    try:
        skewed = Daemon("--gpu.backend=demo", "--demo.gpus=1", "--demo.load=0", *NO_HOST,
                        env={"LD_PRELOAD": str(FAKETIME), "FAKETIME": f"{OFFSET:+d}",
                             "FAKETIME_DONT_FAKE_MONOTONIC": "1"}).start()
        started.append(skewed)
        right = Daemon("--gpu.backend=demo", "--demo.gpus=1", "--demo.load=0",
                       *NO_HOST).start()
        started.append(right)
        for run, daemon in (("behind", skewed), ("on-time", right)):
            started.append(synthetic_client(run, daemon.ingest_url, "--batch-size", "16",
                                            "--data-wait-ms", "30", "--compute-ms", "10"))
        rules = rules_file(tmp, {"recording_interval": "1s", "for": {
            "GpuTrainInputBound": "5s", "GpuTrainClockOffset": "5s",
            "GpuTrainCollectorStale": "0s", "GpuTrainRunVanished": "0s"}})
        prom = Prometheus(tmp, [d.url.removeprefix("http://") for d in (skewed, right)],
                          rule_files=[str(rules)]).start()
        started.append(prom)
        yield {"prom": prom, "skewed": skewed, "right": right}
    finally:
        stop_all(started)


def firing(prom: Prometheus, alert: str) -> list[dict]:
    return [r["metric"] for r in prom.query(
        f'ALERTS{{alertname="{alert}",alertstate="firing"}}')]


def test_the_skewed_daemon_says_its_ages_by_its_own_clock(stack):
    """Its page: the wall clock 10 minutes behind, every age small, the rank's clock skew
    +600 s (the rank's clock less the daemon's)."""
    text = stack["skewed"].metrics()
    wall = sample_value(text, "gputrain_exporter_time_seconds")
    assert wall is not None and abs(wall - time.time() - OFFSET) < 30
    assert sample_value(text, "gputrain_collector_age_seconds", {"collector": "gpu"}) < 30
    rank = {"run": "behind", "rank": "0"}
    wait_until(lambda: sample_value(stack["skewed"].metrics(),
                                    "gputrain_training_last_push_age_seconds", rank) is not None,
               timeout=60, what="the run's first push")
    text = stack["skewed"].metrics()
    assert sample_value(text, "gputrain_training_last_push_age_seconds", rank) < 30
    skew = sample_value(text, "gputrain_training_clock_skew_seconds", rank)
    assert skew is not None and abs(skew + OFFSET) < 30, skew


def test_a_node_10_minutes_behind_is_judged_as_one_on_time(stack):
    """Both runs fire GpuTrainInputBound; only the skewed node fires GpuTrainClockOffset;
    no collector ever read stale and no rank silent (before, the scrape's time less the
    node's wall-clock success time read 600 s: every collector stale, nothing judged)."""
    prom = stack["prom"]
    wait_until(lambda: {m["run"] for m in firing(prom, "GpuTrainInputBound")} >=
               {"behind", "on-time"}, timeout=180,
               what="GpuTrainInputBound for the run on the skewed node and the other")
    offsets = wait_until(lambda: firing(prom, "GpuTrainClockOffset"), timeout=120,
                         what="GpuTrainClockOffset")
    assert {m["instance"] for m in offsets} == {stack["skewed"].url.removeprefix("http://")}
    for alert in NEVER:
        ever = prom.query(f'max_over_time(ALERTS{{alertname="{alert}"}}[30m])')
        assert not ever, f"{alert} on a node whose clock is off: {ever}"


def test_diagnose_and_the_page_conclude_the_same_and_diagnose_names_the_offset(stack):
    prom, skewed = stack["prom"], stack["skewed"]

    def diagnosed() -> dict | None:
        out = subprocess.run([sys.executable, "-m", "exporter", "diagnose", "--prometheus",
                              prom.url, "--run", "behind", "--window", "1m", "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        ranks = json.loads(out.stdout)["ranks"] if out.stdout else []
        return ranks[0] if ranks and "clock-offset" in ranks[0]["findings"] and \
            ranks[0]["verdict"] != "warming-up" else None

    rank = wait_until(diagnosed, timeout=180,
                      what="diagnose to judge the run and name the clock offset")
    assert rank["verdict"] == "input-bound", rank
    assert "stale" not in rank["findings"] and "vanished" not in rank["findings"]
    (offset,) = [f for f in rank["also"] if f["name"] == "clock-offset"]
    assert "behind Prometheus' clock" in offset["reason"], offset
    assert "chronyc" in offset["advice"]
    # the daemon cannot see its own offset; it judges the run the same
    seen: list[dict] = []

    def page() -> dict | None:
        doc = requests.get(skewed.url + "/api/v1/status", timeout=10).json()
        seen[:] = [r for x in doc["runs"] if x["run"] == "behind" for r in x["ranks"]]
        return seen[0] if seen and seen[0]["verdict"] == "input-bound" else None

    try:
        wait_until(page, timeout=120, what="the page to call the run input-bound")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the page said {seen}") from None
