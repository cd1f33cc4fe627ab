"""The PromQL the heuristics are written in: the labels rules group and join by, the recording
rules (each reading of :data:`exporter.heuristics.readings.READINGS` as a series, from its
row's template, and the series beside them that are no reading), and the context an alert's
condition is written with (:class:`Q`).

Every range comes from :data:`~exporter.heuristics.readings.WINDOWS`; ``diagnose`` asks for the
same expressions over another rate window (``recording_rules(..., rate="15m")``) rather than
rewriting them. The record names keep ``rate5m``, ``p99_30m``: they are the shipped names.
"""

from __future__ import annotations

import re
from typing import Any

from exporter.config import parse_duration
from exporter.heuristics.location import WAITING
from exporter.heuristics.readings import (
    ACCOUNTED,
    BY_FIELD,
    LOADER_START,
    PEAK_FLOPS,
    READINGS,
    RECORDED_FRAGMENTS,
    REGIME_GPU,
    RUN_GPU_BUSY,
    STACK_WAITING,
    STEP_SECONDS,
    UNATTRIBUTED_BUSY,
    WAIT,
    WALL,
    WINDOWS,
    Scope,
    of_scope,
    series_of,
    window_seconds,
)
from exporter.protocol import LOADER_START_PHASE, OUTSIDE_STEP_PHASES

# the phases that are part of a step (evaluation, checkpoint saves and start-up are not)
IN_STEP = 'phase!~"' + "|".join(sorted(OUTSIDE_STEP_PHASES)) + '"'
OUTSIDE_STEP = 'phase=~"' + "|".join(sorted(OUTSIDE_STEP_PHASES)) + '"'
# badput causes beside the phases: what the rank's wall time went to when not stepping
DATA_WAIT_CAUSE, OUTSIDE_STEPS_CAUSE = "data_wait", "outside_steps"
# the clock-event reasons that are throttling (sync boost is not: it aligns clocks on purpose)
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
THROTTLE_REASONS = ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown", "hw_slowdown")

# The recording rules written here beside the readings' (readings.READINGS), that the alerts,
# diagnose and the dashboards read too: each named once (those the readings' templates read
# are named in exporter.heuristics.readings)
WASTED_SECONDS = "run:gputrain_gpu_wasted_seconds:rate5m"
RANK_BUSY_AVG = "run_rank:gputrain_gpu_busy_ratio:avg5m"
COMM_BYTES = "run_rank:gputrain_training_comm_bytes:rate5m"
ENERGY_PER_SAMPLE = "run_rank:gputrain_training_energy_joules_per_sample:rate5m"
CPU_CORES = "run_rank:gputrain_training_process_cpu_cores:rate5m"
RESTARTS_RECENT = "run_rank:gputrain_training_restarts:resets5m"  # in the rate window
COMPUTE_MEAN = "run_rank:gputrain_training_compute_seconds:mean5m"  # a step's, in seconds
STEP_PHASE_MAX = "run_rank:gputrain_training_step_phase_ratio:max_rate5m"  # its largest phase
# the two guards most alerts hold (Q.stepping, Q.fresh), recorded once an evaluation
# (Q.guards) rather than written into each alert: at 400 fleet nodes the straggler alert,
# which held the first twelve times, took 2.62 s a pass, 0.67 s reading it recorded
STEPPING = "run_rank:gputrain_training_stepping:bool"
STALENESS = "instance:gputrain_collector_age:max_intervals"


class Identity:
    """The label lists the rules group and join by, from the ``run_labels`` setting.

    A run is ``run_labels`` (default ``run``); a node is the run labels other than ``run``
    (``cluster``) with ``job, instance``; a rank is a node's labels with ``run, rank``."""

    def __init__(self, run_labels: list[str] | tuple[str, ...] = ("run",)) -> None:
        self.run_labels = tuple(run_labels)
        self.extra = tuple(x for x in run_labels if x != "run")  # what tells runs apart
        self.node_tuple = tuple(dict.fromkeys([*self.extra, "job", "instance"]))
        self.rank_tuple = (*self.node_tuple, "run", "rank")
        # as PromQL label lists
        self.run = ", ".join(run_labels)
        self.node = ", ".join(self.node_tuple)
        self.rank = ", ".join(self.rank_tuple)
        self.gpu = f"{self.node}, gpu, uuid"
        self.run_gpu = ", ".join(dict.fromkeys([*run_labels, *self.node_tuple, "gpu", "uuid"]))


