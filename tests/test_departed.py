"""A run that died stays reported as dead after its series expire: the ingest keeps a departed
rank's end (when it last pushed, how it ended) for ``--ingest.dead-ttl`` after
``--ingest.ttl``, on /metrics (so its alert holds on: the promtool cases in rule_cases.py) and
on the status page; a clean end, or a rank that comes back, is no death.

Each case is an hour of a rank pushed every 5 s then silent or said goodbye, on a fake clock,
through the daemon's own ingest, history and status document."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from exporter.heuristics.rules import DEFAULTS
from exporter.protocol import SCHEMA_VERSION
from exporter.reading.sampler import Snapshot
from exporter.serving.attribution import Attribution
from exporter.serving.history import History
from exporter.serving.ingest import CONFIRM_SECONDS, IngestStore
from exporter.serving.status import StatusView
from exporter.serving.training import TrainingCollector

T = DEFAULTS["thresholds"]
TTL, DEAD_TTL = 600.0, 3600.0


class Node:
    """A daemon's ingest, history and page on one fake clock (unix = monotonic + ``offset``:
    a restarted daemon's monotonic clock starts anew, its wall clock does not)."""

    def __init__(self, dead_ttl: float = DEAD_TTL, proc: str = "/proc",
                 offset: float = 1e9) -> None:
        self.now = 1000.0
        self.offset = offset
        self.store = IngestStore(ttl=TTL, dead_ttl=dead_ttl, clock=lambda: self.now,
                                 wall_clock=lambda: self.now + self.offset, proc=proc)
        self.history = History(window=300.0, point_seconds=5.0, instance="n1",
                               clock=lambda: self.now)
        self.views = Attribution()
        self.cycle = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TrainingCollector(self.store, lambda: self.views.latest))

    def push(self, rank: str = "0", run_id: str = "a", **over) -> None:
        t = self.now - 1000.0
        self.store.push(json.dumps({
            "version": SCHEMA_VERSION, "run": "r", "rank": rank, "run_id": run_id,
            "steps": int(t * 10), "step_seconds": t, "data_wait_seconds": 0.1 * t,
            "samples": 320 * t, "elapsed_seconds": t, "last_step_timestamp": self.now + self.offset,
            **over}).encode())

    def run(self, seconds: float, ranks: tuple[str, ...] = ("0",), **over) -> None:
        """``seconds`` of the given ranks pushing every 5 s (none: silence)."""
        for _ in range(int(seconds / 5)):
            self.now += 5.0
            for r in ranks:
                self.push(r, **over)
            self.observe()

    def observe(self) -> None:
        """One sampler cycle, as Attribution.follow runs it: the dead reaped, then joined."""
        self.cycle += 1
        self.store.reap()
        self.history.observe(self.views.update(
            Snapshot(self.cycle, self.now + self.offset, "test", ""), self.store.states(),
            self.store.departed()))

    def page(self) -> dict:
        return StatusView(self.history, T).document()

    def value(self, name: str, rank: str = "0", **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"run": "r", "rank": rank, **labels})


def verdicts(doc: dict) -> dict[str, str]:
    (run,) = doc["runs"]
    return {rank["rank"]: rank["verdict"] for rank in run["ranks"]}


def test_a_killed_run_is_still_said_vanished_long_after_its_series_went():
    node = Node()
    node.run(600)  # ten minutes of steps, then SIGKILL: no goodbye
    node.run(25 * 60, ranks=())  # 25 minutes later: past --ingest.ttl
    assert node.value("gputrain_training_steps_total") is None  # its counters are gone ...
    since = node.now + 1e9 - node.value("gputrain_training_last_push_timestamp_seconds")
    assert since == pytest.approx(25 * 60)  # ... its end is not
    assert node.value("gputrain_training_finished") == 0
    doc = node.page()
    assert verdicts(doc) == {"0": "vanished"}
    assert "25 min ago" in doc["runs"][0]["ranks"][0]["reason"]
    node.run(TTL + DEAD_TTL - 25 * 60 + 5, ranks=())  # dead_ttl after the ttl: forgotten
    assert node.value("gputrain_training_last_push_timestamp_seconds") is None
    assert node.page()["runs"] == []


