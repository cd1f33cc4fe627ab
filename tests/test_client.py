"""The training client against the real daemon over real HTTP."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, cgroup_tree, free_port, require_module, sample_value, wait_until

from exporter.client import TrainingMonitor, batch_len
from exporter.client.monitor import HookTimer, default_rank, default_run
from exporter.protocol import NAME_RE


def sleeping_loader(n: int, wait_s: float, batch: int):
    for i in range(n):
        time.sleep(wait_s)
        yield [i] * batch


def test_input_bound_loop_is_measured_exactly(daemon_factory):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    m = TrainingMonitor(run="sleepy", rank=0, endpoint=d.ingest_url, push_interval=0.5)
    for _ in m.wrap(sleeping_loader(100, 0.030, 16), batch_size=16):
        time.sleep(0.010)
    assert m.flush(5)
    text = d.metrics()
    labels = {"run": "sleepy", "rank": "0"}
    assert sample_value(text, "gputrain_training_steps_total", labels) == 100
    assert sample_value(text, "gputrain_training_samples_total", labels) == 1600
    wait = sample_value(text, "gputrain_training_data_wait_seconds_total", labels)
    total = sample_value(text, "gputrain_training_step_duration_seconds_sum", labels)
    assert wait / total == pytest.approx(0.75, abs=0.05)
    # every step sleeps at least 40 ms (a loaded machine only makes it longer), but the
    # first: its batch is the loader's start-up (the phase dataloader_start), not its step's
    assert sample_value(text, "gputrain_training_step_duration_seconds_bucket",
                        {**labels, "le": "0.025"}) <= 1
    assert sample_value(text, "gputrain_training_phase_seconds_total",
                        {**labels, "phase": "dataloader_start"}) >= 0.030
    assert sample_value(text, "gputrain_training_step_duration_seconds_bucket",
                        {**labels, "le": "+Inf"}) == 100
    assert sample_value(text, "gputrain_training_process_cpu_seconds_total", labels) > 0
    # the tree's PSS from the real smaps_rollup: shared pages count once, so at most its RSS
    pss = sample_value(text, "gputrain_training_process_proportional_memory_bytes", labels)
    rss = sample_value(text, "gputrain_training_process_resident_memory_bytes", labels)
    assert 0 < pss <= rss
    m.close()


def _timed_loop(m: TrainingMonitor, steps: int) -> float:
    started = time.perf_counter()
    for _ in m.wrap(range(steps), batch_size=1):
        time.sleep(0.004)
    return time.perf_counter() - started


def test_a_dead_daemon_neither_slows_nor_breaks_the_loop_and_totals_come_back(
        daemon_factory, caplog, monkeypatch):
    """The training thread never touches the network (so a dead daemon cannot slow it: its
    cost is measured in bench/bench_client.py, not timed here); one warning; the totals
    arrive when the daemon is back."""
    import threading

    import requests

    callers = set()
    post = requests.Session.post

    def recording_post(self, *args, **kwargs):
        callers.add(threading.current_thread().name)
        return post(self, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "post", recording_post)
    d = daemon_factory()
    m = TrainingMonitor(run="resilient", endpoint=d.ingest_url, push_interval=0.05)
    for _ in range(2):
        _timed_loop(m, 150)
    d.kill()
    with caplog.at_level(logging.WARNING, logger="exporter.client"):
        for _ in range(2):
            _timed_loop(m, 150)
        wait_until(lambda: any("cannot push" in r.message for r in caplog.records),
                   timeout=30, what="the pusher to notice the dead daemon")
    assert callers == {"gputrain-pusher"}, callers
    warnings = [r for r in caplog.records if "cannot push" in r.message]
    assert len(warnings) == 1
    d.start()  # same ports
    wait_until(lambda: m.flush(3), timeout=60, what="a push to the restarted daemon")
    text = d.metrics()
    assert sample_value(text, "gputrain_training_steps_total",
                        {"run": "resilient", "rank": "0"}) == 600
    m.close()


def test_hand_written_loop_with_phases(daemon_factory):
    d = daemon_factory()
    m = TrainingMonitor(run="manual", rank=3, endpoint=d.ingest_url, push_interval=60)
    it = iter(range(5))
    for _ in range(5):
        with m.data_wait():
            next(it)
            time.sleep(0.02)
        with m.step(samples=8):
            time.sleep(0.01)
            with m.phase("callbacks"):
                time.sleep(0.01)
    with m.phase("checkpoint"):
        time.sleep(0.05)
    assert m.flush(5)
    text = d.metrics()
    labels = {"run": "manual", "rank": "3"}
    assert sample_value(text, "gputrain_training_steps_total", labels) == 5
    assert sample_value(text, "gputrain_training_samples_total", labels) == 40
    wait = sample_value(text, "gputrain_training_data_wait_seconds_total", labels)
    assert wait == pytest.approx(0.1, abs=0.03)
    assert sample_value(text, "gputrain_training_phase_seconds_total",
                        {**labels, "phase": "callbacks"}) == pytest.approx(0.05, abs=0.03)
    assert sample_value(text, "gputrain_training_phase_seconds_total",
                        {**labels, "phase": "checkpoint"}) == pytest.approx(0.05, abs=0.03)
    m.close()


def test_close_says_goodbye_with_the_final_totals(daemon_factory):
    d = daemon_factory()
    m = TrainingMonitor(run="short", endpoint=d.ingest_url, push_interval=60)
    for _ in m.wrap(range(7), batch_size=2):
        pass
    m.close(timeout=10)  # the goodbye's wait, room for a loaded machine (1 s by default)
    m.close()  # twice is fine
    text = d.metrics()
    assert sample_value(text, "gputrain_training_steps_total", {"run": "short"}) == 7


def test_a_forked_child_never_pushes(daemon_factory):
    d = daemon_factory()
    m = TrainingMonitor(run="forky", endpoint=d.ingest_url, push_interval=60)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say
        try:
            m.flush(1)
            m.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert sample_value(d.metrics(), "gputrain_ingest_requests_total", {"code": "200"}) is None
    m.close(timeout=10)
    assert sample_value(d.metrics(), "gputrain_ingest_requests_total", {"code": "200"}) == 1


def test_a_token_goes_along(daemon_factory, tmp_path, caplog):
    token = "0123456789abcdef-token"
    (tmp_path / "token").write_text(token + "\n")
    d = daemon_factory(f"--ingest.token-file={tmp_path / 'token'}")
    wrong = TrainingMonitor(run="t", endpoint=d.ingest_url, token="nope-nope-nope-nope",
                            push_interval=60)
    with caplog.at_level(logging.WARNING, logger="exporter.client"):
        assert not wrong.flush(3)
    assert any("401" in r.message for r in caplog.records)
    os.environ["GPUTRAIN_TOKEN_FILE"] = str(tmp_path / "token")
    try:
        right = TrainingMonitor(run="t", endpoint=d.ingest_url, push_interval=60)
    finally:
        del os.environ["GPUTRAIN_TOKEN_FILE"]
    assert right.flush(3)
    wrong.close()
    right.close()


def test_an_address_with_the_push_path_or_as_url_reaches_the_daemon(daemon_factory,
                                                                     monkeypatch):
    """GPUTRAIN_URL holding the push path itself is the daemon's address (not the path
    twice and a 404); url= is endpoint= by another name."""
    d = daemon_factory()
    monkeypatch.setenv("GPUTRAIN_URL", d.ingest_url + "/api/v1/push")
    from_env = TrainingMonitor(run="env-path", push_interval=60)
    assert from_env.endpoint == d.ingest_url
    by_url = TrainingMonitor(run="by-url", url=d.ingest_url + "/", push_interval=60)
    for m in (from_env, by_url):
        for _ in m.wrap(range(3), batch_size=1):
            pass
        assert m.flush(10)
        m.close()
    text = d.metrics()
    for run in ("env-path", "by-url"):
        assert sample_value(text, "gputrain_training_steps_total", {"run": run}) == 3


@pytest.mark.parametrize("where, value, message", [
    ("GPUTRAIN_URL", "127.0.0.1:19401",
     "GPUTRAIN_URL 127.0.0.1:19401: give the scheme, as in GPUTRAIN_URL http://127.0.0.1:19401"),
    ("GPUTRAIN_URL", "http://node-3:19401/ingest",
     "GPUTRAIN_URL http://node-3:19401/ingest: give the daemon's ingest address without a "
     "path, as in http://node-3:19401 (the client adds /api/v1/push itself)"),
    ("endpoint", "ftp://node-3:19401", "endpoint= ftp://node-3:19401: the scheme must be "
                                      "http:// or https://, not ftp://"),
    ("url", "http://node-3:port", "url= http://node-3:port: the port is not a number"),
])
def test_a_wrong_address_is_refused_at_once_saying_what_is_wrong(monkeypatch, where, value,
                                                                 message):
    monkeypatch.delenv("GPUTRAIN_URL", raising=False)
    if where == "GPUTRAIN_URL":
        monkeypatch.setenv("GPUTRAIN_URL", value)
        kwargs = {}
    else:
        kwargs = {where: value}
    with pytest.raises(ValueError) as exc:
        TrainingMonitor(run="typo", start=False, **kwargs)
    assert message in str(exc.value)


def test_endpoint_and_url_that_differ_are_refused():
    with pytest.raises(ValueError, match=r"endpoint=.* and url=.* differ"):
        TrainingMonitor(endpoint="http://a:19401", url="http://b:19401", start=False)
    same = TrainingMonitor(endpoint="http://a:19401", url="http://a:19401", start=False)
    assert same.endpoint == "http://a:19401"


def test_a_refused_push_names_the_address_it_went_to(daemon_factory, caplog):
    """A push to the metrics port (not the ingest one) is refused; the log line shows the URL
    used and what to check."""
    d = daemon_factory()
    m = TrainingMonitor(run="wrong-port", endpoint=d.url, push_interval=60)
    with caplog.at_level(logging.WARNING, logger="exporter.client"):
        assert not m.flush(3)
    (line,) = [r.getMessage() for r in caplog.records if "refused a push" in r.getMessage()]
    assert f"{d.url}/api/v1/push refused a push (405)" in line
    assert "ingest address" in line
    m.close(timeout=1)


def test_defaults_from_the_environment(monkeypatch):
    for var in ("GPUTRAIN_RUN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RANK", "SLURM_PROCID",
                "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert default_run() == "4711" and default_rank() == "3"
    monkeypatch.setenv("GPUTRAIN_RUN", "mine")
    monkeypatch.setenv("RANK", "5")
    assert default_run() == "mine" and default_rank() == "5"
    monkeypatch.setenv("GPUTRAIN_URL", "http://10.0.0.1:19401/")
    m = TrainingMonitor(start=False)
    assert (m.run, m.rank, m.endpoint) == ("mine", "5", "http://10.0.0.1:19401")


def test_two_jobs_of_one_script_launched_without_a_run_id_are_two_runs(monkeypatch):
    """torchrun without --rdzv-id says TORCHELASTIC_RUN_ID=none: the default run is the
    script's name and a digest of the job's rendezvous, the same for all its ranks and another
    for the next job (a plain python process keeps the script's name)."""
    for var in ("GPUTRAIN_RUN", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["/work/train.py"])
    assert default_run() == "train"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    first = default_run()
    assert first.startswith("train-") and NAME_RE.fullmatch(first)
    assert default_run() == first  # every rank of the job
    monkeypatch.setenv("MASTER_PORT", "41377")  # the next job (--standalone picks a port)
    assert default_run() != first
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")  # --rdzv-id names the run
    assert default_run() == "job-42"


def test_batch_len():
    class T:
        shape = (12, 3)

    assert batch_len((T(), [1, 2])) == 12
    assert batch_len({"input_ids": T()}) == 12
    assert batch_len([[1, 2, 3], [4, 5, 6]]) == 3
    assert batch_len(object()) == 1


def test_totals_are_consistent_while_the_loop_runs():
    import threading

    m = TrainingMonitor(start=False)
    stop = threading.Event()
    bad = []

    def read():
        while not stop.is_set():
            t = m.totals()
            if t["step_counts"][-1] > t["steps"]:
                bad.append(t)

    reader = threading.Thread(target=read)
    reader.start()
    for _ in m.wrap(range(200_000), batch_size=1):
        pass
    stop.set()
    reader.join()
    assert bad == []
    assert m.totals()["steps"] == 200_000


def test_phase_names_past_the_daemons_limit_are_counted_as_other(caplog):
    """The daemon takes MAX_PHASES phase names per rank and refuses a push with more; the
    client folds the extra names into 'other' (with one warning) so no push is refused."""
    from exporter.protocol import MAX_PHASES, OTHER_PHASE
    from exporter.serving.ingest import parse_push

    m = TrainingMonitor(run="phasey", start=False)
    for i in range(MAX_PHASES + 5):
        with m.phase(f"hook{i}"):
            pass
    phases = m.totals()["phases"]
    assert len(phases) == MAX_PHASES and OTHER_PHASE in phases
    assert sum("counted as phase 'other'" in r.getMessage() for r in caplog.records) == 1
    body = json.dumps({"version": 1, "run": "phasey", "rank": "0", "run_id": "x",
                       **m.totals()}).encode()
    parse_push(body, 0.0, 0.0)  # the daemon accepts it
    with pytest.raises(ValueError, match="at most"):
        TrainingMonitor(run="phasey", start=False, buckets=[0.001 * i for i in range(1, 40)])


def test_model_flops_are_samples_times_flops_per_sample_from_when_they_are_known():
    m = TrainingMonitor(run="mfu", start=False)
    for _ in m.wrap([[0] * 4] * 3):  # 12 samples before the FLOPs are known
        pass
    assert "flops" not in m.totals() and m.totals()["precision"] == "bf16"
    m.set_flops_per_sample(1e9, precision="fp8")
    for _ in m.wrap([[0] * 4] * 5):  # 20 samples after
        pass
    totals = m.totals()
    assert totals["flops"] == 20 * 1e9 and totals["precision"] == "fp8"
    assert totals["samples"] == 32
    m2 = TrainingMonitor(run="mfu", start=False, flops_per_sample=2.5e6)
    with m2.step(samples=8):
        pass
    assert m2.totals()["flops"] == 8 * 2.5e6


def test_elapsed_seconds_run_from_the_process_start():
    """Start-up (imports, model building) is time outside steps: the clock the client pushes
    starts when the process did, not when the monitor was made."""
    import psutil

    age = time.time() - psutil.Process().create_time()
    m = TrainingMonitor(run="wall", start=False)
    first = m.totals()["elapsed_seconds"]
    assert first >= age - 0.05  # psutil's start time is rounded to clock ticks
    with m.step(samples=1):
        time.sleep(0.01)
    totals = m.totals()
    assert totals["elapsed_seconds"] >= first + 0.01


@pytest.mark.parametrize("kwargs, message", [
    ({"flops_per_sample": -1}, "flops_per_sample must be a finite number >= 0"),
    ({"flops_per_sample": float("nan")}, "flops_per_sample must be a finite number >= 0"),
    ({"precision": "int8"}, "precision must be one of fp8, bf16, fp16, tf32, fp32"),
])
def test_bad_flops_or_precision_is_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingMonitor(start=False, **kwargs)


def test_the_precision_is_autocasts_dtype_when_flops_are_set_inside_it():
    torch = __import__("torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = TrainingMonitor(start=False, flops_per_sample=1.0)
    assert m.precision == "bf16"
    with torch.autocast("cpu", dtype=torch.float16):
        m.set_flops_per_sample(2.0)
    assert m.precision == "fp16"
    m.set_flops_per_sample(2.0, precision="tf32")
    assert m.precision == "tf32"


def test_flop_counter_agrees_with_a_hand_count_on_a_small_mlp():
    """Linear(16, 32), ReLU, Linear(32, 4) on a batch of 8. A multiply-add is 2 FLOPs:
    forward 2*8*16*32 + 2*8*32*4 = 10,240; backward: the second layer's input and weight
    gradients (2 * 2,048) and the first layer's weight gradient (8,192; its input needs none);
    22,528 in all, 2,816 per sample."""
    torch = __import__("torch")
    from exporter.client.flops import count_training_flops, transformer_flops_per_sample

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    assert count_training_flops(model, torch.randn(8, 16)) == 2816
    assert all(p.grad is None for p in model.parameters())
    loss = torch.nn.functional.cross_entropy
    target = torch.zeros(8, dtype=torch.long)
    assert count_training_flops(model, torch.randn(8, 16), lambda out: loss(out, target)) == 2816
    assert transformer_flops_per_sample(8e9, 4096) == 6 * 8e9 * 4096


def test_an_evaluation_in_progress_is_pushed_while_it_lasts(monkeypatch):
    """A 20-minute evaluation shows in every push, not only at its end (else the rank reads as
    stalled meanwhile); the phase's total never goes down, even read as the phase ends."""
    import exporter.client.monitor as monitor

    now = [1000.0]
    monkeypatch.setattr(monitor, "_now", lambda: now[0])
    m = TrainingMonitor(run="evaly", start=False)
    seen = []
    with m.phase("evaluation"):
        with m.phase("checkpoint"):  # nested: the outermost one is what is in progress
            now[0] += 30
        for _ in range(4):
            now[0] += 300
            seen.append(m.totals()["phases"]["evaluation"])
        phase = m.phase("evaluation")
        # the phase ends between a push's two reads: its share in progress is gone, its
        # total not yet added
        m._outside_depth, m._open_phase = 0, None
        seen.append(m.totals()["phases"]["evaluation"])
        m._outside_depth, m._open_phase = 1, ("evaluation", phase._t0)
    seen.append(m.totals()["phases"]["evaluation"])
    assert seen == [330, 630, 930, 1230, 1230, 1230]
    assert m.totals()["phases"]["checkpoint"] == 30
    with m.phase("callbacks"):  # a phase within steps is counted when it ends
        now[0] += 5
        assert "callbacks" not in m.totals()["phases"]
    assert m.totals()["phases"]["callbacks"] == 5


def _sent_keys(payload: dict) -> set[str]:
    """The fields a push holds: its top-level keys and those of its ``process`` object."""
    return set(payload) | {f"process.{k}" for k in payload.get("process", {})}


def test_every_key_the_client_sends_is_in_the_push_schema_and_every_field_is_sent(
        one_rank, tmp_path):
    """The real client, every optional path on (a wrapped DataLoader, FLOPs, a DDP model, a
    phase, a cgroup v2 quota, a profile and a py-spy dump asked for, goodbye): each key of
    its push is a field of protocol.PUSH_FIELDS / PROCESS_FIELDS, each field of the schema is
    sent, and the daemon takes the push."""
    from exporter.client.cgroup import CgroupCpu
    from exporter.protocol import PROCESS_FIELDS, PUSH_FIELDS
    from exporter.serving.ingest import IngestStore

    torch = require_module("torch")
    ddp = require_module("torch.nn.parallel").DistributedDataParallel
    model = ddp(torch.nn.Linear(8, 8))
    loader = torch.utils.data.DataLoader(torch.randn(32, 8), batch_size=8, num_workers=0)
    m = TrainingMonitor(run="schema", rank=0, start=False, flops_per_sample=1e3,
                        precision="fp16")
    try:
        assert m.watch_communication(model)
        for x in m.wrap(loader):
            model(x).sum().backward()
        with m.phase("checkpoint"):
            pass
        # half a core: a limit on any machine, so the client says where it comes from
        proc, root = cgroup_tree(tmp_path, "50000 100000", throttled_usec=1_000_000)
        pusher = m._pusher
        pusher.payload()  # makes its process-tree reader
        pusher._cgroup = CgroupCpu(42, str(proc), (str(root),))
        pusher._profiler.offer({"type": "profile", "version": 1, "id": "p-0123456789ab",
                                "steps": 2})
        pusher._stacks.offer({"type": "stacks", "version": 1, "id": "p-ba9876543210",
                              "mode": "dump", "seconds": 1})
        with m.phase("evaluation"):  # in progress in the step the loop's end left open
            # the goodbye of a process that an exception ended
            payload = pusher.payload(goodbye=True, reason="exception", detail="RuntimeError")
    finally:
        m.close()
    schema = {f.name for f in PUSH_FIELDS} | {f"process.{f.name}" for f in PROCESS_FIELDS}
    sent = _sent_keys(payload)
    assert sent - schema == set(), "sent but not in exporter/protocol.py's schema"
    assert schema - sent == set(), "in the schema but no client path sends it"
    store = IngestStore()
    assert store.push(json.dumps(payload).encode()) == "goodbye"
    (state,) = store.states()
    assert state.precision == "fp16" and state.loader_workers == 0 and state.failed
    assert (state.exit_reason, state.exit_detail) == ("exception", "RuntimeError")
    assert state.open_phase == "evaluation" and state.process["cpu_throttled_seconds"] == 1.0


# -- the step in progress ------------------------------------------------------------------

def _fake_clock(monkeypatch) -> list[float]:
    import exporter.client.monitor as monitor

    now = [1000.0]
    monkeypatch.setattr(monitor, "_now", lambda: now[0])
    return now


def test_a_push_says_how_long_the_open_step_and_the_open_phase_have_run(monkeypatch):
    """The step in progress grows with every push, outside-step phases excluded (it holds
    still while one runs, which is pushed beside it); nothing is said when nothing is open."""
    now = _fake_clock(monkeypatch)
    m = TrainingMonitor(run="open", start=False)
    keys = {"step_open_seconds", "open_phase", "open_phase_seconds"}
    assert not keys & set(m.totals())
    seen = []
    with m.step(samples=1):
        now[0] += 7
        seen.append(m.totals())
        with m.phase("evaluation"):
            now[0] += 100
            seen.append(m.totals())
            now[0] += 100
            seen.append(m.totals())
        now[0] += 3
        seen.append(m.totals())
        with m.phase("callbacks"):  # a phase within steps is its step's time
            now[0] += 5
            seen.append(m.totals())
    assert [(t["step_open_seconds"], t.get("open_phase"), t.get("open_phase_seconds"))
            for t in seen] == [(7, None, None), (7, "evaluation", 100), (7, "evaluation", 200),
                               (10, None, None), (15, None, None)]
    now[0] += 2
    after = m.totals()
    assert after["step_seconds"] == 15 and after["step_open_seconds"] == 2  # the next step's
    m.new_epoch()  # no step is open until the next fetch
    with m.phase("checkpoint"):
        now[0] += 4
        between = m.totals()
    assert "step_open_seconds" not in between
    assert (between["open_phase"], between["open_phase_seconds"]) == ("checkpoint", 4)
    # a read torn by a phase's end (the step's start already moved past the phase's)
    # says no time, never a negative one
    m._boundary, m._open_phase = now[0], ("evaluation", now[0] - 50)
    torn = m.totals()
    assert (torn["step_open_seconds"], torn["open_phase_seconds"]) == (0, 50)


def test_a_frameworks_epoch_start_is_pushed_as_the_dataloader_start_until_its_first_batch(
        monkeypatch):
    """The integrations' hooks cannot tell a DataLoader's start from the epoch's first fetch:
    from an epoch's start to its first batch the rank says it is in the DataLoader's start
    (the daemon judges a start that hangs while its peers wait), and when the batch comes that
    time is the step's fetch, as before, never counted twice as a phase too."""
    now = _fake_clock(monkeypatch)
    m = TrainingMonitor(run="epochs", start=False)
    hooks = HookTimer(m)
    for _ in range(2):  # an epoch of two steps: 1 s fetch, 2 s step
        now[0] += 1
        hooks.batch_start()
        now[0] += 2
        hooks.batch_end(8)
    hooks.epoch_start()
    now[0] += 30  # the workers start
    starting = m.totals()
    assert (starting["open_phase"], starting["open_phase_seconds"]) == ("dataloader_start", 30)
    assert "step_open_seconds" not in starting
    assert "dataloader_start" not in starting["phases"]
    hooks.batch_start()
    now[0] += 2
    stepping = m.totals()
    assert "open_phase" not in stepping and stepping["step_open_seconds"] == 32
    hooks.batch_end(8)
    done = m.totals()
    assert (done["steps"], done["step_seconds"], done["data_wait_seconds"]) == (3, 38, 32)
    assert "open_phase" not in done and not done["phases"]
    # a hand-written loop's new_epoch() says nothing of a DataLoader: no step, no phase
    m.new_epoch()
    now[0] += 5
    assert not {"open_phase", "step_open_seconds"} & set(m.totals())


class _Model:
    """What the client reads of a torch module: its mode (``train()``/``eval()``)."""

    def __init__(self) -> None:
        self.training = True


@pytest.mark.parametrize("trained_in_eval", [False, True])
def test_a_watched_model_switched_to_eval_while_no_step_ends_is_pushed_as_an_evaluation(
        monkeypatch, trained_in_eval):
    """A hand-written loop's validation on rank 0 nobody declared (``model.eval()``, minutes
    of forward passes, while the others wait at a barrier): the pushes say the rank is in an
    evaluation (from the first push that sees it), its step's clock stopped there, so the
    daemon judges the others waiting, not the run hung. The near miss: a model trained in
    ``eval()`` (frozen batch norm) has no such evaluation, its open step stays a step."""
    now = _fake_clock(monkeypatch)
    m = TrainingMonitor(run="val", start=False)
    model = _Model()
    model.training = not trained_in_eval
    m.watch_communication(model)  # no DDP model: its communication is not measured
    for _ in range(3):
        with m.step(samples=1):
            now[0] += 1
        m.totals()  # a push while the steps advance: the mode they run in
    model.training = False  # rank 0's validation
    now[0] += 5
    first = m.totals()
    now[0] += 60
    later = m.totals()
    if trained_in_eval:
        assert "open_phase" not in later and later["step_open_seconds"] == 65
        return
    assert first["open_phase"] == "evaluation" and first["open_phase_seconds"] == 0
    assert (later["open_phase"], later["open_phase_seconds"]) == ("evaluation", 60)
    assert later["step_open_seconds"] == 5  # stopped where the evaluation was first seen
    assert "evaluation" not in later["phases"]  # the time stays the step's
    model.training = True  # back in train(): the evaluation holds until the step ends, its
    now[0] += 1            # time never read as a step far past its pace
    back = m.totals()
    assert back["open_phase"] == "evaluation" and back["step_open_seconds"] == 5
    with m.step(samples=1):
        now[0] += 1
    done = m.totals()
    assert "open_phase" not in done and "evaluation" not in done["phases"]
    assert done["step_seconds"] == 3 + 67  # the evaluation's time counted in the step


def test_the_open_step_grows_in_real_time():
    m = TrainingMonitor(run="open", start=False)
    with m.step(samples=1):
        time.sleep(0.05)
        assert m.totals()["step_open_seconds"] >= 0.05


def test_a_loop_left_by_break_holds_its_last_step_until_training_goes_on(monkeypatch):
    """The step a break leaves is in no push until the next training event (here, a phase,
    then a step) counts it, with its whole time."""
    now = _fake_clock(monkeypatch)
    m = TrainingMonitor(run="held", start=False)
    for i, _ in enumerate(m.wrap(range(10), batch_size=2)):
        now[0] += 1
        if i == 3:
            now[0] += 360
            break
    held = m.totals()
    assert (held["steps"], held["samples"], held["step_seconds"]) == (3, 6, 3)
    with m.phase("checkpoint"):
        now[0] += 1
    counted = m.totals()
    assert (counted["steps"], counted["samples"], counted["step_seconds"]) == (4, 8, 364)
    for _ in m.wrap(range(1), batch_size=2):  # left by a break again, counted by a step
        now[0] += 1
        break
    assert m.totals()["steps"] == 4
    with m.step(samples=2):
        now[0] += 1
    assert m.totals()["steps"] == 6 and m.totals()["samples"] == 12


def test_a_step_an_exception_broke_is_never_counted(monkeypatch):
    """Step 4 blocks for 6 minutes (a collective waiting for a peer that never comes), then
    raises out of the loop and the monitor's block: three steps, three seconds, and no
    6-minute step in the histogram."""
    now = _fake_clock(monkeypatch)
    m = TrainingMonitor(run="broken", start=False, endpoint=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RuntimeError, match="timed out"), m:
        for i, _ in enumerate(m.wrap(range(10), batch_size=2)):
            now[0] += 1
            if i == 3:
                now[0] += 360
                raise RuntimeError("collective timed out")
    t = m.totals()
    assert (t["steps"], t["samples"], t["step_seconds"]) == (3, 6, 3)
    assert t["step_counts"][t["step_buckets"].index(1.0)] == 3  # none over a second


PROCESS_GROUPS = """
import datetime, json, sys
import torch.distributed as dist
from exporter.client import TrainingMonitor

m = TrainingMonitor(run="pg", start=False, endpoint="http://127.0.0.1:9")
seen = [m.totals().get("collective_timeout_seconds")]
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=77))
seen.append(m.totals().get("collective_timeout_seconds"))
dist.new_group([0], timeout=datetime.timedelta(seconds=33))
seen.append(m.totals().get("collective_timeout_seconds"))
dist.destroy_process_group()
seen.append(m.totals().get("collective_timeout_seconds"))
print(json.dumps(seen))
"""


def test_the_process_groups_collective_timeout_is_pushed(tmp_path):
    """What init_process_group's timeout set, read from torch.distributed itself (the
    shortest of the process's groups: a subgroup's own); nothing before the group is up or
    after it is torn down."""
    require_module("torch.distributed")
    script = tmp_path / "groups.py"
    script.write_text(PROCESS_GROUPS)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [None, 77, 33, None]


# -- stacks with native frames -------------------------------------------------------------

WAITS_IN_CPP = """
import datetime, os, sys
import torch.distributed as dist
from exporter.client.stacks import allow_parent_tracer, prctl

allow_parent_tracer(prctl())  # the test's py-spy, a sibling, may read it (Yama scope 1)
print("ready", flush=True)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
"""


@pytest.fixture
def waits_in_cpp(tmp_path):
    """A process whose main thread waits inside gloo's C++ for a peer that never comes."""
    require_module("torch.distributed")
    script = tmp_path / "waits.py"
    script.write_text(WAITS_IN_CPP)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "store")],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def _main_thread(result: dict) -> dict:
    (main,) = [p for p in result["processes"] if p["role"] == "main"]
    return next(t for t in main["threads"] if t["name"] == "MainThread")


