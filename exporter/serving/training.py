"""Training-run metric families from the ingest's live (run, rank) states.

The families are one table (:data:`FAMILIES`); :class:`TrainingCollector` writes the page's
lines from it directly, each rank's lines once per push and reused until its next one (about
20x faster than formatting through prometheus_client, which matters at hundreds of ranks). Its
``collect()`` for a prometheus_client registry reads those same lines back: one renderer.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from exporter.heuristics.stalls import SLOW_STEP_FACTOR
from exporter.protocol import MAX_BUCKETS, MAX_GPUS, MAX_PHASES
from exporter.reading.sampler import CollectorStatus
from exporter.serving.attribution import GpuIndex, NodeView, resolve_gpus
from exporter.serving.ingest import IngestStore, RankState, allowance_shares

log = logging.getLogger(__name__)

LABELS = ["run", "rank"]
HIDDEN = "hidden: the ingest token guards it"  # a trace's path, where a token is set


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class Family(NamedTuple):
    """One family of the training collector: its name as exported (a counter's with
    ``_total``), type, help text and label names."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ("run", "rank")
    # the most lines one rank can have in it (0: not a rank's family); their sum is
    # MAX_SERIES_PER_RANK, the page's bound per rank
    per_rank: int = 1
    # a rank's one sample of it from its pushed state alone, None where it has none (a
    # family written otherwise, with more labels or by the clock, has no read)
    read: Callable[[RankState], float | None] | None = None

    def empty(self) -> Metric:
        """The family as prometheus_client builds it, with no samples (for describe())."""
        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
               "histogram": HistogramMetricFamily}[self.kind]
        return cls(self.name, self.help, labels=list(self.labels))


# the families written outside their row: by these names
EXIT_INFO = "gputrain_training_exit_info"
STEP_HISTOGRAM = "gputrain_training_step_duration_seconds"
PHASES = "gputrain_training_phase_seconds_total"
ALLOWANCE = "gputrain_training_process_cpu_allowance_cores"
REQUESTS = "gputrain_ingest_requests_total"
SERIES = "gputrain_ingest_series"
LEFT_OUT = "gputrain_ingest_ranks_left_out"