def check_run_labels(value: Any) -> list[str]:
    """``run_labels`` as a checked list; ValueError says what is wrong."""
    if isinstance(value, str):
        value = [x.strip() for x in value.split(",") if x.strip()]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"'run_labels' must be a list of label names, got {value!r}")
    bad = [x for x in value if not LABEL_NAME.fullmatch(x)]
    if bad:
        raise ValueError(f"'run_labels': {bad[0]!r} is not a label name")
    if "run" not in value:
        raise ValueError("'run_labels' must include 'run'")
    for x in ("instance", "rank"):
        if x in value:
            raise ValueError(f"'run_labels' must not include '{x}': a run spans many of them")
    return list(dict.fromkeys(value))


def identity(cfg: dict) -> Identity:
    """The grouping labels of a merged configuration."""
    return Identity(cfg["run_labels"])


def new_errors(counter: str, window: str) -> str:
    """The errors of ``counter`` (a selector) new in ``window``: its increase, or the count of
    a series that appeared in it (a counter's first sample is no increase; the exporter writes
    an Xid code's series at its first error, and finds the driver's ECC count when it starts)."""
    return (f"(increase({counter}[{window}]) > 0) "
            f"or ({counter} > 0 unless {counter} offset {window})")


def restarts(selector: str, ids: Identity, window: str) -> str:
    """Of each rank, how often its process was replaced in ``window``: the resets of the
    counters each new process starts again from 0, its steps and its process tree's CPU
    seconds (the most either saw: a process that dies before its first step resets only the
    CPU). Its wall time does not reset: the daemon carries it across processes."""
    parts = [f'label_replace(resets({name}{{{selector}}}[{window}]), "counter", "{short}", "", "")'
             for name, short in (("gputrain_training_steps_total", "steps"),
                                 ("gputrain_training_process_cpu_seconds_total", "cpu"))]
    return f"max by ({ids.rank}) ({' or '.join(parts)})"


def tree_growth(pss: str, rss: str, window: str, offset: str = "") -> str:
    """Of each rank's series, how fast its process tree's memory grows over ``window`` (bytes
    per second): its proportional set size where the client pushes it, else its resident
    memory (which counts a page shared by its DataLoader workers once per worker, and misses
    the copies they make of it)."""
    off = f" offset {offset}" if offset else ""
    return f"(deriv({pss}[{window}]{off}) or deriv({rss}[{window}]{off}))"


def memory_outside(available: str, growth: str, ids: Identity, window: str,
                   offset: str = "") -> str:
    """Of each node, how fast its available memory falls (bytes per second) beyond what the
    training process trees' own memory explains: ``growth`` (of each rank, as
    :func:`tree_growth` writes it) summed over the node. A page a DataLoader worker copies on
    access, shared memory, a process no client reports: the memory lost outside the trees."""
    off = f" offset {offset}" if offset else ""
    node = ids.node
    return (f"-(max by ({node}) (deriv({available}[{window}]{off})) + (sum by ({node}) "
            f"({growth}) or max by ({node}) ({available}) * 0))")


def on_prometheus_clock(prefix: str, s: str, by: str, timestamp: str = "timestamp") -> str:
    """When something the exporter ages happened, as a time on Prometheus' clock: the scrape's
    time less the age the exporter gave at that scrape (``<prefix>_age_seconds``, its own
    monotonic clock), so a node whose clock is minutes off reads neither silent nor old;
    ``<prefix>_<timestamp>_seconds`` (the exporter's wall clock) only where an exporter older
    than the age gauge gives no age."""
    age = f"{prefix}_age_seconds{{{s}}}"
    return (f"max by ({by}) (timestamp({age}) - {age}) "
            f"or max by ({by}) ({prefix}_{timestamp}_seconds{{{s}}})")


def collector_age(selector: str, ids: Identity) -> str:
    """Of each collector, how old its last success was when Prometheus last scraped it, in
    the exporter's sampler intervals: the age the exporter wrote at that scrape, by its own
    monotonic clock (a frozen page ages at every scrape; a node's clock offset does not
    enter). From an exporter older than the age gauge, the scrape's time less the success's
    wall-clock time."""
    age = f"gputrain_collector_age_seconds{{{selector}}}"
    last = f"gputrain_collector_last_success_timestamp_seconds{{{selector}}}"
    return (f"({age} or (timestamp({last}) - {last})) / on ({ids.node}) group_left "
            f"max by ({ids.node}) (gputrain_sampler_interval_seconds{{{selector}}})")


def rank_gpu_join(selector: str, per_gpu: str, ids: Identity) -> str:
    """``per_gpu`` (a recording rule name) for the GPUs each rank uses, joined through
    ``gputrain_training_gpu_info``: a rank's labels and gpu, uuid."""
    return (f"max by ({ids.rank}, gpu, uuid) (gputrain_training_gpu_info{{{selector}}}) "
            f"* on ({ids.gpu}) group_left {per_gpu}")


