"""PromQL, evaluated over series kept in memory: the rules' own expressions, run by the daemon.

The recording rules and ``diagnose``'s queries are PromQL (:mod:`exporter.heuristics.promql`).
Prometheus evaluates them over what it scrapes; this module evaluates the same text over a
:class:`Store` of samples (the daemon's history of its own page), so that a reading is written
once and read alike by both. The expression is parsed by ``promql-parser`` (the Rust parser of
GreptimeDB and others, as a Python extension: the whole grammar, with Prometheus' own
precedence and errors, rather than a parser of our own); :class:`Engine` evaluates the part of
the language the rules use (see :data:`FUNCTIONS` and :data:`AGGREGATIONS`) with Prometheus
2's semantics: a range selects the samples in ``[t - range, t]``, an instant selector the last
sample within the lookback (5 m) unless the series went stale since, ``rate`` extrapolates as
Prometheus does, vector matching by ``on``/``ignoring`` with ``group_left``/``group_right``, and
the metric name dropped where Prometheus drops it. Anything else is a :class:`QueryError` naming
it, never a wrong answer.

Times are milliseconds, as Prometheus keeps them; ``Engine.query`` answers as
:class:`exporter.heuristics.diagnose.Prometheus` does: (labels, value) pairs, NaN left out.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Union

import promql_parser as pp

from exporter.heuristics.stalls import bucket_quantile, outside_quantiles

LOOKBACK_MS = 300_000  # an instant selector's lookback delta (Prometheus' default, 5 m)
NAME = "__name__"

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable, one per series


class QueryError(ValueError):
    """An expression this evaluator cannot run: a parse error, or a part of PromQL it does not
    implement (named), or a many-to-many match Prometheus refuses too."""


def labels_of(d: dict[str, str]) -> Labels:
    """A label set as a sorted tuple, empty values dropped (Prometheus keeps none)."""
    return tuple(sorted((k, v) for k, v in d.items() if v != ""))


@dataclass
class _Series:
    labels: Labels
    times: list[int] = field(default_factory=list)  # ms, ascending
    values: list[float] = field(default_factory=list)  # NaN where the series went stale
    stale: list[bool] = field(default_factory=list)
    markers: int = 0  # how many of ``stale`` are True: a range of a series with none is a slice
    label_map: dict[str, str] = field(default_factory=dict)  # the labels, for the matchers

    def __post_init__(self) -> None:
        self.label_map = dict(self.labels)


class Store:
    """Samples by series, appended in time order; kept ``retention_ms``.

    A series absent from an :meth:`append_all` is marked stale at that time (as a scrape that
    no longer has it): an instant selector no longer returns it, a range still holds its
    earlier samples.
    """

    def __init__(self, retention_ms: int = 3_600_000) -> None:
        self.retention_ms = retention_ms
        self._series: dict[Labels, _Series] = {}
        self._by_name: dict[str, dict[Labels, _Series]] = {}

    def __len__(self) -> int:
        return len(self._series)

    def append(self, labels: Labels, t_ms: int, value: float, stale: bool = False) -> None:
        """One sample of one series; a sample older than the series' last is ignored."""
        s = self._series.get(labels)
        if s is None:
            if stale:
                return
            s = self._series[labels] = _Series(labels)
            self._by_name.setdefault(dict(labels).get(NAME, ""), {})[labels] = s
        if s.times and t_ms <= s.times[-1]:
            return
        s.times.append(t_ms)
        s.values.append(value)
        s.stale.append(stale)
        s.markers += stale

    def append_all(self, t_ms: int, samples: Iterable[tuple[Labels, float]]) -> None:
        """A whole scrape at ``t_ms``: every series the store holds that is not in it is marked
        stale."""
        seen: set[Labels] = set()
        for labels, value in samples:
            seen.add(labels)
            self.append(labels, t_ms, value)
        for labels, s in list(self._series.items()):
            if labels not in seen and not s.stale[-1]:
                self.append(labels, t_ms, math.nan, stale=True)

    def prune(self, now_ms: int) -> None:
        """Forget samples older than the retention, and series with none left."""
        cut = now_ms - self.retention_ms
        for labels, s in list(self._series.items()):
            k = bisect.bisect_left(s.times, cut)
            if k:
                s.markers -= sum(s.stale[:k])
                del s.times[:k], s.values[:k], s.stale[:k]
            if not s.times or all(s.stale):
                del self._series[labels]
                del self._by_name[dict(labels).get(NAME, "")][labels]

    def select(self, matchers: list[Callable[[dict[str, str]], bool]],
               name: str | None) -> Iterator[_Series]:
        """The series every matcher accepts (by the metric name first where one is given)."""
        pool: Iterable[_Series] = self._by_name.get(name, {}).values() if name is not None \
            else self._series.values()
        for s in pool:
            if all(m(s.label_map) for m in matchers):
                yield s


