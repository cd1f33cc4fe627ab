"""Verdicts: a window's readings in, the catalogue's findings out, in its decision order.

:func:`judge` gives every rank (:class:`~exporter.heuristics.readings.RankReport`) a status, a
verdict, its reason and advice, and the other findings beside it; :func:`node_findings` gives
a node the faults of GPUs no rank owns. Each finding is one catalogue entry's condition
(:meth:`~exporter.heuristics.catalogue.Heuristic.finding`), evaluated on the values its alert
reads, so the verdict and the findings beside it are the catalogue alerts that fire. The
readings come from Prometheus (``diagnose``) or from the daemon's own history (the status
page, ``/api/v1/status``, ``top``): both are judged by this code.
"""

from __future__ import annotations

from exporter.heuristics.catalogue import (
    BY_VERDICT,
    CATALOGUE,
    GPUMemoryFault,
    GPUUnderutilized,
    alive,
    gone,
    hung_limit,
    shared_ranks,
    silent,
)
from exporter.heuristics.readings import (  # noqa: F401 - the readings, with the verdicts
    Finding,
    GpuReading,
    NodeReport,
    RankReport,
    mean,
    outside_steps,
    percent,
    rank_order,
    run_key,
)
from exporter.heuristics.regime import changed_text

UNDERUTILIZED = GPUUnderutilized.verdict  # busy under the target, no stage to blame
# Verdicts that are no alert of the catalogue: the good case, a pause, a start, the blind one
# and a clean end.
STATUS_ADVICE = {
    "gpu-bound": "The GPU is the bottleneck, as it should be. To make each GPU-second count, "
                 "profile the heaviest kernels.",
    "restarted": "Nothing to judge yet: the rank's process was replaced inside the window, and "
                 "rates across a restart say nothing about a bottleneck. It is judged again "
                 "once the window holds one process; if it keeps restarting, read the first "
                 "failure.",
    "paused": "Nothing to change yet: the rank made no step in the window (start-up, an "
              "evaluation, a checkpoint). It is judged again once it steps; a step that stays "
              "open past its limits is called hung or stalled (`GpuTrainRunHung`, "
              "`GpuTrainStalled`).",
    "warming-up": "Nothing to judge yet: the rank, its exporter or Prometheus started moments "
                  "ago, and a rate needs two samples in the window. Ask again after two scrape "
                  "intervals.",
    "no-gpu-data": "No GPU of this rank is known to the exporter: check that the client reports "
                   "its GPU (CUDA_VISIBLE_DEVICES or torch.cuda) and that the exporter sees it.",
    "finished": "Nothing to change: the rank closed cleanly (its client said goodbye).",
    "stopped": "Continue it (kill -CONT <pid>, or fg in its shell) when you mean it to train "
               "again; its peers wait in their collectives meanwhile, and a collective's "
               "timeout may end them.",
    "ended": "Call close() (or leave the monitor's `with` block) at the end of training, so "
             "that a clean end reads finished: an exit without it cannot be told from a crash "
             "that a launcher caught (torch.multiprocessing.spawn turns an exception into an "
             "exit status).",
    "waiting": "Nothing to change in this rank: its step waits for a peer inside a declared "
               "phase (a checkpoint, an evaluation). If that phase never ends, it is called "
               "stalled at its phase limit; make long saves asynchronous so the others wait "
               "less.",
}
STATUS_SUMMARY = {
    "gpu-bound": "The GPUs are busy: the model's own work sets the pace.",
    "restarted": "The rank's process was replaced inside the window.",
    "paused": "The rank made no step in the window.",
    "warming-up": "The window holds too few samples for a rate yet.",
    "no-gpu-data": "The exporter knows no GPU of this rank.",
    "finished": "The rank finished: it closed cleanly.",
    "waiting": "The rank waits for a peer inside a declared phase.",
    "ended": "The rank's process ended without saying it finished.",
    "stopped": "The rank's process is stopped on purpose (SIGSTOP).",
}
# Every verdict a rank can get, in the order a page lists them: what to act on first
ORDER: tuple[str, ...] = (*(e.verdict for e in CATALOGUE if e.kind not in ("symptom", "note")),
                          UNDERUTILIZED, "waiting", "restarted", "paused", "warming-up",
                          "no-gpu-data", "stopped", "ended",
                          "gpu-bound", "finished")
