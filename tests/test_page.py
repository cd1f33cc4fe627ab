"""The /metrics page is built off the request path, and the training families written directly
are the lines prometheus_client would write."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from conftest import FakeClock
from fake_nvml import FakeDriver, FakeGpu
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.utils import floatToGoString

from exporter.protocol import MAX_BUCKETS, MAX_GPUS, MAX_PHASES, Refused
from exporter.reading.gpu_backends import DemoBackend, NvmlBackend
from exporter.reading.host_processes import HostProcess
from exporter.reading.nvml import Nvml
from exporter.reading.sampler import Sampler
from exporter.serving.attribution import Attribution, GpuIndex, Owners, resolve_gpus
from exporter.serving.exposition import Exposition
from exporter.serving.ingest import IngestStore
from exporter.serving.training import FAMILIES, MAX_SERIES_PER_RANK, TrainingCollector

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"


def push(store: IngestStore, **over) -> str:
    body = {"version": 1, "run": "resnet18", "rank": "0", "run_id": "abc", "steps": 10,
            "step_seconds": 2.5, "data_wait_seconds": 0.5, "samples": 320}
    body.update(over)
    return store.push(json.dumps(body).encode())


def finish_a_profile(store: IngestStore, run: str, rank: str, trace: str, **over) -> None:
    """A profile of (run, rank), asked for and reported done by the rank's next push."""
    profile = store.profiles.request(run, rank, 1)
    state = next(s for s in store.states() if (s.run, s.rank) == (run, rank))
    step = {"seconds": 1.0, "data_loading": 0.5, "forward": 0.2, "backward": 0.2,
            "optimizer": 0.1, "other": 0.0, "idle": 0.0}
    push(store, **{**over, "run": run, "rank": rank, "steps": state.steps,
                   "samples": state.samples}, capabilities=["profile"],
         profile={"id": profile.id, "state": "done", "finished": 1.7e9 + 0.5, "trace": trace,
                  "trace_bytes": 1234, "steps": [step], "top_ops": []})
    assert store.profiles.get(profile.id).state == "done"


def scripted(pid: int) -> None:
    """The fake driver's pids as a process table: each its own root (no parent), so 5151 is a
    stranger rather than a process the daemon cannot read (whose share would be unknown)."""
    return None