# -- values --------------------------------------------------------------------------------

@dataclass
class Vector:
    """An instant vector: (labels, value, sample time ms) per series."""

    samples: list[tuple[Labels, float, int]]


@dataclass
class Matrix:
    """A range vector: per series, its samples in the range as two lists (ms, values), sliced
    from the store's own (a tuple per sample cost a third of an evaluation)."""

    series: list[tuple[Labels, list[int], list[float]]]


Value = Union[float, str, Vector, Matrix]  # noqa: UP007 - a runtime alias on Python 3.10 too


# What is derived from a label set (the set without its name, a grouping key) is remembered:
# the same series come back at every evaluation. Each memo holds at most _REMEMBERED sets.
_REMEMBERED = 1 << 16


def _remembered(memo: dict[Labels, Labels], labels: Labels,
                derive: Callable[[Labels], Labels]) -> Labels:
    """``derive(labels)``, from ``memo`` where it is there."""
    found = memo.get(labels)
    if found is None:
        if len(memo) >= _REMEMBERED:
            memo.clear()
        found = memo[labels] = derive(labels)
    return found


_UNNAMED: dict[Labels, Labels] = {}


def _drop_name(labels: Labels) -> Labels:
    """The labels less the metric name."""
    return _remembered(_UNNAMED, labels, lambda lb: tuple(x for x in lb if x[0] != NAME))


def _matcher(m: Any) -> Callable[[dict[str, str]], bool]:
    name, value, op = m.name, m.value, str(m.op).rpartition(".")[2]
    if op == "Equal":
        return lambda d: d.get(name, "") == value
    if op == "NotEqual":
        return lambda d: d.get(name, "") != value
    try:
        pattern = re.compile(value)
    except re.error as exc:
        raise QueryError(f"invalid regular expression {value!r}: {exc}") from None
    if op == "Re":
        return lambda d: pattern.fullmatch(d.get(name, "")) is not None
    if op == "NotRe":
        return lambda d: pattern.fullmatch(d.get(name, "")) is None
    raise QueryError(f"unknown label matcher {op}")


def _on(matching: Any) -> bool:
    """Whether a vector matching is ``on (...)`` (the parser's Include), not ``ignoring``."""
    return str(matching.type).endswith("Include")


def _ms(duration: Any) -> int:
    """A parser duration (a range, a step, an offset: negative ones too) in ms; None is 0."""
    return round(duration.total_seconds() * 1000) if duration is not None else 0


# -- functions over ranges -------------------------------------------------------------------

def _extrapolated(times: list[int], values: list[float], start: int, end: int, counter: bool,
                  rate: bool) -> float | None:
    """Prometheus' extrapolatedRate (promql/functions.go): the increase over [start, end]
    extrapolated from the samples, counter resets corrected; per second where ``rate``."""
    if len(times) < 2:
        return None
    first_t, first_v = times[0], values[0]
    last_t, last_v = times[-1], values[-1]
    result = last_v - first_v
    # a counter that never fell is its own sort (a C-speed check); only a reset is walked
    if counter and values != sorted(values):
        previous = 0.0
        for v in values:
            if v < previous:
                result += previous
            previous = v
    to_start = (first_t - start) / 1000
    to_end = (end - last_t) / 1000
    sampled = (last_t - first_t) / 1000
    average = sampled / (len(times) - 1)
    if counter and result > 0 and first_v >= 0:
        to_zero = sampled * (first_v / result)
        to_start = min(to_start, to_zero)
    threshold = average * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else average / 2
    interval += to_end if to_end < threshold else average / 2
    result *= interval / sampled
    return result / ((end - start) / 1000) if rate else result


