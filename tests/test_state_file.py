"""A daemon that restarts forgets no run that ended (``--ingest.state-file``): a failed rank is
still failed after it, a silent one still silent (and departs when its ttl runs out, as it
would have), one whose process died while the daemon was down is found killed; a clean end,
a rank that keeps pushing, a death older than the dead ttl are no news after it either. The
unit cases restart the daemon's ingest, history and page on fake clocks (a new monotonic
clock, the wall clock running on); the last ones restart the real daemon under a real
Prometheus, whose GpuTrainRunFailed fires again after the restart instead of resolving."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import NO_HOST, ROOT, free_port, rules_file, sample_value, wait_until
from test_departed import DEAD_TTL, TTL, Node, Proc, looks, pushing, verdicts

from exporter.protocol import SCHEMA_VERSION
from exporter.serving.ingest import RESTORE_GRACE_SECONDS
from exporter.serving.state_file import ROW_BYTES, SAVE_SECONDS, StateFile


def restart(node: Node, path: Path, down: float, proc: str = "/proc") -> Node:
    """``node``'s state written to ``path`` (as at its shutdown), then a new daemon started
    ``down`` seconds later that takes it back: its monotonic clock starts anew at 50 s."""
    StateFile(str(path), node.store).save()
    wall = node.now + node.offset + down
    new = Node(proc=proc, offset=wall - 50.0)
    new.now = 50.0
    StateFile(str(path), new.store).load()
    new.observe()
    return new


def ranks_of(node: Node) -> dict[str, dict]:
    runs = node.page()["runs"]
    return {r["rank"]: r for run in runs for r in run["ranks"]}


def test_a_failed_rank_is_still_failed_after_a_restart_and_forgotten_when_it_would_have_been(
        tmp_path):
    node = Node()
    node.run(300, ranks=("0", "1"))
    node.push("1", goodbye=True, exit_reason="exception", exit_detail="torch.OutOfMemoryError")
    node.run(20 * 60, ranks=())  # rank 0 killed outright: silent; rank 1 past its ttl
    before = {k: node.value(k, "1") for k in ("gputrain_training_failed",
                                              "gputrain_training_last_push_timestamp_seconds")}
    new = restart(node, tmp_path / "ingest.json", down=120)
    assert verdicts(new.page()) == {"0": "vanished", "1": "failed"}
    assert "torch.OutOfMemoryError" in ranks_of(new)["1"]["reason"]
    assert {k: new.value(k, "1") for k in before} == before  # the same series, same values
    assert new.value("gputrain_training_exit_info", "1", reason="exception",
                     detail="torch.OutOfMemoryError") == 1
    # the dead ttl runs on from the failure, not from the restart
    left = TTL + DEAD_TTL - 20 * 60 - 120
    new.now += left - 10
    new.observe()
    assert new.value("gputrain_training_failed", "1") == 1
    new.now += 20
    new.observe()
    assert new.value("gputrain_training_failed", "1") is None
    assert new.page()["runs"] == []


def test_a_silent_rank_departs_after_a_restart_when_its_ttl_runs_out(tmp_path):
    """Killed two minutes before the restart: live (within the ttl) when written, it waits
    for its client's retry (RESTORE_GRACE_SECONDS) and, none coming, is silent for the whole
    time since its last push; it departs, vanished, when its ttl would have run out."""
    node = Node()
    node.run(300)
    node.run(120, ranks=())
    new = restart(node, tmp_path / "ingest.json", down=60)
    assert new.page()["runs"] == []  # its client may yet retry
    new.now += RESTORE_GRACE_SECONDS
    new.observe()
    (rank,) = ranks_of(new).values()
    assert rank["seconds_since_push"] == pytest.approx(180 + RESTORE_GRACE_SECONDS, abs=6)
    new.now += TTL - 180 - RESTORE_GRACE_SECONDS + 10
    new.observe()
    assert new.store.states() == [] and len(new.store.departed()) == 1
    assert verdicts(new.page()) == {"0": "vanished"}


def test_near_miss_a_live_run_whose_client_retries_late_never_reads_vanished(tmp_path):
    """Down 150 s, then its client's next retry a minute later (its back-off): between the
    two it is not shown silent (it would read vanished, and page), and from its push on it
    is as before."""
    node = Node()
    node.run(300, ranks=("0", "1"))
    steps = node.value("gputrain_training_steps_total")
    new = restart(node, tmp_path / "ingest.json", down=150)
    for _ in range(12):  # a minute without a push
        new.now += 5.0
        new.observe()
        assert all(r["verdict"] not in ("vanished", "paused", "hung")
                   for r in ranks_of(new).values()), ranks_of(new)
    for r in "01":
        new.push(r, steps=int(steps) + 100, step_seconds=500.0, data_wait_seconds=50.0,
                 samples=320.0 * (steps + 100), elapsed_seconds=520.0)
    new.observe()
    assert set(ranks_of(new)) == {"0", "1"}
    assert all(r["seconds_since_push"] < 5 for r in ranks_of(new).values())


def test_a_rank_whose_process_died_while_the_daemon_was_down_is_found_killed(tmp_path):
    proc = Proc(tmp_path)
    node = Node(proc=str(tmp_path))
    for r in "01":
        proc.run(100 + int(r))
    pushing(node, 60, "01")
    proc.end(101)  # SIGKILLed while no daemon ran
    new = restart(node, tmp_path / "ingest.json", down=30, proc=str(tmp_path))
    looks(new)
    assert new.value("gputrain_training_failed", "1") == 1
    assert new.value("gputrain_training_exit_info", "1", reason="killed", detail="") == 1
    # rank 0's process still runs: no news, it shows again from its client's next push
    assert new.value("gputrain_training_failed", "0") is None
    assert [st.rank for st in new.store.states()] == ["1"]


def test_near_miss_a_rank_that_keeps_pushing_reads_as_if_there_had_been_no_restart(tmp_path):
    """Its totals go on from where they were (no counter reset on /metrics, no restart of
    its process read), and it is no news."""
    node = Node()
    node.run(300)
    steps = node.value("gputrain_training_steps_total")
    new = restart(node, tmp_path / "ingest.json", down=20)
    assert new.value("gputrain_training_steps_total") is None  # until its next push
    for i in range(12):  # a minute of pushes after the restart, the same process
        new.now += 5.0
        new.push(steps=int(steps) + 50 * (i + 1), step_seconds=300.0 + 5 * (i + 1),
                 data_wait_seconds=30.0, samples=320.0 * (steps + 50 * (i + 1)),
                 elapsed_seconds=320.0 + 5 * (i + 1))
        new.observe()
    assert new.value("gputrain_training_steps_total") == steps + 600
    (rank,) = ranks_of(new).values()
    assert rank["verdict"] not in ("failed", "vanished", "restarting", "hung"), rank
    assert new.value("gputrain_training_failed") == 0


def test_near_miss_clean_ends_and_deaths_older_than_the_dead_ttl_are_not_taken_back(tmp_path):
    node = Node()
    node.run(300, ranks=("0", "1"))
    node.push("0", goodbye=True, exit_reason="completed")
    node.push("1", goodbye=True, exit_reason="exception", exit_detail="ValueError")
    new = restart(node, tmp_path / "ingest.json", down=TTL + DEAD_TTL + 60)
    assert new.page()["runs"] == [] and new.store.departed() == []
    new = restart(node, tmp_path / "ingest2.json", down=GOODBYE_GRACE + 5)
    assert verdicts(new.page()) == {"1": "failed"}  # the clean end's grace is over


GOODBYE_GRACE = 60.0


@pytest.mark.parametrize("text", [
    "{not json",
    json.dumps({"version": 99, "saved_unix": 1e9, "ranks": []}),
    json.dumps([1, 2]),
    "\udcff",  # not UTF-8
    "[" * 100_000 + "]" * 100_000,  # nested past the parser's recursion
    '{"version": 1, "saved_unix": 1' + "0" * 400 + ', "ranks": []}',  # past a float
    '{"version": 1, "saved_unix": NaN, "ranks": []}',
    " " * (ROW_BYTES * 2 * 1024 + 1),  # larger than --ingest.max-series allows
], ids=["json", "version", "array", "utf-8", "nesting", "huge-int", "nan", "size"])
def test_a_file_that_cannot_be_read_is_a_fresh_start_said_in_the_log(tmp_path, caplog, text):
    """Whatever the file holds, the daemon starts (a crash loop under Restart= would lose
    every rank): the file is kept aside as .bad, the next write replaces it."""
    path = tmp_path / "ingest.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    node = Node()
    StateFile(str(path), node.store).load()
    assert node.store.states() == [] and "not a state this version wrote" in caplog.text
    assert (tmp_path / "ingest.json.bad").read_bytes() == text.encode("utf-8",
                                                                       "surrogateescape")
    node.run(10)
    StateFile(str(path), node.store).save()
    assert json.loads(path.read_text())["ranks"][0]["run"] == "r"


BAD_ROWS = {  # a field each, as no daemon writes it: each would break the page or a push
    "label": {"run": 'r"} 1\nevil{x="'},
    "exit detail label": {"exit_detail": 'x"} 1'},
    "exit reason": {"exit_reason": "vanished"},
    "phase name": {"phases": {'a"b': 1.0}},
    "phases a list": {"phases": [1, 2]},
    "steps a string": {"steps": "100"},
    "process a list": {"process": [1]},
    "process figure": {"process": {"cpu_seconds": "x"}},
    "gpu": {"gpus": [0]},
    "histogram": {"bucket_bounds": [1.0, 0.5], "bucket_counts": [1, 2]},
    "infinite": {"step_seconds": 1e400},
    "no run_id": {"run_id": None},
    "no times": {"received_ago": None},
    "not an object": None,
}


def test_rows_this_daemon_did_not_write_are_left_out_and_the_rest_taken_back(tmp_path, caplog):
    """Each bad row is left out; the good one is taken back, and the page, /metrics and a
    push of the next process all work."""
    caplog.set_level(logging.INFO)
    node = Node()
    node.run(60, ranks=("0",))
    path = tmp_path / "ingest.json"
    StateFile(str(path), node.store).save()
    doc = json.loads(path.read_text())
    (good,) = doc["ranks"]
    doc["ranks"] += [None if bad is None else {**good, "rank": str(i + 1), **bad}
                     for i, bad in enumerate(BAD_ROWS.values())]
    path.write_text(json.dumps(doc).replace("Infinity", "1e400"))
    new = Node(offset=node.offset + 5)
    new.now = node.now
    StateFile(str(path), new.store).load()
    assert f"1 rank(s) taken back, {len(BAD_ROWS)} unreadable row(s) left out" in caplog.text
    new.push("0", run_id="b")  # its next process
    new.observe()
    assert [st.rank for st in new.store.states()] == ["0"]
    assert verdicts(new.page()) and new.value("gputrain_training_steps_total") is not None


def test_the_file_is_written_when_a_rank_ends_and_otherwise_every_save_seconds(tmp_path):
    node = Node()
    t = [0.0]
    sf = StateFile(str(tmp_path / "ingest.json"), node.store, clock=lambda: t[0])

    def written() -> list[tuple[str, str | None]]:
        sf.cycle()
        doc = json.loads(sf.path.read_text())
        return sorted((r["rank"], r["exit_reason"]) for r in doc["ranks"])

    node.run(10, ranks=("0", "1"))
    assert written() == [("0", None), ("1", None)]
    node.push("1", goodbye=True, exit_reason="exception", exit_detail="ValueError")
    t[0] += 1
    assert written() == [("0", None), ("1", "exception")]  # at once: an end
    mtime = sf.path.stat().st_mtime_ns
    node.run(5, ranks=("0",))
    t[0] += 1
    sf.cycle()
    assert sf.path.stat().st_mtime_ns == mtime  # only totals moved: not yet
    t[0] += SAVE_SECONDS
    sf.cycle()
    assert sf.path.stat().st_mtime_ns != mtime
    assert not list(tmp_path.glob(".ingest.json.*"))  # no temporary file left


# --- the real daemon, restarted under a real Prometheus ---------------------------------------

def _daemon(port: int, ingest: int, state: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
         f"--ingest.listen-address=127.0.0.1:{ingest}", "--gpu.backend=demo", "--demo.gpus=1",
         *NO_HOST, f"--ingest.state-file={state}"], cwd=ROOT,
        stdout=log.open("a"), stderr=subprocess.STDOUT)


def _up(port: int, proc: subprocess.Popen, log: Path) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the exporter exited ({proc.returncode}): {log.read_text()}")
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200

    wait_until(ready, timeout=90, what=lambda: f"the exporter ({log.read_text()})")


def _push(ingest: int, **over) -> None:
    now = time.time()
    r = requests.post(f"http://127.0.0.1:{ingest}/api/v1/push", timeout=10, json={
        "version": SCHEMA_VERSION, "run": "died", "rank": "0", "run_id": "p1", "steps": 100,
        "step_seconds": 50.0, "data_wait_seconds": 1.0, "samples": 3200.0,
        "elapsed_seconds": 60.0, "last_step_timestamp": now, **over})
    assert r.status_code == 200, r.text


def _failed_on(port: int) -> tuple[float | None, str | None]:
    text = requests.get(f"http://127.0.0.1:{port}/metrics?fresh=1", timeout=10).text
    doc = requests.get(f"http://127.0.0.1:{port}/api/v1/status", timeout=10).json()
    ranks = [r for run in doc["runs"] if run["run"] == "died" for r in run["ranks"]]
    return (sample_value(text, "gputrain_training_failed", {"run": "died", "rank": "0"}),
            ranks[0]["verdict"] if ranks else None)


def test_run_failed_fires_again_after_the_daemon_restarts_instead_of_resolving(
        tmp_path, prometheus_factory):
    """A rank fails (its goodbye says RuntimeError); GpuTrainRunFailed fires. The daemon is
    stopped (SIGTERM: it writes the file as it goes), started again on the same ports, then
    killed (SIGKILL: the file written on the cycle after the failure is all there is) and
    started again: each time the page, the status API and the alert say the rank failed, and
    the alert fires again (it resolves only while Prometheus reads the target down)."""
    state, log = tmp_path / "state" / "ingest.json", tmp_path / "daemon.log"
    state.parent.mkdir()
    port, ingest = free_port(), free_port()
    proc = _daemon(port, ingest, state, log)
    try:
        _up(port, proc, log)
        rules = rules_file(tmp_path, {"recording_interval": "1s", "liveness_interval": "1s"})
        prom = prometheus_factory([f"127.0.0.1:{port}"], rule_files=[str(rules)])
        _push(ingest)
        _push(ingest, steps=110, goodbye=True, exit_reason="exception",
              exit_detail="RuntimeError")
        assert wait_until(lambda: _failed_on(port) == (1.0, "failed"), timeout=30)

        def firing() -> bool:
            return bool(prom.query('ALERTS{alertname="GpuTrainRunFailed",'
                                   'alertstate="firing",run="died"}'))

        wait_until(firing, timeout=120, interval=1, what="GpuTrainRunFailed to fire")
        # the file holds the failure before anything ends the daemon (the cycle after it)
        wait_until(lambda: any(r["exit_reason"] == "exception" for r in
                               json.loads(state.read_text())["ranks"]), timeout=30)
        for how, status in ((signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)):
            proc.send_signal(how)
            assert proc.wait(timeout=30) == status
            wait_until(lambda: not firing(), timeout=60, interval=1,
                       what="the alert to read the target down")  # Prometheus' own doing
            proc = _daemon(port, ingest, state, log)
            _up(port, proc, log)
            assert _failed_on(port) == (1.0, "failed"), (how, log.read_text())
            wait_until(firing, timeout=90, interval=1,
                       what=f"GpuTrainRunFailed to fire again after {how.name}")
        assert log.read_text().count("1 rank(s) taken back") == 2
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_a_state_file_that_cannot_be_written_stops_the_daemon_at_start_saying_so(tmp_path):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{free_port()}",
         f"--ingest.listen-address=127.0.0.1:{free_port()}", "--gpu.backend=demo",
         f"--ingest.state-file={blocked}/ingest.json"], cwd=ROOT, capture_output=True,
        text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 2, out.stderr
    assert f"cannot write --ingest.state-file {blocked}/ingest.json: Not a directory" in \
        out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_write_a_kill_interrupted_is_cleared_at_start(tmp_path):
    """A SIGKILL between the temporary file and its rename leaves the temporary file: the
    next start removes it (an emptyDir has a size limit), and the last whole file stands."""
    node = Node()
    node.run(10)
    path = tmp_path / "ingest.json"
    StateFile(str(path), node.store).save()
    (tmp_path / ".ingest.json.k1ll3d").write_text('{"version": 1, "ran')
    new = Node()
    StateFile(str(path), new.store).load()
    assert not list(tmp_path.glob(".ingest.json.*"))
    assert len(new.store.saved()["ranks"]) == 1
