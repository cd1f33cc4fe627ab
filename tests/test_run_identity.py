"""A rank is judged within its run, on the daemon's surfaces: ranks waiting for a peer inside a
declared phase (a checkpoint, an evaluation) are waiting for that peer, never stalled nor
stragglers, until the peer's phase passes its own limit; a rank whose peers live and step, or
whose phased peer died, is stalled (the promtool cases in rule_cases.py say the same)."""

from __future__ import annotations

import json

import pytest
from test_departed import Node

from exporter.protocol import SCHEMA_VERSION


def two_ranks(node: Node, minutes: int, peer: str) -> None:
    """Rank 0 steps 10 minutes, then its step stays open; rank 1 steps 10 minutes, then
    ``peer``: "checkpoint" or "evaluation" (a declared phase it stays in), "steps" (it goes on
    stepping), "dies" (in a checkpoint, it stops pushing at once)."""
    totals = {"0": 0.0, "1": 0.0}
    for k in range(minutes * 12):
        node.now += 5.0
        t = 5.0 * (k + 1)
        late = t > 600
        for rank in ("0", "1"):
            if rank == "1" and late and peer == "dies":
                continue
            stepping = not late or (rank == "1" and peer == "steps")
            if stepping:
                totals[rank] += 5.0
            extra: dict = {}
            if late and rank == "0":
                extra = {"step_open_seconds": t - 600}
            elif late and rank == "1" and peer in ("checkpoint", "evaluation"):
                extra = {"step_open_seconds": 0.0, "open_phase": peer,
                         "open_phase_seconds": t - 600, "phases": {peer: t - 600}}
            steps = totals[rank] * 10
            node.store.push(json.dumps({
                "version": SCHEMA_VERSION, "run": "r", "rank": rank, "run_id": "a" + rank,
                "steps": int(steps), "step_seconds": totals[rank],
                "data_wait_seconds": 0.01 * totals[rank], "samples": 32 * steps,
                "elapsed_seconds": t, **extra}).encode())
        node.observe()


@pytest.mark.parametrize("peer", ["checkpoint", "evaluation"])
def test_ranks_waiting_for_a_peers_phase_are_waiting_and_say_for_whom(peer):
    node = Node()
    two_ranks(node, 30, peer)  # rank 0's step open 20 minutes, past stalled_seconds
    (run,) = node.page()["runs"]
    r0, r1 = run["ranks"]
    assert r0["verdict"] == "waiting", r0
    assert f"rank 1's {peer}" in r0["reason"]
    assert r1["verdict"] not in ("stalled", "hung", "straggler")
    assert not {"stalled", "straggler", "hung"} & {f["verdict"] for f in r0["also"]}


@pytest.mark.parametrize("peer", ["steps", "dies"])
def test_a_rank_whose_peers_step_or_whose_phased_peer_died_is_stalled(peer):
    node = Node()
    two_ranks(node, 30, peer)
    (run,) = node.page()["runs"]
    r0 = run["ranks"][0]
    found = {r0["verdict"]} | {f["verdict"] for f in r0["also"]}
    assert "stalled" in found or r0["verdict"] == "hung", r0
    assert "straggler" not in found  # its open step is no slow compute


def test_two_jobs_under_one_run_name_are_said_and_never_compared():
    """diagnose's view (every node's ranks): run 'twice' pushed by two jobs of ranks 0 and 1,
    one of which waits 60 % for data. As one run its rank 0 on n2 would be a straggler; as
    two jobs under one name it is said so, and its ranks are not compared. Four ranks of one
    job spread over two nodes are compared as before."""
    from exporter.heuristics.diagnose import GpuReading, RankReport, judge
    from exporter.heuristics.rules import DEFAULTS

    def rank(r: str, node: str, wait: float) -> RankReport:
        rep = RankReport("gputrain", f"{node}:19400", "twice", r, steps_per_second=10,
                         data_wait_ratio=wait, seconds_since_push=2.0, step_seconds=0.1)
        rep.gpus = [GpuReading("0", f"GPU-{node}-{r}", 0.9, memory_used=0.5, power_used=0.7)]
        return rep

    t = DEFAULTS["thresholds"]
    shared = judge([rank("0", "n1", 0.01), rank("1", "n1", 0.01),
                    rank("0", "n2", 0.6), rank("1", "n2", 0.01)], t)
    for rep in shared:
        assert "name-shared" in rep.findings(), rep.reason
        assert "straggler" not in rep.findings()
    one_job = judge([rank("0", "n1", 0.01), rank("1", "n1", 0.01),
                     rank("2", "n2", 0.6), rank("3", "n2", 0.01)], t)
    assert "straggler" in one_job[2].findings()
    assert not any("name-shared" in rep.findings() for rep in one_job)