# Every family, in page order. The first ones are a rank's own (written from its pushed state
# alone, cached per push); then what joins a rank to this node's GPUs and profiles, the GPUs'
# processes no rank owns, and the ingest's own counters.
FAMILIES: tuple[Family, ...] = (
    Family("gputrain_training_steps_total", "counter", "Training steps completed.",
           read=lambda st: st.steps),
    Family("gputrain_training_data_wait_seconds_total", "counter",
           "Seconds the training loop was blocked waiting for the data loader (inside step "
           "time).",
           read=lambda st: st.data_wait_seconds),
    Family("gputrain_training_samples_total", "counter", "Training samples processed.",
           read=lambda st: st.samples),
    Family("gputrain_training_flops_total", "counter",
           "Model FLOPs of the training steps (forward and backward), from the FLOPs per sample "
           "the client states.",
           read=lambda st: st.flops),
    Family("gputrain_training_comm_seconds_total", "counter",
           "Seconds the rank's gradient communication ran (DDP's all-reduce, from DDP's own "
           "timers; absent where the client measures none), overlapped with compute or not.",
           read=lambda st: st.comm_seconds),
    Family("gputrain_training_comm_exposed_seconds_total", "counter",
           "Seconds the training steps waited for gradient communication that compute did not "
           "hide (inside step time).",
           read=lambda st: st.comm_exposed_seconds),
    Family("gputrain_training_comm_bytes_total", "counter",
           "Bytes of gradients all-reduced (the size of DDP's gradient buckets).",
           read=lambda st: st.comm_bytes),
    Family("gputrain_training_elapsed_seconds_total", "counter",
           "Wall seconds of the rank since its process started, restarts included (the gap "
           "between a process's last push and its successor's first counts): the denominator "
           "of goodput and MFU.",
           read=lambda st: st.wall_seconds),
    Family("gputrain_training_slow_step_seconds_total", "counter",
           f"Seconds of steps over {SLOW_STEP_FACTOR:g}x the rank's median step, counted by the "
           "daemon from the "
           "pushed step histogram (a lower bound): what rare long stalls cost.",
           read=lambda st: st.slow_step_seconds if st.bucket_bounds else None),
    Family("gputrain_training_slow_steps_total", "counter",
           f"Steps over {SLOW_STEP_FACTOR:g}x the rank's median step, counted by the daemon from "
           "the pushed step histogram: their share of the steps tells a DataLoader's period (one "
           "slow step in its workers' count) from rare stalls.",
           read=lambda st: st.slow_steps if st.bucket_bounds else None),
    Family("gputrain_training_loader_workers", "gauge",
           "Worker processes of the DataLoader the rank's client wraps (num_workers): its "
           "batches arrive in groups of this many.",
           read=lambda st: st.loader_workers),
    Family("gputrain_training_collective_timeout_seconds", "gauge",
           "The shortest collective timeout of the rank's process groups, in seconds (what "
           "init_process_group's timeout set): NCCL's watchdog ends the job when a collective "
           "waits this long, so the hang checks say a hang well before it.",
           read=lambda st: st.collective_timeout_seconds),
    Family("gputrain_training_process_running", "gauge",
           "1 while this exporter finds the rank's process running (not stopped) in its "
           "/proc and its pushes are not being refused; absent where it cannot see it "
           "(another PID namespace without hostPID) or the rank ended. A rank that stops "
           "pushing while its process runs is frozen (its client's thread cannot run: "
           "native code holding the GIL) or cut off, not gone.",
           read=lambda st: 1.0 if st.process_running and st.exit_reason is None else None),
    Family(STEP_HISTOGRAM, "histogram",
           "Wall time of one training step, data wait included, in seconds.",
           per_rank=MAX_BUCKETS + 3),
    Family(PHASES, "counter",
           "Seconds spent in each named phase (callbacks, checkpoint, evaluation, ...).",
           ("run", "rank", "phase"), per_rank=MAX_PHASES),
    Family("gputrain_training_last_step_timestamp_seconds", "gauge",
           "Unix time the last step ended.",
           read=lambda st: st.last_step_timestamp),
    Family("gputrain_training_last_push_timestamp_seconds", "gauge",
           "Unix time the daemon last heard from the rank.",
           read=lambda st: st.received_unix),
    Family("gputrain_training_last_push_age_seconds", "gauge",
           "Seconds since the daemon last heard from the rank, on its own monotonic clock: the "
           "rules take the rank's liveness from this age (a node whose clock is off never "
           "reads as silent), not from the timestamp."),
    Family("gputrain_training_regime_age_seconds", "gauge",
           "Seconds since the rank's current regime began (see the start timestamp), on the "
           "daemon's own clock: the rules read the regime's age from this."),
    Family("gputrain_training_regime_start_timestamp_seconds", "gauge",
           "Unix time the rank's current regime began: where the daemon found its step time, "
           "throughput and data wait change together (a fix, a slowdown); absent until it "
           "finds one. While that is younger than the rate window, the rules read the rank "
           "over the last minute."),
    Family("gputrain_training_clock_skew_seconds", "gauge",
           "The rank's clock minus the daemon's, as its step timestamps show it (0 within 2 s): "
           "taken off its last step's timestamp, which is never after the push.",
           read=lambda st: st.clock_skew if st.last_step_timestamp is not None else None),
    Family("gputrain_training_finished", "gauge",
           "1 once the rank said goodbye at a clean end (close(), or its loop run out), else "
           "0: a rank that stops pushing without a goodbye has vanished.",
           read=lambda st: 1.0 if st.finished else 0.0),
    Family("gputrain_training_failed", "gauge",
           "1 once the rank's process ended by a failure (an uncaught exception, a collective's "
           "timeout, a signal, or a death without a goodbye the daemon saw), else 0; "
           "gputrain_training_exit_info says which.",
           read=lambda st: 1.0 if st.failed else 0.0),
    Family(EXIT_INFO, "gauge",
           "How the rank's process ended, once it said goodbye: reason closed, completed or "
           "exited (clean), exception or signal (a failure), and detail, the exception's type "
           "or the signal's name; or killed, where the daemon saw its process die without a "
           "goodbye (detail OOMKilled where the node's OOM kill count grew meanwhile); always "
           "1.", ("run", "rank", "reason", "detail")),
    Family("gputrain_training_step_in_progress_seconds", "gauge",
           "Seconds the rank's current step has run so far, outside-step phases excluded, by "
           "the daemon's own clock; before its first step, since its process started (outside "
           "any phase); absent while no step is open: a step far past the rank's pace is a "
           "hang long before it ends."),
    Family("gputrain_training_phase_in_progress_seconds", "gauge",
           "Seconds the rank's outside-step phase in progress (evaluation, checkpoint, "
           "dataloader_start) has run so far, by the daemon's own clock; absent while none is "
           "open.", ("run", "rank", "phase")),
    Family("gputrain_training_stack_location", "gauge",
           "Where the rank's main thread was in the py-spy dump the daemon took when the "
           "rank's run hung: location is one of collective, data_loading, checkpoint_io, "
           "evaluation, computing, elsewhere, function the frame that says so; always 1, "
           "while the rank has made no step since the dump.",
           ("run", "rank", "location", "function")),
    Family("gputrain_training_process_cpu_seconds_total", "counter",
           "CPU seconds of the training process and its children (DataLoader workers).",
           read=lambda st: st.process.get("cpu_seconds")),
    Family(ALLOWANCE, "gauge",
           "CPU cores the training process's cgroup allows it (cgroup v2 cpu.max quota over "
           "period, cpuset.cpus.effective; the machine's CPUs where neither limits it), "
           "divided among the ranks on this node under the cgroup that sets the limit (the "
           "ranks of one pod share its quota)."),
    Family("gputrain_training_process_cpu_throttled_seconds_total", "counter",
           "Seconds the kernel throttled the training process's cgroup (cpu.stat "
           "throttled_usec): time at its CPU quota.",
           read=lambda st: st.process.get("cpu_throttled_seconds")),
    Family("gputrain_training_process_resident_memory_bytes", "gauge",
           "Resident memory of the training process and its children, in bytes.",
           read=lambda st: st.process.get("resident_memory_bytes")),
    Family("gputrain_training_process_proportional_memory_bytes", "gauge",
           "Proportional set size (PSS) of the training process and its children, in bytes: a "
           "page shared by n processes counts 1/n (/proc/<pid>/smaps_rollup, read at most once "
           "a minute); absent where the client cannot read it.",
           read=lambda st: st.process.get("proportional_memory_bytes")),
    Family("gputrain_training_process_read_bytes_total", "counter",
           "Bytes the training process and its children read (storage and page cache).",
           read=lambda st: st.process.get("read_bytes")),
    Family("gputrain_training_gpu_info", "gauge",
           "The GPUs a rank uses and the precision it trains in; always 1. Join on gpu/uuid.",
           ("run", "rank", "gpu", "uuid", "precision"), per_rank=MAX_GPUS),
    Family("gputrain_training_gpu_memory_bytes", "gauge",
           "GPU memory the rank's processes hold on each GPU, in bytes (NVML's compute "
           "processes whose pid is the rank's pushed pid or a descendant of it).",
           ("run", "rank", "gpu", "uuid"), per_rank=MAX_GPUS),
    Family("gputrain_training_gpu_busy_seconds_total", "counter",
           "Seconds the rank's processes kept each GPU's SMs busy: NVML's per-process "
           "utilisation samples of the rank's pushed pid and its descendants, integrated (the "
           "GPU's share that is this rank's; never a pid as a label).",
           ("run", "rank", "gpu", "uuid"), per_rank=MAX_GPUS),
    Family("gputrain_training_gpu_memory_busy_seconds_total", "counter",
           "Seconds the rank's processes kept each GPU's memory busy (read or written: NVML's "
           "per-process memory utilisation), integrated.", ("run", "rank", "gpu", "uuid"),
           per_rank=MAX_GPUS),
    Family("gputrain_training_profile_info", "gauge",
           "The rank's last finished profile (`gputrain-exporter profile`, or an alert): the "
           "trace's path on the rank's machine (hidden where an ingest token is set); the value "
           "is the Unix time it finished.",
           ("run", "rank", "trace")),
    Family("gputrain_gpu_unattributed_memory_bytes", "gauge",
           "GPU memory held by processes that no pushing rank owns, in bytes: someone else on "
           "the GPU (or a job without the client).", ("gpu", "uuid"), per_rank=0),
    Family("gputrain_gpu_unattributed_processes", "gauge",
           "Compute processes on the GPU that no pushing rank owns.", ("gpu", "uuid"), per_rank=0),
    Family("gputrain_gpu_unattributed_busy_seconds_total", "counter",
           "Seconds the GPU's SMs were busy with processes that no pushing rank owns (NVML's "
           "per-process utilisation, integrated): someone else on the GPU, or a job without "
           "the client. Absent where the driver gives no per-process samples.",
           ("gpu", "uuid"), per_rank=0),
    Family("gputrain_gpu_unattributed_memory_busy_seconds_total", "counter",
           "Seconds the GPU's memory was busy for processes that no pushing rank owns.",
           ("gpu", "uuid"), per_rank=0),
    Family(REQUESTS, "counter",
           "Push requests received, by HTTP status code.", ("code",), per_rank=0),
    Family(SERIES, "gauge", "Live (run, rank) pairs the daemon holds.", (),
           per_rank=0),
    Family(LEFT_OUT, "gauge",
           "Live (run, rank) pairs left out of the page because their lines could not be "
           "built (the daemon's log names each once); the other ranks are shown.", (), per_rank=0),
)
INDEX = {f.name: i for i, f in enumerate(FAMILIES)}
# a rank's samples that are counters: what rate() reads, and carries across a reset
COUNTERS = frozenset({*(f.name for f in FAMILIES if f.kind == "counter" and f.per_rank),
                      STEP_HISTOGRAM + "_sum", STEP_HISTOGRAM + "_count"})
