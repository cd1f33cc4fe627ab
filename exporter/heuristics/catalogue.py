"""The bottleneck catalogue: each heuristic is one record, written once.

A :class:`Heuristic` holds its thresholds (default, unit, source), its alert's ``for``,
severity, summary, advice, runbook text and confirming dashboard panel, and its condition twice
side by side: :meth:`~Heuristic.rules`, the alert's PromQL over the recorded readings, and
:meth:`~Heuristic.holds` (or ``holds_gpu``, ``holds_node``), the same predicate over a
window's readings (:mod:`exporter.heuristics.readings`) that ``diagnose``, the status page and
``top`` judge. ``tests/test_agreement.py`` backfills every rule case into a real Prometheus and
checks, entry by entry, that the two agree. :data:`CATALOGUE` is in the decision order: faults
first (a run with a lost GPU is not "gpu-bound"), then the pipeline from its input to its
output, the first finding that holds being the verdict.

The rule files, the runbook, the alert table, the dashboards' threshold lines and the texts of
every surface are generated from here (``scripts/generate.py``); a test fails when a
committed copy is stale. Texts may name thresholds as ``{name}`` (shown in the threshold's
unit: ``5 %``, ``2x``, ``10 m``), a derived value likewise, and the alert's ``for`` as
``{for}``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from exporter.heuristics.location import (
    WAITING,
    Location,
    collective_named,
    culprit_line,
    rank_words,
)
from exporter.heuristics.promql import (
    COMPUTE_MEAN,
    OPEN,
    RANK_BUSY_AVG,
    STEP_PHASE_MAX,
    THROTTLE_REASONS,
    TYPICAL,
    Q,
    collector_age,
    memory_outside,
    new_errors,
    restarts,
    tree_growth,
)
from exporter.heuristics.readings import (
    BY_FIELD,
    LEAK_SPANS,
    LOADER_START,
    REFINED,
    RUN_GPU_BUSY,
    STACK_WAITING,
    UNATTRIBUTED_BUSY,
    WINDOWS,
    GpuReading,
    NodeReport,
    RankReport,
    gpu_series_of,
    mean,
    percent,
    series_of,
    stale_collectors,
)
from exporter.heuristics.stalls import SLOW_STEP_FACTOR
from exporter.protocol import (
    DEFAULT_METRICS_PORT,
    KILLED_EXIT,
    LOADER_START_PHASE,
    OOM_KILLED,
    OUTSIDE_STEP_PHASES,
)
from exporter.reading.sampler import LOST_GPU_RETRY_SECONDS


@dataclass(frozen=True)
class Threshold:
    default: float
    unit: str  # "ratio" (shown as a percentage), "factor" (2x), "count" (3) or "seconds"
    source: str


class Heuristic:
    """One row of the catalogue: an alert, what it means and when it holds.

    ``kind``: ``fault`` (the GPU or the exporter's view of it is broken: outranks every
    pipeline verdict), ``state`` (the run is no longer running: nothing else is judged),
    ``bottleneck`` (``diagnose`` names it), ``health`` (worth acting on, no pipeline stage),
    ``note`` (said beside the verdict, never the verdict: the run itself is not at fault) or
    ``symptom`` (the GPU is under-used; the others say why).
    ``scope``: what the condition is about: ``rank``, ``rank_gpu`` (a GPU as a rank uses it),
    ``gpu`` (any GPU of a node; a rank's verdict takes its own GPUs'), ``node``, or ``run``
    (compares the ranks of a run). ``stepping``: it holds only while its rank steps.
    """

    alert: ClassVar[str]
    verdict: ClassVar[str]  # its name in diagnose, the status page, top and the API
    kind: ClassVar[str] = "bottleneck"
    scope: ClassVar[str] = "rank"
    severity: ClassVar[str]  # "warning", or "info / warning" where tiers share the name
    for_: ClassVar[str]
    summary: ClassVar[str]  # the alert's static summary
    advice: ClassVar[str]  # what to change: the alert's description, diagnose and the runbook
    fires_when: ClassVar[str]  # the alert table's one-line condition
    why: ClassVar[str]  # the runbook's explanation
    confirm: ClassVar[tuple[str, ...]]  # the series that confirm it
    panel: ClassVar[str]  # where to see it on the dashboards (quoted titles checked to exist)
    # where its rule is evaluated: "node" needs one node's raw series, so it runs where the
    # node is scraped (each shard); "global" compares the ranks of a run across nodes, so it
    # runs where every shard is seen (a single Prometheus, vmalert over VictoriaMetrics)
    level: ClassVar[str] = "node"
    # a firing alert of a rank asks the daemon for a profile of it (Alertmanager's webhook):
    # None means every bottleneck; a profile cannot explain a leak, a throttle or a stall
    profile: ClassVar[bool | None] = None
    # and the py-spy capture of the rank's process tree it asks for: "record" (which functions
    # its processes spend their samples in) or "dump" (where every thread is now), or None
    stacks: ClassVar[str | None] = None
    stepping: ClassVar[bool] = True
    run_stepping: ClassVar[bool] = False  # holds only while a rank of its run steps
    # it compares the ranks of a run (or counts them): never where two jobs share the run's
    # name (RunNameShared), whose ranks are no one run's
    compares_ranks: ClassVar[bool] = False
    thresholds: ClassVar[dict[str, Threshold]] = {}  # the thresholds this entry owns

    @property
    def profiled(self) -> bool:
        """Whether this alert, firing for a rank, triggers a profile of it."""
        return self.kind == "bottleneck" if self.profile is None else self.profile

    def derived(self, t: dict[str, float]) -> dict[str, float]:
        """Values computed from thresholds that its texts, rules and panels use."""
        return {}

    def advice_for(self, r: RankReport) -> str:
        """The advice that fits what was seen of this rank (the alert's description says it
        conditionally, as it cannot read the rank's phases)."""
        return self.advice

    # -- the condition, twice: as PromQL and over a window's readings -----------------------

    def rules(self, q: Q) -> list[dict]:
        """Its alerting rules, one per severity tier."""
        raise NotImplementedError

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        """Why it holds for this rank (a reason in words), or None."""
        return None

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        """For scope ``gpu`` and ``rank_gpu``: why it holds for this GPU, or None."""
        return None

    def holds_node(self, n: RankReport | NodeReport, t: dict[str, float]) -> str | None:
        """For scope ``node``: why it holds on this rank's (or report's) node, or None."""
        return None

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        """For scope ``run``: the ranks of one run it holds for (by ``id``), with why."""
        return {}

    @property
    def guarded(self) -> bool:
        """Holds only while its rank steps (its rules say ``Q.stepping``)."""
        return self.stepping and self.scope in ("rank", "rank_gpu")

    def judged(self, r: RankReport | NodeReport, t: dict[str, float]) -> bool:
        """Whether its readings may be judged at all: a fault always; anything else only
        where no collector of the node is stale (frozen readings repeat their last value)."""
        return self.kind == "fault" or not stale_collectors(r.collector_ages,
                                                            t["stale_intervals"])

    def finding(self, r: RankReport, t: dict[str, float]) -> str | None:
        """Why it holds for a rank, whatever its scope, or None. As its rules, an entry
        ``guarded`` holds only for a rank that steps with one process over the window and
        still runs, and one not a fault only on fresh readings."""
        if not self.judged(r, t) or (self.guarded and not steps_judged(r, t)):
            return None
        if self.scope in ("gpu", "rank_gpu"):
            stray = stray_gpus(r, t) if self.scope == "rank_gpu" else set()
            for g in r.gpus:
                if g.gpu in stray:
                    continue  # a stray context's GPU: not the rank's to judge (as its rules)
                why = self.holds_gpu(g, t)
                if why:
                    return f"GPU {g.gpu}: {why}"
            return None
        if self.scope == "node":
            return self.holds_node(r, t)
        return self.holds(r, t)

    # -- writing its rules ---------------------------------------------------------------

    def rule(self, q: Q, severity: str, expr: str, situation: str,
             labels: dict[str, str] | None = None) -> dict:
        """An alerting rule of this entry; ``situation`` starts its description, the advice
        ends it; ``labels`` beside the severity tell apart rules of one severity."""
        expr = q.stepping(expr) if self.guarded else expr
        if self.scope == "rank_gpu" and self.run_stepping:
            # of a run's GPU: not one where its ranks are only stray contexts
            expr = (f"({expr}) unless on ({q.ids.run_gpu}) "
                    f"(max by ({q.ids.run_gpu}) ({GPU_SHARE}) < {q.t['stray_share']} "
                    f"and on ({q.ids.run_gpu}) count by ({q.ids.run_gpu}) ({q.stray}))")
        elif self.scope == "rank_gpu":
            # a GPU the rank holds but does no work on (a stray context) is not its to judge
            expr = f"({expr}) unless on ({q.rank}, gpu, uuid) {q.stray}"
        # a global rule reads only recorded series, across nodes: staleness is the nodes'
        expr = expr if self.kind == "fault" or self.level == "global" else q.fresh(expr)
        if self.compares_ranks:
            expr = f"({expr}) unless on ({q.run}) {q.shared}"
        return {
            "alert": self.alert,
            "expr": " ".join(expr.split()),
            "for": q.cfg["for"][self.alert],
            "labels": {"severity": severity, **(labels or {})},
            "annotations": {
                "summary": self.summary,
                "description": " ".join(f"{situation} {self.advice}".split()),
                "runbook_url": f"{q.cfg['runbook_url']}#{self.alert.lower()}",
            },
        }


def steps_judged(r: RankReport, t: dict[str, float]) -> bool:
    """The rank's window of steps may be judged (as :meth:`Q.stepping`): it steps with one
    process over the window, still runs and is not :func:`silent` (a rank killed outright
    keeps a window of steps, falling, that says nothing of now), and no step of it is held
    far past its pace."""
    return r.stepping and not gone(r, t) and not silent(r, t) and not r.restarts_recent and \
        not held(r, t)


def stray_gpus(r: RankReport, t: dict[str, float]) -> set[str]:
    """The GPUs where the rank is a stray context: it does under ``stray_share`` of the work
    its processes do there while doing ``stray_own_share`` or more of another GPU's (as
    :attr:`Q.stray`). A rank starved on its only GPU is no stray there."""
    if not r.gpu_share or max(r.gpu_share.values()) < t["stray_own_share"]:
        return set()
    return {g for g, s in r.gpu_share.items() if s < t["stray_share"]}


def held(r: RankReport, t: dict[str, float]) -> bool:
    """The rank's step in progress has run past the floor of the hung limit (``hung_min_seconds``,
    or its ceiling where a short collective timeout lowers it under that) and twice its mean
    step: the window's rates are of steps that no longer come, so no bottleneck of its steps
    is judged (as :meth:`Q.stepping`)."""
    return _v(r.step_in_progress, ">", min(t["hung_min_seconds"], ceiling_of(r, t))) and \
        _v(r.step_in_progress, ">", 2 * (typical_step(r) or 0.0))


def silent(r: RankReport, t: dict[str, float]) -> bool:
    """The rank has not pushed for ``silent_seconds``: its pusher thread no longer runs (the
    process killed outright, frozen, or cut off), whatever its last window says."""
    return _v(r.seconds_since_push, ">", t["silent_seconds"])


def running_silent(r: RankReport, t: dict[str, float]) -> bool:
    """The rank has not pushed for ``alive_seconds`` while the exporter of its node finds its
    process running (not stopped): frozen (native code that holds the GIL stops its client's
    thread with its loop), or its client cannot reach the exporter. Never vanished."""
    return not r.ended and r.process_running and \
        _v(r.seconds_since_push, ">=", t["alive_seconds"])


def frozen(r: RankReport, t: dict[str, float]) -> bool:
    """A running silent rank (:func:`running_silent`) past ``vanished_seconds``: what would
    have read vanished."""
    return running_silent(r, t) and _v(r.seconds_since_push, ">", t["vanished_seconds"])


def frozen_hung(r: RankReport, t: dict[str, float]) -> bool:
    """A frozen rank silent past its ceiling (:func:`ceiling_of`: nothing it pushes gives it
    a pace, and a client cut off from the exporter for minutes is rare), outside any declared
    phase or in one past that ceiling (a checkpoint's write that holds the GIL keeps the
    phase's allowance, as a live rank's does)."""
    ceiling = ceiling_of(r, t)
    return frozen(r, t) and _v(r.seconds_since_push, ">", ceiling) and not any(
        _v(seconds, "<=", ceiling) for seconds in r.phase_in_progress.values())


def gone(r: RankReport, t: dict[str, float]) -> bool:
    """The rank no longer runs: it said goodbye, or has not pushed for the vanished
    threshold. Its last window is history, so nothing about its steps is judged."""
    return r.ended or _v(r.seconds_since_push, ">", t["vanished_seconds"])


def refined(r: RankReport | NodeReport, name: str, threshold: str,
            t: dict[str, float]) -> bool:
    """A refinement's node reading ``name`` (one of REFINED) at ``threshold``, with
    hysteresis: it reached the line within the hold range (its peak) and has not fallen below
    the line less ``refinement_margin`` since, so a reading hovering at the line keeps the
    verdict it entered, and a clear drop leaves it at once (as :meth:`Q.refined`)."""
    value = r.host.get(name)
    if value is None:
        return False
    peak = max(value, r.host.get(f"{name}_peak", value))
    return value >= t[threshold] - t["refinement_margin"] and peak >= t[threshold]


def unrefined(r: RankReport | NodeReport, name: str, threshold: str,
              t: dict[str, float]) -> bool:
    """The reading is known and the refinement does not hold."""
    return r.host.get(name) is not None and not refined(r, name, threshold, t)


def loader_period(r: RankReport, t: dict[str, float]) -> str | None:
    """Why the rank's slow steps are its DataLoader's period, or None: a loader with N >= 2
    workers delivers its batches in groups of N (each worker finishes one at about the same
    time), so one step in N waits for data and the N - 1 after it find theirs ready. That is
    slow steps about 1/N of the steps (within ``loader_period_tolerance``) whose time is mostly
    data wait (``loader_wait_share`` of it): the loader, not a stall. Rare stalls (one in
    hundreds) and slow steps that are no data wait (a checkpoint, a sync) are not it."""
    n, share = r.loader_workers, r.slow_step_ratio
    if n is None or n < 2 or not share or not _v(r.slow_step_wait, ">=",
                                                   t["loader_wait_share"]):
        return None
    tolerance = t["loader_period_tolerance"]
    if (1 - tolerance) / n <= share <= (1 + tolerance) / n:
        return (f"one step in {1 / share:.1f} is slow, waiting for data: the loader's {n:g} "
                "workers deliver their batches together")
    return None


def _v(x: float | None, op: str, threshold: float) -> bool:
    """``x op threshold`` where ``x`` is known."""
    if x is None:
        return False
    return {">=": x >= threshold, "<=": x <= threshold, "<": x < threshold,
            ">": x > threshold}[op]


# --- faults: the GPU, or the exporter's view of it, is broken ------------------------------


class GPULost(Heuristic):
    alert, verdict, kind, scope = "GpuTrainGPULost", "gpu-lost", "fault", "gpu"
    severity, for_ = "critical", "1m"
    summary = "A GPU stopped answering."
    advice = "Drain the node; check dmesg for Xid 79."
    fires_when = "`gputrain_gpu_up == 0` for {for}"
    why = ("NVML says the GPU is lost (fallen off the bus); the exporter retries it every "
           "{lost_gpu_retry}.")
    confirm = ("gputrain_gpu_up",)
    panel = 'GpuTrain / Node, table "GPU health" (up 0).'

    def derived(self, t: dict[str, float]) -> dict[str, float]:
        return {"lost_gpu_retry": LOST_GPU_RETRY_SECONDS}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "critical", q.metric("gputrain_gpu_up") + " == 0",
                          f"""GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {q.where}
                          does not answer NVML (fallen off the bus).""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        return "lost: it does not answer NVML" if g.up is False else None


class XidErrors(Heuristic):
    alert, verdict, kind, scope = "GpuTrainXidErrors", "xid-errors", "fault", "gpu"
    severity, for_ = "critical", "0m"
    summary = "A GPU reported Xid errors."
    advice = "Check the driver log for the Xid's meaning; drain the node if it repeats."
    fires_when = "any Xid error in {fault_window}"
    why = "The driver reported Xid errors."
    confirm = ("gputrain_gpu_xid_errors_total",)
    panel = 'GpuTrain / Node, table "GPU health" (Xid errors in the last hour).'

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(
            q, "critical", new_errors(q.metric("gputrain_gpu_xid_errors_total"), q.fault),
            f"""{q.node_gpu} reported Xid {{{{ $labels.xid }}}} {{{{ $value | printf "%.0f" }}}}
            time(s) in {q.fault}.""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if g.xid_errors:
            return f"{g.xid_errors:.0f} Xid error(s) in {WINDOWS['fault']}"
        return None


class GPUMemoryFault(Heuristic):
    alert, verdict, kind, scope = "GpuTrainGPUMemoryFault", "gpu-memory-fault", "fault", "gpu"
    severity, for_ = "warning / critical", "0m"
    summary = "A GPU's memory has a fault: drain it, or reset it when the job ends."
    advice = ("Critical (an uncorrectable ECC error or a failed row remap): drain the node and "
              "have the GPU checked. Warning (a row remap or page retirement pending): reset "
              "the GPU (nvidia-smi -r, or reboot) when the job ends, so the remap takes "
              "effect.")
    fires_when = ("an uncorrectable ECC error in {fault_window} (or found by an exporter "
                  "started in the last {fault_window}) or a failed remap (critical); a remap "
                  "or page retirement pending (warning)")
    why = ("NVML's row remapper (Ampere and newer) replaces a faulty memory row at the next GPU "
           "reset: until then the remap is pending, and a failed remap means the GPU cannot "
           "heal itself. An uncorrectable ECC error can crash the job (Xid 48, 63, 94, 95). "
           "GPUs before Ampere retire pages instead, also at the next reset.")
    confirm = ("gputrain_gpu_ecc_errors_total", "gputrain_gpu_remapped_rows",
               "gputrain_gpu_retired_pages_pending")
    panel = ('GpuTrain / Node, table "GPU health" (uncorrected ECC, remap pending and '
             'failed).')

    def rules(self, q: Q) -> list[dict]:
        # new uncorrectable errors, and those since the driver loaded that an exporter
        # (re)started in the fault window finds (a counter's first sample is no increase)
        ecc = q.metric("gputrain_gpu_ecc_errors_total", 'type="uncorrected"')
        return [
            self.rule(q, "critical", f"""{new_errors(ecc, q.fault)}
                      or {q.metric("gputrain_gpu_remapped_rows", 'state="failed"')} > 0""",
                      f"{q.node_gpu} has an uncorrectable memory error or a failed row remap."),
            self.rule(q, "warning", f"""{q.metric("gputrain_gpu_remapped_rows",
                                                  'state="pending"')} > 0
                      or {q.metric("gputrain_gpu_retired_pages_pending")} > 0""",
                      f"""{q.node_gpu} has a memory row remap (or page retirement) waiting for
                      a GPU reset.""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if g.ecc_uncorrected:
            return f"{g.ecc_uncorrected:.0f} uncorrectable ECC error(s)"
        if g.remap_failed:
            return "a memory row remap failed"
        if g.remap_pending:
            return "a memory row remap (or page retirement) waits for a GPU reset"
        return None

    @staticmethod
    def severity_of(g: GpuReading) -> str:
        """critical or warning, as the two rules split them."""
        return "critical" if g.ecc_uncorrected or g.remap_failed else "warning"


class CollectorFailing(Heuristic):
    alert, verdict, kind, scope = ("GpuTrainCollectorFailing", "collector-failing", "fault",
                                   "node")
    severity, for_ = "warning", "10m"
    summary = "A gputrain-exporter collector fails."
    advice = ("See the exporter's log; for gpu fix the driver or the container's GPU access "
              "(NVIDIA_VISIBLE_DEVICES=all).")
    fires_when = "a collector failing for {for}"
    why = ("A collector has failed for {for}; its metrics are missing. For `gpu`, usually a "
           "driver that fails or went away, or no access to `/dev/nvidia*` (see the "
           "exporter's log line). A node with no NVIDIA driver at all is no failure: it serves "
           "host metrics by design, says so once in its log and on its status page, and its "
           "gpu collector reports nothing.")
    confirm = ("gputrain_collector_success",)
    panel = ('GpuTrain / Node: the failing collector\'s panels are empty; '
             '`gputrain_collector_success` in Prometheus says which.')

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", q.metric("gputrain_collector_success") + " == 0",
                          f"""The {{{{ $labels.collector }}}} collector on {q.where} has failed
                          for a while; its metrics are missing.""")]

    def holds_node(self, n: RankReport | NodeReport, t: dict[str, float]) -> str | None:
        failing = n.collectors_failing
        if len(failing) == 1:
            return f"the {failing[0]} collector fails: its readings are missing"
        if failing:
            return f"the {', '.join(failing)} collectors fail: their readings are missing"
        return None


class CollectorStale(Heuristic):
    alert, verdict, kind, scope = ("GpuTrainCollectorStale", "stale", "fault", "node")
    severity, for_ = "warning", "1m"
    summary = "A gputrain-exporter collector stopped updating: its readings are frozen."
    advice = ("A hung NVML call or a blocked disk or /proc read holds the sampler: see the "
              "exporter's log and `dmesg` (Xid, hung task), then restart the exporter. Nothing "
              "else is judged on the node until its readings move again.")
    fires_when = ("a collector's last success more than {stale_intervals} the sampler "
                  "interval old at a scrape, for {for}, whatever `gputrain_collector_success` "
                  "says")
    why = ("The exporter still answers `/metrics`, but a collector has not completed a cycle "
           "for more than {stale_intervals} the sampler interval: its readings repeat their last "
           "value, and rates over them read zero. Its success gauge still shows the last "
           "cycle that ended, so `GpuTrainCollectorFailing` stays silent (node_exporter's "
           "hung-collector reports: a scrape answers while a collector is stuck). The age is "
           "the scrape's time less the last success's, so Prometheus' clock does not enter "
           "it. No bottleneck is stated on the node's frozen readings.")
    confirm = ("gputrain_collector_last_success_timestamp_seconds",
               "gputrain_sampler_interval_seconds")
    panel = ('GpuTrain / Node: the panels flat-line; '
             '`time() - gputrain_collector_last_success_timestamp_seconds` in Prometheus says '
             'which collector.')
    stepping = False
    thresholds = {"stale_intervals": Threshold(
        5.0, "factor", "node_exporter hung-collector reports: a few cycles missed is a hang, "
                       "one late cycle is not")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", f"""{collector_age(q.s, q.ids)}
                          > {q.t['stale_intervals']}""",
                          f"""The {{{{ $labels.collector }}}} collector on {q.where} last
                          succeeded {{{{ $value | printf "%.0f" }}}} sampler intervals before
                          the scrape: its readings are frozen.""")]

    def holds_node(self, n: RankReport | NodeReport, t: dict[str, float]) -> str | None:
        stale = stale_collectors(n.collector_ages, t["stale_intervals"])
        if not stale:
            return None
        ages = ", ".join(f"{name} {n.collector_ages[name]:.0f}" for name in stale)
        return (f"the exporter's readings are stale: the {', '.join(stale)} collector(s) last "
                f"succeeded {ages} sampler intervals ago; nothing is judged on them")


class RunNameShared(Heuristic):
    alert, verdict, kind, scope, level = ("GpuTrainRunNameShared", "name-shared", "health",
                                          "run", "global")
    severity, for_ = "warning", "2m"
    summary = ("Two jobs push under one run name: the same rank of a run is live on two nodes "
               "at once.")
    advice = ("Give each job its own run name: GPUTRAIN_RUN, torchrun's --rdzv-id, or let the "
              "client take Slurm's job id or the rendezvous (the default where the launcher "
              "sets one). Until then the run's ranks are not compared: no straggler, "
              "communication, hang, stall or vanished verdict is given for it.")
    fires_when = ("a (run, rank) pushed within {alive_seconds} from two or more exporters at "
                  "once")
    why = ("A run is its name, and two jobs that share one (a script's default run name "
           "started twice, a name hard-coded in a config) push the same (run, rank) from two "
           "nodes at once. Compared as one run they make stragglers, hangs and stalls of each "
           "other's pace; so where a rank of a run is live on two exporters, the run-wide "
           "alerts leave the run out, and this one says why.")
    confirm = (series_of("seconds_since_push"),)
    panel = 'GpuTrain / Overview, the Runs table: one run listed on two nodes with one rank.'
    profile, stepping = False, False

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", q.shared,
            """Rank {{ $labels.rank }} of run {{ $labels.run }} is pushed by
            {{ $value | printf "%.0f" }} jobs at once.""")]

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        seen = shared_ranks(ranks, t)
        return {id(r): f"rank {r.rank} is pushed from {', '.join(sorted(seen[r.rank]))} at "
                       "once: two jobs share the run's name"
                for r in ranks if r.rank in seen and alive(r, t)}


def shared_ranks(ranks: list[RankReport], t: dict[str, float]) -> dict[str, set[str]]:
    """Of one run's ranks, those live on two or more exporters at once: {rank: instances}."""
    where: dict[str, set[str]] = {}
    for r in ranks:
        if alive(r, t):
            where.setdefault(r.rank, set()).add(r.instance)
    return {rank: at for rank, at in where.items() if len(at) > 1}


class RunRestarting(Heuristic):
    alert, verdict, kind = "GpuTrainRunRestarting", "restarting", "health"
    severity, for_ = "warning", "0m"
    summary = "A rank's process keeps being replaced: a crash loop makes no progress."
    advice = ("Read the first failure of the loop (the job's log, `kubectl logs --previous`, "
              "`dmesg` for the OOM killer; an NCCL timeout or a CUDA error) and fix it before "
              "restarting again; checkpoint often enough that a restart loses little.")
    fires_when = ("a rank's process replaced >= {restarts_per_hour} times in {restart_window} "
                  "while the rank still reports")
    why = ("The rank's counters reset {restarts_per_hour} or more times in {restart_window} "
           "(each reset is a new process under the same run and rank: torchrun's "
           "`--max-restarts`, a Kubernetes restart policy) while the run goes on. A crash "
           "loop makes no progress however fast each attempt steps, and rates across a "
           "restart are no bottleneck: no other advice is given for a window that straddles "
           "a restart.")
    confirm = ("gputrain_training_steps_total", "gputrain_training_process_cpu_seconds_total")
    panel = ('GpuTrain / Run, "Samples per second": the series drops to zero and starts '
             'again, time after time.')
    profile, stepping = False, False
    thresholds = {"restarts_per_hour": Threshold(
        3.0, "count", "torchrun's default --max-restarts loops reported in the Kubeflow and "
                       "torchelastic trackers: 3 restarts in an hour is a loop, one is not")}

    def rules(self, q: Q) -> list[dict]:
        live = f"max by ({q.rank}) ({q.metric('gputrain_training_steps_total')})"  # reporting
        return [self.rule(q, "warning", f"""{restarts(q.s, q.ids, WINDOWS['restart'])}
                          >= {q.t['restarts_per_hour']} and on ({q.rank}) {live}""",
                          f"""{q.who}: its process was replaced {{{{ $value | printf "%.0f" }}}}
                          times in {WINDOWS['restart']}.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        if _v(r.restarts, ">=", t["restarts_per_hour"]):
            return f"its process was replaced {r.restarts:.0f} times in {WINDOWS['restart']}"
        return None


class RunVanished(Heuristic):
    alert, verdict, kind, scope, level = ("GpuTrainRunVanished", "vanished", "state", "run",
                                          "global")
    severity, for_ = "warning", "0m"
    compares_ranks = True
    summary = "A training run stopped without finishing: its ranks went silent, no goodbye."
    advice = ("The job was killed or crashed (OOM killer, preemption, a node failure, a "
              "SIGKILL or SIGTERM without close()): check the scheduler and the job's log, and "
              "resume from its last checkpoint.")
    fires_when = ("every rank of a run silent for {vanished_seconds} without a goodbye, and its "
                  "GPUs busy < {vanished_gpu_idle} over {recent_window}")
    why = ("Every rank of the run stopped pushing at least {vanished_seconds} ago without the "
           "goodbye a clean close() sends, and none of its GPUs was busy {vanished_gpu_idle} or "
           "more of the last {recent_window}: the processes are gone, not hung (a hung rank "
           "still pushes, and is stalled). A run that closes cleanly is finished, never "
           "vanished. A rank that died is not forgotten with its series: after "
           "--ingest.ttl (10 m) the exporter keeps its end (its last push, no goodbye) for "
           "--ingest.dead-ttl (1 h by default), so the alert, the status page, `top` and "
           "`diagnose` keep saying the run died (a restarted exporter too, with "
           "--ingest.state-file); the status page shows it as stopped without "
           "finishing, and judges nothing else of it. A rank whose process the exporter of "
           "its node still finds running is frozen, not gone: `GpuTrainRunHung`.")
    confirm = (series_of("seconds_since_push"),
               series_of("finished"),
               series_of("recent_busy"))
    panel = 'GpuTrain / Run, "Samples per second" falls to zero and "GPU busy" with it.'
    profile, stepping = False, False
    thresholds = {
        "vanished_seconds": Threshold(
            120, "seconds", "24 missed pushes at the client's 5 s interval (a goodbye "
                            "rank's totals stay 60 s)"),
        "silent_seconds": Threshold(
            60, "seconds", "a rank not heard from this long is judged on none of its steps "
                           "(its rates fall on its last counters): twice alive_seconds, as "
                           "the rules see a push up to a scrape, a liveness interval and a "
                           "push interval late, so a late scrape never pauses a live rank's "
                           "alerts"),
        "vanished_gpu_idle": Threshold(0.05, "ratio", "an idle GPU: no process of the run "
                                                      "left on it")}

    def rules(self, q: Q) -> list[dict]:
        t, run, rank = q.t, q.run, q.rank
        silent = f"time() - {series_of('seconds_since_push')}"
        return [self.rule(q, "warning", f"""max by ({run}) (
              {silent} > {t['vanished_seconds']}
              unless on ({rank}) ({series_of('finished')} > 0
                                   or {series_of('exit')}))
            unless on ({run}) (min by ({run}) ({silent}) <= {t['vanished_seconds']})
            unless on ({run}) (max by ({run}) ({series_of('recent_busy')})
              >= {t['vanished_gpu_idle']})
            unless on ({run}) group by ({run}) ({series_of('process_running')} > 0)""",
            """Every rank of run {{ $labels.run }} stopped pushing without a goodbye
            {{ $value | humanizeDuration }} ago, and its GPUs are idle.""")]

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        limit = t["vanished_seconds"]
        if not ranks or any(r.seconds_since_push is None or r.seconds_since_push <= limit
                            for r in ranks):
            return {}
        busy = [r.recent_busy for r in ranks if r.recent_busy is not None]
        if (busy and max(busy) >= t["vanished_gpu_idle"]) or \
                any(r.process_running and not r.ended for r in ranks):
            return {}  # a process of it still runs (frozen: GpuTrainRunHung)
        return {id(r): f"stopped without finishing {_ago(r.seconds_since_push)} ago: no "
                       "push and no goodbye since, its GPUs idle"
                for r in ranks if not r.ended}


def _ago(seconds: float | None) -> str:
    """A duration for people: ``45 s``, ``3 min``, ``2.5 h`` (``?`` where unknown)."""
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# --- the pipeline, from its input to its output: the first that holds is the verdict -------


def alive(r: RankReport, t: dict[str, float]) -> bool:
    """The rank's process lives: it pushed within ``alive_seconds`` (its pusher thread runs
    in it) and has not said goodbye. Only a live rank is judged hung or stalled: a dead
    rank's old steps say nothing of now."""
    return not r.ended and _v(r.seconds_since_push, "<", t["alive_seconds"] + 1e-9)


def typical_step(r: RankReport) -> float | None:
    """The pace a rank's step in progress is judged against: its process's mean step so far,
    from its counters alone (the window's mean weighs the open step in, and a pace that
    holds the step it judges would never call it long); None before its first step."""
    x = r.typical_step_seconds
    return x if x is not None and x > 0 else None


def waiting(r: RankReport) -> bool:
    """The rank's last stacks show it waiting for a peer: in a collective, a barrier or the
    rendezvous (``gputrain_training_stack_location``, while its step count has not moved)."""
    return any(where in WAITING for where in r.location)


def hang_ceiling(timeout: float | None, t: dict[str, float]) -> float:
    """A rank's hang ceiling, in seconds: ``hung_max_seconds``, and at most
    ``hung_timeout_share`` of its process groups' collective timeout where its client pushes
    it (``timeout``): a job that sets a timeout shorter than NCCL's 10 minutes is still told
    hung, and its stacks taken, before the watchdog ends it."""
    if timeout is not None and timeout > 0:  # 0 is no timeout a process group takes
        return min(t["hung_max_seconds"], t["hung_timeout_share"] * timeout)
    return t["hung_max_seconds"]


def ceiling_of(r: RankReport, t: dict[str, float]) -> float:
    """The rank's hang ceiling (:func:`hang_ceiling`), in seconds."""
    return hang_ceiling(r.collective_timeout, t)


def hung_limit(r: RankReport, t: dict[str, float]) -> float:
    """How long a rank's step may run before it is hung, in seconds: ``hung_step_factor``
    times its typical step, no less than ``hung_min_seconds`` and no more than its ceiling
    (:func:`ceiling_of`: ``hung_max_seconds``, or less before a short collective timeout),
    and never under ``hung_slowest_factor`` times it (a run of minutes-long steps); before
    its first step, ``hung_first_step_seconds`` (compilation, warm-up), or its ceiling where
    its stacks show it waiting (:func:`waiting`: for a peer that never came; the exporter
    takes them once its first step passes that ceiling)."""
    typical = typical_step(r)
    ceiling = ceiling_of(r, t)
    if typical is None:
        return ceiling if waiting(r) else t["hung_first_step_seconds"]
    limit = min(max(t["hung_step_factor"] * typical, t["hung_min_seconds"]), ceiling)
    return max(limit, t["hung_slowest_factor"] * typical)


def start_past_ceiling(r: RankReport, t: dict[str, float]) -> bool:
    """A live rank whose DataLoader's start (the phase ``wrap()`` declares from ``iter()`` to
    an epoch's first batch) has run past its ceiling (:func:`ceiling_of`)."""
    return alive(r, t) and _v(r.phase_in_progress.get(LOADER_START_PHASE), ">",
                              ceiling_of(r, t))


def stuck_starts(ranks: list[RankReport], t: dict[str, float]) -> set[int]:
    """The ranks of a run (their ``id``) whose DataLoader's start is a hang, not a phase to
    wait for: past its ceiling (:func:`ceiling_of`) while a live peer's stacks show it
    waiting in a collective (for them: NCCL's watchdog knows no phase). A start is no
    declaration of the user's: workers that never start, or a first read that never returns,
    hold the run as a read inside a step does. Where no peer is seen waiting (every rank starting its workers
    slowly), the phase's own limit holds."""
    stuck = {id(r) for r in ranks if start_past_ceiling(r, t)}
    if stuck and any(alive(r, t) and waiting(r) for r in ranks if id(r) not in stuck):
        return stuck
    return set()


def phase_past_ceiling(r: RankReport, t: dict[str, float]) -> bool:
    """A live rank whose declared phase in progress (an evaluation, a checkpoint, a
    DataLoader's start) has run past its ceiling (:func:`ceiling_of`)."""
    return alive(r, t) and any(_v(seconds, ">", ceiling_of(r, t))
                               for seconds in r.phase_in_progress.values())


def cannot_join(r: RankReport, t: dict[str, float]) -> bool:
    """A rank of a run that can join no collective any more: not live (silent, stopped,
    failed, exited) and not finished cleanly."""
    return not alive(r, t) and not r.finished


def stuck_phases(ranks: list[RankReport], t: dict[str, float]) -> set[int]:
    """The ranks of a run (their ``id``) whose declared phase is a hang, not work to wait
    for: past its ceiling (:func:`ceiling_of`) the rank's own stacks show it waiting in a
    collective (one its peers never join: an all-gather only it calls in its evaluation, a
    barrier in its checkpoint that the others passed), while a live peer outside any phase waits in a
    collective too, or a rank of the run can join none any more (:func:`cannot_join`: it
    died, or froze, inside the evaluation every rank was in). Nobody works: each waits for
    another. A phase whose rank works in its own code (a checkpoint's write) holds its run to
    the phase's own limit, and so does a run whose every rank is in a phase and alive (one
    dump is one instant: an evaluation that syncs its metrics each batch can be caught inside
    a collective on every rank)."""
    stuck = [r for r in ranks if phase_past_ceiling(r, t) and waiting(r)]
    # a rank that ended inside the phase: one that ended before it (an earlier attempt of
    # the run, remembered an hour) is no peer of this collective
    opened = max((max(r.phase_in_progress.values(), default=0.0) for r in ranks),
                 default=0.0)
    if stuck and any((alive(r, t) and waiting(r) and not r.phase_in_progress)
                     or (cannot_join(r, t) and _v(r.seconds_since_push, "<=", opened))
                     for r in ranks):
        return {id(r) for r in stuck}
    return set()


def phases_past_ceiling(ranks: list[RankReport], t: dict[str, float]) -> bool:
    """A run whose live ranks are each hung or in a declared phase past the ceiling, with a
    DataLoader's start among them, or another phase beside a hung rank outside any or a rank
    that can join no collective (:func:`cannot_join`): whether the others wait for that
    phase, and whether it waits for them, only their stacks can tell (the exporter takes them
    then, as for :func:`first_steps_past_ceiling`)."""
    live = [r for r in ranks if alive(r, t)]
    if not live or not all(phase_past_ceiling(r, t) or rank_hung(r, t) for r in live):
        return False
    return any(start_past_ceiling(r, t) for r in live) or (
        any(phase_past_ceiling(r, t) for r in live) and (
            any(rank_hung(r, t) for r in live) or any(cannot_join(r, t) for r in ranks)))


def first_steps_past_ceiling(ranks: list[RankReport], t: dict[str, float]) -> bool:
    """Every live rank of a run is still in its first step, past its ceiling
    (:func:`ceiling_of`), outside any declared phase: whether it hangs or compiles only its
    stacks can tell (the exporter takes them then, :class:`exporter.serving.hangs.HangWatch`;
    :func:`hung_limit` reads them)."""
    live = [r for r in ranks if alive(r, t)]
    return bool(live) and not in_phase(ranks, t) and all(
        typical_step(r) is None and _v(r.step_in_progress, ">", ceiling_of(r, t))
        for r in live)


def rank_hung(r: RankReport, t: dict[str, float]) -> bool:
    """A live rank whose step in progress has run past :func:`hung_limit`, outside any
    declared phase."""
    return alive(r, t) and not r.phase_in_progress and \
        _v(r.step_in_progress, ">", hung_limit(r, t))


def in_phase(ranks: list[RankReport], t: dict[str, float]) -> list[RankReport]:
    """The live ranks of a run inside a declared phase (an evaluation, a checkpoint): the
    others wait for them, not hung; a phase that is a hang (:func:`stuck_starts`,
    :func:`stuck_phases`) is none."""
    stuck = stuck_starts(ranks, t) | stuck_phases(ranks, t)
    return [r for r in ranks if (alive(r, t) or running_silent(r, t)) and r.phase_in_progress
            and id(r) not in stuck and not frozen_hung(r, t)]


class RunHung(Heuristic):
    alert, verdict, kind, scope, level = "GpuTrainRunHung", "hung", "hang", "run", "global"
    severity, for_ = "critical", "0m"
    compares_ranks = True
    summary = ("A training run hung: its ranks make no step, far past their pace, while their "
               "processes live.")
    advice = ("Read where each rank is: the exporter took py-spy stacks of every rank when the "
              "run hung (the status page, `gputrain-exporter top`, `/api/v1/status`; a frozen "
              "rank, silent while its process runs, cannot be asked: `py-spy dump --native "
              "--pid` it on its node). The rank "
              "that is not waiting in a collective while its peers are holds the run: fix what "
              "holds it (a data set or storage read that blocks, a checkpoint write that hangs, "
              "a deadlock). Where every rank waits in a collective, a peer is gone or the "
              "network failed. Act before the collective's timeout (NCCL's watchdog: 10 "
              "minutes by default) ends the job.")
    fires_when = ("every live rank of a run has a step in progress over {hung_step_factor} its "
                  "typical step (its process's mean step) (at least {hung_min_seconds}, at most {hung_max_seconds}, never "
                  "under {hung_slowest_factor} it; {hung_first_step_seconds} before its first "
                  "step (no step yet counts from its process's start), {hung_max_seconds} where "
                  "its stacks show it waiting in a collective) while it pushes, and no rank of "
                  "the run is in a declared phase (a DataLoader's start past {hung_max_seconds} "
                  "while a peer waits in a collective is a hang, not a phase; so is any phase "
                  "past {hung_max_seconds} whose own rank's stacks show it waiting in a "
                  "collective while a peer outside any phase waits in one, or a rank of the run "
                  "that did not finish cleanly no longer pushes); a rank whose client pushes "
                  "its process groups' collective timeout has as its ceiling no more than "
                  "{hung_timeout_share} of it, in place of {hung_max_seconds}; a rank silent "
                  "past {vanished_seconds} and its ceiling while the exporter of its node "
                  "finds its process running (frozen) counts as hung, outside any declared "
                  "phase or in one past that ceiling")
    why = ("A live rank (it pushed in the last {alive_seconds}: its client's thread runs in the "
           "process) whose current step has run far past its own pace, outside any phase a "
           "client declares (an evaluation, a checkpoint, a DataLoader's start), is hung; a "
           "run is hung when every live rank is. The step in progress is aged by the "
           "exporter's own clock, so the verdict comes within about {hung_min_seconds} plus a "
           "scrape and an evaluation of the hang, long before NCCL's watchdog (a 10-minute "
           "collective timeout, an 8-minute heartbeat) kills the job and the evidence with it. "
           "When a run turns hung, each node's exporter dumps its ranks' stacks (py-spy, with "
           "native frames: a wait inside a C++ collective shows as one) and classifies where "
           "each is: in a collective, loading data, in checkpoint I/O, in evaluation, "
           "computing, elsewhere (`gputrain_training_stack_location`). The culprit is the rank "
           "not waiting in a collective while its peers are. Before a run's first step there "
           "is no pace, and compiling a large model takes minutes: each rank gets "
           "{hung_first_step_seconds} (a rank that has made no step yet is in its first since "
           "its process started: a barrier, a broadcast or the rendezvous before the first "
           "batch is part of it), unless the stacks the exporter takes once every live rank's "
           "first step has passed {hung_max_seconds} show it waiting in a collective (a peer "
           "that never came to the first all-reduce or barrier): then it is held to "
           "{hung_max_seconds} like any rank, and the run is said hung before the watchdog. "
           "A rank in its own code, compiling (its stack in torch's compiler), reading data "
           "or loading a checkpoint keeps its allowance (a slow read looks the same as one "
           "that hangs), and so does its run. Ranks that wait for a peer in a "
           "declared phase are waiting, not hung, until that phase's own limit "
           "(`GpuTrainStalled`). A DataLoader's start is the client's declaration, not the "
           "user's: past {hung_max_seconds}, while the other live ranks' steps have stopped, "
           "the exporter takes the run's stacks, and where a peer waits in a collective for it "
           "the start is a hang like a read inside a step (workers that never start, a first "
           "read that never returns). Any declared phase is a hang once its own rank's stacks, "
           "taken past {hung_max_seconds}, show it waiting in a collective while a peer "
           "outside any phase waits in one (an all-gather only rank 0 calls in its "
           "evaluation), or a rank of the run can join none any more (it died or froze inside "
           "the evaluation every rank was in): nobody works. A phase whose rank works (a "
           "checkpoint's write) holds, and so does a run whose every rank is in a phase and "
           "alive: one dump is one instant, and an "
           "evaluation that syncs its metrics each batch can be caught in a collective on "
           "every rank. A job that sets its own collective timeout "
           "(init_process_group(timeout=...), a framework's setting) is killed at it, not at "
           "NCCL's 10 minutes: the client pushes the shortest of its process groups' timeouts "
           "(gputrain_training_collective_timeout_seconds) and every ceiling above is then "
           "no more than {hung_timeout_share} of it (a 2-minute timeout: hung at 1 minute), "
           "the floor too where it is lower. A rank that stops pushing while its process "
           "runs (the exporter of its node finds it in its /proc, "
           "gputrain_training_process_running) is frozen: native code that holds the GIL (an "
           "extension's blocking call, a deadlock) stops every Python thread, the client's "
           "and the loop's alike, so nothing it pushes can tell. It is never vanished, as its "
           "process lives; past its ceiling of silence ({hung_max_seconds}, or the share of a "
           "pushed collective timeout: it has no pace, and a client cut off from the exporter "
           "that long, its pushes refused or its address wrong, is rare and says so in its "
           "log) it counts as hung, a declared phase it froze in keeping its allowance from "
           "its first silence, and its run is hung when its live ranks are too.")
    confirm = ("gputrain_training_step_in_progress_seconds",
               "gputrain_training_stack_location")
    panel = 'GpuTrain / Run, "Samples per second" at zero while every rank still pushes.'
    profile, stepping = False, False
    thresholds = {
        "hung_step_factor": Threshold(
            10.0, "factor", "a step ten times the rank's typical one is no jitter: garbage "
                            "collection, a recompilation or a slow batch stay well under it"),
        "hung_min_seconds": Threshold(
            60, "seconds", "the floor: a hang is said within 2 minutes at a 15 s scrape and "
                           "evaluation, long before NCCL's 10-minute collective timeout"),
        "hung_max_seconds": Threshold(
            300, "seconds", "the ceiling, well under NCCL's watchdog (TORCH_NCCL_HEARTBEAT_"
                            "TIMEOUT_SEC 480 s, a 600 s collective timeout): the stacks are "
                            "taken while the evidence lives"),
        "hung_timeout_share": Threshold(
            0.5, "ratio", "a rank whose client pushes its process groups' collective timeout "
                          "is held to this share of it where that is under hung_max_seconds "
                          "(a job that sets a 2-minute timeout is told hung at 1 minute): "
                          "half the watchdog's time is left to read the stacks and act"),
        "hung_slowest_factor": Threshold(
            2.0, "factor", "a run of minutes-long steps: a step is hung only past twice its "
                           "typical one, whatever the ceiling"),
        "hung_first_step_seconds": Threshold(
            1800, "seconds", "before the first step there is no pace: torch.compile, "
                             "warm-up and the checkpoint load of a large model take minutes "
                             "(our choice); GpuTrainStalled grants it too; a rank whose stacks "
                             "show it waiting in a collective is held to hung_max_seconds "
                             "instead"),
        "alive_seconds": Threshold(
            30, "seconds", "6 missed pushes at the client's 5 s interval: its process is "
                           "gone or stopped"),
    }

    def rules(self, q: Q) -> list[dict]:
        t, run, rank = q.t, q.run, q.rank
        ceiling = q.ceiling
        floored = f"clamp_min({t['hung_step_factor']} * {TYPICAL}, {t['hung_min_seconds']})"
        clamped = f"(({floored} < {ceiling}) or ({ceiling} and {TYPICAL}))"
        slowest = f"{t['hung_slowest_factor']} * {TYPICAL}"
        # before its first step: the ceiling where its stacks show it waiting (waiting())
        limit = (f"(({slowest} > {clamped}) or {clamped} "
                 f"or ({OPEN} * 0 + {ceiling} and on ({rank}) {STACK_WAITING}) "
                 f"or {OPEN} * 0 + {t['hung_first_step_seconds']})")
        live = q.alive
        hung = f"({OPEN} > {limit} and on ({rank}) {live})"
        # a DataLoader's start past the ceiling while a live peer waits in a collective
        # (stuck_starts): a hang, not a phase to wait for
        started = f"({LOADER_START} > {ceiling} and on ({rank}) {live})"
        stuck = (f"({started} and on ({run}) group by ({run}) "
                 f"({STACK_WAITING} and on ({rank}) {live} unless on ({rank}) {started}))")
        # a declared phase past the ceiling whose rank waits in a collective, while a live
        # peer outside any phase waits in one too (stuck_phases): nobody works
        phase = series_of("phase_in_progress")
        waits = (f"(max by ({rank}) ({phase}) > {ceiling} "
                 f"and on ({rank}) {STACK_WAITING} and on ({rank}) {live})")
        # ... or a rank of the run can join no collective any more (cannot_join), since the
        # phase opened
        last = series_of("seconds_since_push")
        gone = (f"((time() - {last} <= on ({run}) group_left () max by ({run}) ({phase})) "
                f"and on ({rank}) (time() - {last} > {t['alive_seconds']} "
                f"or {series_of('exit')}) unless on ({rank}) {series_of('finished')} > 0)")
        stuck_phase = (f"({waits} and on ({run}) (group by ({run}) "
                       f"({STACK_WAITING} and on ({rank}) {live} unless on ({rank}) {phase}) "
                       f"or group by ({run}) ({gone})))")
        # a frozen rank (silent while its process runs), past its phase's ceiling if in one
        cold = (f"({q.frozen} > {ceiling} unless on ({rank}) "
                f"(max by ({rank}) ({phase}) <= {ceiling}))")
        culprit = (series_of("location") + '{run=%q, '
                   'location!=\\"collective\\"}')
        return [self.rule(q, "critical", f"""count by ({run}) (max by ({rank}) (
              {hung} or {stuck} or {stuck_phase} or {cold}))
            >= count by ({run}) ({live} or {cold})
            unless on ({run}) count by ({run}) (
              ({phase}
               unless on ({rank}) ({stuck} or {stuck_phase} or {cold}))
              and on ({rank}) ({live} or {series_of('process_running')} > 0))""",
            f"""Run {{{{ $labels.run }}}} hung: {{{{ $value | printf "%.0f" }}}} rank(s)
            made no step far past their pace, live or frozen.{{{{ range printf "{culprit}" $labels.run | query }}}}
            Rank {{{{ .Labels.rank }}}} on {{{{ .Labels.instance }}}} is in
            `{{{{ .Labels.function }}}}` ({{{{ .Labels.location }}}}).{{{{ end }}}}""")]

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        live = [r for r in ranks if alive(r, t)]
        # frozen past its ceiling; one not yet is silent, as any peer the live ones may wait
        # for (in a phase, in_phase holds the run)
        cold = [r for r in ranks if frozen_hung(r, t)]
        starts, phases = stuck_starts(ranks, t), stuck_phases(ranks, t)
        if not (live or cold) or in_phase(ranks, t) or \
                not all(id(r) in starts or id(r) in phases or rank_hung(r, t) for r in live):
            return {}
        line = hang_line(live, [r for r in ranks if not alive(r, t)])

        def reason(r: RankReport) -> str:
            ceiling = f"past {ceiling_of(r, t):.0f} s"
            if id(r) in starts:
                return (f"its DataLoader's start has run "
                        f"{r.phase_in_progress[LOADER_START_PHASE]:.0f} s ({ceiling}) while "
                        f"its peers wait; {line}")
            if id(r) in phases:
                phase, seconds = next(iter(r.phase_in_progress.items()))
                return (f"waits in a collective inside its {phase} phase, open {seconds:.0f} s "
                        f"({ceiling}), for peers that wait too or are gone; {line}")
            return (f"no step for {r.step_in_progress:.0f} s (its pace allows "
                    f"{hung_limit(r, t):.0f} s); {line}")

        out = {id(r): reason(r) for r in live}
        for r in cold:
            others = hang_line(live, [x for x in ranks if not alive(x, t) and x is not r])
            out[id(r)] = (f"no push for {_ago(r.seconds_since_push)} while its process runs on "
                          "its node: frozen (native code that holds the GIL stops its "
                          "client's thread with its loop; `py-spy dump --native` of its "
                          "process shows where), or its client cannot reach the exporter "
                          "(its log says so)" + (f"; {others}" if others else ""))
        # a rank of the run that went silent without a goodbye is part of the hang (the
        # alert is the run's): the peer the live ones wait for, gone mid-step
        out.update({id(r): f"silent for {_ago(r.seconds_since_push)} without a goodbye while "
                           "its run's live ranks hang: they may wait for it"
                    for r in ranks if not alive(r, t) and not r.ended and id(r) not in out})
        return out


def hang_line(ranks: list[RankReport], others: list[RankReport] | None = None) -> str:
    """Where a hung run's ranks are, in one line that names the culprit (see
    :func:`exporter.heuristics.location.culprit_line`): from each rank's capture, or
    "stacks being captured" before any is in; then the run's ranks that no longer run
    (``others``): those that went silent without a goodbye (killed outright, or frozen) and
    those that finished first (uneven inputs), each the peer the others may wait for."""
    parts = [_placed_line(ranks)] if ranks else []  # (frozen ranks take no stacks here)
    silent = [r for r in others or () if not r.ended and not r.process_running]
    running = [r for r in others or () if not r.ended and r.process_running]
    ended = [r for r in others or () if r.ended and not r.finished]
    finished = [r for r in others or () if r.finished]
    for group, what in ((silent, "not pushed for {ago}, without a goodbye: gone or frozen, "
                                 "the peer they may wait for"),
                        (running, "not pushed for {ago} while the process runs: frozen "
                                  "or cut off, the peer they may wait for"),
                        (ended, "ended {ago} ago without finishing ({how}): the peer they may "
                                "wait for"),
                        (finished, "finished {ago} ago, before the others: they may wait for "
                                   "{them} in a collective (uneven inputs: a rank that ran out "
                                   "of batches first)")):
        if group:
            ago = _ago(max(r.seconds_since_push or 0.0 for r in group))
            one = len(group) == 1
            verb = ("has " if one else "have ") if group is silent or group is running \
                else ""
            how = ", ".join(sorted({failure_text(r) for r in group}))
            parts.append(f"{rank_words(r.rank for r in group)} {verb}"
                         + what.format(ago=ago, them="it" if one else "them", how=how))
    return "; ".join(parts)


def _placed_line(ranks: list[RankReport]) -> str:
    found = []
    for r in ranks:
        if r.location:
            where, function = next(iter(r.location)), r.location_detail or ""
            # the collective, from the function label: ranks in different ones took
            # different code paths (a barrier, an all-gather only one rank calls)
            found.append((r.rank, r.instance, Location(
                location=where, function=function,
                collective=collective_named(function) if where == "collective" else None)))
    if not found:
        return "its ranks' stacks are being captured"
    return culprit_line(found).line


class Stalled(Heuristic):
    alert, verdict, scope, level = "GpuTrainStalled", "stalled", "run", "global"
    severity, for_ = "critical", "1m"
    compares_ranks = True
    summary = "A live rank has made no step for a long time, or is stuck in a phase."
    advice = ("Look for a hang in a collective, a dead DataLoader worker, a deadlock or an "
              "evaluation or checkpoint that never ends (py-spy dump --pid, or "
              "`gputrain-exporter profile --stacks --dump`).")
    fires_when = ("a live rank's step in progress over {stalled_seconds} "
                  "({hung_first_step_seconds} before its first step) outside any phase "
                  "while no live rank of its run is in a declared phase under "
                  "{stalled_in_phase_seconds}, or its declared phase (an evaluation, a "
                  "checkpoint) open for {stalled_in_phase_seconds}")
    why = ("The long cases, rank by rank: a live rank (pushing) whose step in progress has run "
           "{stalled_seconds} whatever its peers do ({hung_first_step_seconds} before its "
           "first step, as `GpuTrainRunHung` grants: compiling or loading a large model takes "
           "minutes), or whose declared phase outside steps (a "
           "client pushes an evaluation or checkpoint while it lasts) has run "
           "{stalled_in_phase_seconds}: a hang inside it. A run whose ranks all hang is said "
           "sooner, as `GpuTrainRunHung`; ranks waiting for a peer's phase are waiting until "
           "that phase passes its limit (a rank is judged within its run: the rule is global, so "
           "a peer's phase on another node counts). A rank that stopped pushing is no stall: "
           "it died "
           "(`GpuTrainRunVanished`, `GpuTrainRunFailed`). Nothing else is said of a stalled "
           "rank: with no step, no tuning advice holds.")
    confirm = ("gputrain_training_step_in_progress_seconds",
               "gputrain_training_phase_in_progress_seconds")
    panel = 'GpuTrain / Run, "Samples per second" at zero while the rank is still listed.'
    profile, stepping = False, False
    stacks = "dump"  # where is it stuck: a collective, a lock, a dead worker
    thresholds = {
        "stalled_seconds": Threshold(600, "seconds", "no step for 10 minutes"),
        "stalled_in_phase_seconds": Threshold(
            7200, "seconds", "an evaluation or checkpoint of over 2 hours is taken for a hang "
                             "inside it (our choice: set it above your longest)")}

    def rules(self, q: Q) -> list[dict]:
        t, run, rank = q.t, q.run, q.rank
        live = q.alive
        phase = series_of("phase_in_progress")
        # a live peer inside a declared phase, under its limit: the run's open steps wait
        waited = (f"count by ({run}) ({phase} <= {t['stalled_in_phase_seconds']} "
                  f"and on ({rank}) {live})")
        # before its first step (no typical step yet), the first step's allowance
        limit = (f"({TYPICAL} * 0 + {t['stalled_seconds']} "
                 f"or {OPEN} * 0 + {stalled_limit(None, t)})")
        return [self.rule(q, "critical", f"""(({OPEN}
                          > {limit} unless on ({rank}) {phase})
                          unless on ({run}) {waited}
                          or max by ({rank}) ({phase}) > {t['stalled_in_phase_seconds']})
                          and on ({rank}) {live}""",
                          f"""{q.who} made no step for {{{{ $value | humanizeDuration }}}}
                          although it still reports.""")]

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        limit = t["stalled_in_phase_seconds"]
        waited = any(alive(r, t) and r.phase_in_progress and
                     max(r.phase_in_progress.values()) <= limit for r in ranks)
        out: dict[int, str] = {}
        for r in ranks:
            if not alive(r, t):
                continue
            for phase, seconds in r.phase_in_progress.items():
                if seconds > limit:
                    out[id(r)] = f"in {phase} for {seconds:.0f} s"
            if id(r) not in out and not r.phase_in_progress and not waited and \
                    _v(r.step_in_progress, ">", stalled_limit(r, t)):
                out[id(r)] = f"no step for {r.step_in_progress:.0f} s"
        return out


class CollectiveTimeoutRisk(Heuristic):
    alert, verdict, kind, scope, level = ("GpuTrainCollectiveTimeoutRisk", "timeout-risk",
                                          "health", "run", "global")
    severity, for_ = "warning", "1m"
    summary = ("A live rank waits in a collective, its step open for minutes, for a peer "
               "that works: the collective's timeout will end the job.")
    advice = ("The peer the rank waits for works in its own code (a compilation, data "
              "prepared on one rank, an evaluation or a checkpoint on rank 0): when the wait "
              "reaches the process group's timeout (NCCL's watchdog: 10 minutes by default), "
              "the job ends. Do that work on every rank or before init_process_group, "
              "declare it and shorten it, or raise the timeout "
              "(init_process_group(timeout=timedelta(minutes=...))).")
    fires_when = ("a live rank outside any phase has had its step in progress over "
                  "{hung_max_seconds} (no more than {hung_timeout_share} of its pushed "
                  "collective timeout) while its stacks show it waiting in a collective, and "
                  "its run is not hung (`GpuTrainRunHung`'s condition)")
    why = ("A rank waiting in a collective for a peer that works (its stacks, which the "
           "exporter takes once steps or phases pass {hung_max_seconds}, place the peer in "
           "its own code) is no hang: `GpuTrainRunHung` keeps a first step's allowance for a "
           "compilation, and a declared phase's for a checkpoint. The collective does not: "
           "NCCL's watchdog ends the job when a wait reaches the process group's timeout (10 "
           "minutes by default; gloo's is 30), long before a first step's or a phase's limit "
           "(`GpuTrainStalled`). Said past {hung_max_seconds}, minutes before that, with the "
           "rank that holds the others named; where the client pushes a shorter timeout, past "
           "{hung_timeout_share} of it. A run that is hung is `GpuTrainRunHung` "
           "instead.")
    confirm = ("gputrain_training_step_in_progress_seconds",
               "gputrain_training_stack_location")
    panel = 'GpuTrain / Run, "Samples per second" at zero while every rank still pushes.'
    profile, stepping = False, False

    def rules(self, q: Q) -> list[dict]:
        rank = q.rank
        phase = series_of("phase_in_progress")
        hung = RunHung().rules(q)[0]["expr"]  # the run's hang, as its own alert says it
        return [self.rule(q, "warning", f"""(({OPEN} > {q.ceiling}
              unless on ({rank}) {phase})
            and on ({rank}) {STACK_WAITING} and on ({rank}) {q.alive})
            unless on ({q.run}) ({hung})""",
            f"""{q.who} has made no step for {{{{ $value | humanizeDuration }}}} and its
            stacks place it in a collective, waiting for a peer that works: the collective's
            timeout will end the job.""")]

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        live = [r for r in ranks if alive(r, t)]
        waits = [r for r in live if not r.phase_in_progress and waiting(r)
                 and _v(r.step_in_progress, ">", ceiling_of(r, t))]
        if not waits or RunHung().holds_run(ranks, t):
            return {}
        line = _placed_line(live)
        return {id(r): (f"waits in a collective, no step for {_ago(r.step_in_progress)}: "
                        f"{line}; {timeout_text(r)} will end the job") for r in waits}


def timeout_text(r: RankReport) -> str:
    """The collective timeout that ends a rank's job, as a phrase: its own where its client
    pushes it, else NCCL's default."""
    if r.collective_timeout:
        return f"its process group's timeout ({_ago(r.collective_timeout)})"
    return "the collective's timeout (NCCL's: 10 min by default)"


def stalled_limit(r: RankReport | None, t: dict[str, float]) -> float:
    """How long a live rank's step may run outside any phase before it is stalled, in
    seconds: ``stalled_seconds``, and before its first step (``r`` None: the rule's case) no
    less than the first step's allowance, ``hung_first_step_seconds``."""
    if r is not None and typical_step(r) is not None:
        return t["stalled_seconds"]
    return max(t["stalled_seconds"], t["hung_first_step_seconds"])


class RunFailed(Heuristic):
    alert, verdict, kind, scope, level = ("GpuTrainRunFailed", "failed", "state", "run",
                                          "global")
    severity, for_ = "critical", "0m"
    summary = ("A training run failed: a rank's process ended by an exception or a signal, or "
               "died without a goodbye.")
    advice = ("Read the failure the rank names (the job's log has its traceback: a "
              "collective's timeout, an out-of-memory, a CUDA error), fix it, and resume from "
              "the last checkpoint. A SIGTERM is the scheduler's (a preemption or a time "
              "limit: requeue the job) or a launcher's ending the ranks after another failed "
              "(torchrun: read the rank that failed first). A rank that timed out in a "
              "collective often waited for another: read where its peers were when the run "
              "hung.")
    KILLED_ADVICE = ("The process was killed outright, so the job's log ends without a "
                     "traceback: read the node's kernel log (`journalctl -k`, `dmesg`: an OOM "
                     "kill or a segfault names the process) and the scheduler's record "
                     "(Kubernetes: the pod's last state; Slurm: `sacct`'s State and ExitCode; "
                     "an abort by NCCL's watchdog leaves its timeout in the job's log), fix "
                     "it, and resume from the last checkpoint.")
    OOM_ADVICE = ("The kernel's OOM killer most likely ended it (it killed a process on the "
                  "node as this one died: `journalctl -k` names the victim): the node's "
                  "memory, or its container's limit, ran out. Give the job more host "
                  "memory, or use less: fewer DataLoader workers or a smaller "
                  "prefetch_factor, a data set memory-mapped rather than copied into each "
                  "worker; then resume from the last checkpoint.")
    fires_when = ("a rank's client said its process ended by an exception or a signal, or the "
                  "exporter saw its process die without a goodbye")
    why = ("The client tells a clean end (the user's close(), the loop run out, a normal "
           "exit) from a failure (an exception nobody caught, which includes a collective's "
           "timeout; a SIGTERM or SIGHUP): a failed rank is never \"finished\". The exporter "
           "says which exception or signal ended it (`gputrain_training_exit_info`) for "
           "--ingest.ttl (10 m) with its counters, then for --ingest.dead-ttl (1 h by "
           "default) with its end alone: the alert holds on that long, across a restart of "
           "the exporter too where it keeps its ranks in --ingest.state-file (the shipped "
           "systemd unit, DaemonSet and compose file do). A process killed outright "
           "(SIGKILL, the OOM killer, an abort such as NCCL's watchdog's, a crash in native "
           "code) says nothing; where the exporter has seen it run in its own /proc (the same "
           "PID namespace: a daemon on the node's host, or with hostPID) it finds it gone "
           "within seconds and calls it failed, reason `killed`, detail `OOMKilled` where the "
           "node's OOM kill count grew since its last push (a likely cause: the count is the "
           "node's). A process it cannot see is "
           "`GpuTrainRunVanished` once its pushes stop.")
    confirm = ("gputrain_training_failed", "gputrain_training_exit_info")
    panel = 'GpuTrain / Run, "Samples per second" falls to zero.'
    profile, stepping = False, False

    def rules(self, q: Q) -> list[dict]:
        exits = series_of("exit")
        return [self.rule(q, "critical", f"""max by ({q.run}, rank) (
              {series_of('failed')} > 0)""",
            f"""Rank {{{{ $labels.rank }}}} of run {{{{ $labels.run }}}} ended by a failure{{{{ range
            printf "{exits}{{run=%q, rank=%q}}"
            $labels.run $labels.rank | query }}}}: {{{{ .Labels.reason }}}}
            {{{{ .Labels.detail }}}}{{{{ end }}}}.""")]

    def advice_for(self, r: RankReport) -> str:
        if KILLED_EXIT in r.exit:
            return self.OOM_ADVICE if r.exit_detail == OOM_KILLED else self.KILLED_ADVICE
        return self.advice

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        return {id(r): f"ended by {failure_text(r)}" for r in ranks if r.failed}


def failure_text(r: RankReport) -> str:
    """How a failed rank ended, in words: ``an exception (RuntimeError)``."""
    reason = next(iter(r.exit), "a failure")
    if reason == KILLED_EXIT:
        if r.exit_detail == OOM_KILLED:
            return ("the OOM killer, most likely (OOMKilled: its process died without a "
                    "goodbye as the node's OOM kill count grew)")
        return ("a death without a goodbye: its process is gone (SIGKILL, an abort such as "
                "NCCL's watchdog's, a crash in native code, os._exit)")
    what = {"exception": "an exception", "signal": "a signal"}.get(reason, reason)
    return f"{what} ({r.exit_detail})" if r.exit_detail else what


class GPUShared(Heuristic):
    alert, verdict, scope = "GpuTrainGPUShared", "gpu-shared", "rank_gpu"
    severity, for_ = "warning", "10m"
    summary = "A GPU a run uses is busy with processes that are not the run's."
    advice = ("Find the other process: the GPU's row on the status page (its shares), "
              "`nvidia-smi` on the node, or its pod or job (gputrain_gpu_pod_info, "
              "gputrain_gpu_job_info). Move one of the jobs, or give each its own GPU (exclusive "
              "compute mode, MIG, the scheduler's GPU allocation).")
    fires_when = ("a GPU the run uses spends >= {gpu_foreign_busy} of its time busy with "
                  "processes no rank of the run owns, for {for}")
    why = ("The GPU's SMs were busy at least {gpu_foreign_busy} of the time with processes that "
           "no rank of the run owns: another job time-sliced onto it, a notebook, a process "
           "without the client (NVML's per-process utilisation, joined to the ranks by their "
           "process trees). Every step the run takes waits its turn. A run's own MFU and GPU "
           "busy still divide by the whole GPU.")
    confirm = (series_of("foreign"),
               RUN_GPU_BUSY,
               UNATTRIBUTED_BUSY)
    panel = 'GpuTrain / Overview, "GPU shares by run" (the unattributed band and the other runs).'
    # a run's share of a GPU: it holds while a rank of the run steps (on the run's labels)
    profile, stepping, run_stepping = False, False, True
    thresholds = {"gpu_foreign_busy": Threshold(
        0.1, "ratio", "time-slicing shares one GPU between processes; per-process GPU use is "
                      "dcgm-exporter's most asked-for feature "
                      "(https://github.com/NVIDIA/dcgm-exporter/issues/307)")}

    def rules(self, q: Q) -> list[dict]:
        run = q.run
        return [self.rule(q, "warning", f"""{series_of('foreign')} >= {q.t['gpu_foreign_busy']}
            and on ({run}) (sum by ({run}) ({q.steps}) > 0)""",
            f"""GPU {{{{ $labels.gpu }}}} on {q.where}, used by run {{{{ $labels.run }}}}, was busy
            {{{{ $value | humanizePercentage }}}} of the time with processes no rank of the run
            owns.""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if _v(g.foreign, ">=", t["gpu_foreign_busy"]):
            return f"busy {percent(g.foreign)} of the time with processes not this run's"
        return None


class PCIeLinkDegraded(Heuristic):
    alert, verdict, kind, scope = ("GpuTrainPCIeLinkDegraded", "pcie-link-degraded", "health",
                                   "gpu")
    severity, for_ = "warning", "10m"
    summary = "A busy GPU's PCIe link runs below its generation or width: trained down."
    advice = ("Reseat or replace the GPU's riser or cable, check the slot's BIOS PCIe settings "
              "(generation, bifurcation), or move the GPU to another slot; meanwhile its "
              "host-to-device copies run at the link's reduced speed.")
    fires_when = ("a GPU busy >= {pcie_degraded_busy_above} whose link ran below its maximum "
                  "generation x width for most of {rate_window} (its median reading), for "
                  "{for}")
    why = ("A GPU's PCIe link trains down when idle to save power (normal) and back up at "
           "the first transfer; one that runs below its maximum generation or width for most "
           "of {rate_window} while the GPU is at least {pcie_degraded_busy_above} busy is a "
           "hardware finding (a riser, a cable, a slot, BIOS settings): it halves or worse "
           "the host-to-device bandwidth. The link is judged by its median reading over the "
           "window, a share: a link that flaps, down two readings in three, is degraded "
           "(its best reading would hide it, and a `for:` on the raw gauge is reset by every "
           "good reading), while one dip in three is not. Host-to-device traffic is judged "
           "against the link at its best in the window, so a trained-down link shows as a "
           "copy bottleneck at its own speed.")
    confirm = ("gputrain_gpu_pcie_link_current_bytes_per_second",
               "gputrain_gpu_pcie_link_max_bytes_per_second")
    panel = ('GpuTrain / Node: `gputrain_gpu_pcie_link_current_bytes_per_second` against '
             '`..._max_...` while "GPU busy" is high; `nvidia-smi -q -d PCIE`.')
    profile = False
    thresholds = {"pcie_degraded_busy_above": Threshold(
        0.5, "ratio", "NVML's current link generation and width: a link trains down only "
                      "while idle, so a busy GPU's link below its maximum is a fault")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", f"""{gpu_series_of('pcie_link_typical')}
            < on ({q.ids.gpu}) {gpu_series_of('pcie_link_max')}
            and on ({q.ids.gpu}) {gpu_series_of('busy')}
              >= {q.t['pcie_degraded_busy_above']}""",
            f"""{q.node_gpu} is busy, but its PCIe link ran at
            {{{{ $value | humanize }}}}B/s for most of {WINDOWS['rate']} (the median reading),
            below its maximum.""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        now, best = g.pcie_link_typical, g.pcie_link_max
        if now is not None and best and now < best and \
                _v(g.busy, ">=", t["pcie_degraded_busy_above"]):
            return (f"busy {percent(g.busy)}, its PCIe link at {now / 1e9:.1f} GB/s of its "
                    f"{best / 1e9:.1f} GB/s")
        return None


class CPUQuotaBound(Heuristic):
    alert, verdict = "GpuTrainCPUQuotaBound", "cpu-quota-bound"
    severity, for_ = "warning", "10m"
    summary = "A training run is input-bound at its cgroup's CPU limit, on a node with CPUs idle."
    advice = ("Raise the pod's (or job's) CPU limit, or remove it; until then use fewer but "
              "busier DataLoader workers, and move augmentation to the GPU (DALI, GPU "
              "transforms).")
    fires_when = ("input-bound, the process tree at >= {cpu_quota_used} of its cgroup's CPU "
                  "allowance or throttled >= {cpu_throttled_high} of the time, node CPUs under "
                  "{cpu_saturated}")
    why = ("Input-bound while the rank's process tree (its DataLoader workers) uses "
           "{cpu_quota_used} or more of the CPUs its cgroup allows (cgroup v2 `cpu.max`, "
           "cpuset), or the kernel throttles it {cpu_throttled_high} or more of the time "
           "(`cpu.stat`), and the node's CPUs are not saturated: a run has the CPUs its cgroup "
           "gives it, not the node's, and a pod limited to a few cores starves its loaders on "
           "an idle node. More workers only share the same quota.")
    confirm = (series_of("cpu_allowance_used"),
               series_of("cpu_throttled"))
    panel = ('GpuTrain / Run, "Data wait" and "Training processes" (the cores the DataLoader '
             'workers use) against `gputrain_training_process_cpu_allowance_cores`.')
    thresholds = {
        "cpu_quota_used": Threshold(0.9, "ratio", "as a saturated node: a TensorFlow performance "
                                                  "study, preprocessing case, of the allowance"),
        "cpu_throttled_high": Threshold(
            0.1, "ratio", "CFS throttling of DataLoader workers in CPU-limited pods "
                          "(Kubernetes CPU limits: cpu.stat throttled time)")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [self.rule(q, "warning", f"""({q.wait} >= {t['input_bound']})
            and on ({q.rank}) ({series_of('cpu_allowance_used')}
                 >= {t['cpu_quota_used']}
               or {series_of('cpu_throttled')}
                 >= {t['cpu_throttled_high']})
            and on ({q.node}) {q.unrefined(REFINED['cpu_busy'], 'cpu_saturated')}""",
            f"""{q.who} waits {{{{ $value | humanizePercentage }}}} of each step for data while
            its process tree is at its cgroup's CPU limit (or throttled) and the node's CPUs are
            not saturated.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        used, throttled, cpu = r.cpu_allowance_used, r.cpu_throttled, r.host.get("cpu_busy")
        if _v(r.data_wait_ratio, ">=", t["input_bound"]) and \
                unrefined(r, "cpu_busy", "cpu_saturated", t) \
                and (_v(used, ">=", t["cpu_quota_used"])
                     or _v(throttled, ">=", t["cpu_throttled_high"])):
            return (f"data wait {percent(r.data_wait_ratio)} of each step, its processes at "
                    f"{percent(used)} of their CPU allowance, throttled {percent(throttled)} of "
                    f"the time, the node's CPUs {percent(cpu)} busy")
        return None


class HostMemoryPressure(Heuristic):
    alert, verdict = "GpuTrainHostMemoryPressure", "memory-pressure"
    severity, for_ = "warning", "10m"
    summary = ("A training run is input-bound because its node is out of memory and swaps: "
               "the busy disk is paging, not data.")
    advice = ("Free the node's memory before tuning storage: a data set held in Python lists or "
              "dicts is copied into every DataLoader worker as it is read (hold it in numpy "
              "arrays or a memory-mapped file), fewer workers or a smaller prefetch_factor, no "
              "second copy of the data in each rank, or a node with more memory (`free -h`, "
              "`vmstat 1`: si and so).")
    fires_when = ("input-bound and the node swapping >= {swap_mib_per_second} MiB/s (in and "
                  "out)")
    why = ("Input-bound while the node swaps pages in and out at {swap_mib_per_second} MiB a "
           "second or more (/proc/vmstat's pswpin and pswpout): the node's memory is "
           "exhausted, and what looks like a slow disk (iowait, a busy swap device) is the "
           "paging. The cause comes before its symptom: this verdict outranks CPU "
           "preprocessing and disk I/O, and `GpuTrainDiskIOBound` does not fire on a swapping "
           "node. A faster disk would not help; less memory per worker would.")
    confirm = (series_of("swap_rate"),
               series_of("memory_available"))
    panel = ('GpuTrain / Node, "Memory" (available near zero) beside "CPU by mode" (iowait); '
             '`gputrain_host_swap_in_bytes_total` and `_out_` rising.')
    thresholds = {"swap_mib_per_second": Threshold(
        4.0, "count", "our choice, in MiB/s: 1,024 pages of 4 KiB a second, sustained, is a "
                      "node that pages as it trains (vmstat's si + so)")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", f"""({q.wait} >= {q.t['input_bound']}) and on ({q.node})
            {series_of('swap_rate')} >= {q.t['swap_mib_per_second'] * 2**20:g}""",
            f"""{q.who} waits {{{{ $value | humanizePercentage }}}} of each step for data while
            its node swaps {q.t['swap_mib_per_second']:g} MiB a second or more: its memory
            is exhausted.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        swap = r.host.get("swap_rate")
        if _v(r.data_wait_ratio, ">=", t["input_bound"]) and swapping(r, t):
            return (f"data wait {percent(r.data_wait_ratio)} of each step while the node swaps "
                    f"{(swap or 0) / 2**20:.1f} MiB/s")
        return None


def swapping(r: RankReport, t: dict[str, float]) -> bool:
    """The rank's node swaps at the memory-pressure line: its iowait is paging."""
    return _v(r.host.get("swap_rate"), ">=", t["swap_mib_per_second"] * 2**20)


class CPUPreprocessingBound(Heuristic):
    alert, verdict = "GpuTrainCPUPreprocessingBound", "cpu-preprocessing"
    severity, for_ = "warning", "10m"
    stacks = "record"  # which functions its main process and loader workers run
    summary = "A training run is input-bound because the CPUs are saturated."
    advice = ("Move augmentation to the GPU (DALI, GPU transforms), pre-process offline, or get "
              "more cores.")
    fires_when = ("input-bound and host CPU busy >= {cpu_saturated} (held until under "
                  "{cpu_saturated} less {refinement_margin})")
    why = ("Input-bound while the node's CPUs are at least {cpu_saturated} busy: preprocessing "
           "cannot keep up (in a TensorFlow performance study's preprocessing case, CPU use "
           "rose from 66 % to 96 %, the GPU stayed under 36 % busy, 25 samples/s).")
    confirm = (series_of("cpu_busy"),)
    panel = ('GpuTrain / Run, "Data wait" and the node\'s "CPU by mode" (user + system near '
             '100 %), "Training processes" (the cores the DataLoader workers use).')
    thresholds = {"cpu_saturated": Threshold(
        0.9, "ratio", "a TensorFlow performance study, preprocessing case (CPU 66 % -> 96 %)")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", f"""({q.wait} >= {q.t['input_bound']}) and on ({q.node})
                          {q.refined(REFINED['cpu_busy'], 'cpu_saturated')}""",
                          f"""{q.who} waits {{{{ $value | humanizePercentage }}}} of each step for
                          data while the node's CPUs are {q.t['cpu_saturated']} or more busy:
                          preprocessing is the bottleneck.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        cpu = r.host.get("cpu_busy")
        if _v(r.data_wait_ratio, ">=", t["input_bound"]) and \
                refined(r, "cpu_busy", "cpu_saturated", t):
            return f"data wait {percent(r.data_wait_ratio)} of each step, CPUs {percent(cpu)} busy"
        return None


class DiskIOBound(Heuristic):
    alert, verdict = "GpuTrainDiskIOBound", "disk-io"
    severity, for_ = "warning", "10m"
    summary = "A training run is input-bound on disk I/O."
    advice = ("Cache the data set in memory or on local NVMe, use larger sequential reads or "
              "more reader threads.")
    fires_when = ("input-bound, iowait >= {iowait_high} or a disk busy >= {disk_busy_high}, CPU "
                  "not saturated, the node not swapping ({swap_mib_per_second} MiB/s or more)")
    why = ("Input-bound while the CPUs wait on I/O (iowait >= {iowait_high}) or a disk is "
           "{disk_busy_high} busy, and the CPUs are not saturated (a profiling guide's sign of a "
           "disk bottleneck: high disk I/O with low CPU use, in iostat and iotop).")
    confirm = (series_of("iowait"),
               series_of("disk_busy"))
    panel = ('GpuTrain / Run, "CPU by mode" (iowait band) and "Disk I/O"; GpuTrain / Node, '
             '"Disk busy" ({disk_busy_high} line).')
    thresholds = {
        "iowait_high": Threshold(0.2, "ratio", "a profiling guide: high disk I/O with low CPU "
                                               "use"),
        "disk_busy_high": Threshold(0.9, "ratio", "a profiling guide: a disk near saturation "
                                                  "(iostat %util)")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [self.rule(q, "warning", f"""({q.wait} >= {t['input_bound']})
            and on ({q.node}) ({q.refined(REFINED['iowait'], 'iowait_high')}
                 or {q.refined(REFINED['disk_busy'], 'disk_busy_high')})
            and on ({q.node}) {q.unrefined(REFINED['cpu_busy'], 'cpu_saturated')}
            unless on ({q.node}) {series_of('swap_rate')}
              >= {t['swap_mib_per_second'] * 2**20:g}""",
            f"""{q.who} waits {{{{ $value | humanizePercentage }}}} of each step for data while
            the node waits on its disks (iowait >= {t['iowait_high']} or a disk busy >=
            {t['disk_busy_high']}) and the CPUs are not saturated.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        iowait, disk = (r.host.get(k) for k in ("iowait", "disk_busy"))
        if _v(r.data_wait_ratio, ">=", t["input_bound"]) and not swapping(r, t) and \
                unrefined(r, "cpu_busy", "cpu_saturated", t) and \
                (refined(r, "iowait", "iowait_high", t) or
                 refined(r, "disk_busy", "disk_busy_high", t)):
            return (f"data wait {percent(r.data_wait_ratio)} of each step, iowait "
                    f"{percent(iowait)}, busiest disk {percent(disk)}")
        return None


class NetworkInputBound(Heuristic):
    alert, verdict = "GpuTrainNetworkInputBound", "network-input"
    severity, for_ = "warning", "10m"
    summary = "A training run is input-bound on network input."
    advice = "Compress or shrink the raw data, stream it, or use a node with more bandwidth."
    fires_when = "input-bound and a NIC receiving >= {network_saturated} of its speed"
    why = ("Input-bound while a network interface receives at {network_saturated} or more of "
           "its speed (in a TensorFlow performance study's network case, 77.8 % of the step "
           "time went to waiting for data, 22 samples/s).")
    confirm = (series_of("network_rx_used"),)
    panel = ('GpuTrain / Run, "Network receive against link speed" ({network_saturated} line). '
             'A NIC whose driver reports no speed needs `--host.netdev-speed`.')
    thresholds = {"network_saturated": Threshold(
        0.8, "ratio", "a TensorFlow performance study, network case: of the link speed")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", f"""({q.wait} >= {q.t['input_bound']}) and on ({q.node})
            {q.refined(REFINED['network_rx_used'], 'network_saturated')}""",
            f"""{q.who} waits {{{{ $value | humanizePercentage }}}} of each step for data while a
            network interface receives at {q.t['network_saturated']} or more of its speed.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        net = r.host.get("network_rx_used")
        if _v(r.data_wait_ratio, ">=", t["input_bound"]) and \
                refined(r, "network_rx_used", "network_saturated", t):
            return (f"data wait {percent(r.data_wait_ratio)} of each step, network receive at "
                    f"{percent(net)} of the link")
        return None


class InputBound(Heuristic):
    alert, verdict = "GpuTrainInputBound", "input-bound"
    severity, for_ = "info / warning", "10m"
    stacks = "record"  # which functions its main process and loader workers run
    summary = "A training run waits on its data loader."
    advice = ("Use more DataLoader workers (num_workers), a larger prefetch_factor, "
              "persistent_workers=True and pin_memory=True, or cache or pre-process the data "
              "set offline (DALI).")
    fires_when = "data-wait ratio >= {input_bound} / >= {input_bound_high} for {for}"
    why = ("The run spends {input_bound} (info) or {input_bound_high} (warning) of each step "
           "blocked fetching its next batch (the TensorFlow profiler's input-pipeline "
           "thresholds), with CPU, disk and network to spare. A PyTorch tuning walk-through "
           "went from 31.65 % to 97.51 % GPU use mostly through this. The info tier covers "
           "the warning's range, so a ratio hovering at {input_bound_high} keeps alerting. "
           "The stages it is refined into (CPU preprocessing, disk, network, a CPU quota) have "
           "hysteresis alike: a node reading that reached its line within {hold_window} holds "
           "until it falls below the line less {refinement_margin}, so a CPU hovering at its "
           "line keeps the verdict it entered, and a clear drop leaves it at once.")
    confirm = (series_of("data_wait_ratio"),)
    panel = 'GpuTrain / Run, panel "Data wait" ({input_bound} and {input_bound_high} lines).'
    thresholds = {
        "input_bound": Threshold(0.05, "ratio", "TensorFlow Profiler's input-pipeline "
                                                "analysis: moderately input-bound"),
        "input_bound_high": Threshold(0.20, "ratio", "TensorFlow Profiler's input-pipeline "
                                                     "analysis: highly input-bound"),
        "refinement_margin": Threshold(
            0.05, "ratio", "our choice: hysteresis for the stage input-bound is refined into "
                           "(CPU, disk, network): entered at its line, left below the line less "
                           "this, so a reading hovering at 90 % does not flip the verdict")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [
            self.rule(q, "info", f"{q.wait} >= {t['input_bound']}",
                      f"""{q.who} spends {{{{ $value | humanizePercentage }}}} of each step
                      waiting for the data loader (moderately input-bound at
                      {t['input_bound']})."""),
            self.rule(q, "warning", f"{q.wait} >= {t['input_bound_high']}",
                      f"""{q.who} spends {{{{ $value | humanizePercentage }}}} of each step
                      waiting for the data loader (highly input-bound at
                      {t['input_bound_high']}).""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        if _v(r.data_wait_ratio, ">=", t["input_bound"]):
            periodic = loader_period(r, t)
            return f"data wait {percent(r.data_wait_ratio)} of each step" + \
                (f"; {periodic}" if periodic else "")
        return None


class DataLoaderRestarts(Heuristic):
    alert, verdict = "GpuTrainDataLoaderRestarts", "loader-restarts"
    severity, for_ = "info", "15m"
    summary = "A training run loses time starting its DataLoader workers, epoch after epoch."
    advice = ("Keep the workers across epochs: DataLoader(..., persistent_workers=True), and a "
              "lighter worker start (no heavy imports or dataset copies in each worker).")
    fires_when = ("DataLoader start-up > {loader_start_share} of the wall time over "
                  "{periodic_window}, for {for}, while the rank runs")
    why = ("Starting the DataLoader's workers (the phase `dataloader_start`, `iter(loader)`, "
           "which the client keeps outside the steps) takes more than {loader_start_share} of "
           "the rank's wall time over {periodic_window}: without persistent_workers, PyTorch "
           "starts every worker again each epoch, and short epochs pay it often. A cost that "
           "recurs is judged by its share over a window that holds several occurrences, "
           "through the minutes each one stops the steps, never by a `for:` that each "
           "occurrence would reset.")
    confirm = (series_of("periodic") + f'{{phase="{LOADER_START_PHASE}"}}',)
    panel = 'GpuTrain / Run, "Goodput and badput": the `dataloader_start` band.'
    stepping = False  # judged while the rank runs, stepping or starting its workers
    thresholds = {"loader_start_share": Threshold(
        0.05, "ratio", "PyTorch's DataLoader: persistent_workers keeps workers across epochs")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "info", q.live(f"""{q.periodic(LOADER_START_PHASE)}
            > {q.t['loader_start_share']}"""),
            f"""{q.who} spends {{{{ $value | humanizePercentage }}}} of its wall time starting
            DataLoader workers (over {WINDOWS['periodic']}).""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        share = r.periodic.get(LOADER_START_PHASE)
        if not gone(r, t) and _v(share, ">", t["loader_start_share"]):
            return (f"DataLoader start-up takes {percent(share)} of the wall time over "
                    f"{WINDOWS['periodic']}")
        return None


class CommunicationBound(Heuristic):
    # global: the ranks of a run are compared (a run spans nodes)
    alert, verdict, level = "GpuTrainCommunicationBound", "communication-bound", "global"
    severity, for_ = "warning", "10m"
    compares_ranks = True
    summary = "A training run waits for its gradient communication (all-reduce)."
    advice = ("Overlap and shrink the gradient sync: tune DDP's bucket_cap_mb, set "
              "static_graph=True and gradient_as_bucket_view=True, compress with a DDP comm "
              "hook (fp16 or bf16 compress, PowerSGD), accumulate gradients under no_sync() "
              "so that fewer steps all-reduce, and raise the per-GPU batch so that each "
              "all-reduce serves more compute. Check the fabric: NCCL_DEBUG=INFO names the "
              "transport in use; it should be NVLink, InfiniBand or RoCE, not TCP sockets.")
    fires_when = ("exposed gradient communication >= {comm_bound} of the step time on every "
                  "rank of the run that measures it; or, where none is measured, a NIC at >= {network_saturated} of its speed both ways "
                  "with data wait < {input_bound} (inferred)")
    why = ("In data-parallel training every step ends with the gradients' all-reduce; the "
           "part of it that the backward pass does not hide is time the GPU waits (NCCL's "
           "kernels keep it \"busy\" meanwhile, so GPU busy does not show it). The client "
           "reads DDP's own reducer timers (`watch_communication`): when the steps of every rank "
           "of the run wait {comm_bound} or more of their time for communication, "
           "communication is the bottleneck. A rank that waits more than its run's others "
           "waits for them (a straggler), not for the link: the run's least wait is what "
           "communication costs. Where no client measures it, a network interface saturated both "
           "ways ({network_saturated} of its speed, received and sent: an all-reduce sends "
           "as much as it receives) while the data wait stays under {input_bound} points "
           "at it too; that verdict is marked inferred. What the measured figure leaves out: "
           "the compute that communication slows while it overlaps (see docs/client.md).")
    confirm = (series_of("comm_exposed_ratio"),
               series_of("comm_ratio"),
               series_of("network_duplex_used"))
    panel = ('GpuTrain / Run, "Gradient communication" ({comm_bound} line) and "Bytes '
             'all-reduced"; GpuTrain / Node, "Network both ways".')
    thresholds = {"comm_bound": Threshold(
        0.2, "ratio", "TensorFlow Profiler's highly-bound share of a step, applied to the "
                      "gradient sync stage of the same step analysis")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        # every rank of the run waits: the least wait of its ranks is the communication's own
        measured = (f"{q.comm} >= {t['comm_bound']} and on ({q.run}) "
                    f"(min by ({q.run}) ({q.comm}) >= {t['comm_bound']})")
        duplex = series_of("network_duplex_used")
        inferred = (f"""({q.wait} < {t['input_bound']}) unless on ({q.rank}) {q.comm}
            and on ({q.node}) ({duplex} >= {t['network_saturated']})""")
        return [
            self.rule(q, "warning", measured,
                      f"""{q.who} waits {{{{ $value | humanizePercentage }}}} of each step for
                      its gradient communication (measured).""", {"evidence": "measured"}),
            self.rule(q, "warning", inferred,
                      f"""{q.who} barely waits for data while a network interface of its
                      node runs at {t['network_saturated']} or more of its speed both ways:
                      communication-bound (inferred: no communication is measured).""",
                      {"evidence": "inferred"})]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        if r.comm_exposed_ratio is not None:
            least = r.comm_exposed_ratio if r.run_comm_exposed_min is None \
                else r.run_comm_exposed_min
            if _v(r.comm_exposed_ratio, ">=", t["comm_bound"]) and \
                    _v(least, ">=", t["comm_bound"]):
                return (f"waits {percent(r.comm_exposed_ratio)} of each step for gradient "
                        f"communication ({percent(r.comm_ratio)} runs; its run's ranks "
                        f"{percent(least)} or more), measured")
            return None
        duplex = r.host.get("network_duplex_used")
        if _v(r.data_wait_ratio, "<", t["input_bound"]) and \
                _v(duplex, ">=", t["network_saturated"]):
            return (f"inferred: no communication measured, a NIC at {percent(duplex)} of its "
                    f"speed both ways, data wait {percent(r.data_wait_ratio)}")
        return None


class HostToDeviceBound(Heuristic):
    alert, verdict, scope = "GpuTrainHostToDeviceBound", "host-to-device", "rank_gpu"
    severity, for_ = "warning", "10m"
    summary = "Host-to-device copies saturate the PCIe link and the GPU waits."
    advice = ("Send uint8 and normalise on the GPU (4x less data), use pin_memory with "
              "non_blocking copies, defer one_hot and casts to the GPU.")
    fires_when = ("PCIe RX >= {pcie_rx_high} of the link as it runs and GPU busy < "
                  "{h2d_gpu_busy_below}")
    why = ("The GPU receives at least {pcie_rx_high} of its PCIe link's capacity as the link "
           "runs (its best speed in the window, not its maximum: a link trained down is a "
           "bottleneck at its own speed) while busy "
           "less than {h2d_gpu_busy_below} (a TensorFlow performance study's host-to-device "
           "case; sending uint8 is a PyTorch tuning walk-through's 4th step).")
    confirm = (series_of("pcie_rx_used"),)
    panel = ('GpuTrain / Run, "PCIe host-to-device against the link" ({pcie_rx_high} line) '
             'beside "GPU busy".')
    thresholds = {
        "pcie_rx_high": Threshold(0.5, "ratio", "a TensorFlow performance study, host-to-device "
                                                "case: of the PCIe link"),
        "h2d_gpu_busy_below": Threshold(0.8, "ratio", "a TensorFlow performance study, "
                                                      "host-to-device case")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", f"""{series_of('pcie_rx_used')}
            >= {q.t['pcie_rx_high']} and on ({q.rank}, gpu, uuid) {q.busy} <
            {q.t['h2d_gpu_busy_below']}""",
            f"""{q.gpu_who} receives {{{{ $value | humanizePercentage }}}} of its PCIe link's
            capacity while busy less than {q.t['h2d_gpu_busy_below']}.""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if _v(g.pcie_rx_used, ">=", t["pcie_rx_high"]) and \
                _v(g.busy, "<", t["h2d_gpu_busy_below"]):
            return f"PCIe RX at {percent(g.pcie_rx_used)} of the link, busy {percent(g.busy)}"
        return None


class HostOverheadBound(Heuristic):
    alert, verdict = "GpuTrainHostOverheadBound", "host-overhead"
    severity, for_ = "warning", "10m"
    stacks = "record"  # which functions its main process and loader workers run
    summary = "A training run's GPUs idle on host-side work, not on data."
    advice = ("Move post-processing to a background thread, do it every N steps, keep metrics "
              "on the GPU, avoid .item() or other synchronisation in every step.")
    fires_when = ("the rank's GPUs' busy time added up < {gpu_busy_low} with data wait < "
                  "{input_bound}, or a phase of the step (not evaluation, checkpoint, start-up) "
                  "> {phase_dominates} the rest of it")
    why = ("The GPUs idle although the run barely waits for data (their busy time added up: "
           "one process driving four GPUs as pipeline stages, one busy at every moment, is a "
           "pipeline, not host overhead), or a phase of the step "
           "(callbacks, logging) takes more than {phase_dominates} the rest of it, that is "
           "over {phase_share} of the step (a TensorFlow performance study's post-processing "
           "case: GPU 46 % busy, 43 samples/s; Keras warns of a callback slow against the "
           "batch at 1.0x). Evaluation, checkpoint saves and DataLoader start-up are not part "
           "of any step and never count here.")
    confirm = (STEP_PHASE_MAX,
               series_of("phases"))
    panel = ('GpuTrain / Run, "Phases" ({phase_share} line) and "Data wait" low while "GPU '
             'busy" is low.')
    thresholds = {"phase_dominates": Threshold(
        1.0, "factor", "Keras: a callback slow compared to the batch time")}

    def derived(self, t: dict[str, float]) -> dict[str, float]:
        # a phase more than k times the rest of its step is over k / (1 + k) of the step
        return {"phase_share": t["phase_dominates"] / (1 + t["phase_dominates"])}

    def rules(self, q: Q) -> list[dict]:
        t, share = q.t, self.derived(q.t)["phase_share"]
        # the rank's GPUs added up: a process driving several GPUs (pipeline stages,
        # device_map="auto") keeps one busy at a time, which is no host overhead
        return [self.rule(q, "warning", f"""(clamp_max(sum by ({q.rank}) ({q.busy}), 1)
              < {t['gpu_busy_low']}
              and on ({q.rank}) {q.wait} < {t['input_bound']})
            or on ({q.rank}) ({STEP_PHASE_MAX} > {share:g})""",
            f"""{q.who}: its GPUs are idle although it barely waits for data, or a phase of the
            step (callbacks, logging) takes more than {t['phase_dominates']}x the rest of
            it.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        in_step = {p: v for p, v in r.phases.items() if p not in OUTSIDE_STEP_PHASES}
        heavy = max(in_step.items(), key=lambda kv: kv[1], default=None)
        if heavy is not None and heavy[1] > self.derived(t)["phase_share"]:
            return f"phase '{heavy[0]}' takes {percent(heavy[1])} of each step"
        known = [g.busy for g in r.gpus if g.busy is not None]
        busy = min(1.0, sum(known)) if known else None  # the rank's GPUs added up
        if _v(busy, "<", t["gpu_busy_low"]) and _v(r.data_wait_ratio, "<", t["input_bound"]):
            what = "GPU busy" if len(known) == 1 else f"its {len(known)} GPUs busy, added up,"
            return f"{what} {percent(busy)}, data wait only {percent(r.data_wait_ratio)}"
        return None


class LaunchBound(Heuristic):
    alert, verdict, scope = "GpuTrainLaunchBound", "launch-bound", "rank_gpu"
    severity, for_ = "info", "15m"
    summary = "A GPU is busy but does little work: kernels are too small."
    advice = "Use a larger batch, CUDA graphs or torch.compile, and fuse small ops."
    fires_when = ("busy >= {launch_busy_above} but SM active < {launch_sm_active_below} (GPM), "
                  "or where GPM is missing power < {launch_power_below} of the limit, {for}")
    why = ("The GPU is busy at least {launch_busy_above} of the time but draws under "
           "{launch_power_below} of its power limit, or its SMs are under "
           "{launch_sm_active_below} active (GPM's measure wins: where it is read, power is not "
           "judged, as a GPU held at half its clock draws little power with every SM busy): "
           "many small kernels (low power means idle SMs, as "
           "nvidia-smi shows them; a TensorFlow performance study's small-batch case spent "
           "half its step launching kernels). torch.compile gave a PyTorch tuning walk-through "
           "+32 %.")
    confirm = (series_of("power_used"),
               series_of("sm_active"))
    panel = ('GpuTrain / Run, "Power against the limit" ({launch_power_below} line) and "SM and '
             'tensor activity" ({launch_sm_active_below} line) while "GPU busy" is high.')
    thresholds = {
        "launch_busy_above": Threshold(0.8, "ratio", "profiling guides: busy but low power"),
        "launch_power_below": Threshold(0.4, "ratio", "profiling guides: low power means idle "
                                                      "SMs; of the enforced limit"),
        "launch_sm_active_below": Threshold(0.3, "ratio", "GPM SM activity")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [self.rule(q, "info", f"""{q.busy} >= {t['launch_busy_above']}
            and on ({q.rank}, gpu, uuid)
            ({series_of('power_used')} < {t['launch_power_below']}
               unless on ({q.rank}, gpu, uuid) {series_of('sm_active')}
             or {series_of('sm_active')} < {t['launch_sm_active_below']})""",
            f"""{q.gpu_who} is busy {{{{ $value | humanizePercentage }}}} of the time but draws
            less than {t['launch_power_below']} of its power limit (or its SMs are less than
            {t['launch_sm_active_below']} active).""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        # GPM's SM activity is the measure; power only its proxy where GPM is missing (a GPU
        # whose clock is held at half draws little power with every SM busy)
        idle_sms = _v(g.sm_active, "<", t["launch_sm_active_below"]) if g.sm_active is not None \
            else _v(g.power_used, "<", t["launch_power_below"])
        if _v(g.busy, ">=", t["launch_busy_above"]) and idle_sms:
            return (f"busy {percent(g.busy)} but power {percent(g.power_used)} of the limit, "
                    f"SM active {percent(g.sm_active)}")
        return None


class TensorCoresIdle(Heuristic):
    alert, verdict, scope = "GpuTrainTensorCoresIdle", "tensor-cores-idle", "rank_gpu"
    severity, for_ = "info", "15m"
    summary = "A busy GPU never uses its tensor cores."
    advice = ("Train with automatic mixed precision (torch.autocast) or bf16 so the tensor "
              "cores do the matrix work.")
    fires_when = ("SM active >= {tensor_sm_active_above} and tensor active < "
                  "{tensor_active_below}, {for}")
    why = ("SMs at least {tensor_sm_active_above} active but tensor cores under "
           "{tensor_active_below} (GPM, Hopper and newer). Automatic mixed precision gave a "
           "PyTorch tuning walk-through +50 % throughput.")
    confirm = (series_of("tensor_active"),)
    panel = 'GpuTrain / Run, "SM and tensor activity": the tensor series flat at zero.'
    thresholds = {
        "tensor_sm_active_above": Threshold(0.5, "ratio", "a PyTorch tuning walk-through, "
                                                          "mixed precision step"),
        "tensor_active_below": Threshold(0.01, "ratio", "a PyTorch tuning walk-through: 0 % "
                                                        "tensor-core use before AMP")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [self.rule(q, "info", f"""{series_of('sm_active')} >=
            {t['tensor_sm_active_above']} and on ({q.rank}, gpu, uuid)
            {series_of('tensor_active')} < {t['tensor_active_below']}""",
            f"""{q.gpu_who} has its SMs {{{{ $value | humanizePercentage }}}} active but its
            tensor cores below {t['tensor_active_below']}.""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if _v(g.sm_active, ">=", t["tensor_sm_active_above"]) and \
                _v(g.tensor_active, "<", t["tensor_active_below"]):
            return f"SM active {percent(g.sm_active)}, tensor active {percent(g.tensor_active)}"
        return None


class LowMFU(Heuristic):
    alert, verdict = "GpuTrainLowMFU", "low-mfu"
    severity, for_ = "info", "15m"
    summary = "A busy GPU does little useful math: low model FLOPs utilisation."
    advice = ("Train in bf16 or with AMP (torch.autocast), raise the batch size, torch.compile "
              "the model, use fused kernels (FlashAttention, fused optimizers) and fewer small "
              "ops.")
    fires_when = ("busy >= {mfu_busy_above} and MFU < {mfu_low}, where the client reports "
                  "FLOPs, {for}")
    why = ("The GPUs the rank works on are busy at least {mfu_busy_above} of the time (a GPU "
           "where it does under {stray_share} of the work, a stray context's, left out), "
           "yet its model's "
           "FLOPs per second are under {mfu_low} of their dense peak at the precision it "
           "trains in: the kernels run, but slowly (small or unfused ops, FP32 where bf16 "
           "would do, memory-bound work). torchtitan reaches 33-39 % for Llama 3.1 8B on "
           "H100s; a PyTorch tuning walk-through gained 50 % from AMP and 32 % from "
           "torch.compile. Only ranks that report FLOPs (flops_per_sample) on GPUs whose peak "
           "is known are judged.")
    confirm = (series_of("mfu"),
               RANK_BUSY_AVG)
    panel = ('GpuTrain / Run, "Model FLOPs utilisation" ({mfu_low} line) beside "SM and tensor '
             'activity".')
    thresholds = {
        "mfu_busy_above": Threshold(0.9, "ratio", "a GPU busy enough that its work, not its "
                                                  "feeding, is the question"),
        "mfu_low": Threshold(0.2, "ratio", "torchtitan: 33-39 % MFU for Llama 3.1 8B on H100 "
                                           "(bf16, against the 989 TFLOP/s dense peak)")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        # the mean over the GPUs the rank works on: a stray context's GPU is not its to keep
        # busy (a rank at 95 % on its GPU with an idle stray one read 47.5 %)
        busy = f"avg by ({q.rank}) ({q.busy} unless on ({q.rank}, gpu, uuid) {q.stray})"
        return [self.rule(q, "info", f"""{series_of('mfu')} < {t['mfu_low']}
            and on ({q.rank}) {busy} >= {t['mfu_busy_above']}""",
            f"""{q.who} reaches {{{{ $value | humanizePercentage }}}} model FLOPs utilisation
            (under {t['mfu_low']}) while its GPUs are busy {t['mfu_busy_above']} or more of the
            time.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        stray = stray_gpus(r, t)
        busy = mean([g.busy for g in r.gpus if g.gpu not in stray])
        if _v(r.mfu, "<", t["mfu_low"]) and _v(busy, ">=", t["mfu_busy_above"]):
            return f"MFU {percent(r.mfu)} while the GPUs are busy {percent(busy)}"
        return None


class GPUMemoryUnderused(Heuristic):
    alert, verdict, scope = "GpuTrainGPUMemoryUnderused", "small-batch", "rank_gpu"
    severity, for_ = "info", "30m"
    summary = "A training run uses little of its GPU's memory: the batch may be too small."
    advice = "Raise the batch size (and re-tune the learning rate)."
    fires_when = "GPU memory used < {memory_underused} for {for}"
    why = ("The run uses less than {memory_underused} of its GPU's memory (a PyTorch tuning "
           "walk-through: under 1 GB of 16 GB; a TensorFlow performance study's small-batch "
           "case: 23 %). The walk-through went from 1200 to 1584 samples/s with a larger "
           "batch.")
    confirm = (series_of("memory_used"),)
    panel = 'GpuTrain / Run, "GPU memory used" ({memory_underused} line).'
    thresholds = {"memory_underused": Threshold(
        0.25, "ratio", "a PyTorch tuning walk-through: under 1 GB of 16 GB")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "info", f"{series_of('memory_used')} < "
                                     f"{q.t['memory_underused']}",
                          f"""{q.gpu_who} uses {{{{ $value | humanizePercentage }}}} of its
                          memory (threshold {q.t['memory_underused']}).""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if _v(g.memory_used, "<", t["memory_underused"]):
            return f"{percent(g.memory_used)} of its memory used"
        return None


class StepTimeStalls(Heuristic):
    alert, verdict = "GpuTrainStepTimeStalls", "step-time-stalls"
    severity, for_ = "info", "15m"
    summary = "A training run stalls periodically."
    advice = ("If the run saves checkpoints (the phase `checkpoint`), checkpoint "
              "asynchronously or less often, to local disk and upload later; if the stalls come "
              "at each epoch's start, keep the DataLoader's workers across epochs "
              "(persistent_workers=True); otherwise see what the slow steps do: "
              "`gputrain-exporter profile --stacks` during one (garbage collection, a sync or "
              "logging every N steps).")
    CHECKPOINT_ADVICE = ("Checkpoint asynchronously or less often, write to local disk and "
                         "upload later.")
    EVALUATION_ADVICE = ("Evaluate less often or on fewer batches (Lightning's "
                         "val_check_interval and limit_val_batches, transformers' eval_steps), "
                         "or on another GPU while training goes on.")
    LOADER_START_ADVICE = ("Keep the DataLoader's workers across epochs: "
                           "DataLoader(..., persistent_workers=True).")
    UNKNOWN_ADVICE = ("See what the slow steps do: `gputrain-exporter profile --stacks` during "
                      "one (garbage collection: gc.freeze() after start-up; a synchronisation, "
                      "an evaluation or logging every N steps).")
    fires_when = ("steps over {slow_step_factor} the median take > {stall_time_share} of the "
                  "wall time over {quantile_window} (or, where that count is missing, p99 step "
                  "time > {stall_p99_over_p50} the median), while the rank steps (not where the slow steps are the loader's "
                  "period: one in its workers' count, within {loader_period_tolerance}, their "
                  "time >= {loader_wait_share} data wait); or, while it runs, checkpoint saves "
                  "> {checkpoint_share} or evaluations > {evaluation_share} of the wall time "
                  "over {periodic_window}")
    why = ("Rare long stalls are judged by the time they cost: steps more than "
           "{slow_step_factor} the rank's median took more than {stall_time_share} of its wall "
           "time over {quantile_window} (counted by the daemon from the pushed step histogram, "
           "a lower bound, and exact where the quantiles are not: with it, the quantiles are "
           "not judged). A stall in under 1 % of the steps (a DataLoader re-created each "
           "epoch, a checkpoint every few hundred steps) can cost a fifth of the wall time "
           "while the p99 never moves. Where the count is missing (a Prometheus fed by "
           "another client), it fires where the p99 step time is more than "
           "{stall_p99_over_p50} the median; or checkpoint saves (the phase `checkpoint`, "
           "which the client keeps out of step time) take more than {checkpoint_share} of the "
           "wall time, or evaluations (the phase `evaluation`) more than {evaluation_share} (a "
           "TensorFlow performance study: even periodic bottlenecks hurt the average). A "
           "checkpoint to slow storage for 8 minutes every 30 lasts less than any `for:` and "
           "stops the steps while it runs, so these costs are judged by their share of the "
           "wall time over {periodic_window} (several occurrences) while the rank runs, "
           "stepping or not. A DataLoader with N workers delivers its batches in groups of N: one "
           "step in N waits for data and the rest find theirs ready, so the p99 is far above "
           "the median with no stall at all. Where the client states the loader's workers and "
           "the slow steps are one in N (within {loader_period_tolerance}) and mostly data wait "
           "(at least {loader_wait_share} of their time), that is the loader: input-bound "
           "says so, and this does not fire. Its advice fits what was seen: checkpoints where "
           "the rank saves them, persistent workers where its loader restarts.")
    confirm = (series_of("stall_share"),
               series_of("step_p99_seconds"),
               series_of("periodic"))
    panel = ('GpuTrain / Run, "Step time": the max far above p50, in periodic spikes; "Goodput '
             'and badput" shows the `checkpoint` and `evaluation` bands if the client marks '
             'them.')
    stepping = False  # its slow steps are judged while it steps, its periodic costs while it runs
    thresholds = {
        "stall_p99_over_p50": Threshold(5.0, "factor", "a TensorFlow performance study: "
                                                       "periodic stalls hurt the average"),
        "stall_time_share": Threshold(
            0.1, "ratio", "our choice: a tenth of the wall time is worth a fix; a DataLoader "
                          "re-created each epoch or a checkpoint every few hundred steps costs "
                          "up to a fifth while the p99 does not move"),
        "checkpoint_share": Threshold(
            0.1, "ratio", "checkpoint saves, a phase outside the steps: a tenth of the wall "
                          "time (our choice; async checkpointing takes them off the loop)"),
        "evaluation_share": Threshold(
            0.2, "ratio", "evaluations, a phase outside the steps: a fifth of the wall time "
                          "(our choice: some evaluation is the point, most of the time is "
                          "not)"),
        "loader_period_tolerance": Threshold(
            0.5, "ratio", "our choice: slow steps within half of 1/N of the steps are a loader "
                          "of N workers' period (rare stalls are one in hundreds)"),
        "loader_wait_share": Threshold(
            0.5, "ratio", "our choice: the loader's slow steps are mostly data wait (a "
                          "checkpoint or a sync is none)")}

    def derived(self, t: dict[str, float]) -> dict[str, float]:
        # what "far above the typical step" is: a definition of the daemon's slow-step count
        return {"slow_step_factor": SLOW_STEP_FACTOR}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        workers, share = (series_of("loader_workers"),
                          series_of("slow_step_ratio"))
        tolerance = t["loader_period_tolerance"]
        loader = f"""({workers} >= 2
            and on ({q.rank}) {share} >= on ({q.rank}) ({num(1 - tolerance)} / {workers})
            and on ({q.rank}) {share} <= on ({q.rank}) ({num(1 + tolerance)} / {workers})
            and on ({q.rank}) {series_of('slow_step_wait')}
              >= {t['loader_wait_share']})"""
        slow = q.stepping(f"""({series_of('stall_share')}
            > {t['stall_time_share']}
            or on ({q.rank}) ({series_of('step_p99_seconds')}
              > {t['stall_p99_over_p50']} * {series_of('step_p50_seconds')}
              unless on ({q.rank}) {series_of('stall_share')}))
            unless on ({q.rank}) {loader}""")
        periodic = q.live(f"""{q.periodic('checkpoint')} > {t['checkpoint_share']}
            or on ({q.rank}) {q.periodic('evaluation')} > {t['evaluation_share']}""")
        return [self.rule(q, "info", f"{slow} or on ({q.rank}) ({periodic})",
            f"""{q.who}: steps over {SLOW_STEP_FACTOR:g}x the median take more than
            {t['stall_time_share']} of the wall time, or the p99 step time is more than
            {t['stall_p99_over_p50']}x the median over {WINDOWS['quantile']}; or checkpoint
            saves take more than {t['checkpoint_share']}, or evaluations more than
            {t['evaluation_share']}, of the wall time over {WINDOWS['periodic']}
            ({{{{ $value | printf "%.3g" }}}}).""")]

    def advice_for(self, r: RankReport) -> str:
        if r.periodic.get("checkpoint") or r.phases.get("checkpoint") or \
                r.badput.get("checkpoint"):
            return self.CHECKPOINT_ADVICE
        if r.periodic.get("evaluation"):
            return self.EVALUATION_ADVICE
        if r.badput.get(LOADER_START_PHASE) or r.phases.get(LOADER_START_PHASE):
            return self.LOADER_START_ADVICE
        return self.UNKNOWN_ADVICE

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        periodic = loader_period(r, t)
        if steps_judged(r, t):
            if not periodic and _v(r.stall_share, ">", t["stall_time_share"]):
                return (f"steps over {SLOW_STEP_FACTOR:g}x the median take "
                        f"{percent(r.stall_share)} of the wall time")
            p50, p99 = r.step_p50_seconds, r.step_p99_seconds
            # the quantiles, interpolated inside wide buckets, only where the exact count of
            # slow steps is missing: a step in 8 at 4x the median (a gradient-accumulation
            # boundary) can read p99 over 5x p50 in buckets 0.01-1-10 s, and is no stall
            if not periodic and r.stall_share is None and p50 and p99 and \
                    p99 > t["stall_p99_over_p50"] * p50:
                return (f"p99 step time {p99:.3g} s is over {t['stall_p99_over_p50']:g}x the "
                        f"median {p50:.3g} s ({WINDOWS['quantile']})")
        if gone(r, t):
            return None
        for phase, what in (("checkpoint", "checkpoint saves"), ("evaluation", "evaluations")):
            share = r.periodic.get(phase)
            if _v(share, ">", t[f"{phase}_share"]):
                return (f"{what} take {percent(share)} of the wall time over "
                        f"{WINDOWS['periodic']}")
        return None


class StragglerRank(Heuristic):
    alert, verdict, scope, level = "GpuTrainStragglerRank", "straggler", "run", "global"
    severity, for_ = "warning", "15m"
    compares_ranks = True
    summary = "One rank of a run is slower than the others."
    advice = "Check that rank's node: its input, thermal throttling, a slower GPU or link."
    fires_when = ("data wait > {straggler_wait_factor} the run's median (and >= {input_bound}); "
                  "or, where communication is measured, it waits for the all-reduce less than "
                  "1/{straggler_wait_factor} of the run's median while that median is >= "
                  "{input_bound}, or computes > {straggler_compute_factor} the median; where "
                  "none is measured, its step time > {straggler_compute_factor} the median")
    why = ("In synchronous data-parallel training the fast ranks wait: when one rank is slow "
           "(its input, its GPUs, its link), the others spend the extra time waiting in the "
           "gradient all-reduce, and that waiting is not compute. A straggler is the rank the "
           "others wait for; the ranks that wait are never stragglers. It shows in what it "
           "does differently: it waits for data more than {straggler_wait_factor} its run's "
           "median; or, where the client measures the communication, it is the rank that "
           "waits least for it (under 1/{straggler_wait_factor} of the median) while the "
           "others wait, or it computes (step less data and communication wait) "
           "{straggler_compute_factor} longer (HTA's straggler analysis). Where no "
           "communication is measured, a rank's step less its data wait is no measure of its "
           "compute (a fast rank's includes its wait for the slow one), so only a step time "
           "{straggler_compute_factor} the median (an unsynchronised rank) counts.")
    confirm = (series_of("data_wait_ratio"),
               series_of("comm_exposed_ratio"),
               COMPUTE_MEAN)
    panel = ('GpuTrain / Run with all ranks selected: the rank whose "Data wait" or step time '
             'stands out, or the one that waits least in "Gradient communication"; then '
             'GpuTrain / Node for its node.')
    thresholds = {
        "straggler_wait_factor": Threshold(2.0, "factor", "HTA straggler analysis"),
        "straggler_compute_factor": Threshold(1.2, "factor", "HTA straggler analysis")}

    def rules(self, q: Q) -> list[dict]:
        # a rank of a run is its run labels and rank: a run spans jobs, never split by them
        t, run, rank = q.t, q.run, f"{q.run}, rank"
        # only the ranks that step are compared: a rank waiting for a peer's checkpoint, or
        # hung, has an open step that weighs in its mean, and lags nobody (Q.stepping)
        wait, comm = f"({q.stepping(q.wait)})", f"({q.stepping(q.comm)})"
        compute = f"({q.stepping(COMPUTE_MEAN)})"
        step = f"({q.stepping(series_of('step_seconds'))})"
        f, cf = t["straggler_wait_factor"], t["straggler_compute_factor"]
        return [self.rule(q, "warning", f"""({wait} >= {t['input_bound']}
              and {wait} > on ({run}) group_left () ({f} * quantile by ({run}) (0.5, {wait})))
            or ({comm} < on ({run}) group_left () (quantile by ({run}) (0.5, {comm}) / {f})
              and on ({run}) (quantile by ({run}) (0.5, {comm}) >= {t['input_bound']}))
            or ({compute} > on ({run}) group_left () ({cf} * quantile by ({run}) (0.5, {compute}))
              and on ({rank}) {comm})
            or ({step} > on ({run}) group_left () ({cf} * quantile by ({run}) (0.5, {step}))
              unless on ({rank}) {comm})""",
            f"""{q.who} lags its run's other ranks (it waits for data more than {f}x their
            median, or they wait for it in the gradient all-reduce, or it computes more than
            {cf}x their median).""")]

    def holds_run(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        return self.laggards(ranks, t)

    def laggards(self, ranks: list[RankReport], t: dict[str, float]) -> dict[int, str]:
        """The ranks of one run that lag the others (by ``id``), with the reason. A rank
        that waits for the others (data or communication) is never one of them; only ranks
        whose steps may be judged are compared (:func:`steps_judged`)."""
        ranks = [r for r in ranks if steps_judged(r, t)]
        f, cf = t["straggler_wait_factor"], t["straggler_compute_factor"]
        waits = [r.data_wait_ratio for r in ranks if r.data_wait_ratio is not None]
        comms = [r.comm_exposed_ratio for r in ranks if r.comm_exposed_ratio is not None]
        computes = {id(r): r.step_seconds * (1 - (r.data_wait_ratio or 0)
                                             - r.comm_exposed_ratio)
                    for r in ranks
                    if r.step_seconds is not None and r.comm_exposed_ratio is not None}
        steps = [r.step_seconds for r in ranks if r.step_seconds is not None]
        wait_median = _median(waits) if waits else None
        comm_median = _median(comms) if comms else None
        compute_median = _median(list(computes.values())) if computes else None
        step_median = _median(steps) if steps else None
        out: dict[int, str] = {}
        for r in ranks:
            w, x, c = r.data_wait_ratio, r.comm_exposed_ratio, computes.get(id(r))
            if w is not None and wait_median is not None and w >= t["input_bound"] \
                    and w > f * wait_median:
                out[id(r)] = (f"waits {percent(w)} of each step for data against its run's "
                              f"median {percent(wait_median)}")
            elif x is not None and comm_median is not None and \
                    comm_median >= t["input_bound"] and x < comm_median / f:
                out[id(r)] = (f"the others wait for it: it waits {percent(x)} of each step "
                              f"for gradient communication against its run's median "
                              f"{percent(comm_median)}")
            elif c is not None and compute_median and c > cf * compute_median:
                out[id(r)] = (f"computes {c * 1000:.1f} ms per step against its run's median "
                              f"{compute_median * 1000:.1f} ms")
            elif x is None and r.step_seconds is not None and step_median and \
                    r.step_seconds > cf * step_median:
                out[id(r)] = (f"steps take {r.step_seconds * 1000:.1f} ms against its run's "
                              f"median {step_median * 1000:.1f} ms")
        return out


class HostMemoryLeak(Heuristic):
    alert, verdict = "GpuTrainHostMemoryLeak", "memory-leak"
    severity, for_ = "warning", "30m"
    summary = "A training process's memory keeps growing."
    advice = ("Look for tensors kept across steps (losses appended without .item()) and growing "
              "caches. Memory lost outside the process tree is most often DataLoader workers "
              "copying the dataset on access (Python lists and dicts of objects: each access "
              "writes a reference count): hold it in NumPy arrays or tensors, or read it from "
              "disk in __getitem__; or shared memory (/dev/shm) that nothing frees.")
    fires_when = ("the process tree's memory (PSS where readable, else RSS) growing, or the "
                  "node's available memory falling beyond what the training processes' memory "
                  "explains, over {leak_window}, the last {leak_recent_window} and the "
                  "{leak_recent_window} before, fast enough to use up the node's available "
                  "memory within {leak_horizon_seconds}")
    why = ("The training process tree's memory grows, over the last {leak_window} and still "
           "over the last {leak_recent_window} and the {leak_recent_window} before them, fast "
           "enough to use up the memory the node still has available within "
           "{leak_horizon_seconds} (a TensorFlow performance study: rising memory may mean a "
           "leak). The tree's memory is its proportional set size (PSS, from "
           "`/proc/<pid>/smaps_rollup`: a page shared by n processes counts 1/n) where the "
           "client can read it, else its resident memory (RSS). RSS misses the leak that "
           "DataLoader workers make: each worker's pages of the dataset, shared with the "
           "parent after fork, are copied as it touches them, so the node's memory falls "
           "while each process's RSS stays flat. So the alert also judges the node: its "
           "available memory falling, beyond what the training trees' own memory explains, "
           "fast enough to run out within {leak_horizon_seconds} (its rule labelled "
           "`evidence=\"node\"`; the tree's is `evidence=\"process\"`). A slope must be sustained: a step up or a one-off drop (a profile, a "
           "dataset copied once into shared memory, a cache filled once) lies in one of the "
           "two {leak_recent_window} windows only, and a run too young for both is not "
           "judged. A high but flat memory, one that grew during warm-up and then levelled "
           "off, a decline that would take longer than {leak_horizon_seconds} to use up what "
           "is available, or a process restarted within the {leak_window} (its memory is a "
           "new process's) does not fire.")
    confirm = ("gputrain_training_process_proportional_memory_bytes",
               "gputrain_training_process_resident_memory_bytes",
               "gputrain_host_memory_available_bytes")
    panel = ('GpuTrain / Run, "Training process memory" (RSS and PSS) rising steadily; or '
             'GpuTrain / Node, "Memory" used rising while it stays flat.')
    profile = False
    thresholds = {"leak_horizon_seconds": Threshold(
        14400, "seconds", "rising memory that exhausts the node within 4 h; node_exporter's "
        "mixin gives NodeFilesystemSpaceFillingUp the same 4 h horizon (critical)")}

    def rules(self, q: Q) -> list[dict]:
        horizon, leak = q.t["leak_horizon_seconds"], WINDOWS["leak"]
        pss = q.metric("gputrain_training_process_proportional_memory_bytes")
        rss = q.metric("gputrain_training_process_resident_memory_bytes")
        available = q.metric("gputrain_host_memory_available_bytes")
        steps = q.metric("gputrain_training_steps_total")
        # a sustained slope: over each span (the long range, the recent one, the one before)
        tree = " and ".join(f"{tree_growth(pss, rss, w, o)} * {horizon} > {q.on_node} {available}"
                            for w, o in LEAK_SPANS.values())
        # the node: how long its available memory lasts at the rate it falls outside the trees
        # (the recent span's, the alert's value, first)
        lasts = " and ".join(
            f"(max by ({q.node}) ({available}) / "
            f"{memory_outside(available, tree_growth(pss, rss, w, o), q.ids, w, o)} "
            f"> 0 < {horizon})"
            for w, o in (LEAK_SPANS[x] for x in ("15m", "15m_before", "1h")))
        # one process's memory: a restart in the window (its steps counter reset) is a new
        # process, whose warm-up is no leak
        return [
            self.rule(q, "warning", f"""({tree})
                unless on ({q.rank}) (resets({steps}[{leak}]) > 0)""",
                f"""{q.who}: its process tree's memory grows fast enough to use up the node's
                available memory within {{{{ {horizon} | humanizeDuration }}}}.""",
                labels={"evidence": "process"}),
            self.rule(q, "warning", f"""max by ({q.rank}) ({q.steps}) * 0
                + on ({q.node}) group_left () ({lasts})""",
                f"""{q.who}: the node's available memory falls, beyond what the training
                processes' own memory explains, fast enough to run out in about
                {{{{ $value | humanizeDuration }}}}.""", labels={"evidence": "node"})]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        available, horizon = r.host.get("memory_available"), t["leak_horizon_seconds"]
        if available is None:
            return None
        rate = _sustained((r.rss_growth_1h, r.rss_growth_15m, r.rss_growth_15m_before),
                          available, horizon)
        if rate is not None:
            measure = "proportional (PSS)" if r.memory_measure == "pss" else "resident (RSS)"
            return (f"its process tree's {measure} memory grows {rate * 60 / 2**20:.0f} "
                    f"MiB/min: the node's {available / 2**30:.1f} GiB available last about "
                    f"{available / rate / 3600:.1f} h")
        rate = _sustained(tuple(r.host.get(f"memory_outside_growth_{w}") for w in LEAK_SPANS),
                          available, horizon)
        if rate is not None and available > 0:
            return (f"the node's available memory falls {rate * 60 / 2**20:.0f} MiB/min beyond "
                    f"what the training processes' memory explains: its "
                    f"{available / 2**30:.1f} GiB last about {available / rate / 3600:.1f} h")
        return None


def _sustained(slopes: tuple[float | None, ...], available: float,
               horizon: float) -> float | None:
    """The recent slope (bytes per second; the second of the leak rule's spans) where every
    span's would use up ``available`` bytes within ``horizon`` seconds, else None."""
    known = [x for x in slopes if x is not None]
    if len(known) < len(slopes) or min(known) * horizon <= available:
        return None
    return known[1]


class GPUMemoryNearLimit(Heuristic):
    alert, verdict, kind, scope = ("GpuTrainGPUMemoryNearLimit", "gpu-memory-near-limit",
                                   "health", "gpu")
    severity, for_ = "warning", "5m"
    summary = "A GPU's memory is nearly full."
    advice = ("Use activation checkpointing, AMP, or a smaller micro-batch with gradient "
              "accumulation.")
    fires_when = ("GPU memory used > {memory_near_limit} over most of {rate_window} (its "
                  "median), for {for}")
    why = ("A GPU's memory is over {memory_near_limit} used for most of {rate_window} (the "
           "window's median reading: a GPU at its ceiling two readings in three, freeing a "
           "little between steps, is at its ceiling; a `for:` on the raw reading would be "
           "reset by every dip): the next larger batch or sequence will fail.")
    confirm = (gpu_series_of("memory_used"),)
    panel = ('GpuTrain / Node, "GPU memory" (used against total); GpuTrain / Run, "GPU memory '
             'used" ({memory_near_limit} line).')
    thresholds = {"memory_near_limit": Threshold(
        0.95, "ratio", "the PyTorch profiler plugin's memory view (over 90 % of peak)")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "warning", f"{gpu_series_of('memory_used')} > "
                                        f"{q.t['memory_near_limit']}",
                          f"{q.node_gpu} uses {{{{ $value | humanizePercentage }}}} of its "
                          "memory.")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if _v(g.memory_used, ">", t["memory_near_limit"]):
            return f"{percent(g.memory_used)} of its memory used"
        return None


class Throttling(Heuristic):
    alert, verdict, scope = "GpuTrainThrottling", "throttling", "gpu"
    severity, for_ = "warning", "10m"
    summary = "A GPU's clocks are held down by power or temperature."
    advice = "Check cooling and the power limit: nvidia-smi -q -d PERFORMANCE."
    fires_when = ("power/thermal clock events > {throttle_ratio} of the time, or the SM clock "
                  "< {slow_clock_ratio} of its identical peers' while busy >= {gpu_busy_low}, "
                  "for {for}")
    why = ("Power-cap, thermal or power-brake clock events ({throttle_reasons}) for more than "
           "{throttle_ratio} of the time (the driver's counters; before driver 575, the "
           "hardware reasons from NVML's current reasons bitmask, sampled). Or, whatever the "
           "driver says: the GPU's SM clock over {rate_window} is under {slow_clock_ratio} of "
           "the median of the node's GPUs of the same model while it is at least "
           "{gpu_busy_low} busy (a GPU at half its identical peers' clock under the same work "
           "is slowed: a failing fan, a power brake the driver does not report).")
    confirm = (gpu_series_of("throttled"),
               "gputrain_gpu_temperature_celsius")
    panel = ('GpuTrain / Run, "SM clock" and "Throttled time" ({throttle_ratio} line); '
             'GpuTrain / Node, "Temperature" and "Power".')
    profile = False
    thresholds = {
        "throttle_ratio": Threshold(0.1, "ratio", "NVML's clock-event reasons"),
        "slow_clock_ratio": Threshold(
            0.7, "ratio", "our choice: a GPU at half its peers' clock is slowed; boost clocks "
                          "of identical GPUs under one load differ by a few percent")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [self.rule(q, "warning", f"""{gpu_series_of('throttled')}
            > {t['throttle_ratio']}
            or ({gpu_series_of('sm_clock_vs_peers')} < {t['slow_clock_ratio']}
                and on ({q.ids.gpu}) {gpu_series_of('busy')} >= {t['gpu_busy_low']})""",
            f"""{q.node_gpu} was throttled {{{{ $value | humanizePercentage }}}} of the time
            (power cap, thermal slowdown or power brake), or its SM clock ran at that share of
            its identical peers' while busy.""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if _v(g.throttled, ">", t["throttle_ratio"]):
            return f"throttled {percent(g.throttled)} of the time"
        if _v(g.sm_clock_vs_peers, "<", t["slow_clock_ratio"]) and \
                _v(g.busy, ">=", t["gpu_busy_low"]):
            return (f"SM clock at {percent(g.sm_clock_vs_peers)} of its identical peers' while "
                    f"{percent(g.busy)} busy")
        return None


# --- the symptom and the exporter itself ---------------------------------------------------


class GPUUnderutilized(Heuristic):
    alert, verdict, kind, scope = ("GpuTrainGPUUnderutilized", "underutilized", "symptom",
                                   "rank_gpu")
    severity, for_ = "info / warning", "10m"
    summary = "A training run leaves its GPU mostly idle."
    advice = ("Find the stage that starves it: the other GpuTrain alerts for this run say "
              "which. A rank driving several GPUs as pipeline stages leaves each idle in its "
              "bubbles: more micro-batches per step fill them.")
    fires_when = "a rank's GPU busy < {gpu_busy_target} / < {gpu_busy_low} for {for}"
    why = ("A GPU that a run uses was busy (any kernel running) less than {gpu_busy_target} "
           "of the time over {rate_window} (info), or less than {gpu_busy_low} (warning). A "
           "profiling guide calls SM use under 50 % a sure sign the GPU is not used well; a "
           "TensorFlow performance study calls anything under 90 % wasted money. This is the "
           "symptom: the other GpuTrain alerts on the same run say which stage starves the "
           "GPU. The info tier covers the warning's range, so a GPU hovering at "
           "{gpu_busy_low} keeps alerting. A rank's GPUs are every GPU NVML lists its "
           "processes on (one process may drive several: device_map=\"auto\", pipeline "
           "stages), each judged; a GPU no run uses is idle capacity, never a run's.")
    confirm = (series_of("busy"),)
    panel = ('GpuTrain / Overview, the Runs table sorted by GPU busy; then GpuTrain / Run, '
             'panel "GPU busy" ({gpu_busy_low} and {gpu_busy_target} lines), and the panels '
             'below it for the stage.')
    thresholds = {
        "gpu_busy_low": Threshold(0.5, "ratio", "a profiling guide (SM use under 50 %) and the "
                                                "PyTorch profiler plugin"),
        "gpu_busy_target": Threshold(0.9, "ratio", "a TensorFlow performance study: under 90 % "
                                                   "is wasted money")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [
            self.rule(q, "info", f"{q.busy} < {t['gpu_busy_target']}",
                      f"""{q.gpu_who} was busy {{{{ $value | humanizePercentage }}}} of the time
                      over {WINDOWS['rate']}, below the {t['gpu_busy_target']} a well-fed GPU
                      reaches."""),
            self.rule(q, "warning", f"{q.busy} < {t['gpu_busy_low']}",
                      f"""{q.gpu_who} was busy {{{{ $value | humanizePercentage }}}} of the time
                      over {WINDOWS['rate']} (threshold {t['gpu_busy_low']}).""")]

    def holds_gpu(self, g: GpuReading, t: dict[str, float]) -> str | None:
        if _v(g.busy, "<", t["gpu_busy_target"]):
            return f"busy {percent(g.busy)}"
        return None


class ExporterDown(Heuristic):
    alert, verdict, kind, scope = "GpuTrainExporterDown", "exporter-down", "fault", "node"
    severity, for_ = "critical", "5m"
    summary = "Prometheus cannot scrape a gputrain-exporter."
    advice = ("Check the service (systemctl status gputrain-exporter) and the network path to "
              f"port {DEFAULT_METRICS_PORT}.")
    fires_when = "`up == 0` for {for}"
    why = "Prometheus cannot scrape the exporter: its GPUs and runs are unmonitored."
    confirm = ("up",)
    panel = ('GpuTrain / Overview: the node\'s runs and GPUs disappear; `up{{job=~"gputrain.*"}}` '
             'in Prometheus.')
    stepping = False

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "critical", q.metric("up") + " == 0",
                          f"{q.where} has not been scraped: its GPUs and runs are unmonitored.")]


# a rank's share of each GPU it holds, and the bytes it holds there (readings.READINGS)
GPU_SHARE, GPU_HELD = BY_FIELD["gpu_share"].record, BY_FIELD["gpu_memory_held"].record


class StrayCudaContext(Heuristic):
    alert, verdict, kind = "GpuTrainStrayCudaContext", "stray-context", "note"
    severity, for_ = "info", "10m"
    summary = ("A training process holds memory on a GPU it does no work on: a stray CUDA "
               "context.")
    advice = ("Load checkpoints with `torch.load(path, map_location=...)` (the rank's own "
              "device, or \"cpu\"), and call `torch.cuda.set_device(local_rank)` before "
              "anything touches CUDA: each stray context takes several hundred MiB of the other "
              "GPU's memory, from the rank that trains there.")
    fires_when = ("the rank's processes hold memory on a GPU where they do under {stray_share} "
                  "of the work its processes do, while doing {stray_own_share} or more of "
                  "another GPU's, for {for}")
    why = ("A `torch.load` without `map_location` restores tensors to the device they were "
           "saved from (cuda:0 for every rank of a data-parallel job), and any CUDA call before "
           "`set_device` opens a context on GPU 0: each such rank then holds a context (and "
           "what its caching allocator keeps) on a GPU another rank trains on, doing no work "
           "there. The exporter sees it in NVML's process list: memory held, and no share of "
           "that GPU's busy time (per-process samples), while the rank does its work on its "
           "own GPU. It is said beside the verdict, and such a GPU adds nothing to the rank's "
           "capacity (MFU's peak counts each GPU by the rank's share of it): before, it added "
           "that GPU's whole peak to every rank that held one.")
    confirm = (GPU_SHARE, GPU_HELD)
    panel = (f"Prometheus: `{GPU_SHARE}` (a rank's share of each GPU it holds) beside "
             "`gputrain_training_gpu_memory_bytes`.")
    profile = False
    stepping = False
    thresholds = {
        "stray_share": Threshold(0.01, "ratio", "a context that launches nothing: no share of "
                                                "the GPU's per-process busy time"),
        "stray_own_share": Threshold(0.5, "ratio", "the rank does its work on a GPU of its own "
                                                   "(most of that GPU's work is its)")}

    def rules(self, q: Q) -> list[dict]:
        t = q.t
        return [self.rule(q, "info", f"""{GPU_HELD} > 0 and on ({q.rank}, gpu, uuid) {q.stray}""",
            f"""{q.who} holds {{{{ $value | humanize1024 }}}}B on GPU {{{{ $labels.gpu }}}},
            where its processes do under {t['stray_share']} of the work: a stray CUDA
            context.""")]

    def holds(self, r: RankReport, t: dict[str, float]) -> str | None:
        stray = sorted((g for g in stray_gpus(r, t) if (r.gpu_memory_held.get(g) or 0) > 0),
                       key=lambda g: (len(g), g))
        if not stray:
            return None
        held = ", ".join(f"{r.gpu_memory_held[g] / 2**20:.0f} MiB on GPU {g}" for g in stray)
        return f"holds {held} where it does no work: a stray CUDA context"


class ClockOffset(Heuristic):
    alert, verdict, kind, scope = "GpuTrainClockOffset", "clock-offset", "note", "node"
    severity, for_ = "info", "10m"
    summary = "A node's clock is off Prometheus' clock."
    advice = ("Synchronise the node's clock (`chronyc tracking` or `timedatectl "
              "timesync-status` says how far off it is). No verdict reads the node's clock: the "
              "exporter ages pushes and readings by its own monotonic clock; but the timestamps "
              "it exports (a rank's last step, a regime's start) and its log read off by as "
              "much.")
    fires_when = ("the exporter's wall clock more than {clock_offset_seconds} from the time of "
                  "Prometheus' scrapes, for {for}")
    why = ("Each scrape carries the exporter's wall clock (`gputrain_exporter_time_seconds`, "
           "as node_exporter's `node_time_seconds`); the scrape's own time less it is the "
           "node's clock offset from Prometheus', within the scrape's latency. A node whose "
           "clock is minutes off used to read as frozen collectors and silent ranks (a "
           "timestamp compared across two machines); the rules now take every age from the "
           "exporter's monotonic clock, and say the offset here instead. The daemon's own "
           "page cannot see it: it has no other clock to compare with.")
    confirm = (series_of("clock_offset"),
               "gputrain_exporter_time_seconds")
    panel = ("Prometheus: `gputrain_exporter_time_seconds - "
             "timestamp(gputrain_exporter_time_seconds)`.")
    profile = False
    stepping = False
    thresholds = {"clock_offset_seconds": Threshold(
        30.0, "seconds", "well past NTP's offsets (milliseconds) and a scrape's latency, "
                         "well under the 2-minute silence that calls a run vanished")}

    def rules(self, q: Q) -> list[dict]:
        return [self.rule(q, "info", f"""abs({series_of('clock_offset')})
                          > {q.t['clock_offset_seconds']:g}""",
                          f"""The clock of {q.where} is {{{{ $value | printf "%.0f" }}}} s off
                          Prometheus' clock.""")]

    def holds_node(self, n: RankReport | NodeReport, t: dict[str, float]) -> str | None:
        offset = n.host.get("clock_offset")
        if offset is None or abs(offset) <= t["clock_offset_seconds"]:
            return None
        return (f"the node's clock is {abs(offset):.0f} s "
                f"{'ahead of' if offset > 0 else 'behind'} Prometheus' clock")


# The catalogue, in the decision order: faults, the stall, the pipeline from its input to its
# output, then what is not a stage of it, and the symptom. A rank's verdict is the first that
# holds.
CATALOGUE: tuple[Heuristic, ...] = (
    GPULost(), XidErrors(), GPUMemoryFault(), CollectorFailing(), ExporterDown(),
    CollectorStale(), RunNameShared(), RunFailed(), RunVanished(), RunRestarting(),
    RunHung(), Stalled(), CollectiveTimeoutRisk(), GPUShared(), PCIeLinkDegraded(),
    CPUQuotaBound(), HostMemoryPressure(), CPUPreprocessingBound(), DiskIOBound(), NetworkInputBound(), InputBound(),
    DataLoaderRestarts(), CommunicationBound(),
    HostToDeviceBound(), HostOverheadBound(), LaunchBound(), TensorCoresIdle(), LowMFU(),
    GPUMemoryUnderused(), StepTimeStalls(), StragglerRank(), HostMemoryLeak(),
    GPUMemoryNearLimit(), Throttling(), StrayCudaContext(), ClockOffset(),
    GPUUnderutilized(),
)


def _collect_thresholds(entries: Iterable[Heuristic]) -> dict[str, Threshold]:
    out: dict[str, Threshold] = {}
    for e in entries:
        for name, th in e.thresholds.items():
            if name in out:
                raise ValueError(f"threshold {name!r} is owned by two entries")
            out[name] = th
    return out


THRESHOLDS: dict[str, Threshold] = _collect_thresholds(CATALOGUE)
BY_ALERT: dict[str, Heuristic] = {e.alert: e for e in CATALOGUE}
BY_VERDICT: dict[str, Heuristic] = {e.verdict: e for e in CATALOGUE}
LEVELS = ("node", "global")
KINDS = ("fault", "state", "hang", "bottleneck", "health", "note", "symptom")
# the alerts whose firing for a rank asks for a profile of it (Alertmanager's webhook)
PROFILED_ALERTS: frozenset[str] = frozenset(e.alert for e in CATALOGUE if e.profiled)
# the alerts whose firing for a rank asks for py-spy stacks of it, and which capture
STACK_ALERTS: dict[str, str] = {e.alert: e.stacks for e in CATALOGUE if e.stacks}


def _median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def derived(thresholds: dict[str, float]) -> dict[str, float]:
    """Every entry's derived values (HostOverheadBound's phase share, ...), by name."""
    out: dict[str, float] = {}
    for e in CATALOGUE:
        out.update(e.derived(thresholds))
    return out


def show(name: str, value: float) -> str:
    """A threshold as people read it: ``5 %``, ``2x``, ``10 m``, ``4 h``. Derived values are
    shown as ratios, but the GPU retry interval, in seconds, and a ``_factor``, as one."""
    unit = THRESHOLDS[name].unit if name in THRESHOLDS else \
        ("seconds" if name.endswith("_retry") else
         "factor" if name.endswith("_factor") else "ratio")
    if unit == "ratio":
        return f"{value * 100:g} %"
    if unit == "factor":
        return f"{value:g}x"
    if unit == "count":
        return f"{value:g}"
    seconds = int(value)
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    return f"{seconds // 60} m" if seconds % 60 == 0 else f"{seconds} s"


def num(x: float) -> str:
    """A number as PromQL is written here: no trailing ``.0``."""
    return f"{x:g}"


def fill(text: str, thresholds: dict[str, float], for_: str = "") -> str:
    """``text`` with ``{name}`` replaced by the threshold (or derived value) shown in its unit,
    ``{<window>_window}`` by a window of the readings, ``{for}`` by ``for_``."""
    values = {name: show(name, v) for name, v in {**thresholds, **derived(thresholds)}.items()}
    windows = {f"{name}_window": w for name, w in WINDOWS.items()}
    return text.format(**values, **windows, throttle_reasons=", ".join(THROTTLE_REASONS),
                       **{"for": for_})


def defaults() -> dict[str, float]:
    """The default thresholds by name."""
    return {name: t.default for name, t in THRESHOLDS.items()}