# A rank's status by the kind of its verdict: a run that is gone is stopped, not a bottleneck
STATUS = {"fault": "fault", "state": "stopped", "hang": "hung", "bottleneck": "bottleneck",
          "health": "bottleneck"}
# verdicts whose status is their own: a failure is not just stopped
STATUS_OF = {"failed": "failed"}
# said beside whatever verdict a rank gets, never as it (a node's clock offset)
NOTES: tuple[str, ...] = tuple(e.verdict for e in CATALOGUE if e.kind == "note")


def summary(verdict: str) -> str:
    """A verdict in one sentence: the catalogue entry's summary, for the page and ``top``."""
    return STATUS_SUMMARY.get(verdict) or BY_VERDICT[verdict].summary


def advice(verdict: str) -> str:
    """What to change for a verdict: the catalogue's advice, the same text the alert gives."""
    return STATUS_ADVICE.get(verdict) or BY_VERDICT[verdict].advice


def advice_for(verdict: str, rep: RankReport) -> str:
    """What to change for a rank's verdict or finding: the advice that fits what was seen of
    it (:meth:`~exporter.heuristics.catalogue.Heuristic.advice_for`)."""
    return STATUS_ADVICE.get(verdict) or BY_VERDICT[verdict].advice_for(rep)


def rank_findings(rep: RankReport, t: dict[str, float], run_steps: bool = True,
                  shared: bool = False) -> dict[str, str]:
    """Every finding of one rank that holds, with its reason, in the decision order: faults
    of its GPUs and node first. As the alerts, an entry about the rank's steps holds only while
    it steps (a stalled rank is stalled, and its GPUs' and node's faults and health, nothing
    else), and one about its run's share of a GPU while a rank of the run does
    (``run_steps``); none that compares the ranks of its run where two jobs share the run's
    name (``shared``)."""
    out: dict[str, str] = {}
    for e in CATALOGUE:
        if e.kind == "symptom" or e.scope == "run" or (e.run_stepping and not run_steps) or \
                (shared and e.compares_ranks):
            continue
        why = e.finding(rep, t)
        if why:
            out[e.verdict] = why
    return out


def run_findings(reports: list[RankReport], t: dict[str, float]) -> dict[int, dict[str, str]]:
    """The findings that compare or cover the ranks of a run (a straggler, a vanished run),
    by the rank's ``id``, each with its reason: the run alerts' conditions across each run
    (``run`` and the run labels beyond it, never ``job``)."""
    runs: dict[tuple, list[RankReport]] = {}
    for rep in reports:
        runs.setdefault(run_key(rep), []).append(rep)
    out: dict[int, dict[str, str]] = {}
    for entry in (e for e in CATALOGUE if e.scope == "run"):
        for ranks in runs.values():
            if entry.compares_ranks and shared_ranks(ranks, t):
                continue  # two jobs under one name: no one run's ranks to compare
            for who, why in entry.holds_run(ranks, t).items():
                out.setdefault(who, {})[entry.verdict] = why
    return out