class Reference:
    """The training families built through prometheus_client, family by family, from the
    same states: the referee the collector's own lines are held against."""

    def __init__(self, store: IngestStore, views: Attribution) -> None:
        self._store, self._views, self._owners = store, views, Owners(scripted)

    def _families(self):
        return {f.name: f.empty() for f in FAMILIES}

    def collect(self) -> Iterator[Metric]:
        states = sorted(self._store.states(), key=lambda s: (s.run, s.rank))
        view = self._views.latest  # the busy seconds accumulated: read here, not counted
        gpus = GpuIndex(view.snapshot)
        held, others = self._owners.attribute(view.snapshot, list(view.states))
        f = self._families()
        (steps, wait, samples, flops, comm, exposed, comm_bytes, elapsed, slow, hist, phases,
         last_step, last_push, skew, finished, cpu, allowance, throttled, rss, pss, read,
         gpu_info, gpu_memory, profile, unattributed, strangers, requests, series,
         left_out) = (
            f[f"gputrain_{n}"] for n in (
                "training_steps_total", "training_data_wait_seconds_total",
                "training_samples_total", "training_flops_total", "training_comm_seconds_total",
                "training_comm_exposed_seconds_total", "training_comm_bytes_total",
                "training_elapsed_seconds_total", "training_slow_step_seconds_total",
                "training_step_duration_seconds",
                "training_phase_seconds_total", "training_last_step_timestamp_seconds",
                "training_last_push_timestamp_seconds", "training_clock_skew_seconds",
                "training_finished",
                "training_process_cpu_seconds_total",
                "training_process_cpu_allowance_cores",
                "training_process_cpu_throttled_seconds_total",
                "training_process_resident_memory_bytes",
                "training_process_proportional_memory_bytes", "training_process_read_bytes_total",
                "training_gpu_info", "training_gpu_memory_bytes", "training_profile_info",
                "gpu_unattributed_memory_bytes", "gpu_unattributed_processes",
                "ingest_requests_total", "ingest_series", "ingest_ranks_left_out"))
        busy, memory_busy = (f["gputrain_training_gpu_busy_seconds_total"],
                             f["gputrain_training_gpu_memory_busy_seconds_total"])
        others_busy, others_memory = (f["gputrain_gpu_unattributed_busy_seconds_total"],
                                      f["gputrain_gpu_unattributed_memory_busy_seconds_total"])
        slow_n, workers = (f["gputrain_training_slow_steps_total"],
                           f["gputrain_training_loader_workers"])
        failed, exit_info, in_step, in_phase, push_age = (
            f[f"gputrain_training_{n}"] for n in (
                "failed", "exit_info", "step_in_progress_seconds", "phase_in_progress_seconds",
                "last_push_age_seconds"))
        now = self._store.now()
        ranks_busy, unowned = view.busy, view.unowned
        here = view.listed  # a rank's share is exported while it is on the GPU
        profiles = self._store.profiles.latest_done()
        for st in states:
            lv = [st.run, st.rank]
            steps.add_metric(lv, st.steps)
            wait.add_metric(lv, st.data_wait_seconds)
            samples.add_metric(lv, st.samples)
            if st.flops is not None:
                flops.add_metric(lv, st.flops)
            for family, value in ((comm, st.comm_seconds), (exposed, st.comm_exposed_seconds),
                                  (comm_bytes, st.comm_bytes)):
                if value is not None:
                    family.add_metric(lv, value)
            elapsed.add_metric(lv, st.wall_seconds)
            if st.bucket_bounds:
                slow.add_metric(lv, st.slow_step_seconds)
                slow_n.add_metric(lv, st.slow_steps)
            if st.loader_workers is not None:
                workers.add_metric(lv, st.loader_workers)
            pairs = zip(st.bucket_bounds, st.bucket_counts, strict=True)
            buckets = [(floatToGoString(b), c) for b, c in pairs]
            buckets.append(("+Inf", st.steps))
            hist.add_metric(lv, buckets, st.step_seconds)
            for name, seconds in sorted(st.phases.items()):
                phases.add_metric([*lv, name], seconds)
            if st.last_step_timestamp is not None:
                last_step.add_metric(lv, st.last_step_timestamp)
            last_push.add_metric(lv, st.received_unix)
            push_age.add_metric(lv, round(max(0.0, now - st.received_at), 3))
            if st.last_step_timestamp is not None:
                skew.add_metric(lv, st.clock_skew)
            finished.add_metric(lv, 1.0 if st.finished else 0.0)
            failed.add_metric(lv, 1.0 if st.failed else 0.0)
            if st.exit_reason is not None:
                exit_info.add_metric([*lv, st.exit_reason, st.exit_detail or ""], 1)
            if (open_s := st.step_in_progress(now)) is not None:
                in_step.add_metric(lv, open_s)
            if (phase := st.phase_in_progress(now)) is not None:
                in_phase.add_metric([*lv, phase[0]], phase[1])
            if "cpu_seconds" in st.process:
                cpu.add_metric(lv, st.process["cpu_seconds"])
            if "cpu_allowance_cores" in st.process:
                allowance.add_metric(lv, st.process["cpu_allowance_cores"])
            if "cpu_throttled_seconds" in st.process:
                throttled.add_metric(lv, st.process["cpu_throttled_seconds"])
            if "resident_memory_bytes" in st.process:
                rss.add_metric(lv, st.process["resident_memory_bytes"])
            if "proportional_memory_bytes" in st.process:
                pss.add_metric(lv, st.process["proportional_memory_bytes"])
            if "read_bytes" in st.process:
                read.add_metric(lv, st.process["read_bytes"])
            for index, uuid in resolve_gpus(st, gpus):
                gpu_info.add_metric([*lv, index, uuid, st.precision], 1)
            for (index, uuid), used in sorted(held.get((st.run, st.rank), {}).items()):
                gpu_memory.add_metric([*lv, index, uuid], used)
            for (index, uuid), (b, m) in sorted(ranks_busy.get((st.run, st.rank), {}).items()):
                if (index, uuid) not in here.get((st.run, st.rank), ()):
                    continue
                busy.add_metric([*lv, index, uuid], b)
                memory_busy.add_metric([*lv, index, uuid], m)
            if (done := profiles.get((st.run, st.rank))) is not None:
                profile.add_metric([*lv, done.trace], done.finished)
        for (index, uuid), (count, used) in others.items():
            unattributed.add_metric([index, uuid], used)
            strangers.add_metric([index, uuid], count)
        for (index, uuid), (b, m) in sorted(unowned.items()):
            others_busy.add_metric([index, uuid], b)
            others_memory.add_metric([index, uuid], m)
        for family in (steps, wait, samples, flops, comm, exposed, comm_bytes, elapsed, slow,
                       slow_n, workers, hist, phases, last_step, last_push, push_age, skew,
                       finished,
                       failed, exit_info, in_step, in_phase, cpu,
                       allowance, throttled, rss, pss, read, gpu_info, gpu_memory, busy,
                       memory_busy, profile, unattributed, strangers, others_busy, others_memory):
            if family.samples:
                yield family
        for code, n in sorted(self._store.requests().items()):
            requests.add_metric([code], n)
        yield requests
        series.add_metric([], len(states))
        yield series
        left_out.add_metric([], 0)  # every rank here can be written
        yield left_out