def test_a_native_dump_shows_the_cpp_frames_a_rank_waits_in(waits_in_cpp, tmp_path,
                                                            monkeypatch):
    from exporter.client.stacks import capture
    from exporter.protocol import MAX_DUMP_FRAMES

    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path / "traces"))

    def native() -> dict | None:
        result = capture("dump", 1, waits_in_cpp.pid, "native", "0", "p-0123456789ab",
                         native=True)
        frames = _main_thread(result)["frames"]
        in_cpp = any(f["function"].startswith(("c10d::", "gloo::")) for f in frames)
        return result if in_cpp else None

    result = wait_until(native, timeout=60, what="a native dump inside gloo's wait")
    assert "warning" not in result
    thread = _main_thread(result)
    frames = thread["frames"]
    assert len(frames) <= MAX_DUMP_FRAMES
    cpp = next(f for f in frames if f["function"].startswith(("c10d::", "gloo::")))
    assert cpp["file"].endswith(".so") and cpp["line"] == 0
    # the program's own line, under the C++ and torch's Python frames
    assert frames[thread["where"]]["file"] == "waits.py"
    assert any(f["function"] == "init_process_group" for f in frames)
    # the near miss: a dump not asked for native frames has none
    plain = _main_thread(capture("dump", 1, waits_in_cpp.pid, "native", "0", "p-ba9876543210"))
    assert not any(f["file"].endswith(".so") for f in plain["frames"])
    assert plain["frames"][plain["where"]]["file"] == "waits.py"


