"""A small fleet through the real pipeline: exactly the planted faults fire, once each.

bench/fleet.py's fleet at 20 nodes (160 ranks): real demo daemons with real training clients
as the templates (a healthy run, one with a straggler, an input-bound run, a run that finishes,
one that starts late, an idle node), one page server serving every node on its own port with
its run, ranks and GPUs rewritten; Debian's vmagent scraping them into victoria-metrics, one
vmalert with the node rules (recording their results back) and one with the global rules, the
flags of deploy/scale-out/vmalert.service; a real Alertmanager posting to a webhook. Timings
are seconds (1 s scrapes and evaluations, the planted alerts' `for` 5 s through the thresholds
file, as tests/test_scaleout.py does); bench/bench_fleet.py runs the same at production
intervals and hundreds of nodes.

Planted: rank 21 of run-000 (node-0002, the third of its 8 nodes) computes 2.5x as long as its
63 peers (GpuTrainStragglerRank, from the global vmalert); the 8 ranks of run ``starved`` wait
for data 3/4 of each step (GpuTrainInputBound, its info and its warning tier, per rank); the
page of node-0012 goes away (GpuTrainExporterDown).
"""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, wait_until

sys.path.insert(0, str(ROOT / "bench"))
import fleet as fleetlib

pytestmark = pytest.mark.integration

NODES = 20
SETTLE_S = 10  # how long both rulers evaluate, after every planted alert arrived, for a copy
TIMINGS = fleetlib.Timings(scrape="1s", evaluation="1s", recording="1s", liveness="1s",
                           for_="5s", latency_offset="1s", refresh=1.0, disable_cache=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    plan = fleetlib.make_plan(NODES)
    # the finishing run's 8 ranks end after 250 steps of about 0.1 s, while it is watched
    running = fleetlib.start_pipeline(tmp, plan, TIMINGS, finish_steps=250)
    try:
        running.start_late()  # a run starts
        running.kill(plan.dead)  # a node goes away, after every node was scraped
        yield running
    finally:
        running.stop()


def test_exactly_the_planted_faults_fire_once_each(fleet):
    expected = fleet.plan.expected
    assert len(expected) == 1 + 16 + 1  # the straggler, 8 ranks x 2 tiers, the dead node
    wait_until(lambda: expected <= set(fleetlib.received(fleet.hook)), timeout=240,
               interval=0.5, what=f"the planted alerts (missing: "
                                  f"{fleetlib.verdict(fleetlib.received(fleet.hook), expected)}"
                                  ")")
    # then a window for copies and strays: every rule of both rulers evaluated SETTLE_S later,
    # and every alert Alertmanager holds delivered
    fleetlib.settle(fleet, SETTLE_S)
    got = fleetlib.received(fleet.hook)
    assert fleetlib.verdict(got, expected) == {"missing": [], "unexpected": [],
                                               "duplicated": []}, got
    # each from the ruler of its level: the straggler compares ranks across nodes
    (straggler,) = next(v for k, v in got.items() if k[0] == "GpuTrainStragglerRank")
    assert straggler["alertgroup"] == "gputrain.global.alerts"
    for key, (labels,) in got.items():
        if key[0] != "GpuTrainStragglerRank":
            assert labels["alertgroup"] == "gputrain.alerts", labels


def test_every_node_is_the_real_page_with_its_own_labels(fleet):
    """VictoriaMetrics holds each healthy node's page whole: as many raw series as its
    template daemon's page has samples, and the node's own ranks and GPUs."""
    import requests

    vm = fleet.vm.url
    page = requests.get(fleet.daemons["healthy"].url + "/metrics", timeout=10).text
    samples = sum(1 for line in page.splitlines() if line and not line.startswith("#"))

    def stored() -> float:
        return fleetlib.scalar(vm, 'count({instance="node-0016", __name__=~"gputrain_.+"})')

    # the page's own series (its count moves by a collector's or a departed rank's lines)
    got = wait_until(lambda: abs(stored() - samples) <= 8 and stored(), timeout=60,
                     what=f"node-0016's series ({samples} on its template's page)")
    assert got > 700  # 8 GPUs and 8 ranks
    ranks = {r["metric"]["rank"] for r in fleetlib.query(
        vm, 'gputrain_training_steps_total{run="run-002"}')}
    assert ranks == {str(r) for r in range(8 * 4)}  # run-002's four nodes, ranks 0-31
    uuids = fleetlib.query(vm, 'count(count by (uuid) (last_over_time(gputrain_gpu_up[10m])))')
    assert int(float(uuids[0]["value"][1])) == 8 * NODES  # every node's GPUs its own