def test_training_lines_are_what_prometheus_client_writes_in_both_formats():
    clock = FakeClock()
    # rank 1's process 4242 and a stranger, 5151, take turns on GPU 0: their busy seconds
    gpus = [FakeGpu(uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000",
                    processes=[(4242, 2**30), (5151, 2**29)]),
            FakeGpu(uuid="GPU-11111111-aaaa-bbbb-cccc-111111111111", bus_id="00000000:28:00.0")]
    sampler = Sampler(NvmlBackend(Nvml(FakeDriver(gpus, clock=clock).binding), clock=clock),
                      None, clock=clock)
    sampler.run_once()
    clock.advance(1.0)
    gpus[0].process_samples = [(2_000_000, 4242, 40, 20), (2_000_000, 5151, 25, 10)]
    sampler.run_once()
    store = IngestStore(clock=clock)
    push(store)  # nothing optional
    push(store, rank="1", step_buckets=[0.1, 1, 2.5], step_counts=[1, 5, 10],
         phases={"zeta": 1e-7, "checkpoint": 3}, last_step_timestamp=1.7e9,
         process={"cpu_seconds": 1, "pid": 4242, "resident_memory_bytes": 12345678901,
                  "proportional_memory_bytes": 9876543210.5, "read_bytes": 0,
                  "cpu_allowance_cores": 2.5, "cpu_throttled_seconds": 0.25},
         comm_seconds=1.5, comm_exposed_seconds=0.5, comm_bytes=4e8,  # its GPU found by pid
         loader_workers=4, step_open_seconds=2.5, open_phase="checkpoint",
         open_phase_seconds=0.75)
    push(store, rank="2", step_open_seconds=12.5)  # its step open: it grows with the clock
    push(store, rank="4", goodbye=True, exit_reason="exception",
         exit_detail="torch.distributed.DistBackendError")
    push(store, run="alpha", rank="3", steps=10**15, samples=1e22,
         gpus=["1", "GPU-00000000-aaaa-bbbb-cccc-000000000000", "7"],  # 7: not on this node
         capabilities=["profile"])
    finish_a_profile(store, "alpha", "3", trace='/tmp/a "quoted" \\ path.pt.trace.json.gz')
    store.count(200)
    store.count(429)
    views = Attribution(Owners(scripted))
    views.update(sampler.snapshot, store.states())  # the cycle's join, with the ranks pushed
    collector = TrainingCollector(store, lambda: views.latest)
    registry = CollectorRegistry()
    registry.register(Reference(store, views))
    for _ in range(2):  # the second time from the per-rank cache
        assert collector.render(False) == generate_latest(registry)
        assert collector.render(True) + b"# EOF\n" == generate_openmetrics(registry)
    push(store, rank="1", steps=11, step_seconds=2.6, samples=352, step_buckets=[0.1, 1, 2.5],
         step_counts=[1, 6, 11], phases={"zeta": 1e-7, "checkpoint": 3.5},
         process={"cpu_seconds": 2, "pid": 4242, "cpu_throttled_seconds": 0.5},
         comm_seconds=1.6, comm_exposed_seconds=0.5, comm_bytes=4.4e8)
    assert collector.render(False) == generate_latest(registry)
    line = b'gputrain_training_gpu_info{gpu="0",precision="bf16",rank="1",run="resnet18"'
    assert line in collector.render()
    page = collector.render()
    assert (b'gputrain_training_gpu_busy_seconds_total{gpu="0",rank="1",run="resnet18",'
            b'uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000"} 0.4\n') in page
    assert (b'gputrain_gpu_unattributed_busy_seconds_total{gpu="0",'
            b'uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000"} 0.25\n') in page
    assert (b'gputrain_training_profile_info{rank="3",run="alpha",trace="/tmp/a \\"quoted\\" '
            b'\\\\ path.pt.trace.json.gz"} 1.7000000005e+09\n') in collector.render()


