"""The push endpoint: validation, limits, auth, expiry, and what it exports."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import requests
from conftest import FakeClock, sample_value, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from exporter.protocol import PROCESS_FIELDS, PUSH_FIELDS, SCALAR_KINDS, Refused
from exporter.reading.gpu_backends import DemoBackend
from exporter.reading.host_processes import read_state
from exporter.reading.sampler import Sampler
from exporter.serving.exposition import Exposition
from exporter.serving.ingest import IngestStore
from exporter.serving.routes import IngestSite
from exporter.serving.server import make_server, serve_in_thread
from exporter.serving.training import TrainingCollector

TOKEN = "s3cret-token-0123456789"


def body(**over):
    b = {"version": 1, "run": "resnet18", "rank": "0", "run_id": "abc123", "steps": 10,
         "step_seconds": 2.0, "data_wait_seconds": 0.5, "samples": 320,
         "step_buckets": [0.1, 0.25, 1.0], "step_counts": [2, 9, 10],
         "phases": {"checkpoint": 0.25}, "last_step_timestamp": 1.7e9,
         "process": {"cpu_seconds": 12.5, "resident_memory_bytes": 1e9, "read_bytes": 4096,
                     "pid": 4242},
         "gpus": ["0"]}
    b.update(over)
    return {k: v for k, v in b.items() if v is not ...}


class Rig:
    def __init__(self, token=None, max_series=1024, ttl=600.0):
        self.clock = FakeClock()
        self.store = IngestStore(max_series=max_series, ttl=ttl, token=token, clock=self.clock)
        self.sampler = Sampler(DemoBackend(2, 0.5, host="ingest-test"), None, collectors={"gpu"})
        self.sampler.run_once()
        self.app = Exposition(self.sampler, self.store)
        self.server = make_server("127.0.0.1", 0, IngestSite, self.store, self.sampler.healthy)
        serve_in_thread(self.server, "ingest-test")
        self.url = f"http://127.0.0.1:{self.server.address[1]}/api/v1/push"
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TrainingCollector(self.store, lambda: self.app.views.latest))

    def push(self, payload, headers=None, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(payload).encode()
        return requests.post(self.url, data=data, headers=headers or {}, timeout=5)

    def v(self, name, **labels):
        return self.registry.get_sample_value(name, {"run": "resnet18", "rank": "0", **labels})

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.server.shutdown()


def test_a_push_is_exported_with_run_and_rank(rig):
    r = rig.push(body())
    assert r.status_code == 200, r.text
    assert rig.v("gputrain_training_steps_total") == 10
    assert rig.v("gputrain_training_samples_total") == 320
    assert rig.v("gputrain_training_data_wait_seconds_total") == 0.5
    assert rig.v("gputrain_training_step_duration_seconds_sum") == 2.0
    assert rig.v("gputrain_training_step_duration_seconds_count") == 10
    assert rig.v("gputrain_training_step_duration_seconds_bucket", le="0.25") == 9
    assert rig.v("gputrain_training_step_duration_seconds_bucket", le="+Inf") == 10
    assert rig.v("gputrain_training_phase_seconds_total", phase="checkpoint") == 0.25
    assert rig.v("gputrain_training_last_step_timestamp_seconds") == 1.7e9
    assert rig.v("gputrain_training_process_cpu_seconds_total") == 12.5
    assert rig.v("gputrain_training_process_resident_memory_bytes") == 1e9
    assert rig.v("gputrain_training_process_read_bytes_total") == 4096
    uuid0 = rig.sampler.snapshot.gpus[0].identity.uuid
    assert rig.v("gputrain_training_gpu_info", precision="bf16", gpu="0", uuid=uuid0) == 1
    text = rig.exposition()
    assert "pid" not in text and 'job="' not in text
    assert rig.registry.get_sample_value("gputrain_ingest_requests_total", {"code": "200"}) == 1


def test_model_flops_and_precision_are_exported(rig):
    """A client that knows its FLOPs per sample pushes the cumulative model FLOPs and the
    precision it trains in; one that does not exports no FLOPs line and the default."""
    rig.push(body())
    assert rig.v("gputrain_training_flops_total") is None
    uuid0 = rig.sampler.snapshot.gpus[0].identity.uuid
    r = rig.push(body(steps=11, step_counts=[2, 9, 11], flops=3.2e12, precision="fp8"))
    assert r.status_code == 200, r.text
    assert rig.v("gputrain_training_flops_total") == 3.2e12
    assert rig.v("gputrain_training_gpu_info", precision="fp8", gpu="0", uuid=uuid0) == 1


def test_elapsed_seconds_carry_across_a_restart(rig):
    """The rank's wall seconds: its process's age at the first push, then the client's clock;
    a restart (new run_id) adds the whole gap since the old process's last push, so the time
    lost to the crash and the new start-up counts although both processes' other totals
    restart from zero."""
    elapsed = lambda: rig.v("gputrain_training_elapsed_seconds_total")  # noqa: E731
    assert rig.push(body(elapsed_seconds=30.0)).status_code == 200
    assert elapsed() == 30.0
    rig.clock.advance(100.0)  # the daemon's clock does not count within one process
    assert rig.push(body(elapsed_seconds=40.0, steps=12, step_counts=[2, 9, 12])).ok
    assert elapsed() == 40.0
    rig.clock.advance(25.0)  # crash; the new process's first push comes 25 s later
    assert rig.push(body(run_id="def456", elapsed_seconds=8.0, steps=1, step_counts=[0, 1, 1],
                         step_seconds=0.2, data_wait_seconds=0.0, samples=32)).ok
    assert elapsed() == 65.0
    assert rig.v("gputrain_training_steps_total") == 1  # a counter reset to Prometheus
    assert rig.push(body(run_id="def456", elapsed_seconds=10.5, steps=1, step_counts=[0, 1, 1],
                         step_seconds=0.2, data_wait_seconds=0.0, samples=32)).ok
    assert elapsed() == 67.5
    r = rig.push(body(run_id="def456", elapsed_seconds=9.0, steps=1, step_counts=[0, 1, 1],
                      step_seconds=0.2, data_wait_seconds=0.0, samples=32))
    assert r.status_code == 409 and "'elapsed_seconds' went down" in r.text
    assert elapsed() == 67.5  # the rejected push changed nothing


def test_a_client_without_elapsed_seconds_gets_the_daemons_clock(rig):
    assert rig.push(body()).ok
    assert rig.v("gputrain_training_elapsed_seconds_total") == 0.0
    rig.clock.advance(5.0)
    assert rig.push(body()).ok
    assert rig.v("gputrain_training_elapsed_seconds_total") == 5.0


@pytest.mark.parametrize("over, message", [
    ({"elapsed_seconds": -2}, "field 'elapsed_seconds' must be a finite number >= 0"),
    ({"precision": "int4"}, "field 'precision' must be one of fp8, bf16, fp16, tf32, fp32"),
    ({"flops": -1}, "field 'flops' must be a finite number >= 0"),
    ({"flops": "many"}, "field 'flops' must be a number"),
])
def test_bad_flops_or_precision_is_a_400_that_says_why(rig, over, message):
    r = rig.push(body(**over))
    assert r.status_code == 400 and message in r.text, r.text


def test_gradient_communication_is_exported_where_the_client_measures_it(rig):
    """A client watching a DDP model pushes the seconds its all-reduce ran, the part its steps
    waited for and the bytes; one that measures none exports no such line (no verdict can be
    drawn from it), and a total that goes down within a process is a 409."""
    assert rig.push(body()).ok
    assert rig.v("gputrain_training_comm_exposed_seconds_total") is None
    assert rig.push(body(steps=11, step_counts=[2, 9, 11], comm_seconds=1.5,
                         comm_exposed_seconds=0.4, comm_bytes=4e8)).ok
    assert rig.v("gputrain_training_comm_seconds_total") == 1.5
    assert rig.v("gputrain_training_comm_exposed_seconds_total") == 0.4
    assert rig.v("gputrain_training_comm_bytes_total") == 4e8
    r = rig.push(body(steps=12, step_counts=[2, 9, 12], comm_seconds=1.5,
                      comm_exposed_seconds=0.3, comm_bytes=4e8))
    assert r.status_code == 409 and "'comm_exposed_seconds' went down" in r.text, r.text


@pytest.mark.parametrize("over, message", [
    ({"comm_exposed_seconds": 0.1}, "'comm_exposed_seconds' needs 'comm_seconds'"),
    ({"comm_seconds": 0.5, "comm_exposed_seconds": 0.9},
     "'comm_exposed_seconds' (0.9) is more than 'comm_seconds' (0.5)"),
    ({"comm_seconds": 5.0, "comm_exposed_seconds": 3.0},
     "'comm_exposed_seconds' (3) is more than 'step_seconds' (2)"),
    ({"comm_seconds": -1.0}, "field 'comm_seconds' must be a finite number >= 0"),
    ({"comm_bytes": "lots"}, "field 'comm_bytes' must be a number"),
])
def test_inconsistent_communication_is_a_400_that_says_why(rig, over, message):
    r = rig.push(body(**over))
    assert r.status_code == 400 and message in r.text, r.text
    assert rig.v("gputrain_training_steps_total") is None  # nothing stored


@pytest.mark.parametrize("over, field", [
    ({"steps": 1e300}, "steps"),
    ({"steps": 9.3e18}, "steps"),  # a float past 2^53 holds no exact integer
    ({"steps": 2**63}, "steps"),
    ({"steps": 10.5}, "steps"),
    ({"step_counts": [2, 9, 1e300]}, "step_counts"),
    ({"step_counts": [2, 9.5, 10]}, "step_counts"),
    ({"process": {"pid": 1e300}}, "process.pid"),
    ({"process": {"cpu_seconds": -1.0}}, "process.cpu_seconds"),
])
def test_a_counter_past_what_it_can_hold_exactly_is_a_400_naming_the_field(rig, over, field):
    r = rig.push(body(**over))
    assert r.status_code == 400 and f"field '{field}'" in r.text, r.text
    assert rig.v("gputrain_training_steps_total") is None  # nothing stored


def test_counters_at_their_bounds_are_taken(rig):
    """A whole-number counter up to 2^63-1 as an integer, or up to 2^53 as a float without a
    fraction; a float counter such as model FLOPs past 2^53 (a day of one GPU's)."""
    big = 2**63 - 1
    r = rig.push(body(steps=big, step_counts=[2, 9, 10], flops=8.6e19))
    assert r.status_code == 200, r.text
    assert rig.v("gputrain_training_flops_total") == 8.6e19
    r = rig.push(body(run_id="other", steps=float(2**53), step_counts=[2, 9, 10]))
    assert r.status_code == 200, r.text
    assert rig.v("gputrain_training_steps_total") == 2**53


def test_gpus_resolve_from_uuids_and_from_the_nvml_process_list(rig):
    uuid1 = rig.sampler.snapshot.gpus[1].identity.uuid
    rig.push(body(gpus=[uuid1]))
    assert rig.v("gputrain_training_gpu_info", precision="bf16", gpu="1", uuid=uuid1) == 1
    assert rig.v("gputrain_training_gpu_info", precision="bf16", gpu="0",
                 uuid=rig.sampler.snapshot.gpus[0].identity.uuid) is None
    # no GPUs pushed: the GPUs whose process list holds the pid (as of the next cycle)
    rig.push(body(gpus=[], steps=11, step_counts=[2, 9, 11]))
    snap = rig.sampler.snapshot
    g0 = snap.gpus[0]
    listed = dataclasses.replace(g0, sample=dataclasses.replace(g0.sample, pids=(4242,)))
    rig.app.views.update(dataclasses.replace(snap, cycle=snap.cycle + 1,
                                             gpus=(listed, *snap.gpus[1:])), rig.store.states())
    assert rig.v("gputrain_training_gpu_info", precision="bf16", gpu="0",
                 uuid=rig.sampler.snapshot.gpus[0].identity.uuid) == 1


BAD = [
    ("malformed JSON", None, b'{"version": 1,', 400, "invalid JSON"),
    ("not an object", None, b"[1, 2]", 400, "JSON object"),
    ("NaN", None, b'{"version": 1, "steps": NaN}', 400, "NaN"),
    ("wrong version", body(version=2), None, 400, "'version'"),
    ("steps as text", body(steps="10"), None, 400, "'steps' must be a number"),
    ("fractional steps", body(steps=1.5), None, 400, "whole number"),
    ("negative", body(data_wait_seconds=-1), None, 400, "'data_wait_seconds'"),
    ("missing field", body(samples=...), None, 400, "missing field 'samples'"),
    ("empty run", body(run=""), None, 400, "'run' must not be empty"),
    ("long run", body(run="r" * 129), None, 400, "limit is 128"),
    ("bad characters", body(rank="0 OR 1"), None, 400, "'rank' may only hold"),
    ("a final newline", body(run="evil\n"), None, 400, "'run' may only hold"),
    ("run_id with a final newline", body(run_id="abc\n"), None, 400, "'run_id'"),
    ("phase with a final newline", body(phases={"ckpt\n": 1.0}), None, 400, "phase name"),
    ("gpu with a final newline", body(gpus=["0\n"]), None, 400, "'gpus'"),
    ("run as list", body(run=["a"]), None, 400, "'run' must be a string"),
    ("bad run_id", body(run_id="x" * 65), None, 400, "'run_id'"),
    ("bad bucket order", body(step_buckets=[1.0, 0.5, 2.0]), None, 400, "strictly increasing"),
    ("counts beyond steps", body(step_counts=[2, 9, 11]), None, 400, "'steps' is 10"),
    ("bad phase name", body(phases={"a b": 1.0}), None, 400, "phase name"),
    ("bad gpu ref", body(gpus=["../../etc"]), None, 400, "'gpus'"),
    ("goodbye as text", body(goodbye="yes"), None, 400, "'goodbye'"),
]


@pytest.mark.parametrize("what, payload, raw, code, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_that_says_why_and_changes_nothing(rig, what, payload, raw, code,
                                                              message):
    assert rig.push(body()).status_code == 200
    before = rig.exposition()
    r = rig.push(payload, raw=raw)
    assert r.status_code == code, r.text
    assert message in r.text
    after = rig.exposition()
    strip = lambda t: [ln for ln in t.splitlines() if "ingest_requests" not in ln]  # noqa: E731
    assert strip(after) == strip(before)


def test_decreasing_totals_within_a_run_id_are_refused_but_a_new_run_id_resets(rig):
    assert rig.push(body()).status_code == 200
    r = rig.push(body(steps=5, step_counts=[1, 2, 5]))
    assert r.status_code == 409 and "'steps' went down" in r.text
    assert rig.v("gputrain_training_steps_total") == 10
    r = rig.push(body(run_id="restarted", steps=5, step_counts=[1, 2, 5]))
    assert r.status_code == 200
    assert rig.v("gputrain_training_steps_total") == 5


def test_two_processes_pushing_one_run_and_rank_are_told_not_counted_as_restarts(rig):
    """Two processes push run resnet18 rank 0 (a script started twice, two jobs with one run
    name): the second's run_id takes over as a restart would, but the first coming back to
    its run_id is the sign; it is refused with a 409 that says why, and the totals stay the
    second's instead of flipping between the two (each flip read as a restart)."""
    assert rig.push(body(run_id="first", steps=100, step_counts=[2, 9, 100])).status_code == 200
    assert rig.push(body(run_id="second", steps=3, step_counts=[1, 2, 3])).status_code == 200
    for steps in (101, 102, 103):
        r = rig.push(body(run_id="first", steps=steps, step_counts=[2, 9, steps]))
        assert r.status_code == 409, r.text
        assert "another process" in r.text and "second" in r.text and "GPUTRAIN_RUN" in r.text
        assert rig.push(body(run_id="second", steps=steps - 97,
                             step_counts=[1, 2, steps - 97])).status_code == 200
        assert rig.v("gputrain_training_steps_total") == steps - 97


@pytest.fixture
def processes():
    """Two real processes of this machine (sleeping), each with the process ids a client in
    it would push; killed at the end."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
             for _ in range(2)]
    try:
        yield [(p, {"pid": p.pid, "start_time": wait_until(
                    lambda p=p: read_state(p.pid), timeout=10, what="its /proc")[1]})
               for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_second_process_is_refused_from_its_first_push_while_the_first_runs(rig, processes):
    """Where the daemon sees both processes (one PID namespace), the second process's very
    first push is a 409: its predecessor still runs, so it is no restart (before, that first
    switch took the series and read as a restart). The first keeps its totals; and once the
    first exits, the other's next push is a restart like any."""
    (first, first_ids), (_, second_ids) = processes
    assert rig.push(body(run_id="first", steps=100, step_counts=[2, 9, 100],
                         process=first_ids)).status_code == 200
    r = rig.push(body(run_id="second", steps=3, step_counts=[1, 2, 3], process=second_ids))
    assert r.status_code == 409 and "another process" in r.text, r.text
    assert rig.v("gputrain_training_steps_total") == 100
    first.kill()
    first.wait()
    assert rig.push(body(run_id="second", steps=4, step_counts=[1, 2, 4],
                         process=second_ids)).status_code == 200
    assert rig.v("gputrain_training_steps_total") == 4


@pytest.mark.parametrize("case", ["exited", "said goodbye", "not visible"])
def test_a_new_process_whose_predecessor_is_gone_is_a_restart(rig, processes, case):
    """The near misses: the (run, rank)'s process exited before the new one's first push (a
    restart, as torchrun's elastic agent does one), said goodbye first, or runs where this
    daemon cannot see it (another PID namespace): the new process takes the (run, rank)."""
    (old, old_ids), (_, new_ids) = processes
    if case == "not visible":
        old_ids = {"pid": 2**22 - 7, "start_time": old_ids["start_time"]}
    extra = {"goodbye": True} if case == "said goodbye" else {}
    assert rig.push(body(run_id="old", steps=100, step_counts=[2, 9, 100],
                         process=old_ids, **extra)).status_code == 200
    if case == "exited":
        old.kill()
        old.wait()
    assert rig.push(body(run_id="new", steps=3, step_counts=[1, 2, 3],
                         process=new_ids)).status_code == 200
    assert rig.v("gputrain_training_steps_total") == 3


def test_restarts_that_never_return_to_an_old_run_id_are_restarts(rig):
    """The near misses: a process restarted three times (each a new run_id) is taken every
    time, and so is a run_id seen again only after the ttl (600 s), long forgotten."""
    for i, run_id in enumerate(("a", "b", "c", "d")):
        assert rig.push(body(run_id=run_id, steps=1 + i, step_counts=[0, 0, 1 + i])) \
            .status_code == 200
    assert rig.v("gputrain_training_steps_total") == 4
    rig.clock.advance(300)
    assert rig.push(body(run_id="d", steps=9, step_counts=[0, 0, 9])).status_code == 200
    rig.clock.advance(601)
    assert rig.push(body(run_id="a", steps=2, step_counts=[0, 0, 2])).status_code == 200
    assert rig.v("gputrain_training_steps_total") == 2


def test_body_over_1_mib_is_413(rig):
    r = rig.push(None, raw=b" " * (1024 * 1024 + 1))
    assert r.status_code == 413 and "limit" in r.text


def test_series_limit_is_429():
    r = Rig(max_series=2)
    try:
        assert r.push(body(rank="0")).status_code == 200
        assert r.push(body(rank="1")).status_code == 200
        resp = r.push(body(rank="2"))
        assert resp.status_code == 429 and "--ingest.max-series" in resp.text
        assert r.push(body(rank="1", steps=11, step_counts=[2, 9, 11])).status_code == 200
    finally:
        r.server.shutdown()


def test_token_is_required_when_configured():
    r = Rig(token=TOKEN)
    try:
        assert r.push(body()).status_code == 401
        assert r.push(body(), headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = r.push(body(), headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
    finally:
        r.server.shutdown()


def test_ranks_expire_after_the_ttl_and_goodbye_soon_after(rig):
    rig.push(body())
    rig.push(body(rank="1"))
    rig.clock.advance(300)
    rig.push(body(rank="1", goodbye=True))
    assert rig.v("gputrain_training_steps_total") == 10
    assert rig.registry.get_sample_value("gputrain_training_steps_total",
                                         {"run": "resnet18", "rank": "1"}) == 10
    rig.clock.advance(61)  # the goodbye's grace is over
    assert rig.registry.get_sample_value("gputrain_training_steps_total",
                                         {"run": "resnet18", "rank": "1"}) is None
    assert rig.v("gputrain_training_steps_total") == 10
    rig.clock.advance(240)  # 601 s since rank 0's last push
    assert rig.v("gputrain_training_steps_total") is None


def test_wrong_path_and_method(rig):
    base = rig.url.rsplit("/api", 1)[0]
    assert requests.post(base + "/push", json=body(), timeout=5).status_code == 404
    assert requests.get(rig.url, timeout=5).status_code == 405


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
fields = st.sampled_from(["version", "run", "rank", "run_id", "steps", "step_seconds",
                          "data_wait_seconds", "samples", "step_buckets", "step_counts",
                          "phases", "process", "gpus", "goodbye", "last_step_timestamp"])


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.dictionaries(fields, json_values, min_size=1, max_size=4),
       junk=st.binary(max_size=64))
def test_fuzzed_pushes_never_5xx_and_rejected_ones_change_nothing(rig, mutations, junk):
    rig.push(body())
    before = rig.exposition()
    for payload, raw in ((body(**mutations), None), (None, junk)):
        r = rig.push(payload, raw=raw)
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert r.text.strip(), "a rejection says why"
            after = rig.exposition()
            strip = lambda t: [ln for ln in t.splitlines()  # noqa: E731
                               if "ingest_requests" not in ln]
            assert strip(after) == strip(before)
        else:
            before = rig.exposition()
            assert sample_value(before, "gputrain_training_steps_total") is not None


def test_parse_errors_are_push_rejected_not_crashes():
    store = IngestStore()
    with pytest.raises(Refused):
        store.push(b"[" * 100000)


def test_the_trees_pss_is_exported_where_pushed_and_absent_not_zero_where_not(rig):
    pss = {"cpu_seconds": 1.0, "resident_memory_bytes": 3e9, "proportional_memory_bytes": 2e9}
    assert rig.push(body(process=pss)).status_code == 200
    assert rig.v("gputrain_training_process_proportional_memory_bytes") == 2e9
    assert rig.v("gputrain_training_process_resident_memory_bytes") == 3e9
    rss_only = {"cpu_seconds": 2.0, "resident_memory_bytes": 3e9}
    assert rig.push(body(rank="1", process=rss_only)).status_code == 200
    assert rig.v("gputrain_training_process_proportional_memory_bytes", rank="1") is None
    assert rig.v("gputrain_training_process_resident_memory_bytes", rank="1") == 3e9
    bad = rig.push(body(process={"proportional_memory_bytes": -1.0}))
    assert bad.status_code == 400 and "process.proportional_memory_bytes" in bad.text


def test_a_push_from_the_last_release_still_works(rig):
    """A client of the previous release (tests/fixtures/push-03b9196.json: what its pusher
    sent, without the fields added since, such as `loader_workers` and the tree's PSS) is
    answered 200 and exported as it always was; what it does not send stays absent."""
    from conftest import ROOT

    old = json.loads((ROOT / "tests" / "fixtures" / "push-03b9196.json").read_text())
    old["run"] = "resnet18"
    r = rig.push(old)
    assert r.status_code == 200, r.text
    assert rig.v("gputrain_training_steps_total") == old["steps"]
    assert rig.v("gputrain_training_samples_total") == old["samples"]
    assert rig.v("gputrain_training_data_wait_seconds_total") == old["data_wait_seconds"]
    assert rig.v("gputrain_training_flops_total") == old["flops"]
    assert rig.v("gputrain_training_process_resident_memory_bytes") == \
        old["process"]["resident_memory_bytes"]
    assert rig.v("gputrain_training_phase_seconds_total", phase="checkpoint") == \
        old["phases"]["checkpoint"]
    assert rig.v("gputrain_training_process_proportional_memory_bytes") is None
    assert rig.v("gputrain_training_loader_workers") is None


# every scalar field of the schema (exporter/protocol.py), with values it refuses and one it
# takes (at its bound where it has one)
SCALARS = [(where, f) for where, fields in (("", PUSH_FIELDS), ("process.", PROCESS_FIELDS))
           for f in fields if f.kind in SCALAR_KINDS]
REFUSED = {"count": [-1, 1.5, "1", True, 2**63, 1e300], "amount": [-1.0, "1", True, 2**63],
           "timestamp": [-1.0, "now", [1]], "enum": ["fp64", 16, None], "bool": ["yes", 1, None]}
TAKEN = {"count": 10, "amount": 1.0, "timestamp": 1.7e9, "enum": "fp8", "bool": True}
NEEDS = {"comm_exposed_seconds": {"comm_seconds": 2.0},  # what a field is checked against
         "open_phase_seconds": {"open_phase": "evaluation"},  # or comes with
         "exit_reason": {"goodbye": True}}


def _with(where: str, name: str, value=...) -> dict:
    """body() with one field set (``...``: left out), inside ``process`` where it lives."""
    if where:
        proc = {**body()["process"], name: value}
        return body(process={k: v for k, v in proc.items() if v is not ...})
    return body(**NEEDS.get(name, {}), **{name: value})


@pytest.mark.parametrize("where, f", SCALARS, ids=[w + f.name for w, f in SCALARS])
def test_every_scalar_field_of_the_schema_is_checked_and_taken(rig, where, f):
    """Each field the schema lists is read by the ingest: a value of the wrong kind (or past
    its bound) is a 400 naming it and stores nothing; a good one (the bound itself) is taken;
    a required field left out is a 400, an optional one is not."""
    bad = REFUSED[f.kind] + ([f.bound + 1] if f.bound is not None else [])
    for value in bad:
        r = rig.push(_with(where, f.name, value))
        assert r.status_code == 400 and f"'{where}{f.name}'" in r.text, (value, r.text)
        assert rig.v("gputrain_training_steps_total") is None
    r = rig.push(_with(where, f.name, ...))
    if f.required:
        assert r.status_code == 400 and f"missing field '{where}{f.name}'" in r.text, r.text
    else:
        assert r.status_code == 200, r.text
    good = f.bound if f.bound is not None else f.choices[0] if f.choices else TAKEN[f.kind]
    r = rig.push(_with(where, f.name, good) | {"run_id": "taken"})
    assert r.status_code == 200, r.text
    assert rig.v("gputrain_training_steps_total") == 10


CUMULATIVE = [(w, f) for w, f in SCALARS if f.kind in ("count", "amount")]


@pytest.mark.parametrize("where, f", CUMULATIVE, ids=[w + f.name for w, f in CUMULATIVE])
def test_a_cumulative_field_that_goes_down_is_a_409_and_a_gauge_may(rig, where, f):
    """Within one run_id a total the schema marks cumulative never goes down (409 naming
    it); a field it does not (memory, the CPU allowance, a pid) may."""
    if f.name == "steps":
        high, low = _with(where, f.name, 10), body(steps=9, step_counts=[2, 9, 9])
    else:
        high, low = _with(where, f.name, 2.0 if f.kind == "amount" else 2), \
            _with(where, f.name, 1.0 if f.kind == "amount" else 1)
    assert rig.push(high).status_code == 200
    r = rig.push(low)
    if f.cumulative:
        assert r.status_code == 409 and f.name in r.text, r.text
    else:
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [
    ("last_step_timestamp", 1e308), ("last_step_timestamp", 1e10), ("elapsed_seconds", 1e308)])
def test_a_time_no_clock_gives_is_a_400_naming_it_and_the_readings_stay_right(
        rig, field, value):
    """A timestamp far from any real clock (or an elapsed time no process reaches) would make
    the clock correction wipe the rank's last step into 1970: it is refused, naming the field,
    and the rank's readings stay those of its last good push."""
    assert rig.push(body(last_step_timestamp=time.time() - 1)).status_code == 200
    before = rig.v("gputrain_training_last_step_timestamp_seconds")
    r = rig.push(body(steps=11, step_counts=[2, 9, 11], **{field: value}))
    assert r.status_code == 400 and f"'{field}'" in r.text, r.text
    assert rig.v("gputrain_training_steps_total") == 10
    assert rig.v("gputrain_training_last_step_timestamp_seconds") == before
    assert rig.v("gputrain_training_clock_skew_seconds") == 0


def test_a_profiles_times_past_any_clock_are_a_400_naming_the_field(rig):
    rig.push(body(capabilities=["profile"]))
    p = rig.store.profiles.request("resnet18", "0", 1)
    r = rig.push(body(capabilities=["profile"], profile={
        "id": p.id, "state": "running", "started": 1e308}))
    assert r.status_code == 400 and "'profile.started'" in r.text, r.text


@pytest.mark.parametrize("token", [None, "s3cret"])
def test_a_trace_path_is_on_metrics_only_where_no_token_guards_it(token):
    """The status page hides a profile's trace path when an ingest token is set; /metrics,
    which anyone who can scrape reads, hides it too."""
    r = Rig(token=token)
    try:
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        r.push(body(capabilities=["profile"]), headers=auth)
        p = r.store.profiles.request("resnet18", "0", 1)
        step = {"seconds": 1.0, "data_loading": 0.5, "forward": 0.2, "backward": 0.2,
                "optimizer": 0.1, "other": 0.0, "idle": 0.0}
        done = r.push(body(capabilities=["profile"], profile={
            "id": p.id, "state": "done", "finished": 1.7e9, "trace": "/home/alice/secret/t.json",
            "trace_bytes": 10, "steps": [step], "top_ops": []}), headers=auth)
        assert done.status_code == 200, done.text
        page = r.exposition()
        assert ("/home/alice/secret" in page) is (token is None), page
        assert "gputrain_training_profile_info" in page
    finally:
        r.server.shutdown()