def judge(reports: list[RankReport], t: dict[str, float]) -> list[RankReport]:
    """Set every rank's status, verdict and findings in the catalogue's decision order; the
    findings are exactly the catalogue alerts that fire for it."""
    per_run = run_findings(reports, t)
    per_phase: dict[tuple, list[RankReport]] = {}
    for r in reports:
        if alive(r, t) and r.phase_in_progress:
            per_phase.setdefault(run_key(r), []).append(r)
    stepping = {run_key(r) for r in reports if r.stepping}
    least: dict[tuple, float] = {}
    for r in reports:
        if r.comm_exposed_ratio is not None:
            key = run_key(r)
            least[key] = min(least.get(key, r.comm_exposed_ratio), r.comm_exposed_ratio)
    for r in reports:
        r.run_comm_exposed_min = least.get(run_key(r))
    runs: dict[tuple, list[RankReport]] = {}
    for r in reports:
        runs.setdefault(run_key(r), []).append(r)
    shared = {key for key, ranks in runs.items() if shared_ranks(ranks, t)}
    for rep in reports:
        found = rank_findings(rep, t, run_key(rep) in stepping, run_key(rep) in shared)
        for name, why in per_run.get(id(rep), {}).items():
            if name in ("vanished", "failed", "hung") or "stalled" not in found:
                found[name] = why
        ordered = [v for v in ORDER if v in found]
        busy = mean([x.busy for x in rep.gpus])
        waits = waiting_for(rep, per_phase.get(run_key(rep), []), t)
        if rep.finished and not any(BY_VERDICT[v].kind == "fault" for v in ordered):
            # a clean close(): finished, whatever its last window held
            rep.status = rep.verdict = "finished"
            ago = rep.seconds_since_push
            how = {"completed": "its loop ran to its end", "exited": "its process exited "
                   "normally"}.get(next(iter(rep.exit), ""), "closed cleanly")
            rep.reason = how + (f" {ago:.0f} s ago" if ago is not None else "")
            rep.also = [Finding(n, found[n], advice_for(n, rep)) for n in ordered]
        elif rep.stopped and not rep.ended:
            rep.status, rep.verdict = "stopped", "stopped"
            rep.reason = ("its process is stopped (SIGSTOP or Ctrl-Z): no step and no push "
                          "until it is continued (SIGCONT, fg)")
            rep.also = [Finding(n, found[n], advice_for(n, rep)) for n in ordered
                        if BY_VERDICT[n].kind == "fault"]
        elif rep.ended and not rep.failed and not any(
                BY_VERDICT[v].kind == "fault" for v in ordered):
            rep.status, rep.verdict = "stopped", "ended"
            ago = rep.seconds_since_push
            rep.reason = ("its process exited without close() or the end of its loop"
                          + (f" {ago:.0f} s ago" if ago is not None else ""))
            rep.also = [Finding(n, found[n], advice_for(n, rep)) for n in ordered]
        elif ordered:
            rep.verdict = ordered[0]
            rep.status = STATUS_OF.get(rep.verdict) or STATUS[BY_VERDICT[rep.verdict].kind]
            rep.reason = found[ordered[0]]
            rep.also = [Finding(n, found[n], advice_for(n, rep)) for n in ordered[1:]]
        elif waits:
            # a live rank whose step waits on a peer's declared phase: no hang, no stall
            rep.status, rep.verdict, rep.reason = "ok", "waiting", waits
        elif gone(rep, t) or silent(rep, t):
            # silent (its run not vanished as a whole): its last window says nothing of now
            rep.status, rep.verdict = "ok", "paused"
            others = any(alive(r, t) for r in runs[run_key(rep)] if r is not rep)
            rep.reason = (f"no push for {rep.seconds_since_push:.0f} s"
                          + (" while its process runs on its node (frozen, or cut off from "
                             "the exporter)" if rep.process_running else "")
                          + (" while its run's other ranks push" if others else "")
                          + ": nothing is judged of its steps")
        elif rep.restarts_recent:
            rep.status, rep.verdict = "ok", "restarted"
            rep.reason = (f"its process was replaced {rep.restarts_recent:.0f} time(s) in the "
                          "window: its rates straddle a restart")
        elif busy is None and rep.gpus and rep.steps_per_second is None:
            # the GPU is known, but neither its busy time nor the steps have two samples yet
            rep.status, rep.verdict = "ok", "warming-up"
            rep.reason = ("too few samples in the window for a rate of its steps or its "
                          "GPUs' busy time: a run, exporter or Prometheus that just started")
        elif busy is None:
            rep.status = rep.verdict = "no-gpu-data"
            rep.reason = ("the exporter reports no busy time for this rank's GPUs" if rep.gpus
                          else "the exporter reports no GPU for this rank")
        elif not rep.stepping:
            rep.status, rep.verdict = "ok", "paused"
            phase = outside_steps(rep)
            where = f"in {phase[0]} ({percent(phase[1])} of the window), no step" if phase \
                else "no step in the window"
            rep.reason = f"{where}; GPU busy {percent(busy)}"
        elif BY_VERDICT[UNDERUTILIZED].finding(rep, t):  # as its alert: any GPU under target
            rep.status = rep.verdict = UNDERUTILIZED
            rep.reason = (f"GPU busy {percent(busy)}, a GPU under "
                          f"{percent(t['gpu_busy_target'])}, and no stage of the pipeline "
                          "stands out")
        else:
            rep.status, rep.verdict = "ok", "gpu-bound"
            rep.reason = f"GPU busy {percent(busy)}"
        said = {f.name for f in rep.also}
        rep.also += [Finding(n, found[n], advice_for(n, rep)) for n in NOTES
                     if n in found and n not in said]
        rep.advice = advice_for(rep.verdict, rep)
        if rep.regime_changed_seconds is not None:
            rep.reason += f"; {changed_text(rep.regime_changed_seconds)}"
    return reports