def _rig(clock: FakeClock) -> tuple[Sampler, IngestStore, Exposition]:
    # one clock for all: the page's per-request lines (its age, the collectors' ages, the
    # daemon's time) are the same at two requests of one moment
    sampler = Sampler(DemoBackend(2, 0.5, clock=clock, host="page-test"), None,
                      collectors={"gpu"}, clock=clock, wall_clock=lambda: 1.7e9 + clock())
    sampler.run_once()
    store = IngestStore(clock=clock)
    return sampler, store, Exposition(sampler, store, clock=clock)


def test_a_scrape_sends_the_page_built_off_the_request_path(clock):
    sampler, store, app = _rig(clock)
    first, _ = app.page()  # the very first request of a format is built once, here
    builds = app.builds
    push(store)
    body, ctype = app.page()
    assert body == first and app.builds == builds  # the scrape rendered nothing
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client's choice
    app.rebuild()  # what the page thread does after the push
    body, _ = app.page()
    assert b'gputrain_training_steps_total{rank="0",run="resnet18"} 10.0' in body
    sampler.run_once()
    app.rebuild()
    om, ctype = app.page(OPENMETRICS)
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert om.endswith(b"# EOF\n")
    assert om.count(b"# EOF") == 1


def test_a_format_nobody_asked_for_in_a_while_is_built_for_its_next_request(clock):
    """The page thread stops building a variant nobody asked for in UNUSED_SECONDS; its next
    request must not get the page of then."""
    from exporter.serving.exposition import UNUSED_SECONDS

    sampler = Sampler(DemoBackend(1, 0.5, clock=clock, host="page-test"), None,
                      collectors={"gpu"}, clock=clock)
    sampler.run_once()
    store = IngestStore(clock=clock)
    app = Exposition(sampler, store, clock=clock)
    app.page()
    clock.advance(UNUSED_SECONDS + 1)
    push(store)
    app.rebuild()  # builds nothing: nobody asked lately
    assert b'run="resnet18"' in app.page()[0]