def _slope(times: list[int], ys: list[float]) -> float | None:
    """deriv(): the least-squares slope in units per second (Prometheus' linearRegression)."""
    if len(times) < 2:
        return None
    t0, y0 = times[0], ys[0]
    if all(v == y0 for v in ys):
        return math.nan if math.isinf(y0) else 0.0
    xs = [(t - t0) / 1000 for t in times]
    n = len(times)
    sx, sy = _sum(xs), _sum(ys)
    sxy = _sum(x * y for x, y in zip(xs, ys, strict=True))
    sx2 = _sum(x * x for x in xs)
    var = sx2 - sx * sx / n
    return (sxy - sx * sy / n) / var if var else math.nan


def _quantile(q: float, values: list[float]) -> float:
    """Prometheus' quantile(): linear between the nearest ranks; +-Inf outside [0, 1]."""
    out_of_range = outside_quantiles(q)
    if out_of_range is not None or not values:
        return math.nan if out_of_range is None else out_of_range
    v = sorted(values)
    rank = q * (len(v) - 1)
    lower = max(0, math.floor(rank))
    upper = min(len(v) - 1, lower + 1)
    weight = rank - math.floor(rank)
    return v[lower] * (1 - weight) + v[upper] * weight


def _sum(values: Iterable[float]) -> float:
    """An exact sum, or where infinities meet (fsum refuses inf - inf) the plain one: NaN or
    +-Inf, as Prometheus gives."""
    values = list(values)
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):
        return sum(values)


def _avg(values: list[float]) -> float:
    return _sum(values) / len(values)


OVER_TIME: dict[str, Callable[[list[float]], float]] = {
    "max_over_time": max,
    "min_over_time": min,
    "avg_over_time": _avg,
    "sum_over_time": _sum,
    "count_over_time": lambda v: float(len(v)),
    "last_over_time": lambda v: v[-1],
}

# the functions of one range (_range_function), and all the evaluator runs (the rules use
# these); any other is a QueryError
RANGE_FUNCTIONS = frozenset({"rate", "increase", "irate", "delta", "deriv", "resets", "changes",
                             *OVER_TIME})
FUNCTIONS = frozenset({
    *RANGE_FUNCTIONS, "quantile_over_time", "time", "timestamp", "vector", "scalar",
    "label_replace", "clamp", "clamp_min", "clamp_max", "abs", "histogram_quantile", "absent",
    "sqrt", "ln", "exp", "ceil", "floor", "round",
})
AGGREGATIONS = frozenset({"sum", "max", "min", "avg", "count", "quantile", "group"})

_ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: _divide(a, b),
    "%": lambda a, b: math.fmod(a, b) if b else math.nan,
    "^": lambda a, b: _power(a, b),
}
_COMPARISON: dict[str, Callable[[float, float], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
}


def _divide(a: float, b: float) -> float:
    if b:
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _power(a: float, b: float) -> float:
    try:
        return float(a ** b)
    except (OverflowError, ZeroDivisionError):
        return math.inf
    except (TypeError, ValueError):
        return math.nan


def _unary(fn: Callable[[float], float]) -> Callable[[float], float]:
    def safe(x: float) -> float:
        try:
            return fn(x)
        except (ValueError, OverflowError):
            return math.nan
    return safe


_MATH: dict[str, Callable[[float], float]] = {
    "abs": abs, "sqrt": _unary(math.sqrt), "ln": _unary(math.log), "exp": _unary(math.exp),
    "ceil": lambda x: float(math.ceil(x)) if math.isfinite(x) else x,
    "floor": lambda x: float(math.floor(x)) if math.isfinite(x) else x,
}


# -- the expression, compiled once -------------------------------------------------------------
# The parser's nodes are Rust values: each attribute read copies a subtree into Python. An
# expression is therefore turned once into these plain nodes, each keyed by its own text, and
# the engine remembers a node's value at a time: diagnose's queries write the same recording
# rules inline many times over, and each is evaluated once an evaluation.

@dataclass(frozen=True, eq=False)
class _Node:
    key: str  # the node's PromQL, as the parser writes it back
    # of an aggregation or a vector match, each input label set's grouping key (_remembered)
    keys: dict[Labels, Labels] = field(default_factory=dict, init=False, repr=False)


@dataclass(frozen=True, eq=False)
class _Num(_Node):
    value: float


@dataclass(frozen=True, eq=False)
class _Str(_Node):
    value: str


@dataclass(frozen=True, eq=False)
class _Neg(_Node):
    expr: _Node


@dataclass(frozen=True, eq=False)
class _Selector(_Node):
    name: str | None
    matchers: tuple[Callable[[dict[str, str]], bool], ...]
    offset: int  # ms


@dataclass(frozen=True, eq=False)
class _Range(_Node):
    selector: _Selector
    range: int  # ms


@dataclass(frozen=True, eq=False)
class _Subquery(_Node):
    expr: _Node
    range: int
    step: int  # ms; 0: the engine's default
    offset: int


@dataclass(frozen=True, eq=False)
class _Call(_Node):
    name: str
    args: tuple[_Node, ...]


@dataclass(frozen=True, eq=False)
class _Aggregate(_Node):
    op: str
    expr: _Node
    param: _Node | None
    labels: frozenset[str]
    without: bool


@dataclass(frozen=True, eq=False)
class _Binary(_Node):
    op: str
    lhs: _Node
    rhs: _Node
    want_bool: bool
    card: str  # OneToOne, ManyToOne, OneToMany, ManyToMany
    on: bool | None  # on (...), ignoring (...), or no matching clause
    match: frozenset[str]
    include: tuple[str, ...]


def _no_at(node: Any) -> None:
    if getattr(node, "at", None) is not None:
        raise QueryError(f"the @ modifier is not evaluated here: {node}")


def _compile(node: Any) -> _Node:
    kind = type(node).__name__
    key = str(node)
    if kind == "ParenExpr":
        return _compile(node.expr)
    if kind == "NumberLiteral":
        return _Num(key, float(node.val))
    if kind == "StringLiteral":
        return _Str(key, str(node.val))
    if kind == "UnaryExpr":
        return _Neg(key, _compile(node.expr))
    if kind == "VectorSelector":
        _no_at(node)
        matchers = node.matchers
        if matchers.or_matchers:
            raise QueryError(f"'or' inside a selector is not evaluated here: {node}")
        name = node.name or None
        return _Selector(key, name, tuple(_matcher(m) for m in matchers.matchers
                                          if m.name != NAME or name is None), _ms(node.offset))
    if kind == "MatrixSelector":
        selector = _compile(node.vector_selector)
        assert isinstance(selector, _Selector)
        return _Range(key, selector, _ms(node.range))
    if kind == "SubqueryExpr":
        _no_at(node)
        return _Subquery(key, _compile(node.expr), _ms(node.range), _ms(node.step),
                         _ms(node.offset))
    if kind == "Call":
        name = node.func.name
        if name not in FUNCTIONS:
            raise QueryError(f"the function {name}() is not evaluated here")
        return _Call(key, name, tuple(_compile(a) for a in node.args))
    if kind == "AggregateExpr":
        op = str(node.op).lower()
        if op not in AGGREGATIONS:
            raise QueryError(f"the aggregation {op} is not evaluated here")
        modifier = node.modifier
        return _Aggregate(key, op, _compile(node.expr),
                          _compile(node.param) if node.param is not None else None,
                          frozenset(modifier.labels) if modifier is not None else frozenset(),
                          modifier is not None and str(modifier.type).endswith("Without"))
    if kind == "BinaryExpr":
        modifier = node.modifier
        matching = modifier.matching if modifier is not None else None
        return _Binary(key, str(node.op).strip(), _compile(node.lhs), _compile(node.rhs),
                       bool(modifier is not None and modifier.return_bool),
                       str(modifier.card).rpartition(".")[2] if modifier is not None
                       else "OneToOne",
                       None if matching is None else _on(matching),
                       frozenset(matching.labels) if matching is not None else frozenset(),
                       tuple(modifier.group_labels or ()) if modifier is not None else ())
    raise QueryError(f"{kind} is not evaluated here: {node}")


_COMPILED: dict[str, _Node] = {}
_COMPILED_MAX = 4096  # distinct expressions kept compiled (the rules and diagnose ask ~300)


def compiled(expr: str) -> _Node:
    """``expr`` parsed and compiled, once per distinct text; raises QueryError."""
    node = _COMPILED.get(expr)
    if node is None:
        try:
            parsed = pp.parse(expr)
        except Exception as exc:  # the parser raises its own error types
            raise QueryError(f"cannot parse {expr!r}: {exc}") from None
        node = _compile(parsed)
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.clear()
        _COMPILED[expr] = node
    return node


# -- the engine ------------------------------------------------------------------------------

class Engine:
    """Evaluates PromQL over a :class:`Store` at one time (``at_ms``), as Prometheus'
    instant query does. ``step_ms``: a subquery's default resolution (Prometheus uses its
    global evaluation interval). An engine remembers what it evaluated: make one an
    evaluation, after the store's samples for it are in."""

    def __init__(self, store: Store, at_ms: int, step_ms: int = 60_000,
                 lookback_ms: int = LOOKBACK_MS) -> None:
        self.store, self.at_ms, self.step_ms, self.lookback_ms = store, at_ms, step_ms, lookback_ms
        self._memo: dict[tuple[str, int], Value] = {}

    # the interface diagnose's Prometheus client has
    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """The instant query's result as (labels, value), NaN left out (as
        :meth:`exporter.heuristics.diagnose.Prometheus.query`)."""
        value = self.evaluate(expr)
        if isinstance(value, Vector):
            return [(dict(labels), v) for labels, v, _ in value.samples if v == v]
        if isinstance(value, float):
            return [({}, value)] if value == value else []
        raise QueryError(f"{expr!r} is not an instant vector or a scalar")

    def evaluate(self, expr: str, at_ms: int | None = None) -> Value:
        """The value of ``expr`` at ``at_ms`` (default: the engine's time)."""
        return self._eval(compiled(expr), self.at_ms if at_ms is None else at_ms)

    def _eval(self, node: _Node, t: int) -> Value:
        memo = (node.key, t)
        found = self._memo.get(memo)
        if found is None:
            found = self._memo[memo] = self._evaluate(node, t)
        return found

    def _evaluate(self, node: _Node, t: int) -> Value:
        if isinstance(node, _Num | _Str):
            return node.value
        if isinstance(node, _Neg):
            value = self._eval(node.expr, t)
            if isinstance(value, float):
                return -value
            if isinstance(value, Vector):
                return Vector([(_drop_name(lb), -v, ts) for lb, v, ts in value.samples])
            raise QueryError(f"unary minus of a range: {node.key}")
        if isinstance(node, _Selector):
            return self._instant(node, t)
        if isinstance(node, _Range):
            return self._range(node, t)
        if isinstance(node, _Subquery):
            return self._subquery(node, t)
        if isinstance(node, _Call):
            return self._call(node, t)
        if isinstance(node, _Aggregate):
            return self._aggregate(node, t)
        assert isinstance(node, _Binary)
        return self._binary(node, t)

    # selectors
    def _instant(self, node: _Selector, t: int) -> Vector:
        at = t - node.offset
        out = []
        for s in self.store.select(list(node.matchers), node.name):
            k = bisect.bisect_right(s.times, at) - 1
            if k < 0 or s.times[k] < at - self.lookback_ms or s.stale[k]:
                continue
            out.append((s.labels, s.values[k], s.times[k]))
        return Vector(out)

    def _range(self, node: _Range, t: int) -> Matrix:
        end = t - node.selector.offset
        start = end - node.range
        out = []
        for s in self.store.select(list(node.selector.matchers), node.selector.name):
            times = s.times
            lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
            if lo >= hi:
                continue
            if s.markers:
                kept = [i for i in range(lo, hi) if not s.stale[i]]
                if kept:
                    out.append((s.labels, [times[i] for i in kept], [s.values[i] for i in kept]))
            else:
                out.append((s.labels, times[lo:hi], s.values[lo:hi]))
        return Matrix(out)

    def _subquery(self, node: _Subquery, t: int) -> Matrix:
        end = t - node.offset
        step = node.step or self.step_ms
        start = step * ((end - node.range) // step)
        if start < end - node.range:
            start += step
        by: dict[Labels, tuple[list[int], list[float]]] = {}
        for ts in range(start, end + 1, step):
            value = self._eval(node.expr, ts)
            samples: list[tuple[Labels, float]]
            if isinstance(value, float):
                samples = [((), value)]
            elif isinstance(value, Vector):
                samples = [(labels, v) for labels, v, _ in value.samples]
            else:
                raise QueryError(f"a subquery of a range: {node.key}")
            for labels, v in samples:
                times, values = by.setdefault(labels, ([], []))
                times.append(ts)
                values.append(v)
        return Matrix([(labels, times, values) for labels, (times, values) in by.items()])

    # functions
    def _call(self, node: _Call, t: int) -> Value:
        name, args = node.name, node.args
        if name == "time":
            return t / 1000
        if name in RANGE_FUNCTIONS:
            return self._range_function(name, args[0], t)
        if name == "quantile_over_time":
            q = self._scalar(args[0], t)
            m = self._matrix(args[1], t)
            return Vector([(_drop_name(lb), _quantile(q, values), t)
                           for lb, _, values in m.series])
        if name == "timestamp":
            # of a selector, each sample's own time; of anything else, the evaluation's (as
            # Prometheus, whose other results all carry the evaluation time)
            v = self._vector(args[0], t)
            direct = isinstance(args[0], _Selector)
            return Vector([(_drop_name(lb), (ts if direct else t) / 1000, t)
                           for lb, _, ts in v.samples])
        if name == "vector":
            return Vector([((), self._scalar(args[0], t), t)])
        if name == "scalar":
            v = self._vector(args[0], t)
            return v.samples[0][1] if len(v.samples) == 1 else math.nan
        if name == "absent":
            v = self._vector(args[0], t)
            return Vector([] if v.samples else [((), 1.0, t)])
        if name == "label_replace":
            return self._label_replace(args, t)
        if name == "histogram_quantile":
            return self._histogram_quantile(args, t)
        if name in ("clamp", "clamp_min", "clamp_max"):
            v = self._vector(args[0], t)
            bounds = [self._scalar(a, t) for a in args[1:]]
            lo = bounds[0] if name in ("clamp", "clamp_min") else -math.inf
            hi = bounds[-1] if name in ("clamp", "clamp_max") else math.inf
            if lo > hi:
                return Vector([])
            return Vector([(_drop_name(lb), max(lo, min(hi, x)) if x == x else x, ts)
                           for lb, x, ts in v.samples])
        if name == "round":
            v = self._vector(args[0], t)
            to = self._scalar(args[1], t) if len(args) > 1 else 1.0
            return Vector([(_drop_name(lb), math.floor(x / to + 0.5) * to
                            if math.isfinite(x) else x, ts) for lb, x, ts in v.samples])
        v = self._vector(args[0], t)
        return Vector([(_drop_name(lb), _MATH[name](x), ts) for lb, x, ts in v.samples])

    def _range_function(self, name: str, arg: _Node, t: int) -> Vector:
        m = self._matrix(arg, t)
        if isinstance(arg, _Range):
            end, span = t - arg.selector.offset, arg.range
        elif isinstance(arg, _Subquery):
            end, span = t - arg.offset, arg.range
        else:
            raise QueryError(f"{name}() needs a range: {arg.key}")
        start = end - span
        out = []
        for labels, times, values in m.series:
            value: float | None
            if name in ("rate", "increase", "delta"):
                value = _extrapolated(times, values, start, end, counter=name != "delta",
                                      rate=name == "rate")
            elif name == "irate":
                value = None
                if len(times) >= 2:
                    v1, v2 = values[-2], values[-1]
                    value = (v2 - v1 if v2 >= v1 else v2) / ((times[-1] - times[-2]) / 1000)
            elif name == "deriv":
                value = _slope(times, values)
            elif name == "resets":
                value = float(sum(b < a for a, b in pairwise(values)))
            elif name == "changes":
                value = float(sum(b != a and not (a != a and b != b)
                                  for a, b in pairwise(values)))
            else:
                value = OVER_TIME[name](values)
            if value is not None:
                out.append((_drop_name(labels), value, t))
        return Vector(out)

    def _label_replace(self, args: tuple[_Node, ...], t: int) -> Vector:
        v = self._vector(args[0], t)
        dst, replacement, src, regex = (self._string(a, t) for a in args[1:5])
        try:
            pattern = re.compile(regex)
        except re.error as exc:
            raise QueryError(f"invalid regular expression {regex!r} in label_replace: "
                             f"{exc}") from None
        template = re.sub(r"\$(\d+|\{\w+\})", lambda m: "\\g<" + m.group(1).strip("{}") + ">",
                          replacement)
        out = []
        for labels, value, ts in v.samples:
            d = dict(labels)
            m = pattern.fullmatch(d.get(src, ""))
            if m:
                new = m.expand(template)
                if new:
                    d[dst] = new
                else:
                    d.pop(dst, None)
            out.append((labels_of(d), value, ts))
        return Vector(out)

    def _histogram_quantile(self, args: tuple[_Node, ...], t: int) -> Vector:
        q = self._scalar(args[0], t)
        v = self._vector(args[1], t)
        by: dict[Labels, list[tuple[float, float]]] = {}
        for labels, value, _ in v.samples:
            le = next((x for k, x in labels if k == "le"), None)
            if le is None:
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            by.setdefault(tuple(x for x in labels if x[0] != "le" and x[0] != NAME),
                          []).append((bound, value))
        return Vector([(labels, bucket_quantile(q, buckets), t)
                       for labels, buckets in by.items()])

    # aggregations
    def _aggregate(self, node: _Aggregate, t: int) -> Vector:
        op = node.op
        param = self._scalar(node.param, t) if node.param is not None else None
        v = self._vector(node.expr, t)
        names = node.labels
        if node.without:
            def grouping(labels: Labels) -> Labels:
                return tuple(x for x in labels if x[0] not in names and x[0] != NAME)
        else:
            def grouping(labels: Labels) -> Labels:
                return tuple(x for x in labels if x[0] in names)
        groups: dict[Labels, list[float]] = {}
        for labels, value, _ in v.samples:
            groups.setdefault(_remembered(node.keys, labels, grouping), []).append(value)
        out = []
        for key, values in groups.items():
            if op == "sum":
                result = _sum(values)
            elif op in ("max", "min"):
                finite = [x for x in values if x == x]
                result = (max if op == "max" else min)(finite) if finite else math.nan
            elif op == "avg":
                result = _avg(values)
            elif op == "count":
                result = float(len(values))
            elif op == "group":
                result = 1.0
            else:  # quantile
                result = _quantile(param if param is not None else math.nan, values)
            out.append((key, result, t))
        return Vector(out)

    # binary operators
    def _binary(self, node: _Binary, t: int) -> Value:
        op = node.op
        lhs, rhs = self._eval(node.lhs, t), self._eval(node.rhs, t)
        if op in ("and", "or", "unless"):
            if not isinstance(lhs, Vector) or not isinstance(rhs, Vector):
                raise QueryError(f"{op} needs vectors on both sides: {node.key}")
            return self._set_op(op, lhs, rhs, node)
        if isinstance(lhs, float) and isinstance(rhs, float):
            if op in _COMPARISON:
                if not node.want_bool:
                    raise QueryError(f"comparisons between scalars must use bool: {node.key}")
                return float(_COMPARISON[op](lhs, rhs))
            return _ARITHMETIC[op](lhs, rhs)
        if isinstance(lhs, Vector) and isinstance(rhs, float):
            return self._vector_scalar(op, lhs, rhs, swap=False, want_bool=node.want_bool)
        if isinstance(lhs, float) and isinstance(rhs, Vector):
            return self._vector_scalar(op, rhs, lhs, swap=True, want_bool=node.want_bool)
        if isinstance(lhs, Vector) and isinstance(rhs, Vector):
            return self._vector_vector(op, lhs, rhs, node)
        raise QueryError(f"{op} between these operands is not evaluated here: {node.key}")

    @staticmethod
    def _vector_scalar(op: str, v: Vector, scalar: float, swap: bool,
                       want_bool: bool) -> Vector:
        out = []
        for labels, x, ts in v.samples:
            a, b = (scalar, x) if swap else (x, scalar)
            if op in _COMPARISON:
                keep = _COMPARISON[op](a, b)
                if want_bool:
                    out.append((_drop_name(labels), float(keep), ts))
                elif keep:
                    out.append((labels, x, ts))  # the vector's own value, whichever side
            else:
                out.append((_drop_name(labels), _ARITHMETIC[op](a, b), ts))
        return Vector(out)

    @staticmethod
    def _signature(node: _Binary) -> Callable[[Labels], Labels]:
        names = node.match
        if node.on is None:
            return _drop_name
        if node.on:
            def on(lb: Labels) -> Labels:
                return tuple(x for x in lb if x[0] in names)
            derive = on
        else:
            def ignoring(lb: Labels) -> Labels:
                return tuple(x for x in lb if x[0] not in names and x[0] != NAME)
            derive = ignoring
        return lambda lb: _remembered(node.keys, lb, derive)

    def _set_op(self, op: str, lhs: Vector, rhs: Vector, node: _Binary) -> Vector:
        sig = self._signature(node)
        right = {sig(lb) for lb, _, _ in rhs.samples}
        if op == "and":
            return Vector([x for x in lhs.samples if sig(x[0]) in right])
        if op == "unless":
            return Vector([x for x in lhs.samples if sig(x[0]) not in right])
        left = {sig(lb) for lb, _, _ in lhs.samples}
        return Vector(lhs.samples + [x for x in rhs.samples if sig(x[0]) not in left])

    def _vector_vector(self, op: str, lhs: Vector, rhs: Vector, node: _Binary) -> Vector:
        sig = self._signature(node)
        many, one = lhs.samples, rhs.samples
        swapped = node.card == "OneToMany"
        if swapped:
            many, one = one, many
        ones: dict[Labels, tuple[Labels, float]] = {}
        for labels, x, _ in one:
            key = sig(labels)
            if key in ones:
                side = "left" if swapped else "right"
                raise QueryError(f"many-to-many matching not allowed: found duplicate series "
                                 f"on the {side} hand-side of {node.key} for {dict(key)}")
            ones[key] = (labels, x)
        out = []
        seen: set[Labels] = set()
        one_to_one = node.card == "OneToOne"
        drop = op not in _COMPARISON or node.want_bool
        for labels, x, ts in many:
            key = sig(labels)
            hit = ones.get(key)
            if hit is None:
                continue
            one_labels, y = hit
            a, b = (y, x) if swapped else (x, y)
            if op in _COMPARISON:
                keep = _COMPARISON[op](a, b)
                if not keep and not node.want_bool:
                    continue
                value = float(keep) if node.want_bool else a
            else:
                value = _ARITHMETIC[op](a, b)
            # the labels stay sorted through each filter: a dict and a sort only to add the
            # one side's labels (group_left (...))
            base = _drop_name(labels) if drop else labels
            if one_to_one and node.on:
                result = tuple(x for x in base if x[0] in node.match)
            elif one_to_one and node.match:
                result = tuple(x for x in base if x[0] not in node.match)
            else:
                result = base
            if node.include:
                d = dict(result)
                for name in node.include:
                    found = dict(one_labels).get(name, "")
                    if found:
                        d[name] = found
                    else:
                        d.pop(name, None)
                result = labels_of(d)
            if result in seen:
                if one_to_one:
                    raise QueryError(f"multiple matches for labels {dict(key)} in {node.key}: "
                                     "grouping labels must ensure unique matches")
                raise QueryError(f"multiple matches for labels {dict(result)} in {node.key}")
            seen.add(result)
            out.append((result, value, ts))
        return Vector(out)

    # typed sub-evaluations
    def _typed(self, node: _Node, t: int, kind: type, what: str) -> Any:
        value = self._eval(node, t)
        if not isinstance(value, kind):
            raise QueryError(f"expected {what}, got {type(value).__name__}: {node.key}")
        return value

    def _vector(self, node: _Node, t: int) -> Vector:
        return self._typed(node, t, Vector, "an instant vector")

    def _matrix(self, node: _Node, t: int) -> Matrix:
        return self._typed(node, t, Matrix, "a range vector")

    def _scalar(self, node: _Node, t: int) -> float:
        return self._typed(node, t, float, "a scalar")

    def _string(self, node: _Node, t: int) -> str:
        return self._typed(node, t, str, "a string")