def recording_rules(selector: str, ids: Identity | None = None,
                    rate: str = WINDOWS["rate"]) -> dict[str, str]:
    """The recording rules' expressions by record name; ``rate`` is the range of their ratios
    and means (the shipped rules': the rate window)."""
    return {r["record"]: r["expr"] for r in recording(selector, ids or Identity(), rate)}


# "group_left name" must not become "group_left (expr)": the parser reads a label list there
_BARE_GROUPING = re.compile(r"\b(group_left|group_right) (?=[a-z_]+:)")


# a whole name (a metric's, a recording rule's), with the range that may follow it
_NAME = re.compile(r"(?<![\w:])([a-zA-Z_:][\w:]*)(?![\w:])(\[\w+\])?")


def inline(expr: str, records: dict[str, str]) -> str:
    """``expr`` with every recording rule it names replaced by the rule's expression, so it
    runs on a Prometheus that does not evaluate the rules (diagnose, a backfilled replay)."""
    found = 0

    def written(m: re.Match) -> str:
        nonlocal found
        record = records.get(m.group(1))
        if record is None:
            return m.group(0)
        found += 1
        # a recorded series over a range becomes a subquery of its expression
        return f"({record})" + (f"{m.group(2)[:-1]}:]" if m.group(2) else "")

    # one scan for names, each looked up (an alternation of every record's name was a
    # regex that tried each of them at each position)
    for _ in range(10):  # recording rules built on recording rules
        expr = _BARE_GROUPING.sub(r"\1 () ", expr)
        found = 0
        expr = _NAME.sub(written, expr)
        if not found:
            return expr
    raise ValueError(f"recording rules nested too deep in {expr!r}")


# A rank's regime (exporter.heuristics.regime): where it began (a reading: how long ago its
# run changed pace), and its age while the rank is read over the regime window instead of the
# rate window (absent otherwise)
REGIME_START = BY_FIELD["regime_changed_seconds"].record
OPEN = BY_FIELD["step_in_progress"].record
TYPICAL = BY_FIELD["typical_step_seconds"].record  # the process's mean step: no open step in it
REGIME_SHORT = "run_rank:gputrain_training_regime_age_seconds:short_window"
# ... and while it is younger than the quantile window: its percentiles and stall share are
# read over the rate window (over the regime window where REGIME_SHORT holds), never over
# old-regime steps
REGIME_YOUNG = "run_rank:gputrain_training_regime_age_seconds:quantile_window"
QUANTILE_RECORDS = frozenset(x.record for x in READINGS if x.window == "quantile")


def regime_record(gpu_record: str) -> str:
    """The per-GPU series of a GPU reading over the regime window, beside its rate-window one
    (``gpu:gputrain_gpu_busy_ratio:rate5m`` -> ``...:rate1m``; ``...:ratio`` ->
    ``...:ratio_1m``): what a young regime's ranks read of their GPUs."""
    level, metric, op = gpu_record.split(":")
    regime = WINDOWS["regime"]
    return f"{level}:{metric}:" + (op.replace("5m", regime) if "5m" in op else f"{op}_{regime}")


# each GPU reading of a rank read over the regime window where its regime is young, by its
# per-GPU series: the series over the regime window
REGIME_RECORDS = {BY_FIELD[f].gpu_record: regime_record(BY_FIELD[f].gpu_record)
                  for f in REGIME_GPU}
# over the rate window whatever the regime: whether the window straddles a restart
_NOT_SELECTED = (RESTARTS_RECENT,)


def regime_rules(s: str, ids: Identity, r: str = WINDOWS["rate"]) -> list[dict]:
    """The selector of the ranks read over the regime window: those whose regime (from
    :data:`REGIME_START`) fills it and is younger than ``r``, and those that are themselves
    (their wall seconds) (:func:`exporter.heuristics.regime.short_window` is the same
    condition, of either age)."""
    young, window = window_seconds("regime"), parse_duration(r)
    # ... or the rank itself is (its wall seconds): never read over what its GPUs did
    # before it came
    wall = f"max by ({ids.rank}) (gputrain_training_elapsed_seconds_total{{{s}}})"
    return [_rec(REGIME_SHORT, f"(time() - {REGIME_START}) >= {young:g} < {window:g} "
                               f"or {wall} >= {young:g} < {window:g}"),
            _rec(REGIME_YOUNG, f"(time() - {REGIME_START}) < {window_seconds('quantile'):g}")]