def test_the_page_thread_follows_pushes_and_snapshots():
    from conftest import wait_until

    sampler = Sampler(DemoBackend(1, 0.5, host="page-thread"), None, collectors={"gpu"},
                      interval=30.0)
    sampler.start()
    store = IngestStore()
    app = Exposition(sampler, store)
    app.start()
    try:
        app.page(gzip_ok=True)
        push(store)
        wait_until(lambda: b'run="resnet18"' in __import__("gzip").decompress(
            app.page(gzip_ok=True)[0]), timeout=10, interval=0.02,
            what="the push on the page, without a sampler cycle")
        store.count(400)
        wait_until(lambda: b'gputrain_ingest_requests_total{code="400"} 1.0'
                   in app.page()[0], timeout=10, interval=0.02, what="a rejected push counted")
        for steps in range(11, 31):  # ?fresh=1: every push answered before it is on the page
            push(store, steps=steps)
            store.count(200)
            line = f'gputrain_training_steps_total{{rank="0",run="resnet18"}} {steps}.0'
            assert line.encode() in app.page(OPENMETRICS, fresh=True)[0]
    finally:
        app.stop()
        sampler.stop()


def test_a_rank_is_bounded_to_max_series_per_rank_lines(clock):
    _, store, app = _rig(clock)
    full = {"step_buckets": [0.001 * (i + 1) for i in range(MAX_BUCKETS)],
            "step_counts": [10] * MAX_BUCKETS,
            "phases": {f"p{i}": 1.0 for i in range(MAX_PHASES)},
            "last_step_timestamp": 1.7e9,
            "process": {"cpu_seconds": 1, "resident_memory_bytes": 1, "read_bytes": 1,
                        "proportional_memory_bytes": 1, "cpu_allowance_cores": 1,
                        "cpu_throttled_seconds": 1},
            "gpus": [str(i % 2) if i < 2 else f"GPU-x{i}" for i in range(MAX_GPUS)]}
    push(store, **full, capabilities=["profile"])
    finish_a_profile(store, "resnet18", "0", "/traces/" + "x" * 400, **full)
    lines = [ln for ln in app.render()[0].decode().splitlines()
             if ln.startswith("gputrain_training_") and 'run="resnet18"' in ln]
    assert len(lines) <= MAX_SERIES_PER_RANK
    for key, value in (("phases", {**full["phases"], "one-more": 1.0}),
                       ("step_buckets", [*full["step_buckets"], 1.0]),
                       ("gpus", [*full["gpus"], "GPU-extra"])):
        with pytest.raises(Refused) as err:
            push(store, rank="1", **{**full, key: value,
                                     "step_counts": [10] * len(full["step_buckets"])
                                     if key != "step_buckets" else [10] * (MAX_BUCKETS + 1)})
        assert err.value.status == 400 and "at most" in str(err.value)


def test_a_rank_whose_lines_cannot_be_written_is_left_out_counted_and_logged_once(clock, caplog):
    """Whatever reaches a rank's state that UTF-8 cannot encode (here a profile's trace path
    set past validation), the page is still built: that rank is left out and counted, every
    other rank is shown, and the rank is named in the log once, not at every build."""
    _, store, app = _rig(clock)
    push(store, rank="0")
    push(store, rank="1", capabilities=["profile"])
    finish_a_profile(store, "resnet18", "1", trace="/tmp/ok.pt.trace.json.gz")
    store.profiles.latest_done()[("resnet18", "1")].trace = "/tmp/tr\udcffaces"
    caplog.set_level(logging.ERROR, logger="exporter.serving.training")
    for steps in (11, 12):
        push(store, rank="0", steps=steps)
        text = app.render()[0].decode()
        assert f'gputrain_training_steps_total{{rank="0",run="resnet18"}} {steps}.0' in text
        assert 'rank="1"' not in text
        assert "gputrain_ingest_ranks_left_out 1.0" in text
    logged = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(logged) == 1 and "'1'" in logged[0], logged
    # the near miss: every rank writable, none left out
    store.profiles.latest_done()[("resnet18", "1")].trace = "/tmp/traçes"
    push(store, rank="1", steps=11, capabilities=["profile"])
    text = app.render()[0].decode()
    assert "gputrain_ingest_ranks_left_out 0.0" in text and 'trace="/tmp/traçes"' in text