def _logging_py_spy(tmp_path, refuse_native: bool) -> tuple:
    """py-spy behind a script that logs its arguments and, with ``refuse_native``, answers
    --native as py-spy does where it cannot unwind native frames."""
    from exporter.client.stacks import find_py_spy

    real = find_py_spy()
    assert real is not None, "py-spy is part of the test environment"
    log_file = tmp_path / "py-spy-args"
    refuse = ('case " $* " in *" --native "*) echo "Error: native stack traces are not '
              'supported on this platform" >&2; exit 1;; esac\n' if refuse_native else "")
    spy = tmp_path / "py-spy"
    spy.write_text(f'#!/bin/sh\necho "$*" >> {log_file}\n{refuse}exec {real} "$@"\n')
    spy.chmod(0o755)
    return spy, log_file


def test_without_native_frames_the_dump_is_taken_and_says_why(waits_in_cpp, tmp_path,
                                                              monkeypatch):
    from exporter.client.stacks import capture

    spy, log_file = _logging_py_spy(tmp_path, refuse_native=True)
    monkeypatch.setenv("GPUTRAIN_PY_SPY", str(spy))
    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path / "traces"))
    result = capture("dump", 1, waits_in_cpp.pid, "native", "0", "p-0123456789ab",
                     native=True)
    assert result["warning"].startswith("native frames were not available")
    assert "not supported on this platform" in result["warning"]
    thread = _main_thread(result)
    assert thread["frames"][thread["where"]]["file"] == "waits.py"
    assert [line.split()[3] for line in log_file.read_text().splitlines()] == [
        "--native", "--nonblocking"]


@pytest.mark.parametrize("native, flag", [(True, "--native"), ("true", "--nonblocking"),
                                          (1, "--nonblocking"), (None, "--nonblocking")])
def test_only_native_true_asks_for_native_frames(tmp_path, monkeypatch, native, flag):
    """The daemon's instruction is read leniently: native frames where it says true, a plain
    dump for anything else (never a refused instruction)."""
    from exporter.client.stacks import StackSampler

    spy, log_file = _logging_py_spy(tmp_path, refuse_native=False)
    monkeypatch.setenv("GPUTRAIN_PY_SPY", str(spy))
    monkeypatch.setenv("GPUTRAIN_TRACE_DIR", str(tmp_path / "traces"))
    sampler = StackSampler("lenient", "0", lambda: None)
    sampler.offer({"type": "stacks", "version": 1, "id": "p-0123456789ab", "mode": "dump",
                   "seconds": 1, **({"native": native} if native is not None else {})})
    report = wait_until(lambda: (sampler.report() or {}).get("state") in ("done", "failed")
                        and sampler.report(), timeout=60, what="the dump")
    assert report["state"] == "done", report
    first = log_file.read_text().splitlines()[0].split()
    assert first[:3] == ["dump", "--pid", str(os.getpid())] and first[3] == flag