def regime_selected(short: str, long: str, ids: Identity) -> str:
    """A rank's reading over the regime window (``short``) where its regime is young, over the
    rate window (``long``) elsewhere."""
    return (f"(({short}) and on ({ids.rank}) {REGIME_SHORT}) or "
            f"(({long}) unless on ({ids.rank}) {REGIME_SHORT})")


def quantile_selected(short: str, medium: str, long: str, ids: Identity) -> str:
    """A quantile-window reading (percentiles, the stall share): over the regime window where
    the regime is that young (:data:`REGIME_SHORT`), over the rate window (``medium``) while
    it is younger than the quantile window, over the quantile window elsewhere: after a change
    of pace, the tail is the new regime's too."""
    return (f"(({short}) and on ({ids.rank}) {REGIME_SHORT}) or "
            f"(({medium}) and on ({ids.rank}) {REGIME_YOUNG} "
            f"unless on ({ids.rank}) {REGIME_SHORT}) or "
            f"(({long}) unless on ({ids.rank}) {REGIME_YOUNG})")


def recording(s: str, ids: Identity, r: str = WINDOWS["rate"]) -> list[dict]:
    """Recording rules: level:metric:operation. Ratios divide separately-summed counters over
    ``r``, or over the regime window for a rank whose run changed pace less than ``r`` ago
    (:mod:`exporter.heuristics.regime`); the step-time percentiles take the quantile window.
    Each rule comes after the rules whose series it reads."""
    regime = WINDOWS["regime"]
    short = {x["record"]: x["expr"] for x in _windowed(s, ids, regime, quantile=regime)}
    for x in (BY_FIELD[f] for f in REGIME_GPU):
        short[x.record] = " ".join(rank_gpu_join(s, REGIME_RECORDS[x.gpu_record], ids).split())
    medium = {x["record"]: x["expr"] for x in _readings("rank", s, ids, r, quantile=r)}
    out = regime_rules(s, ids, r)
    for rule in _windowed(s, ids, r):
        name, expr = rule["record"], rule["expr"]
        if name in REGIME_RECORDS:
            out.append(_rec(REGIME_RECORDS[name], short[name]))
        if name in QUANTILE_RECORDS:
            rule = _rec(name, quantile_selected(short[name], medium[name], expr, ids))
        elif name.startswith("run_rank") and name not in _NOT_SELECTED and short[name] != expr:
            rule = _rec(name, regime_selected(short[name], expr, ids))
        out.append(rule)
    return _in_order(out)


def _in_order(rules: list[dict]) -> list[dict]:
    """``rules`` in their order, but a rule that reads another's series moves that rule ahead
    of itself (a group evaluates its rules in turn: one read before it is recorded is a cycle
    old); ValueError on rules that read each other."""
    by_name = {rule["record"]: rule for rule in rules}
    named = re.compile("(?<![\\w:])(" + "|".join(map(re.escape, by_name)) + ")(?![\\w:])")
    out: dict[str, dict] = {}

    def add(rule: dict, path: tuple[str, ...] = ()) -> None:
        name = rule["record"]
        if name in path:
            raise ValueError(f"recording rules read each other: {' -> '.join((*path, name))}")
        for read in named.findall(rule["expr"]):
            if read != name and read not in out:
                add(by_name[read], (*path, name))
        out.setdefault(name, rule)

    for rule in rules:
        add(rule)
    return list(out.values())