def test_the_bound_per_rank_counts_every_family_a_rank_writes(clock):
    """MAX_SERIES_PER_RANK is the sum of the families' per-rank maxima: every family a pushed
    rank writes declares how many lines it may add, and the node's and the ingest's own
    families none (a family added without its bound fails here)."""
    _, store, app = _rig(clock)
    push(store, last_step_timestamp=1.7e9, flops=1e12, elapsed_seconds=10.0,
         comm_seconds=1.0, comm_exposed_seconds=0.5, comm_bytes=1e6, loader_workers=2,
         step_buckets=[0.01, 0.1], step_counts=[1, 10], phases={"checkpoint": 1.0},
         process={"cpu_seconds": 1, "resident_memory_bytes": 1, "read_bytes": 1,
                  "proportional_memory_bytes": 1, "cpu_allowance_cores": 1,
                  "cpu_throttled_seconds": 1}, gpus=["0"])
    text = app.render()[0].decode()
    written = {f.name for f in FAMILIES
               if any(ln.startswith(f.name) and 'run="resnet18"' in ln
                      for ln in text.splitlines())}
    assert written, text[:2000]
    for f in FAMILIES:
        if f.name in written:
            assert f.per_rank >= 1, f"{f.name} is a rank's family: give it per_rank"
        elif "rank" not in f.labels:
            assert f.per_rank == 0, f"{f.name} is no rank's: per_rank=0"