# The most lines one rank adds to the page (docs/push-protocol.md): the page stays bounded at
# --ingest.max-series ranks
MAX_SERIES_PER_RANK = sum(f.per_rank for f in FAMILIES)


class TrainingCollector:
    """Renders every live (run, rank) the ingest holds, plus the ingest's own counters."""

    def __init__(self, store: IngestStore, view: Callable[[], NodeView],
                 regimes: Callable[[], dict[tuple[str, str], float]] | None = None) -> None:
        self._store = store
        self._regimes = regimes or dict  # each rank's regime start, from the history
        self._view = view  # the latest cycle's attribution (exporter.serving.attribution)
        self._status = CollectorStatus(True, 0.0, time.time(), self._store.now())
        # a rank's own lines by family index, until its next push
        self._lines: dict[tuple[str, str], tuple[RankState, tuple[tuple[int, str], ...]]] = {}
        self._left_out: set[tuple[str, str]] = set()  # ranks logged as left out
        self.left_out = 0  # ranks left out of the last render: their lines cannot be built

    def describe(self) -> list[Metric]:
        return [f.empty() for f in FAMILIES]

    @property
    def status(self) -> CollectorStatus:
        """The last render, as a collector status (the ingest has no sampling cycle)."""
        return self._status

    def collect(self) -> Iterator[Metric]:
        """The families for a prometheus_client registry: :meth:`render`'s lines, read back."""
        yield from text_string_to_metric_families(self.render().decode())

    def render(self, openmetrics: bool = False) -> bytes:
        """The training families' exposition (text format, or OpenMetrics without ``# EOF``),
        each rank's own lines reused until its next push."""
        started = time.perf_counter()
        # the ranks as pushed now; who holds which GPU as of the latest cycle's view
        states = sorted(self._store.states(), key=lambda s: (s.run, s.rank))
        shares = allowance_shares(states)  # a cgroup's allowance, divided among its ranks
        view = self._view()
        gpus, held = view.gpus, view.held
        busy = {k: {g: v for g, v in on.items() if g in view.listed.get(k, ())}
                for k, on in view.busy.items()}  # exported while its processes are there
        profiles = self._store.profiles.latest_done()
        locations = self._store.profiles.hang_locations()
        now, wall = self._store.now(), self._store.wall()
        regimes = self._regimes()
        chunks: list[list[str]] = [[] for _ in FAMILIES]
        cache: dict[tuple[str, str], tuple[RankState, tuple[tuple[int, str], ...]]] = {}
        left_out = 0
        for st in states:
            key = (st.run, st.rank)
            try:
                lines = self._rank_parts(st, gpus, held, busy, profiles, cache, now, locations)
                if (cores := shares.get(key)) is not None:
                    lines.append(_line(ALLOWANCE, _labels(st), cores))
                if (start := regimes.get(key)) is not None:
                    lines.append(_line("gputrain_training_regime_start_timestamp_seconds",
                                       _labels(st), start))
                    lines.append(_line("gputrain_training_regime_age_seconds", _labels(st),
                                       round(max(0.0, wall - start), 3)))
            except Exception as exc:  # one rank's bad state must never stop the page
                left_out += 1
                if key not in self._left_out:
                    log.error("run %r rank %r is left out of /metrics: its lines cannot be "
                              "built (%s: %s)", st.run, st.rank, type(exc).__name__, exc)
                self._left_out.add(key)
                continue
            for i, chunk in lines:
                chunks[i].append(chunk)
        self._left_out &= {(st.run, st.rank) for st in states}  # gone: logged if back
        for st in sorted(self._store.departed(), key=lambda s: (s.run, s.rank)):
            for i, chunk in _departed_lines(st):
                chunks[i].append(chunk)
            _append(chunks, _push_age(st, now))
        self.left_out = left_out
        self._lines = cache  # forgets ranks that are gone
        for name, field in (("gputrain_gpu_unattributed_memory_bytes", 1),
                            ("gputrain_gpu_unattributed_processes", 0)):
            for (index, uuid), other in view.others.items():
                _append(chunks, _line(name, _gpu_labels(index, uuid), other[field]))
        for (index, uuid), seconds in sorted(view.unowned.items()):
            for name, busy_s in zip(("gputrain_gpu_unattributed_busy_seconds_total",
                                     "gputrain_gpu_unattributed_memory_busy_seconds_total"),
                                    seconds, strict=True):
                _append(chunks, _line(name, _gpu_labels(index, uuid), busy_s))
        for code, n in sorted(self._store.requests().items()):
            _append(chunks, _line(REQUESTS, f'code="{code}"', n))
        _append(chunks, _line(SERIES, "", len(states)))
        _append(chunks, _line(LEFT_OUT, "", left_out))
        out: list[str] = []
        always = (REQUESTS, SERIES, LEFT_OUT)
        for family, header, family_lines in zip(FAMILIES, self._headers[openmetrics], chunks,
                                                strict=True):
            if family_lines or family.name in always:
                out.append(header)
                out.extend(family_lines)
        self._status = CollectorStatus(True, time.perf_counter() - started, time.time(),
                                       self._store.now())
        return "".join(out).encode()

    def _rank_parts(self, st: RankState, gpus: GpuIndex, held: Mapping, busy: Mapping,
                    profiles: dict, cache: dict, now: float = 0.0,
                    locations: Mapping | None = None) -> list[tuple[int, str]]:
        """One rank's lines by family index; raises when they cannot be written (a string
        UTF-8 cannot encode)."""
        key = (st.run, st.rank)
        locations = locations or {}
        hit = self._lines.get(key)
        own = hit[1] if hit is not None and hit[0] is st else _rank_lines(st)
        parts = list(own)
        lbl = _labels(st)
        parts.extend(
            _line("gputrain_training_gpu_info",
                  f'gpu="{_escape(index)}",precision="{st.precision}",{lbl},'
                  f'uuid="{_escape(uuid)}"', 1.0)
            for index, uuid in resolve_gpus(st, gpus, held.get(key, {})))
        parts.extend(
            _line("gputrain_training_gpu_memory_bytes",
                  f'gpu="{_escape(index)}",{lbl},uuid="{_escape(uuid)}"', used)
            for (index, uuid), used in sorted(held.get(key, {}).items()))
        for (index, uuid), seconds in sorted(busy.get(key, {}).items()):
            for name, v in zip(("gputrain_training_gpu_busy_seconds_total",
                                "gputrain_training_gpu_memory_busy_seconds_total"), seconds,
                               strict=True):
                parts.append(_line(name, f'gpu="{_escape(index)}",{lbl},uuid="{_escape(uuid)}"',
                                   v))
        parts.append(_push_age(st, now))
        if (open_s := st.step_in_progress(now)) is not None:
            parts.append(_line("gputrain_training_step_in_progress_seconds", lbl, open_s))
        if (phase := st.phase_in_progress(now)) is not None:
            parts.append(_line("gputrain_training_phase_in_progress_seconds",
                               f'phase="{phase[0]}",{lbl}', phase[1]))
        if (where := locations.get(key)) is not None and where.current(st.steps):
            parts.append(_line("gputrain_training_stack_location",
                               f'function="{_escape(where.function)}",'
                               f'location="{where.location}",{lbl}', 1.0))
        if (done := profiles.get(key)) is not None:
            # a path on the rank's machine: hidden where an ingest token guards it, as on the
            # status page (GET /api/v1/profile with the token has it)
            trace = HIDDEN if self._store.guarded else _escape(done.trace)
            parts.append(_line("gputrain_training_profile_info", f'{lbl},trace="{trace}"',
                               done.finished))
        for _, line in parts:
            if not line.isascii():  # O(1): the page is encoded whole, so check here
                line.encode("utf-8")
        cache[key] = (st, own)
        return parts

    @functools.cached_property
    def _headers(self) -> dict[bool, tuple[str, ...]]:
        """The HELP and TYPE lines of each family in both formats, from prometheus_client's
        own encoders (so they match whatever version is installed)."""
        from prometheus_client.exposition import generate_latest
        from prometheus_client.openmetrics.exposition import generate_latest as generate_om

        out: dict[bool, tuple[str, ...]] = {}
        for om, encode in ((False, generate_latest), (True, generate_om)):
            out[om] = tuple(encode(_One(f.empty())).decode().removesuffix("# EOF\n")
                            for f in FAMILIES)
        return out


