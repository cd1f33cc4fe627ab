"""A change of regime in a rank's own series: found after a fix or a slowdown, never in noise.

The detector (exporter.heuristics.regime) reads the 10 s intervals the daemon's history keeps.
Here the intervals are built from simulated steps (seeded), as a training loop makes them: a
fix halves the data wait, a slowdown doubles the step; the near misses are a steady run with
step times jittering +-50 %, one slow step, a rare stall, a small drift, and a run with too few
steps to tell.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import requests
from conftest import (
    NO_HOST,
    ROOT,
    Daemon,
    rules_file,
    sample_value,
    synthetic_client,
    wait_until,
)
from conftest import Prometheus as PromServer
from test_status import T, push

from exporter.heuristics.regime import (
    CHANGE,
    MIN_STEPS,
    REGIME_SECONDS,
    Interval,
    change_point,
    moved,
    short_window,
)
from exporter.heuristics.verdict import judge

POINT = 10.0  # seconds between the history's points


def run(paces: list[tuple[float, float, float]], seconds: float, seed: int = 1,
        jitter: float = 0.1, extra: dict[int, float] | None = None) -> list[Interval]:
    """Intervals of ``POINT`` s over ``seconds`` of a loop whose step (compute s, wait s) is
    ``paces[i]`` from its start time ``paces[i][0]`` on; each step's parts vary by
    +-``jitter``; ``extra`` adds seconds to the step with that number (a stall)."""
    rnd = random.Random(seed)
    t, n, out = 0.0, 0, []
    edge, acc = POINT, [0, 0.0, 0.0, 0]
    while t < seconds:
        _, compute, wait = [p for p in paces if p[0] <= t][-1]
        c = compute * (1 + rnd.uniform(-jitter, jitter))
        w = wait * (1 + rnd.uniform(-jitter, jitter))
        step = c + w + (extra or {}).get(n, 0.0)
        t += step
        n += 1
        acc = [acc[0] + 1, acc[1] + step, acc[2] + w, acc[3] + 32]
        while t >= edge:  # the step counts in the interval it ends in
            out.append(Interval(edge, POINT, *acc))
            acc, edge = [0, 0.0, 0.0, 0], edge + POINT
    return out


def watched(iv: list[Interval]) -> list[float | None]:
    """What the detector says at each point, as the daemon asks it every 10 s."""
    return [change_point(iv[:k], iv[k - 1].end) for k in range(1, len(iv) + 1)]


def first_found(iv: list[Interval]) -> tuple[float, float]:
    """When the detector first finds a change (unix seconds), and where it places it."""
    found = watched(iv)
    k = next(k for k, x in enumerate(found) if x is not None)
    return iv[k].end, found[k]


def test_a_fix_that_halves_the_step_is_found_where_it_happened():
    # input-bound: 40 ms waiting + 10 ms computing; the loader fixed at 200 s (wait 2 ms)
    when, where = first_found(run([(0, 0.010, 0.040), (200, 0.010, 0.002)], 300))
    # found inside the recent window after the fix, and placed at the fix (one interval)
    assert when - 200 <= REGIME_SECONDS
    assert where == pytest.approx(200, abs=POINT)


def test_a_slowdown_is_a_change_too():
    when, where = first_found(run([(0, 0.020, 0.002), (150, 0.040, 0.002)], 240))
    assert when - 150 <= REGIME_SECONDS
    assert where == pytest.approx(150, abs=POINT)


def test_a_wait_share_that_moves_with_the_step_is_a_change():
    # the wait drops from 30 % to 5 % of the step, the step by 17 %: under CHANGE alone,
    # but the data wait moved with it
    _, where = first_found(run([(0, 0.035, 0.015), (150, 0.0395, 0.0021)], 240))
    assert where == pytest.approx(150, abs=POINT)


@pytest.mark.parametrize("name,paces,extra,jitter", [
    ("steady with step times jittering +-50 %", [(0, 0.02, 0.02)], None, 0.5),
    ("one slow step of 5 s", [(0, 0.02, 0.02)], {4000: 5.0}, 0.1),
    ("a rare stall: 3 s every 2000 steps", [(0, 0.02, 0.02)],
     {n: 3.0 for n in range(500, 10000, 2000)}, 0.1),
    ("a drift of 10 %", [(0, 0.02, 0.02), (150, 0.022, 0.022)], None, 0.1),
])
def test_noise_is_no_change(name, paces, extra, jitter):
    iv = run(paces, 300, jitter=jitter, extra=extra)
    # at every point of the run: the near misses never restart the window
    assert watched(iv) == [None] * len(iv), name


def test_too_few_steps_are_no_evidence():
    # 6 s steps, then 3.5 s: 17 a minute, under MIN_STEPS in the recent window
    iv = run([(0, 4.0, 2.0), (150, 3.0, 0.5)], 300)
    recent = sum(x.steps for x in iv if x.end > iv[-1].end - REGIME_SECONDS)
    assert recent < MIN_STEPS
    assert watched(iv) == [None] * len(iv)


def test_the_rest_of_the_regime_must_be_as_long_as_the_recent_part():
    # a run (or a regime) younger than twice the recent window: nothing to compare with
    iv = run([(0, 0.01, 0.04), (70, 0.01, 0.0)], 110)
    assert change_point(iv, iv[-1].end) is None


def _sums(iv: list[Interval]) -> tuple[float, float, float, float]:
    return (sum(x.steps for x in iv), sum(x.step_seconds for x in iv),
            sum(x.wait for x in iv), sum(x.samples for x in iv))


@pytest.mark.parametrize("paces", [
    [(0, 0.010, 0.040), (200, 0.010, 0.002)],
    [(0, 0.020, 0.002), (150, 0.040, 0.002)],
    [(0, 0.035, 0.015), (150, 0.0395, 0.0021)],
])
def test_the_daemons_cheap_first_look_lets_every_change_through(paces):
    # the daemon computes the medians only where the means moved (moved()): at every point
    # where the detector finds a change, the means moved too
    iv = run(paces, 300)
    for k in range(1, len(iv) + 1):
        now = iv[k - 1].end
        if change_point(iv[:k], now) is not None:
            old = [x for x in iv[:k] if x.end <= now - REGIME_SECONDS]
            new = [x for x in iv[:k] if x.end > now - REGIME_SECONDS]
            assert moved(_sums(old), _sums(new))


def test_a_steady_run_costs_no_medians():
    iv = run([(0, 0.02, 0.02)], 300, jitter=0.5)
    assert not moved(_sums(iv[:24]), _sums(iv[24:]))


def test_the_threshold_is_a_real_margin():
    assert 0.1 < CHANGE < 0.5  # between the noise above and the fixes worth naming


def test_a_young_regime_is_read_over_the_regime_window_only_while_it_fills_it():
    assert not short_window(None, 300)
    assert not short_window(REGIME_SECONDS - 1, 300)  # not yet a window of its own
    assert short_window(REGIME_SECONDS, 300)
    assert short_window(299, 300)
    assert not short_window(300, 300)  # the rate window holds the new regime alone


# --- live: a run fixed mid-run, every surface sampled through the change ----------------------

TARGET = 120.0  # seconds after the fix by which every surface names the new state


class Surfaces:
    """What each surface says of rank 0 of ``run``: the page's document, `top --once`,
    `diagnose --json` and the alert, as a user reads them."""

    def __init__(self, daemon: Daemon, prom: PromServer, run: str) -> None:
        self.daemon, self.prom, self.run = daemon, prom, run

    def page(self) -> dict:
        doc = requests.get(self.daemon.url + "/api/v1/status", timeout=10).json()
        ranks = [r for x in doc["runs"] if x["run"] == self.run for r in x["ranks"]]
        return ranks[0] if ranks else {}

    def top(self) -> str:
        return subprocess.run([sys.executable, "-m", "exporter", "top", "--once", "--url",
                               self.daemon.url], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout

    def diagnose(self) -> dict:
        out = subprocess.run([sys.executable, "-m", "exporter", "diagnose", "--prometheus",
                              self.prom.url, "--run", self.run, "--json"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        ranks = json.loads(out.stdout)["ranks"] if out.stdout else []
        return ranks[0] if ranks else {}

    def alerting(self) -> bool:
        return bool(self.prom.query(f'ALERTS{{alertname="GpuTrainInputBound",'
                                    f'alertstate="firing",run="{self.run}"}}'))

    def regime_start(self) -> float | None:
        return sample_value(self.daemon.metrics(),
                            "gputrain_training_regime_start_timestamp_seconds",
                            {"run": self.run})


def test_every_surface_names_a_fixed_run_within_two_minutes(tmp_path, daemon_factory,
                                                           prometheus_factory):
    """A real client whose loader takes 40 ms a batch (20 ms steps: input-bound), fixed by a
    control file: the page, `top`, `diagnose` and the alert all name the new state within
    TARGET seconds, and say the run changed; before the fix the steady (jittery, sleep-based)
    run never restarts its window. The 5m windows alone still read 30-40 % data wait then."""
    run = "fixed-mid-run"
    # the host collectors off: the machine's own load cannot refine input-bound
    daemon = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", *NO_HOST)
    rules = rules_file(tmp_path, {"recording_interval": "1s", "for": {
        "GpuTrainInputBound": "2s", "GpuTrainGPUUnderutilized": "2s"}})
    prom = prometheus_factory([daemon.url.removeprefix("http://")], rule_files=[str(rules)])
    fix = tmp_path / "loader-fixed"
    client = synthetic_client(run, daemon.ingest_url, "--data-wait-ms", "40",
                              "--compute-ms", "20", "--fixed-when", str(fix))
    s = Surfaces(daemon, prom, run)
    try:
        started = time.monotonic()
        wait_until(lambda: s.page().get("verdict") == "input-bound", timeout=180,
                   interval=2, what="the page to find the slow loader")
        wait_until(lambda: s.diagnose().get("verdict") == "input-bound", timeout=180,
                   interval=3, what="diagnose to find the slow loader")
        wait_until(s.alerting, timeout=180, interval=2, what="GpuTrainInputBound to fire")
        # the detector compares a minute with the rest: the old regime lasts 2 minutes
        while time.monotonic() - started < 120:
            assert s.regime_start() is None, "a steady run restarted its window"
            time.sleep(5)
        assert s.top().count("pace changed") == 0
        fix.touch()
        fixed = time.time()
        named: dict[str, float] = {}
        seen: dict[str, object] = {}
        while len(named) < 4 and time.time() - fixed < TARGET + 60:
            page = s.page()
            if page.get("verdict") not in (None, "input-bound") and \
                    page.get("regime_changed_seconds") is not None:
                named.setdefault("page", time.time() - fixed)
                seen["page"] = page
            top = s.top()
            if "pace changed" in top and " input-bound" not in top:
                named.setdefault("top", time.time() - fixed)
                seen["top"] = top
            diag = s.diagnose()
            if diag.get("verdict") not in (None, "input-bound") and \
                    diag.get("regime_changed_seconds") is not None:
                named.setdefault("diagnose", time.time() - fixed)
                seen["diagnose"] = diag
            if not s.alerting():
                named.setdefault("alert", time.time() - fixed)
            time.sleep(1)
        print(f"seconds from the fix to the new state named: {named}")
        late = {k: v for k, v in named.items() if v > TARGET}
        assert set(named) == {"page", "top", "diagnose", "alert"} and not late, \
            f"seconds after the fix each surface named the new state: {named}"
        # the change is placed at the fix, and the surfaces judge the same window alike
        start = s.regime_start()
        assert start is not None and abs(start - fixed) <= 20
        assert seen["page"]["data_wait_ratio"] < 0.05
        assert seen["diagnose"]["data_wait_ratio"] < 0.05
        assert "pace changed" in seen["diagnose"]["reason"]
        page, diag = s.page(), s.diagnose()
        assert page["verdict"] == diag["verdict"], (page["reason"], diag["reason"])
        recorded = prom.query(f'run_rank:gputrain_training_data_wait_ratio:rate5m{{run="{run}"}}')
        assert float(recorded[0]["value"][1]) < 0.05
    finally:
        client.kill()
        client.wait()


# --- the daemon's history: the change found in the points it keeps, the regime read alone ------

def _train(node, seconds: int, steps_per_s: float, wait_share: float, rnd: random.Random,
           state: dict, stall_at: int | None = None) -> None:
    """``seconds`` of a loop stepping ``steps_per_s`` (jittering +-30 %), ``wait_share`` of
    each step waiting for data, pushing each second; ``stall_at``: one step of 5 s then."""
    for second in range(seconds):
        n = round(steps_per_s * (1 + rnd.uniform(-0.3, 0.3)))
        step_s = 1.0 + (5.0 if second == stall_at else 0.0)
        state["steps"] += n + (1 if second == stall_at else 0)
        state["step_seconds"] += step_s
        state["data_wait_seconds"] += wait_share
        state["samples"] += 32 * n
        state["elapsed_seconds"] += step_s
        push(node.store, gpus=["0"], **state)
        node.cycle(step_s)


def test_the_daemon_reads_a_fixed_run_over_its_new_regime_alone(clock):
    from fake_nvml import FakeGpu
    from test_status import Node

    gpu = FakeGpu("GPU-a", name="NVIDIA H100 80GB HBM3", util_rate=20)
    node = Node(clock, [gpu], window=300.0)
    rnd, state = random.Random(3), {"steps": 0, "step_seconds": 0.0,
                                    "data_wait_seconds": 0.0, "samples": 0.0,
                                    "elapsed_seconds": 0.0}
    _train(node, 150, 20, 0.8, rnd, state)  # 50 ms steps, 40 ms of each waiting
    assert node.history.regime_starts() == {}
    fixed = clock()
    gpu.util_rate = 95
    _train(node, 90, 90, 0.05, rnd, state)  # the loader fixed: 11 ms steps
    start = node.history.regime_starts()[("r", "0")]
    assert start == pytest.approx(fixed, abs=10)
    (rep,) = node.history.reports()
    # the last minute alone, its GPU's too: the 5 minutes would read ~0.6 and ~0.45
    assert rep.data_wait_ratio == pytest.approx(0.05, abs=0.01)
    assert rep.gpus[0].busy == pytest.approx(0.95, abs=0.03)
    assert rep.regime_changed_seconds == pytest.approx(clock() - start, abs=2)
    (judged,) = judge([rep], T)
    # nothing of the data wait is left: not the verdict, nor a finding beside it
    assert judged.verdict != "input-bound" and "input-bound" not in judged.findings(), \
        judged.reason
    assert "pace changed" in judged.reason


def test_the_daemon_keeps_the_window_of_a_steady_run_with_a_stall(clock):
    from fake_nvml import FakeGpu
    from test_status import Node

    node = Node(clock, [FakeGpu("GPU-a", name="NVIDIA H100 80GB HBM3", util_rate=20)],
                window=300.0)
    rnd, state = random.Random(4), {"steps": 0, "step_seconds": 0.0,
                                    "data_wait_seconds": 0.0, "samples": 0.0,
                                    "elapsed_seconds": 0.0}
    _train(node, 240, 20, 0.8, rnd, state, stall_at=200)
    assert node.history.regime_starts() == {}
    (rep,) = node.history.reports()
    assert rep.regime_changed_seconds is None
    (judged,) = judge([rep], T)
    assert judged.verdict == "input-bound" and "pace changed" not in judged.reason