def waiting_for(rep: RankReport, phased: list[RankReport], t: dict[str, float]) -> str:
    """Why a live rank without a phase of its own waits for peers in a declared phase (their
    checkpoint, their evaluation), or "": its step in progress is theirs to end."""
    if not alive(rep, t) or rep.phase_in_progress or not phased or \
            (rep.step_in_progress or 0.0) <= min(hung_limit(rep, t), t["hung_min_seconds"]):
        return ""
    who = "; ".join(f"rank {p.rank}'s {name} ({seconds:.0f} s so far)"
                    for p in phased for name, seconds in p.phase_in_progress.items())
    return f"its step waits for {who}; no step for {rep.step_in_progress:.0f} s"


def node_findings(node: NodeReport, t: dict[str, float]) -> NodeReport:
    """The faults and health findings of a node and of each of its GPUs, whoever uses them:
    (gpu, or "" for the node; severity; finding), in the decision order."""
    node.findings = []
    if node.up is False:
        e = BY_VERDICT["exporter-down"]
        node.findings.append(("", e.severity, Finding(e.verdict, "Prometheus cannot scrape "
                                                      "the exporter", e.advice)))
    for e in CATALOGUE:
        if e.scope == "node" and e.judged(node, t) and (why := e.holds_node(node, t)):
            node.findings.append(("", e.severity, Finding(e.verdict, why, e.advice)))
        elif e.scope == "gpu" and e.judged(node, t):
            for g in node.gpus:
                if why := e.holds_gpu(g, t):
                    severity = GPUMemoryFault.severity_of(g) if isinstance(
                        e, GPUMemoryFault) else e.severity
                    node.findings.append((g.gpu, severity, Finding(e.verdict, why, e.advice)))
    return node


def visibility(reports: list[RankReport], shard: str = "") -> list[RankReport]:
    """Mark the ranks of every run that is only partly visible, with why: ranks missing
    below the highest one seen, or ``shard`` (this server looks like one shard of several)."""
    runs: dict[tuple, list[RankReport]] = {}
    for rep in reports:
        runs.setdefault(run_key(rep), []).append(rep)
    for ranks in runs.values():
        numbers = {int(r.rank) for r in ranks if r.rank.isdigit()}
        # the ranks a client says its run has, else those up to the highest seen
        world = max((int(r.world_size) for r in ranks if r.world_size), default=0)
        top = max(world - 1, max(numbers, default=-1))
        missing = sorted(set(range(top + 1)) - numbers) if numbers else []
        why = []
        if missing:
            why.append(f"ranks {_ranges(missing)} of 0-{top} are not visible")
        if shard:
            why.append(shard)
        for r in ranks:
            r.partial = "; ".join(why)
    return reports


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def wasted_gpus(ranks: list[RankReport]) -> float | None:
    """GPU-seconds per second that the ranks' GPUs sat idle (1 - busy; a GPU that two ranks
    share counts once), as ``run:gputrain_gpu_wasted_seconds:rate5m`` records it."""
    idle = {(r.instance, x.gpu, x.uuid): 1 - x.busy
            for r in ranks for x in r.gpus if x.busy is not None}
    return sum(idle.values()) if idle else None