class _One:
    """A registry of one family, to take its header from an encoder."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterator[Metric]:
        yield self._family


def _line(name: str, labels: str, value: float) -> tuple[int, str]:
    """One sample's line of the family ``name`` (a row of FAMILIES, whose index it goes
    with), its labels written in order."""
    sample = f"{name}{{{labels}}}" if labels else name
    return INDEX[name], f"{sample} {floatToGoString(value)}\n"


def _append(chunks: list[list[str]], line: tuple[int, str]) -> None:
    """``line`` (:func:`_line`) added to its family's chunk."""
    chunks[line[0]].append(line[1])


def _gpu_labels(index: str, uuid: str) -> str:
    return f'gpu="{_escape(index)}",uuid="{_escape(uuid)}"'


def _push_age(st: RankState, now: float) -> tuple[int, str]:
    """The rank's last push age line at ``now`` (the store's monotonic clock)."""
    return _line("gputrain_training_last_push_age_seconds", _labels(st),
                 round(max(0.0, now - st.received_at), 3))


def _labels(st: RankState) -> str:
    # label names sorted, as prometheus_client writes them; names are validated at ingest
    return f'rank="{st.rank}",run="{st.run}"'


# what a departed rank (it ended without a clean close, its ttl ran out) keeps on the page: its
# end, so that its run's alert holds on for the ingest's dead_ttl; none of its counters
DEPARTED = ("gputrain_training_last_step_timestamp_seconds",
            "gputrain_training_last_push_timestamp_seconds", "gputrain_training_finished",
            "gputrain_training_failed", EXIT_INFO)