def test_a_failed_rank_is_said_failed_for_the_dead_ttl_with_its_exception():
    node = Node()
    node.run(300, ranks=("0", "1"))
    node.push("1", goodbye=True, exit_reason="exception", exit_detail="torch.OutOfMemoryError")
    node.run(40 * 60, ranks=())  # rank 0 killed by the scheduler after its peer's failure
    assert node.value("gputrain_training_failed", "1") == 1
    assert node.value("gputrain_training_exit_info", "1", reason="exception",
                      detail="torch.OutOfMemoryError") == 1
    assert verdicts(node.page()) == {"0": "vanished", "1": "failed"}
    assert "torch.OutOfMemoryError" in node.page()["runs"][0]["ranks"][1]["reason"]


def test_a_clean_end_is_never_a_death_after_the_ttl():
    node = Node()
    node.run(300)
    node.push(goodbye=True, exit_reason="completed")
    node.run(30 * 60, ranks=())
    assert node.value("gputrain_training_last_push_timestamp_seconds") is None
    assert node.store.departed() == []
    assert node.page()["runs"] == []


def test_a_rank_that_comes_back_is_alive_not_departed():
    node = Node()
    node.run(300)
    node.run(TTL + 60, ranks=())  # departed ...
    assert [st.rank for st in node.store.departed()] == ["0"]
    node.run(60, run_id="b")  # ... then restarted under the same run and rank
    assert node.store.departed() == []
    assert node.value("gputrain_training_steps_total") is not None
    assert verdicts(node.page())["0"] not in ("vanished", "failed", "stalled")


def test_dead_ttl_zero_forgets_with_the_ttl_and_departed_ranks_are_bounded():
    node = Node(dead_ttl=0.0)
    node.run(60)
    node.run(TTL + 10, ranks=())
    assert node.value("gputrain_training_last_push_timestamp_seconds") is None
    bounded = IngestStore(max_series=3, ttl=10.0, clock=lambda: node.now,
                          wall_clock=lambda: node.now)
    for k in range(6):  # six ranks die one after the other: the three latest are kept
        bounded.push(json.dumps({"version": SCHEMA_VERSION, "run": "r", "rank": str(k),
                                 "run_id": "a", "steps": 1, "step_seconds": 1.0,
                                 "data_wait_seconds": 0.0, "samples": 1}).encode())
        node.now += 11.0
        bounded.states()
    assert sorted(st.rank for st in bounded.departed()) == ["3", "4", "5"]


def test_a_rank_killed_outright_is_not_judged_on_its_steps_once_silent_past_silent_seconds():
    """Rank 1 is killed (SIGKILL: no goodbye) while rank 0 goes on. Its last window of steps,
    its rates falling, says nothing of now: 20 s after its last push it is still judged as
    before (a push, a scrape may be late), past silent_seconds (60 s) it reads paused, "no
    push", on the page as in diagnose (the same judge), never a bottleneck or gpu-bound."""
    node = Node()
    node.run(300, ranks=("0", "1"))
    before = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert before["1"]["verdict"] not in ("paused", "vanished"), before["1"]
    node.run(20, ranks=("0",))
    assert verdicts(node.page())["1"] == before["1"]["verdict"]
    node.run(T["silent_seconds"] + 10 - 20, ranks=("0",))
    ranks = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert ranks["1"]["verdict"] == "paused", ranks["1"]
    assert ranks["1"]["reason"] == ("no push for 70 s while its run's other ranks push: "
                                    "nothing is judged of its steps"), ranks["1"]
    assert ranks["0"]["verdict"] == before["0"]["verdict"]


def test_a_rank_that_finished_first_is_kept_while_its_run_goes_on_then_forgotten_with_it():
    """Uneven inputs: rank 0 runs out of batches and says goodbye while rank 1 goes on (and
    may wait for it in a collective). A clean end is forgotten a minute after its goodbye,
    which is the hang floor: rank 0 would be gone from every surface just when rank 1 is
    called hung, and nothing could name it. It is kept, finished, while a rank of its run still
    runs, then forgotten with the run's last goodbye, as any clean end is."""
    node = Node()
    node.run(300, ranks=("0", "1"))
    node.push("0", goodbye=True, exit_reason="completed")
    node.run(5 * 60, ranks=("1",))
    assert node.value("gputrain_training_finished", "0") == 1
    ranks = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert ranks["0"]["verdict"] == "finished" and ranks["1"]["verdict"] != "finished", ranks
    node.push("1", goodbye=True, exit_reason="completed")
    node.run(55, ranks=())
    assert set(verdicts(node.page()).values()) == {"finished"}
    node.run(10, ranks=())  # a minute after the last goodbye: the run is forgotten whole
    assert node.page()["runs"] == []
    assert node.store.departed() == []
    assert node.value("gputrain_training_finished", "0") is None