def _fragments(s: str, ids: Identity, w: str) -> dict[str, str]:
    """What a reading's template (:attr:`Reading.expr`) and the rules beside it are written
    with: the selector, the label lists, the range ``w``, and the parts of a rank's wall time
    over ``w`` (each divides by ``gputrain_training_elapsed_seconds_total``)."""
    rank = ids.rank
    # the readings' own trees, rendered: the rules and the daemon read one definition
    wall, steps, wait = (x.template().format(s=s, w=w, rank=rank)
                         for x in (WALL, STEP_SECONDS, WAIT))

    def phases(selector: str) -> str:
        # 0 where the rank has no such phase, rather than no result at all
        return (f"(sum by ({rank}) (rate(gputrain_training_phase_seconds_total{{{s},{selector}}}"
                f"[{w}])) or 0 * {wall})")

    # A step straddling the window's start counts whole at its end, so at a run's first and
    # last pushes a raw difference can go past the wall time by up to a step: the parts that
    # would go negative count 0
    # the step in progress, where it has run longer than the window's mean step: it weighs in
    # the step time and the throughput as it grows (its part inside the window, a second a
    # second of it, and one step more); where the window holds no step, it counts whole
    seconds = parse_duration(w) if w else 0.0
    open_ = f"max by ({rank}) (gputrain_training_step_in_progress_seconds{{{s}}})"
    mean = (f"({steps} / sum by ({rank}) "
            f"(rate(gputrain_training_step_duration_seconds_count{{{s}}}[{w}])))")
    longer = f"unless on ({rank}) ({open_} <= {mean})"
    open_part = (f"(clamp_max({open_}, {seconds:g}) / {seconds:g} {longer} or 0 * {steps})"
                 if seconds else "0")
    open_count = (f"({open_} * 0 + 1 / {seconds:g} {longer} or 0 * {steps})"
                  if seconds else "0")
    return {"s": s, "w": w, "rank": rank, "gpu": ids.gpu, "node": ids.node, "run": ids.run,
            "open_part": open_part, "open_count": open_count,
            "last_push": on_prometheus_clock("gputrain_training_last_push", s, rank),
            "regime_start": on_prometheus_clock("gputrain_training_regime", s, rank,
                                                "start_timestamp"),
            "run_gpu": ids.run_gpu, "wall": wall, "steps": steps, "wait": wait,
            "all_phases": phases("phase!=''"), "outside": OUTSIDE_STEP,
            "productive": f"clamp_min({steps} - {wait} - {phases(IN_STEP)}, 0)",
            "outside_steps": f"clamp_min({wall} - {steps} - {phases(OUTSIDE_STEP)}, 0)",
            "throttle_reasons": "|".join(THROTTLE_REASONS),
            "data_wait_cause": DATA_WAIT_CAUSE, "outside_steps_cause": OUTSIDE_STEPS_CAUSE,
            **RECORDED_FRAGMENTS}


def _readings(scope: Scope, s: str, ids: Identity, r: str,
              quantile: str = WINDOWS["quantile"]) -> list[dict]:
    """The recording rule of each reading of ``scope`` (:data:`READINGS`), over its window
    (``r`` for the rate window, ``quantile`` for the quantile window); a GPU reading's
    per-GPU series."""
    out = []
    for x in of_scope(scope):
        w = r if x.window == "rate" else quantile if x.window == "quantile" else \
            WINDOWS.get(x.window or "", "")
        out.append(_rec(x.gpu_record if scope == "rank_gpu" else x.record,
                        x.template.format(**_fragments(s, ids, w))))
    return out


