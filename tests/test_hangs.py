"""Hangs, end to end: real torch.distributed (gloo on the CPU), four ranks as two nodes (two
daemons, two ranks each), a real Prometheus with the shipped node and global rules and a real
Alertmanager.

One rank blocks (in its data loading, in a checkpoint save outside any phase); within two
minutes of the block `GpuTrainRunHung` fires once for the run, and every surface (the status
API, the page in Chromium, `top`, `diagnose`) says hung and names that rank, its node and its
function, from the stacks every daemon took of its ranks without anyone asking. A collective's
timeout ends the waiting ranks by an exception: they read failed, never finished. The near
misses (a long checkpoint in its declared phase, a run of minutes-long steps, a job stopped on
purpose, a DataLoader's start, a first step that compiles) are called nothing of the kind.
The hangs judged at the ceiling (before and in a first step, at a DataLoader's start) are
``test_hang_ceiling.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import yaml
from conftest import (
    ENV_BIN,
    NO_HOST,
    ROOT,
    Alertmanager,
    Daemon,
    Prometheus,
    Webhook,
    require_module,
    sample_value,
    stop_all,
    wait_until,
)
from test_status import chromium

from exporter.protocol import PUSH_PATH

pytestmark = pytest.mark.torch
HANG_TRAIN = ROOT / "tests" / "hang_train.py"
# the rules at their default thresholds; only how often Prometheus evaluates them is the
# test's (a 2 s cycle), so that the two minutes are the thresholds' and not the intervals'
RULES = {"recording_interval": "2s", "liveness_interval": "2s"}


def exporter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


class Job:
    """The ranks of one run, a process each as torchrun starts them, rank r pushing to
    ``endpoints[r]``; ``args`` are hang_train.py's flags; ``preexec_fn`` runs in each before
    it execs (joins a cgroup)."""

    def __init__(self, tmp: Path, run: str, endpoints: list[str], *args: str,
                 preexec_fn: Callable[[], object] | None = None) -> None:
        self.run, self.out = run, tmp / run
        self.out.mkdir()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "PATH": f"{ENV_BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        self.logs = [open(self.out / f"rank{r}.log", "w") for r in range(len(endpoints))]  # noqa: SIM115
        self.procs = [subprocess.Popen(
            [sys.executable, str(HANG_TRAIN), "--rank", str(r), "--world", str(len(endpoints)),
             "--endpoint", url, "--run", run, "--out", str(self.out), *args],
            cwd=ROOT, env=env, stdout=self.logs[r], stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn)
            for r, url in enumerate(endpoints)]

    def log(self, rank: int) -> str:
        return (self.out / f"rank{rank}.log").read_text()[-3000:]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in self.logs:
            f.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two nodes' daemons, one Prometheus with the node and global rules, Alertmanager."""
    require_module("torch")
    tmp = tmp_path_factory.mktemp("hangs")
    started: list = []
    try:
        config = tmp / "rules.yml"
        config.write_text(yaml.safe_dump(RULES))
        files = []
        for level in ("node", "global"):
            out = exporter("rules", "--level", level, "--config", str(config))
            assert out.returncode == 0, out.stderr
            files.append(tmp / f"gputrain.{level}.rules.yml")
            files[-1].write_text(out.stdout)
        hook = Webhook()
        am_config = tmp / "alertmanager.yml"
        am_config.write_text(yaml.safe_dump({
            "route": {"receiver": "hook", "group_by": ["..."], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": hook.url}]}]}))
        am = Alertmanager(tmp, am_config).start()
        started.append(am)
        nodes = [Daemon("--gpu.backend=demo", "--demo.gpus=2", *NO_HOST).start()
                 for _ in range(2)]
        started.extend(nodes)
        prom = Prometheus(tmp, [n.url.removeprefix("http://") for n in nodes],
                          rule_files=[str(f) for f in files], scrape_interval="2s",
                          alertmanager=f"127.0.0.1:{am.port}").start()
        started.append(prom)
        yield {"tmp": tmp, "nodes": nodes, "prom": prom, "hook": hook}
    finally:
        stop_all(started)


def status(daemon: Daemon) -> dict:
    return requests.get(daemon.url + "/api/v1/status", timeout=10).json()


def run_of(daemon: Daemon, run: str) -> dict | None:
    return next((r for r in status(daemon)["runs"] if r["run"] == run), None)


def firing(prom: Prometheus, alert: str, run: str) -> list[dict]:
    return prom.query(f'ALERTS{{alertname="{alert}",run="{run}",alertstate="firing"}}')


def hang_profiles(daemon: Daemon, run: str) -> dict[str, dict]:
    """The daemon's own captures of a hung run's ranks, done, by rank."""
    return {p["rank"]: p for p in status(daemon)["profiles"]
            if p["run"] == run and p["trigger"] == "hang" and p["state"] == "done"}


def two_nodes(cluster) -> list[str]:
    a, b = cluster["nodes"]
    return [a.ingest_url, a.ingest_url, b.ingest_url, b.ingest_url]


def assert_hang_named(cluster, run: str, words: tuple[str, ...]) -> None:
    """Within two minutes of rank 3's block, the run's alert fires once, and every surface
    says hung and names rank 3, its node and ``words`` (its function, where it is)."""
    prom, hook = cluster["prom"], cluster["hook"]
    a, b = cluster["nodes"]
    node_b = b.url.removeprefix("http://")
    wait_until(lambda: firing(prom, "GpuTrainRunHung", run), timeout=300, interval=1,
               what=f"GpuTrainRunHung firing for {run}")
    # the latency: from rank 3's last step (its block) to the alert's first evaluation
    (active,) = prom.query(f'ALERTS_FOR_STATE{{alertname="GpuTrainRunHung",run="{run}"}}')
    (last,) = prom.query(f'max(gputrain_training_last_step_timestamp_seconds'
                         f'{{run="{run}",rank="3"}})')
    latency = float(active["value"][1]) - float(last["value"][1])
    assert 0 < latency <= 120, f"GpuTrainRunHung came {latency:.0f} s after the block"

    # every daemon took its ranks' stacks, with native frames, without anyone asking
    wait_until(lambda: set(hang_profiles(a, run)) == {"0", "1"}, timeout=120,
               what=f"node a's captures of ranks 0 and 1 ({status(a)['profiles']})")
    wait_until(lambda: set(hang_profiles(b, run)) == {"2", "3"}, timeout=120,
               what=f"node b's captures of ranks 2 and 3 ({status(b)['profiles']})")
    where = {**hang_profiles(a, run), **hang_profiles(b, run)}
    assert {r: p["location"]["location"] for r, p in where.items() if r != "3"} == \
        dict.fromkeys(("0", "1", "2"), "collective"), where

    # the status API and the page of the culprit's node
    def named() -> dict | None:
        card = run_of(b, run)
        return card if card and card["hang"] and all(w in card["hang"] for w in words) \
            and "rank 3" in card["hang"] else None

    card = wait_until(named, timeout=60,
                      what=f"node b's status naming rank 3 ({run_of(b, run)})")
    assert card["status"] == "hung", card
    assert {r["rank"]: r["verdict"] for r in card["ranks"]} == {"2": "hung", "3": "hung"}
    page = chromium(b.url + "/", "--dump-dom").stdout
    assert "Hung:" in page and "rank 3" in page and all(w in page for w in words), page[-3000:]
    top = exporter("top", "--once", "--url", b.url)
    assert top.returncode == 0, top.stderr
    assert "hung: rank 3" in " ".join(top.stdout.split()), top.stdout

    # diagnose, from Prometheus: the whole run, the culprit on its node
    def diagnosed() -> list | None:
        out = exporter("diagnose", "--prometheus", prom.url, "--run", run, "--json")
        ranks = json.loads(out.stdout)["ranks"] if out.stdout else []
        hung = [r for r in ranks if r["verdict"] == "hung"]
        return hung if len(hung) == 4 and all(
            "rank 3" in r["reason"] and node_b in r["reason"] and
            all(w in r["reason"] for w in words) for r in hung) else None

    wait_until(diagnosed, timeout=90, interval=2, what="diagnose naming rank 3 on node b")

    # once, for the run, at Alertmanager
    wait_until(lambda: hook.find("GpuTrainRunHung", run=run), timeout=60,
               what="GpuTrainRunHung at the webhook")
    assert len({json.dumps(x["labels"], sort_keys=True)
                for x in hook.find("GpuTrainRunHung", run=run)}) == 1


# each block: the words that name it, and the step it comes after
BLOCKS = {
    "data": (("Samples.__getitem__", "loading data"), 150),  # a read that never returns
    "checkpoint": (("save_checkpoint", "checkpoint I/O"), 250),  # a save outside any phase
}


class TestBlocked:
    """Each block a job of its own, both started at once (each timed from its own block, the
    second a hundred steps later than the first: their captures and alerts do not coincide)."""

    @pytest.fixture(scope="class")
    def blocked(self, cluster):
        jobs = [Job(cluster["tmp"], f"hang-{block}", two_nodes(cluster), "--block", block,
                    "--block-rank", "3", "--block-after", str(after))
                for block, (_, after) in BLOCKS.items()]
        yield
        for job in jobs:
            job.stop()

    @pytest.mark.parametrize("block", BLOCKS)
    def test_a_blocked_rank_is_named_hung_within_two_minutes(self, cluster, blocked, block):
        assert_hang_named(cluster, f"hang-{block}", BLOCKS[block][0])


def test_a_hang_is_said_before_the_jobs_own_collective_timeout_ends_it_as_failed(cluster):
    """The job sets a 40 s collective timeout (init_process_group's, as a user sets one
    shorter than NCCL's 10 minutes): its client pushes it, each rank's hang ceiling is half of
    it, and the run is said hung, in the status API and by its alert, before the timeout ends
    the waiting ranks; they then read failed, never finished."""
    a, _ = cluster["nodes"]
    prom, run = cluster["prom"], "hang-timeout"
    job = Job(cluster["tmp"], run, two_nodes(cluster), "--block", "data",
              "--block-rank", "3", "--block-after", "100", "--timeout", "40")
    try:
        pushed = wait_until(lambda: sample_value(
            a.metrics(), "gputrain_training_collective_timeout_seconds", {"run": run}),
            timeout=120, what="the run's collective timeout pushed")
        assert pushed == 40

        def said() -> dict | None:  # the run hung, or a rank failed: whichever comes first
            card = run_of(a, run)
            return card if card and (card["status"] == "hung" or any(
                r["failed"] for r in card["ranks"])) else None

        first = wait_until(said, timeout=240, interval=0.5, what=f"{run} hung or failed")
        assert first["status"] == "hung" and not any(r["failed"] for r in first["ranks"]), \
            first
        assert all("allows 20 s" in r["reason"] for r in first["ranks"]), first

        def failed() -> dict | None:
            card = run_of(a, run)
            ranks = {r["rank"]: r for r in card["ranks"]} if card else {}
            return ranks if ranks and all(r["failed"] for r in ranks.values()) else None

        ranks = wait_until(failed, timeout=240, interval=1,
                           what=f"ranks 0 and 1 failed on node a ({run_of(a, run)})")
        for r in ranks.values():
            assert r["exit_reason"] == "exception" and not r["finished"], r
            assert r["verdict"] == "failed" and "exception" in r["reason"], r
            assert "Error" in (r["exit_detail"] or ""), r
        assert job.procs[0].wait(timeout=30) != 0
        wait_until(lambda: firing(prom, "GpuTrainRunFailed", run),
                   timeout=120, what="GpuTrainRunFailed firing")
        # in Prometheus' own record: the hang's alert fired before any rank read failed
        hung_at = prom.query(f'min_over_time(timestamp(ALERTS{{alertname="GpuTrainRunHung",'
                             f'run="{run}",alertstate="firing"}})[10m:1s])')
        failed_at = prom.query(f'min_over_time(timestamp(gputrain_training_failed'
                               f'{{run="{run}"}} > 0)[10m:1s])')
        assert hung_at and failed_at, (hung_at, failed_at)
        assert float(hung_at[0]["value"][1]) < min(float(x["value"][1]) for x in failed_at)
        # the 20 s wait that ended in the timeout is no step: every step was short
        text = a.metrics()
        over = [line for line in text.splitlines()
                if line.startswith("gputrain_training_step_duration_seconds_bucket")
                and 'run="hang-timeout"' in line and 'le="10.0"' in line]
        count = [line for line in text.splitlines()
                 if line.startswith("gputrain_training_step_duration_seconds_count")
                 and 'run="hang-timeout"' in line]
        assert over and count and [x.split()[-1] for x in over] == \
            [x.split()[-1] for x in count], (over, count)
    finally:
        job.stop()


def test_a_rank_killed_outright_reads_failed_at_once_and_tells_its_runs_failure(cluster):
    """Rank 3 of 'killed' is killed (SIGKILL: as the OOM killer, an abort by NCCL's watchdog
    or a segfault, no handler runs, no goodbye comes). Its node's daemon finds its process
    gone from /proc within seconds: failed, reason killed, on the status API, /metrics and
    in Prometheus, where GpuTrainRunFailed fires for it, and diagnose says so. Its peers'
    collectives then fail (gloo sees the closed connection; NCCL would wait for its watchdog)
    and end by their exceptions, their own word: the run is told by rank 3, which died
    first, not by what its death did to the others."""
    _, b = cluster["nodes"]
    prom, run = cluster["prom"], "killed"
    job = Job(cluster["tmp"], run, two_nodes(cluster))
    try:
        wait_until(lambda: (sample_value(b.metrics(), "gputrain_training_steps_total",
                                         {"run": run, "rank": "3"}) or 0) > 20,
                   timeout=180, interval=1, what="rank 3 stepping")
        job.procs[3].kill()

        def dead() -> dict | None:
            card = run_of(b, run)
            ranks = {r["rank"]: r for r in card["ranks"]} if card else {}
            return ranks if ranks.get("3", {}).get("exit_reason") == "killed" else None

        ranks = wait_until(dead, timeout=60, interval=1,
                           what=f"rank 3 failed, killed ({run_of(b, run)})")
        assert ranks["3"]["failed"] and ranks["3"]["verdict"] == "failed", ranks["3"]
        assert "without a goodbye" in ranks["3"]["reason"], ranks["3"]
        assert job.procs[2].wait(timeout=120) != 0  # its collective failed
        card = wait_until(lambda: (c := run_of(b, run)) and all(
            r["failed"] for r in c["ranks"]) and c, timeout=60, interval=1,
            what=f"rank 2's failure on node b ({run_of(b, run)})")
        ranks = {r["rank"]: r for r in card["ranks"]}
        assert ranks["2"]["exit_reason"] == "exception", ranks["2"]
        lead = card["verdicts"][0]
        assert lead["verdict"] == "failed" and "without a goodbye" in lead["reason"], lead

        wait_until(lambda: [a for a in firing(prom, "GpuTrainRunFailed", run)
                            if a["metric"].get("rank") == "3"],
                   timeout=120, interval=1, what="GpuTrainRunFailed firing for rank 3")
        assert prom.query(f'gputrain_training_exit_info{{run="{run}",rank="3",'
                          'reason="killed"}'), "the killed end in Prometheus"

        def diagnosed() -> dict | None:
            out = exporter("diagnose", "--prometheus", prom.url, "--run", run, "--json")
            ranks = {r["rank"]: r for r in json.loads(out.stdout)["ranks"]} \
                if out.stdout else {}
            three = ranks.get("3")
            return three if three and three["verdict"] == "failed" else None

        three = wait_until(diagnosed, timeout=60, interval=2, what="diagnose: rank 3 failed")
        assert "without a goodbye" in three["reason"], three
    finally:
        job.stop()


def test_a_long_declared_checkpoint_with_the_others_at_a_barrier_is_waiting_not_hung(cluster):
    a, _ = cluster["nodes"]
    prom = cluster["prom"]
    run = "long-save"
    # every rank on node a: its daemon sees the phase and the ranks that wait for it
    job = Job(cluster["tmp"], run, [a.ingest_url] * 4, "--block", "checkpoint-phase",
              "--block-rank", "3", "--block-after", "100", "--block-seconds", "100")
    seen: set[str] = set()
    said: list = []  # whatever called it hung or stalled (wait_until would swallow an assert)
    try:
        def resumed() -> bool:
            if firing(prom, "GpuTrainRunHung", run):
                said.append("GpuTrainRunHung")
            card = run_of(a, run)
            if not card:
                return False
            if card["status"] == "hung" or card["hang"] is not None:
                said.append(card)
            for r in card["ranks"]:
                seen.add(r["verdict"])
                if r["verdict"] in ("hung", "stalled") or (
                        r["verdict"] == "waiting" and "rank 3's checkpoint" not in r["reason"]):
                    said.append(r)
            steps = [r["step_in_progress_seconds"] or 0.0 for r in card["ranks"]]
            # past the phase: the ranks that waited over the floor step again
            return bool(said) or ("waiting" in seen and all(v < 10 for v in steps))

        wait_until(resumed, timeout=300, interval=1, what=f"the save to end ({seen})")
        assert not said, said
        assert "waiting" in seen, seen
        assert not [p for p in status(a)["profiles"] if p["run"] == run
                    and p["trigger"] == "hang"]
        assert not prom.query(f'ALERTS{{alertname=~"GpuTrainRunHung|GpuTrainStalled",'
                              f'run="{run}"}}')
    finally:
        job.stop()


# --- the daemon's own judgement, from scripted pushes: exact, and quick ---------------------


@pytest.fixture
def node(daemon_factory) -> Daemon:
    return daemon_factory("--gpu.backend=demo", "--demo.gpus=1", *NO_HOST)


def push(d: Daemon, run: str, rank: str = "0", **fields) -> requests.Response:
    body = {"version": 1, "run": run, "rank": rank, "run_id": f"{run}-{rank}", "steps": 5,
            "step_seconds": 1.0, "data_wait_seconds": 0.0, "samples": 40,
            "capabilities": ["stacks"], **fields}
    r = requests.post(d.ingest_url + PUSH_PATH, json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r


def verdict(d: Daemon, run: str, rank: str = "0") -> dict:
    card = wait_until(lambda: run_of(d, run), timeout=30, what=f"run {run} on the page")
    return next(r for r in card["ranks"] if r["rank"] == rank)


@pytest.mark.parametrize(("open_s", "hung"), [(250, False), (310, True)])
def test_a_run_of_two_minute_steps_is_hung_only_past_its_own_limit(node, open_s, hung):
    # 5 steps of 120 s: the limit is the 300 s ceiling (twice the step is 240 s)
    push(node, "slow", steps=5, step_seconds=600.0, step_open_seconds=open_s)
    r = verdict(node, "slow")
    assert (r["verdict"] == "hung") is hung, r
    assert r["step_in_progress_seconds"] >= open_s


@pytest.mark.parametrize(("open_s", "hung"), [(50, False), (70, True)])
def test_a_fast_run_is_hung_past_the_floor(node, open_s, hung):
    push(node, "fast", steps=1000, step_seconds=30.0, step_open_seconds=open_s)
    assert (verdict(node, "fast")["verdict"] == "hung") is hung


def test_a_dataloader_start_and_a_first_step_are_no_hang(node):
    # the workers of an epoch start inside the declared phase, however long they take
    push(node, "loader", steps=1000, step_seconds=30.0, step_open_seconds=0.0,
         open_phase="dataloader_start", open_phase_seconds=400.0)
    # no step yet (compiling): no pace to judge against, under the first step's limit
    push(node, "compile", steps=0, step_seconds=0.0, samples=0, step_open_seconds=600.0)
    assert verdict(node, "loader")["verdict"] != "hung"
    assert verdict(node, "compile")["verdict"] != "hung"
    assert verdict(node, "loader")["phase_in_progress"]["dataloader_start"] >= 400


def test_a_rank_ended_by_an_exception_reads_failed_and_an_exit_without_close_ended(node):
    push(node, "crashed", steps=1000, step_seconds=30.0, step_open_seconds=400.0,
         goodbye=True, exit_reason="exception", exit_detail="RuntimeError")
    r = verdict(node, "crashed")
    assert (r["verdict"], r["status"], r["finished"], r["failed"]) == \
        ("failed", "failed", False, True), r
    assert "RuntimeError" in r["reason"]
    push(node, "handloop", steps=1000, step_seconds=30.0, goodbye=True, exit_reason="exited")
    r = verdict(node, "handloop")
    assert (r["verdict"], r["finished"], r["failed"]) == ("ended", False, False), r


def test_a_job_stopped_on_purpose_reads_stopped_not_hung(node, tmp_path):
    """A real client, stopped with SIGSTOP: no push, no step, and its daemon says stopped."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import time\nfrom exporter.client import TrainingMonitor\n"
        f"m = TrainingMonitor(run='paused', rank=0, endpoint='{node.ingest_url}', "
        "push_interval=0.2)\n"
        "while True:\n    with m.step(samples=1):\n        time.sleep(0.01)\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until(lambda: run_of(node, "paused"), timeout=30, what="the loop on the page")
        proc.send_signal(signal.SIGSTOP)
        r = wait_until(lambda: (x := verdict(node, "paused"))["verdict"] == "stopped" and x,
                       timeout=60, what="the rank read stopped")
        assert r["status"] == "stopped" and "SIGSTOP" in r["reason"]
        assert run_of(node, "paused")["hang"] is None
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