def test_a_run_that_failed_is_told_by_its_first_failure_not_the_launchers_sigterm():
    """Rank 1 raises; a few seconds later the launcher (torchrun) ends ranks 0 and 2 by
    SIGTERM. Every rank reads failed, each with its own end, and the run's verdict is told
    by the failure that came first, the cause, not by rank 0's SIGTERM."""
    node = Node()
    node.run(300, ranks=("0", "1", "2"))
    node.push("1", goodbye=True, exit_reason="exception", exit_detail="RuntimeError")
    node.run(5, ranks=())
    for r in ("0", "2"):
        node.push(r, goodbye=True, exit_reason="signal", exit_detail="SIGTERM")
    node.run(10, ranks=())
    (run,) = node.page()["runs"]
    assert {r["rank"]: r["verdict"] for r in run["ranks"]} == {
        "0": "failed", "1": "failed", "2": "failed"}
    failed = run["verdicts"][0]
    assert failed["verdict"] == "failed" and failed["ranks"] == ["0", "1", "2"]
    assert "RuntimeError" in failed["reason"] and "SIGTERM" not in failed["reason"], failed


class Proc:
    """A /proc of fixture files: processes (their state and start time) and the node's OOM
    kill count (/proc/vmstat)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.oom(0)

    def run(self, pid: int, start: int = 4242, state: str = "S") -> None:
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "stat").write_text(
            f"{pid} (python3 train.py) {state} " + "1 " * 18 + f"{start} 0 0\n")

    def end(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))

    def oom(self, kills: int) -> None:
        (self.root / "vmstat").write_text(f"nr_free_pages 1000\noom_kill {kills}\npgfault 9\n")


def _pid(rank: str) -> dict:
    return {"process": {"pid": 100 + int(rank), "start_time": 4242}}


def pushing(node: Node, seconds: float, ranks: str) -> None:
    """``seconds`` of ``ranks`` pushing every 5 s, each with its process (pid 100 + rank)."""
    for _ in range(int(seconds / 5)):
        node.now += 5.0
        for r in ranks:
            node.push(r, **_pid(r))
        node.observe()


def looks(node: Node, seconds: float = CONFIRM_SECONDS + 1.0) -> None:
    """The daemon's cycles over ``seconds`` (a second apart) with no push: a process found
    gone is looked for again, and dead once still gone CONFIRM_SECONDS later."""
    for _ in range(int(seconds)):
        node.now += 1.0
        node.observe()


def test_a_rank_whose_process_is_gone_without_a_goodbye_reads_failed_killed_at_once(tmp_path):
    """SIGKILL, an abort (NCCL's watchdog), a segfault: no handler of the process runs, no
    goodbye comes. Where the daemon has seen the process in its /proc, it finds it gone at its
    next cycle and, still gone a few seconds later (a goodbye may be late), reads it failed,
    reason killed, on /metrics (so GpuTrainRunFailed fires) and on the page; the run is told
    by it, not by the SIGTERM its launcher sends the others after."""
    proc = Proc(tmp_path)
    node = Node(proc=str(tmp_path))
    for r in ("0", "1", "2"):
        proc.run(100 + int(r))
    pushing(node, 300, "012")
    proc.end(102)
    looks(node, CONFIRM_SECONDS - 1.0)
    assert node.value("gputrain_training_failed", "2") == 0  # not yet: a goodbye may be late
    looks(node, 2.0)
    assert node.value("gputrain_training_failed", "2") == 1
    assert node.value("gputrain_training_exit_info", "2", reason="killed", detail="") == 1
    ranks = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert ranks["2"]["verdict"] == "failed", ranks["2"]
    assert "without a goodbye" in ranks["2"]["reason"] and "OOM" not in ranks["2"]["reason"]
    assert ranks["0"]["verdict"] != "failed"
    node.now += 4.0  # torchrun ends the others
    for r in ("0", "1"):
        node.push(r, goodbye=True, exit_reason="signal", exit_detail="SIGTERM", **_pid(r))
        proc.end(100 + int(r))
    node.observe()
    (run,) = node.page()["runs"]
    assert run["verdicts"][0]["verdict"] == "failed"
    assert "without a goodbye" in run["verdicts"][0]["reason"], run["verdicts"][0]
    assert node.value("gputrain_training_exit_info", "0", reason="signal",
                      detail="SIGTERM") == 1  # their own word stands


def test_a_rank_killed_by_the_oom_killer_is_said_so_and_one_kill_is_one_ranks(tmp_path):
    """The node's OOM kill count (/proc/vmstat oom_kill, a cgroup limit's kills included)
    grew between the rank's last push and its death: OOMKilled. A kill before its last push
    (another process, earlier) is no evidence, and one kill is one rank's: a peer that dies
    after it (its collective aborted) is killed, not OOMKilled."""
    proc = Proc(tmp_path)
    node = Node(proc=str(tmp_path))
    for r in "012":
        proc.run(100 + int(r))
    pushing(node, 60, "012")
    proc.oom(3)  # an earlier kill: rank 1 pushes after it, then dies
    node.now += 5.0
    for r in "012":
        node.push(r, **_pid(r))
    node.observe()
    proc.end(101)
    looks(node)
    assert node.value("gputrain_training_exit_info", "1", reason="killed", detail="") == 1
    node.now += 1.0
    node.push("0", **_pid("0")), node.push("2", **_pid("2"))
    node.observe()
    proc.oom(4)
    proc.end(100), proc.end(102)
    looks(node)
    details = {r: [d for d in ("", "OOMKilled") if node.value(
        "gputrain_training_exit_info", r, reason="killed", detail=d) == 1] for r in "02"}
    assert sorted(details.values()) == [[""], ["OOMKilled"]], details
    oom = next(r for r, d in details.items() if d == ["OOMKilled"])
    ranks = {r["rank"]: r for r in node.page()["runs"][0]["ranks"]}
    assert "OOM killer" in ranks[oom]["reason"] and "OOM" not in ranks["1"]["reason"]


def test_a_process_the_daemon_never_saw_a_stopped_one_or_one_that_said_goodbye_is_no_kill(
        tmp_path):
    """Near misses. A pid the daemon never found with its start time (another PID namespace:
    a daemon without hostPID) is judged by its pushes alone, as before; a stopped process (T)
    lives; a goodbye is the process's own word, late as it may come (the client waits a
    second for its answer, then exits); a /proc the daemon cannot read says nothing. Then the
    deaths: a pid the daemon saw, now another process's (a new start time), and a process
    that died unreaped (a zombie)."""
    proc = Proc(tmp_path)
    node = Node(proc=str(tmp_path))
    proc.run(100, start=999)  # rank 0's pid here is another process's (another namespace)
    for r in "12345":
        proc.run(100 + int(r))
    pushing(node, 60, "012345")
    proc.end(100)
    proc.run(101, state="T")  # SIGSTOP
    proc.end(102)  # rank 2 exits ...
    proc.end(104)
    (tmp_path / "104").mkdir()  # rank 4's /proc entry unreadable (its stat a directory)
    (tmp_path / "104" / "stat").mkdir()
    node.now += 1.0
    node.observe()
    node.now += 1.5
    node.observe()  # gone for 1.5 s: not dead yet, a goodbye may be on its way ...
    assert node.value("gputrain_training_failed", "2") == 0
    node.push("2", goodbye=True, exit_reason="completed", **_pid("2"))  # ... and it came
    looks(node)
    for r in "014":
        assert node.value("gputrain_training_failed", r) == 0, r
    assert node.value("gputrain_training_finished", "2") == 1
    ranks = {r["rank"]: r["verdict"] for r in node.page()["runs"][0]["ranks"]}
    assert ranks["1"] != "failed" and ranks["2"] == "finished", ranks
    proc.run(101, start=5000)  # its pid reused by a new process: rank 1's is gone
    proc.run(103, state="Z")  # rank 3 died, unreaped by its parent
    looks(node)
    assert node.value("gputrain_training_exit_info", "1", reason="killed", detail="") == 1
    assert node.value("gputrain_training_exit_info", "3", reason="killed", detail="") == 1
    assert node.value("gputrain_training_failed", "5") == 0  # alive all along