def test_the_page_and_the_status_history_read_one_join_per_cycle():
    """Who holds which GPU is joined once per sampler cycle, and /metrics and the status
    document show that one join: the page's and the document's GPUs of a rank are the same,
    pushes between cycles included. The near miss: a process NVML lists only from the next
    cycle on is on neither until that cycle."""
    from exporter.heuristics.rules import DEFAULTS
    from exporter.serving.history import History
    from exporter.serving.status import StatusView

    clock = FakeClock()
    gpus = [FakeGpu(uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000", processes=[(4242, 2**30)]),
            FakeGpu(uuid="GPU-11111111-aaaa-bbbb-cccc-111111111111", bus_id="00000000:28:00.0")]
    sampler = Sampler(NvmlBackend(Nvml(FakeDriver(gpus, clock=clock).binding), clock=clock),
                      None, clock=clock)
    store = IngestStore(clock=clock)
    views = Attribution(Owners(scripted), snapshot=sampler.snapshot)
    views.follow(sampler, store)
    history = History(window=60.0, point_seconds=1.0, instance="n1")
    views.listeners.append(history.observe)
    app = Exposition(sampler, store, clock=clock, views=views)
    status = StatusView(history, DEFAULTS["thresholds"], backend="nvml")

    def page_gpus(rank: str) -> set[str]:
        text = app.render()[0].decode()
        return {line.split('gpu="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("gputrain_training_gpu_info{") and f'rank="{rank}"' in line}

    def doc_gpus(rank: str) -> set[str]:
        return {g["gpu"] for run in status.document()["runs"] for r in run["ranks"]
                if r["rank"] == rank for g in r["gpus"]}

    for k in range(3):
        push(store, rank="0", steps=10 + k, process={"pid": 4242})  # NVML lists it on GPU 0
        push(store, rank="1", steps=10 + k, process={"pid": 777})  # on no GPU yet
        sampler.run_once()
        clock.advance(1.0)
    for k in range(3):  # pushes between cycles: the page is rebuilt from the same join
        push(store, rank="0", steps=20 + k, process={"pid": 4242})
        assert page_gpus("0") == {"0"}
    assert page_gpus("0") == doc_gpus("0") == {"0"}
    assert page_gpus("1") == doc_gpus("1") == set()
    gpus[1].processes = [(777, 2**29)]  # rank 1 starts on GPU 1: seen from the next cycle
    assert page_gpus("1") == set()
    sampler.run_once()
    assert page_gpus("1") == doc_gpus("1") == {"1"}


def test_a_join_that_fails_never_freezes_the_page(caplog):
    """A bug in attributing processes to ranks (here: reading the process table raises) costs
    that cycle its attribution, logged once; the GPUs' own series and the pushed ranks' lines
    keep refreshing. The near miss: the join working again brings the attribution back."""
    clock = FakeClock()
    gpus = [FakeGpu(uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000", processes=[(4242, 2**30)])]
    sampler = Sampler(NvmlBackend(Nvml(FakeDriver(gpus, clock=clock).binding), clock=clock),
                      None, clock=clock)
    store = IngestStore(clock=clock)
    broken = [True]

    def read(pid: int) -> HostProcess:
        if broken[0]:
            raise RuntimeError("a bug")
        return HostProcess(pid, pid, 1, 77)  # its start: 77 ticks after boot

    app = Exposition(sampler, store, clock=clock,
                     views=Attribution(Owners(read=read), snapshot=sampler.snapshot))
    app.views.follow(sampler, store)
    for k in range(3):
        push(store, rank="0", steps=10 + k, process={"pid": 4242, "start_time": 77})
        clock.advance(1.0)
        with caplog.at_level(logging.ERROR, logger="exporter.serving.attribution"):
            sampler.run_once()
        page = app.render()[0].decode()
        assert f"gputrain_training_steps_total{{rank=\"0\",run=\"resnet18\"}} {10 + k}.0" in page
        assert 'gputrain_gpu_sampled_seconds_total{gpu="0"' in page
        assert "gputrain_training_gpu_memory_bytes{" not in page
    assert sum("attributing" in r.message for r in caplog.records) == 1
    broken[0] = False
    sampler.run_once()
    assert 'gputrain_training_gpu_memory_bytes{gpu="0",rank="0"' in app.render()[0].decode()


def test_a_look_for_the_ranks_processes_that_fails_never_freezes_the_page(caplog,
                                                                         monkeypatch):
    """A bug in looking for the ranks' processes in /proc (the reap of the dead) costs the
    cycle its reaping, logged once; the cycle's view, the page's rank lines and every later
    cycle go on. The near miss: a reap that works again reaps."""
    clock = FakeClock()
    gpus = [FakeGpu(uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000")]
    sampler = Sampler(NvmlBackend(Nvml(FakeDriver(gpus, clock=clock).binding), clock=clock),
                      None, clock=clock)
    store = IngestStore(clock=clock)
    app = Exposition(sampler, store, clock=clock,
                     views=Attribution(Owners(scripted), snapshot=sampler.snapshot))
    app.views.follow(sampler, store)
    reaped = []

    def broken() -> list:
        raise OSError("a bug")

    monkeypatch.setattr(store, "reap", broken)
    for k in range(3):
        push(store, rank="0", steps=10 + k)
        clock.advance(1.0)
        with caplog.at_level(logging.ERROR, logger="exporter.serving.attribution"):
            sampler.run_once()
        assert app.views.latest.cycle == sampler.snapshot.cycle  # the view is this cycle's
        page = app.render()[0].decode()
        assert f"gputrain_training_steps_total{{rank=\"0\",run=\"resnet18\"}} {10 + k}.0" in page
    assert sum("/proc failed" in r.message for r in caplog.records) == 1
    monkeypatch.setattr(store, "reap", lambda: reaped.append(1) or [])
    sampler.run_once()
    assert reaped == [1]