def _departed_lines(st: RankState) -> list[tuple[int, str]]:
    """A departed rank's lines: those of :data:`DEPARTED` it has."""
    keep = {INDEX[name] for name in DEPARTED}
    return [(i, line) for i, line in _rank_lines(st) if i in keep]


# One rank's own samples as its lines show them, by the name they are read by: each family
# with a ``read``, the step histogram's ``_sum`` and ``_count``, and the phases by phase (the
# histogram's buckets are RankState.cumulative_counts)
READERS: dict[str, Callable[[RankState], float | dict[str, float] | None]] = {
    **{f.name: f.read for f in FAMILIES if f.read is not None},
    STEP_HISTOGRAM + "_sum": lambda st: st.step_seconds,
    STEP_HISTOGRAM + "_count": lambda st: float(st.steps),
    PHASES: lambda st: dict(st.phases),
}


def _rank_lines(st: RankState) -> tuple[tuple[int, str], ...]:
    """One rank's own lines, by the index of their family in FAMILIES (those it has)."""
    fg = floatToGoString
    lbl = _labels(st)
    bounds = (*map(fg, st.bucket_bounds), "+Inf")
    hist = [f'{STEP_HISTOGRAM}_bucket{{le="{b}",{lbl}}} {fg(c)}\n'
            for b, c in zip(bounds, st.cumulative_counts, strict=True)]
    hist.append(f"{STEP_HISTOGRAM}_count{{{lbl}}} {fg(st.steps)}\n")
    hist.append(f"{STEP_HISTOGRAM}_sum{{{lbl}}} {fg(st.step_seconds)}\n")
    out = [(i, f"{f.name}{{{lbl}}} {fg(v)}\n") for i, f in enumerate(FAMILIES)
           if f.read is not None and (v := f.read(st)) is not None]
    if st.exit_reason is not None:
        out.append(_line(EXIT_INFO, f'detail="{st.exit_detail or ""}",rank="{st.rank}",'
                                    f'reason="{st.exit_reason}",run="{st.run}"', 1.0))
    out.append((INDEX[STEP_HISTOGRAM], "".join(hist)))
    out.extend((INDEX[PHASES], f'{PHASES}{{phase="{name}",{lbl}}} {fg(seconds)}\n')
               for name, seconds in sorted(st.phases.items()))
    return tuple(out)