def _windowed(s: str, ids: Identity, r: str, quantile: str = WINDOWS["quantile"]) -> list[dict]:
    """The recording rules with every ratio and mean over ``r`` (the quantile readings over
    ``quantile``): the readings', and those of the series beside them that alerts, dashboards
    and readings read."""
    rank, gpu, f = ids.rank, ids.gpu, _fragments(s, ids, r)
    gpu_power = "gpu:gputrain_gpu_power_watts:rate5m"
    return [
        *_readings("rank", s, ids, r, quantile),
        # how often each rank's process was replaced in the rate window: rates across a
        # restart are no bottleneck (recorded, so that global rules may read it too)
        _rec(RESTARTS_RECENT, restarts(s, ids, r)),
        _rec(COMM_BYTES, f"""
            sum by ({rank}) (rate(gputrain_training_comm_bytes_total{{{s}}}[{r}]))"""),
        # a step's compute: its time less the data wait and, where measured, the wait for
        # gradient communication (a fast rank waiting for a slow one computes no longer)
        _rec(COMPUTE_MEAN, f"""
            ({f['steps']}
             - {f['wait']}
             - (sum by ({rank}) (rate(gputrain_training_comm_exposed_seconds_total{{{s}}}[{r}]))
                or 0 * {f['steps']}))
            / sum by ({rank}) (rate(gputrain_training_step_duration_seconds_count{{{s}}}[{r}]))"""),
        _rec(STEP_PHASE_MAX, f"""
            max by ({rank}) (
              sum by ({rank}, phase) (rate(gputrain_training_phase_seconds_total{{{s},{IN_STEP}}}[{r}]))
              / on ({rank}) group_left
              {f['steps']})"""),
        _rec("run_rank:gputrain_training_checkpoint_ratio:rate5m", f"""
            sum by ({rank}) (rate(gputrain_training_phase_seconds_total{{{s},phase="checkpoint"}}[{r}]))
            / {f['steps']}"""),
        _rec(CPU_CORES, f"""
            sum by ({rank}) (rate(gputrain_training_process_cpu_seconds_total{{{s}}}[{r}]))"""),
        # whether a rank's last stacks show it waiting for a peer (a collective): before its
        # first step such a rank is held to the hang ceiling, not to the first step's
        # allowance (catalogue.hung_limit), and a peer's DataLoader start it waits for past
        # the ceiling is a hang (catalogue.stuck_starts)
        _rec(STACK_WAITING, f"""
            max by ({rank}) (gputrain_training_stack_location{{{s},location=~"{'|'.join(WAITING)}"}})"""),
        _rec(LOADER_START, f"""
            max by ({rank}) (gputrain_training_phase_in_progress_seconds{{{s},phase="{LOADER_START_PHASE}"}})"""),
        _rec("run_rank:gputrain_training_process_resident_memory_bytes:sum", f"""
            sum by ({rank}) (gputrain_training_process_resident_memory_bytes{{{s}}})"""),
        # the summed peak of a rank's GPUs at the precision it trains in (MFU's denominator),
        # each GPU by the rank's share of its busy time where that is measured (a stray
        # context on another rank's GPU adds nothing, two runs on one GPU each its part),
        # whole where it is not
        _rec(PEAK_FLOPS, f"""
            sum by ({rank}) (
              max by ({rank}, gpu, uuid, precision) (gputrain_training_gpu_info{{{s}}})
              * on ({gpu}, precision) group_left
              max by ({gpu}, precision) (gputrain_gpu_peak_flops{{{s}}})
              * on ({rank}, gpu, uuid) group_left ()
              ({BY_FIELD["gpu_share"].record}
               or on ({rank}, gpu, uuid)
               max by ({rank}, gpu, uuid) (gputrain_training_gpu_info{{{s}}}) * 0 + 1))"""),
        # the wall time's parts: productive (step time less data wait and the phases inside
        # steps), data wait, each phase, and outside steps (the rest); goodput and badput are
        # shares of the parts' sum, each within [0, 1] and adding up to 1
        _rec(ACCOUNTED, """
            {productive} + {wait} + {all_phases} + {outside_steps}""".format(**f)),
        # per GPU, and a rank's GPUs, joined through gputrain_training_gpu_info
        *(gpu_rules := _readings("rank_gpu", s, ids, r)),
        # mean power from the energy counter: exact over the window, unlike sampled gauges
        _rec(gpu_power, f"""
            sum by ({gpu}) (rate(gputrain_gpu_energy_joules_total{{{s}}}[{r}]))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        *[_rec(f"run_rank_gpu:{name.split(':', 1)[1]}", rank_gpu_join(s, name, ids))
          for name in [x["record"] for x in gpu_rules] + [gpu_power]],
        _rec(RANK_BUSY_AVG,
            f"avg by ({rank}) ({series_of('busy')})"),
        # joules per sample: the rank's GPUs' mean power over its samples per wall second
        # (each side over its own clock, so exact from a run's first minute)
        _rec(ENERGY_PER_SAMPLE, f"""
            sum by ({rank}) (run_rank_gpu:gputrain_gpu_power_watts:rate5m)
            / (sum by ({rank}) (rate(gputrain_training_samples_total{{{s}}}[{r}]))
               / {f['wall']})"""),
        # GPU-seconds per second that a run's GPUs sat idle while it held them (a GPU two
        # ranks share counts once); sum_over_time(...[range]) * the recording interval is
        # GPU-seconds over the range
        _rec(WASTED_SECONDS, f"""
            sum by ({ids.run}) (max by ({ids.node}, run, gpu, uuid)
              (1 - {series_of('busy')}))"""),
        # a GPU's shares: each run's (its ranks' processes) and no rank's, from the processes'
        # busy seconds; a run that holds the GPU but had no busy sample counts 0. A share
        # leaves with its processes: the exporter drops a rank's busy counter of a GPU once
        # none of its processes is on it (stale at once, where a range would hold it for the
        # window), and the unattributed share counts while a process no rank owns is there
        _rec(RUN_GPU_BUSY, f"""
            (sum by ({ids.run_gpu}) (rate(gputrain_training_gpu_busy_seconds_total{{{s}}}[{r}])
                                    and gputrain_training_gpu_busy_seconds_total{{{s}}})
             or 0 * max by ({ids.run_gpu}) (gputrain_training_gpu_info{{{s}}}))
            / on ({gpu}) group_left
            sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        _rec(UNATTRIBUTED_BUSY, f"""
            (sum by ({gpu}) (rate(gputrain_gpu_unattributed_busy_seconds_total{{{s}}}[{r}]))
               and on ({gpu}) (max by ({gpu}) (gputrain_gpu_unattributed_processes{{{s}}}) > 0)
             or 0 * sum by ({gpu}) (rate(gputrain_gpu_unattributed_busy_seconds_total{{{s}}}[{r}])))
            / sum by ({gpu}) (rate(gputrain_gpu_sampled_seconds_total{{{s}}}[{r}]))"""),
        *_readings("run_gpu", s, ids, r),
        *_readings("node", s, ids, r),
    ]



def _rec(name: str, expr: str) -> dict:
    """A recording rule, its expression on one line."""
    return {"record": name, "expr": " ".join(expr.split())}


class Q:
    """What an alert's condition is written with: the rule settings ``cfg`` (their scrape-job
    selector ``s`` and thresholds ``t``), the grouping labels, the recorded readings' names
    and the phrases its description names the rank, GPU or node with."""

    # the recorded readings an alert compares (their ranges are the rate window's)
    wait = series_of("data_wait_ratio")
    comm = series_of("comm_exposed_ratio")  # where it is measured
    busy = series_of("busy")  # each GPU of a rank
    steps = series_of("steps_per_second")

    def __init__(self, cfg: dict, ids: Identity) -> None:
        self.cfg, self.s, self.t, self.ids = cfg, cfg["selector"], cfg["thresholds"], ids
        self.rank, self.run, self.node = ids.rank, ids.run, ids.node
        # "on node-1 (cluster a)": the run labels beyond `run` name where the node is
        self.where = "{{ $labels.instance }}" + "".join(
            f" ({x} {{{{ $labels.{x} }}}})" for x in ids.extra if x != "job")
        self.who = f"Run {{{{ $labels.run }}}} rank {{{{ $labels.rank }}}} on {self.where}"
        self.gpu_who = f"GPU {{{{ $labels.gpu }}}} of {self.who[0].lower()}{self.who[1:]}"
        self.node_gpu = f"GPU {{{{ $labels.gpu }}}} on {self.where}"
        self.on_node = f"on ({ids.node}) group_left"
        self.fault = WINDOWS["fault"]

    @property
    def stray(self) -> str:
        """Of each rank, the GPUs where it is a stray context: it does under ``stray_share``
        of the work its processes do there while doing ``stray_own_share`` or more of another
        GPU's (as :func:`exporter.heuristics.catalogue.stray_gpus`). A rank starved on its only
        GPU is no stray there: that GPU is still its own."""
        share = BY_FIELD["gpu_share"].record
        return (f"({share} < {self.t['stray_share']} and on ({self.rank}) "
                f"(max by ({self.rank}) ({share}) >= {self.t['stray_own_share']}))")

    def stepping(self, expr: str) -> str:
        """``expr`` (of a rank, or of a rank's GPUs) only while the rank steps
        (:attr:`stepping_ranks`, recorded once as :data:`STEPPING`)."""
        return f"({expr}) and on ({self.rank}) {STEPPING}"

    @property
    def ceiling(self) -> str:
        """Each rank's hang ceiling, in seconds (catalogue.ceiling_of): ``hung_max_seconds``,
        or ``hung_timeout_share`` of its pushed collective timeout where that is less; for
        every rank that pushes (its last push's series is the base)."""
        t = self.t
        return (f"(clamp_max({t['hung_timeout_share']} * "
                f"({series_of('collective_timeout')} > 0), {t['hung_max_seconds']}) "
                f"or {series_of('seconds_since_push')} * 0 + {t['hung_max_seconds']})")

    @property
    def stepping_ranks(self) -> str:
        """The ranks that step, with one process over the rate window, and still run: a run
        whose steps stopped while its GPUs spin is stalled, and nothing else holds for it;
        rates across a restart are no bottleneck; a rank that said goodbye, or has not pushed
        for ``silent_seconds`` (killed outright), left only history behind; and one whose step
        in progress has run past the floor of
        the hung limit (or its ceiling, where a short collective timeout lowers it under the
        floor) and twice its process's mean step is judged on that step, not on the window's
        rates of steps that no longer come."""
        return (f"({self.steps} > 0) unless on ({self.rank}) "
                f"({self.ended} or "
                f"time() - {series_of('seconds_since_push')} > {self.t['silent_seconds']} or "
                f"{RESTARTS_RECENT} > 0 or "
                f"{OPEN} > clamp_max({self.ceiling}, {self.t['hung_min_seconds']}) "
                f"and on ({self.rank}) {OPEN} > 2 * {TYPICAL})")

    def guards(self) -> list[dict]:
        """The recording rules :meth:`stepping` and :meth:`fresh` read, last in the recording
        group (after every series they read), at the node level (the global alerts read the
        shards' results)."""
        return [_rec(STEPPING, self.stepping_ranks),
                _rec(STALENESS, f"max by ({self.node}) ({collector_age(self.s, self.ids)})")]

    @property
    def ended(self) -> str:
        """The ranks that no longer run: a goodbye (finished, or an exit said) or silent past
        ``vanished_seconds`` (as :func:`exporter.heuristics.catalogue.gone`)."""
        return (f"{series_of('finished')} > 0 "
                f"or {series_of('exit')} or time() - "
                f"{series_of('seconds_since_push')} > "
                f"{self.t['vanished_seconds']}")

    @property
    def alive(self) -> str:
        """The live ranks: pushed within ``alive_seconds``, no exit said (as
        :func:`exporter.heuristics.catalogue.alive`)."""
        return (f"(time() - {series_of('seconds_since_push')} "
                f"<= {self.t['alive_seconds']} unless on ({self.rank}) "
                f"{series_of('exit')})")

    @property
    def running(self) -> str:
        """The ranks silent past ``alive_seconds`` while the exporter of their node finds
        their process running, no exit said: their seconds of silence (as
        :func:`exporter.heuristics.catalogue.running_silent`)."""
        # (the exporter writes no process_running for a rank that ended)
        return (f"(time() - {series_of('seconds_since_push')} "
                f">= {self.t['alive_seconds']} "
                f"and on ({self.rank}) {series_of('process_running')} > 0)")

    @property
    def frozen(self) -> str:
        """The frozen ranks: running silent ones past ``vanished_seconds``, their seconds of
        silence (as :func:`exporter.heuristics.catalogue.frozen`)."""
        return f"({self.running} > {self.t['vanished_seconds']})"

    @property
    def shared(self) -> str:
        """The runs whose name two jobs share: a (run, rank) live on two instances at once
        (its run labels and rank; pushed within ``alive_seconds``). Their ranks are never
        compared as one run's."""
        return (f"(count by ({self.run}, rank) (time() - "
                f"{series_of('seconds_since_push')} "
                f"<= {self.t['alive_seconds']}) > 1)")

    def live(self, expr: str) -> str:
        """``expr`` (of a rank) only while the rank runs: it pushes and said no goodbye. A
        cost judged over the periodic window holds through the minutes a checkpoint stops
        the steps, where :meth:`stepping` would reset the alert's ``for``."""
        return f"({expr}) unless on ({self.rank}) ({self.ended})"

    def periodic(self, phase: str) -> str:
        """Of each rank, the share of its wall time in ``phase`` over the periodic window
        (the reading ``periodic`` of that phase, written raw: a recorded series is never
        selected with matchers, so a rule can be inlined)."""
        w = WINDOWS["periodic"]
        return (f"(sum by ({self.rank}) (rate(gputrain_training_phase_seconds_total"
                f'{{{self.s},phase="{phase}"}}[{w}])) / sum by ({self.rank}) '
                f"(rate(gputrain_training_elapsed_seconds_total{{{self.s}}}[{w}])))")

    def refined(self, record: str, threshold: str) -> str:
        """A refinement's reading (a recorded node series) at ``threshold``, with hysteresis:
        at or over the line within the hold range, and not since below it less the margin
        (as :func:`exporter.heuristics.catalogue.refined` judges a window's readings)."""
        line = self.t[threshold]
        low = round(line - self.t["refinement_margin"], 6)
        return (f"({record} >= {low} and max_over_time({record}[{WINDOWS['hold']}]) "
                f">= {line})")

    def unrefined(self, record: str, threshold: str) -> str:
        """The reading where it is known and the refinement does not hold."""
        return f"({record} unless {self.refined(record, threshold)})"

    def fresh(self, expr: str) -> str:
        """``expr`` only where no collector of its node is stale: nothing but a fault is
        judged on frozen readings (its oldest collector's age in sampler intervals, recorded
        once as :data:`STALENESS`)."""
        return f"({expr}) unless on ({self.node}) ({STALENESS} > {self.t['stale_intervals']})"

    def outside_steps(self) -> str:
        """Of each rank, the seconds a second in phases outside steps (an evaluation, a
        checkpoint). Raw, as recorded readings cannot take a selector once inlined; it is
        above 0 where the badput of those phases is, as every client that pushes a phase in
        progress also pushes its wall time."""
        return (f"sum by ({self.rank}) (rate(gputrain_training_phase_seconds_total"
                f"{{{self.s},{OUTSIDE_STEP}}}[{WINDOWS['rate']}]))")

    def metric(self, name: str, matchers: str = "") -> str:
        """A raw series under the selector (``matchers`` added inside the braces)."""
        return f"{name}{{{self.s}{',' + matchers if matchers else ''}}}"

