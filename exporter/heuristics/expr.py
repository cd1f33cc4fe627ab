"""A reading as one small expression tree: its PromQL and its own evaluation.

A rank's or a node's reading of :data:`exporter.heuristics.readings.READINGS` is a few
counters' rates or samples combined by arithmetic. Written as a tree of :class:`Expr` nodes it
is written once and read two ways: :meth:`Expr.template` renders the recording rule's PromQL (a
template with the selector ``{s}``, the labels ``{rank}`` or ``{node}`` and the range ``{w}``,
as :func:`exporter.heuristics.promql.recording` formats every reading), and :func:`compiled`
makes the Python that evaluates it over two points of the daemon's history (the rank's or the
node's page lines; a rank's counters carried across resets as ``rate()`` carries them).
Prometheus' ``rate`` over a range and the daemon's difference over its points differ by the
extrapolation to the range's edges only: none in a ratio of two rates over the same range,
a point's spacing at most in a plain rate.

The PromQL evaluator (:mod:`exporter.heuristics.evaluator`) answers the rules' whole language
over any samples, but at 20x the daemon's cost (bench/RESULTS.md); a tree answers only what it
is built of. The daemon evaluates every reading of a rank at each status build, so the trees
are compiled once into one Python function (:func:`compiled`): each node a line of it, a node
several trees share (the step time's rate divides half of them) computed once. Walking the
trees node by node instead cost the build half again (bench/RESULTS.md).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from exporter.heuristics.stalls import histogram_quantile

# what a node evaluates to for one rank or node: a number, one by label value, or nothing (an
# absent series, a division by zero: PromQL's empty result or NaN, which the readings leave out)
Value = float | dict[str, float] | None


class Lookup(Protocol):
    """Samples by name: a dict, or the daemon's view of a rank's state."""

    def get(self, name: str, /) -> float | dict[str, float] | None: ...


class Point(NamedTuple):
    """One rank's or one node's samples at one time, as its page lines show them.

    ``gauges``: every sample by name (a labelled family's as a dict by its label);
    ``values``: the counters' samples the trees rate (:meth:`Expr.names`), one tuple a point (a
    dict a point took four times the history's memory); a rank's carried across its resets (a
    value that fell adds the one before it, as ``rate()`` does);
    ``buckets``: the step histogram's cumulative counts with its ``bounds``, of one ``epoch``
    while the bounds stay."""

    t: float  # unix seconds
    gauges: Lookup
    values: tuple  # the counters' samples, at the positions of ``names`` (None: absent)
    names: Mapping[str, int]  # where each counter is in ``values``: one for a whole history
    buckets: tuple[int, ...] = ()
    bounds: tuple[float, ...] = ()
    epoch: int = 0

    def counter(self, name: str) -> float | dict[str, float] | None:
        """A counter's sample, carried across its resets; None where absent (or not kept)."""
        i = self.names.get(name)
        return None if i is None else self.values[i]


Env = Mapping[str, float]  # a fragment's value where the daemon knows it otherwise

# PromQL's binary operators by precedence (higher binds tighter)
_PRECEDENCE = {"or": 1, ">": 3, "<": 3, "+": 4, "-": 4, "*": 5, "/": 5}


class Expr:
    """A node: what it renders as PromQL, and the Python it evaluates as
    (:meth:`emit`: an expression over ``old``, ``now``, ``dt`` and ``env``)."""

    precedence = 9  # an atom: never parenthesised
    by: str | None = None  # the label besides the rank's its value is keyed by (``phase``)
    keyed = False  # its value is one by a label (a dict), not one number

    def template(self) -> str:
        raise NotImplementedError

    def names(self) -> frozenset[str]:
        """The counters it rates (what a point must keep for it)."""
        return frozenset()

    def emit(self, code: _Code) -> str:
        """Its value as a Python expression of :data:`_HELPERS`, its children's values named
        in ``code``."""
        raise NotImplementedError

    def __add__(self, other: Expr) -> Expr:
        return Binary("+", self, other)

    def __sub__(self, other: Expr) -> Expr:
        return Binary("-", self, other)

    def __mul__(self, other: Expr) -> Expr:
        return Binary("*", self, other)

    def __truediv__(self, other: Expr) -> Expr:
        return Binary("/", self, other)

    def __gt__(self, other: Expr) -> Expr:
        return Binary(">", self, other)

    def __lt__(self, other: Expr) -> Expr:
        return Binary("<", self, other)

    def or_(self, other: Expr) -> Expr:
        """PromQL's ``or``: this node's series, and ``other``'s where it has none."""
        return Binary("or", self, other)


def _number(value: float) -> str:
    """A number as PromQL reads it back exactly (``1``, ``0.99``)."""
    text = repr(float(value))
    return text.removesuffix(".0")


def _selector(name: str, matcher: str) -> str:
    return f"{name}{{{{{{s}}{',' + matcher if matcher else ''}}}}}"


def _grouping(by: str | None) -> str:
    return "{rank}" + (f", {by}" if by else "")


@dataclass(frozen=True, eq=False)
class Rate(Expr):
    """A rank's counter, its per-second rate over the window: ``sum by (rank) (rate(...))``;
    with ``by``, one by that label (``phase``)."""

    name: str
    by: str | None = None

    @property
    def keyed(self) -> bool:  # type: ignore[override]
        return self.by is not None

    def template(self) -> str:
        return f"sum by ({_grouping(self.by)}) (rate({_selector(self.name, '')}[{{w}}]))"

    def names(self) -> frozenset[str]:
        return frozenset({self.name})

    def emit(self, code: _Code) -> str:
        a, b = code.counter("old", self.name), code.counter("now", self.name)
        if self.by is not None:  # a phase the rank opened in the window counts from 0
            return f"_rate({a}, {b}, dt, True)"
        # one number a rank: inline, a helper's call a rate cost a fifth of a status build
        return f"(({b} - {a}) / dt if {a} is not None and {b} is not None and dt > 0 else None)"


@dataclass(frozen=True, eq=False)
class Series(Expr):
    """A node's family, series by series (one by its ``label``: a dict; one number where it
    has none): its rate over the window, ``rate(family[w])``, or with ``rate`` False its
    sample as it is at the window's end; ``matcher`` (``mode=~"idle|iowait"``) keeps the
    series whose label matches."""

    name: str
    label: str | None = None
    rate: bool = True
    matcher: str = ""

    @property
    def keyed(self) -> bool:  # type: ignore[override]
        return self.label is not None

    def template(self) -> str:
        selector = _selector(self.name, self.matcher)
        return f"rate({selector}[{{w}}])" if self.rate else selector

    def names(self) -> frozenset[str]:
        return frozenset({self.name}) if self.rate else frozenset()

    def emit(self, code: _Code) -> str:
        keep = code.constant(_matching(self.matcher, self.label))
        if not self.rate:
            return f"_filtered(now.gauges.get({self.name!r}), {keep})"
        a, b = code.counter("old", self.name), code.counter("now", self.name)
        # a disk or an interface the old point lacks is rated over its own samples by
        # Prometheus: none here (its total since boot is no increase)
        return f"_filtered(_rate({a}, {b}, dt, False), {keep})"


@dataclass(frozen=True, eq=False)
class Aggregate(Expr):
    """``op by (group) (expr)``: a node's (``group`` "node") series aggregated into one
    number, ``sum`` or ``max``."""

    op: str
    expr: Expr
    group: str = "node"

    def __post_init__(self) -> None:
        if self.op not in ("sum", "max"):
            raise ValueError(f"aggregation {self.op!r}: sum or max")

    def template(self) -> str:
        return f"{self.op} by ({{{self.group}}}) ({self.expr.template()})"

    def names(self) -> frozenset[str]:
        return self.expr.names()

    def emit(self, code: _Code) -> str:
        return f"_aggregate({self.op}, {code.name(self.expr)})"


@dataclass(frozen=True, eq=False)
class Gauge(Expr):
    """A rank's sample as it is at the window's end: ``sum by (rank) (family)`` (a rank has
    one series of it: any ``agg`` reads that sample)."""

    name: str
    agg: str = "sum"

    def template(self) -> str:
        return f"{self.agg} by ({{rank}}) ({_selector(self.name, '')})"

    def emit(self, code: _Code) -> str:
        return f"_scalar(now.gauges.get({self.name!r}))"


@dataclass(frozen=True, eq=False)
class Number(Expr):
    value: float

    def template(self) -> str:
        return _number(self.value)

    def emit(self, code: _Code) -> str:
        return repr(float(self.value))


@dataclass(frozen=True, eq=False)
class Fragment(Expr):
    """A part the recording rules write once beside the readings (``{open_part}``: a step in
    progress; ``{peak_flops}``: a recorded series); the daemon gives its value in ``env``
    (absent: the reading is unknown)."""

    name: str

    def template(self) -> str:
        return "{" + self.name + "}"

    def emit(self, code: _Code) -> str:
        return f"env.get({self.name!r})"


@dataclass(frozen=True, eq=False)
class Quantile(Expr):
    """A histogram's quantile over the window: ``histogram_quantile(q, sum by (rank, le)
    (rate(family_bucket)))``; unknown where the bounds changed inside it or no step ended."""

    q: float
    name: str

    def template(self) -> str:
        return (f"histogram_quantile({_number(self.q)}, sum by ({{rank}}, le) "
                f"(rate({_selector(self.name + '_bucket', '')}[{{w}}])))")

    def emit(self, code: _Code) -> str:
        # the buckets' increase is one for every quantile of the window
        return f"_quantile({self.q!r}, now.bounds, {code.shared('_increase(old, now)')})"


@dataclass(frozen=True, eq=False)
class Binary(Expr):
    """``lhs op rhs``; a side keyed by a label (``by``) meets the rank's one value through
    ``on (rank) group_left``, as the rules write it."""

    op: str
    lhs: Expr
    rhs: Expr

    def __post_init__(self) -> None:
        if self.op not in _OPS and self.op != "or":
            raise ValueError(f"operator {self.op!r}: one of {', '.join(_OPS)}, or")
        for side, other in ((self.lhs, self.rhs), (self.rhs, self.lhs)):
            if side.keyed and side.by is None and not other.keyed and \
                    not isinstance(other, Number):
                # PromQL would match a node's series one to one with a node's one number
                raise ValueError("a node's series meet another's series or a number, not an "
                                 "aggregate: aggregate them first")

    @property
    def precedence(self) -> int:  # type: ignore[override]
        return _PRECEDENCE[self.op]

    @property
    def by(self) -> str | None:  # type: ignore[override]
        return self.lhs.by or self.rhs.by

    @property
    def keyed(self) -> bool:  # type: ignore[override]
        return self.lhs.keyed or self.rhs.keyed

    def template(self) -> str:
        mine = self.precedence
        # arithmetic beside a comparison or a set operator is bracketed for the reader
        plain = mine <= 3
        left = self.lhs.template()
        if self.lhs.precedence < mine or (plain and isinstance(self.lhs, Binary) and \
                self.lhs.precedence > 3):
            left = f"({left})"
        right = self.rhs.template()
        if self.rhs.precedence <= mine or (plain and isinstance(self.rhs, Binary) and \
                self.rhs.precedence > 3):
            right = f"({right})"
        match = ""
        if self.lhs.by and not self.rhs.by:
            match = " on ({rank}) group_left"
        elif self.rhs.by and not self.lhs.by:
            match = " on ({rank}) group_right"
        return f"{left} {self.op}{match} {right}"

    def names(self) -> frozenset[str]:
        return self.lhs.names() | self.rhs.names()

    def emit(self, code: _Code) -> str:
        a, b = code.name(self.lhs), code.name(self.rhs)
        if self.op == "or":
            return f"_or({a}, {b})"
        if self.keyed:
            return f"_binary({_OPS[self.op]}, {a}, {b})"
        known = f"{a} is not None and {b} is not None"
        if self.op == "/":  # x/0 is Inf or NaN in PromQL: no reading
            return f"({a} / {b} if {known} and {b} else None)"
        if self.op in (">", "<"):  # a filter, as PromQL's comparison without bool
            return f"({a} if {known} and {a} {self.op} {b} else None)"
        return f"({a} {self.op} {b} if {known} else None)"


# -- the evaluation: Python over two points -------------------------------------------------

def _rate(a: float | dict[str, float] | None, b: float | dict[str, float] | None,
          dt: float, from_zero: bool) -> Value:
    """A counter's per-second increase from ``a`` to ``b`` (by label where it has one; a
    label ``a`` lacks counts from 0 where ``from_zero``, else not at all)."""
    if a is None or b is None or dt <= 0:
        return None
    if isinstance(b, dict):
        before = a if isinstance(a, dict) else {}
        return {k: (v - before.get(k, 0.0)) / dt for k, v in b.items()
                if from_zero or k in before}
    return (b - a) / dt if not isinstance(a, dict) else None


def _scalar(value: object) -> float | None:
    return float(value) if isinstance(value, float | int) else None


def _increase(old: Point, now: Point) -> tuple[int, ...] | None:
    """The step histogram's cumulative counts' increase; None where its bounds changed in the
    window or no step ended in it."""
    if now.epoch != old.epoch or not len(now.buckets) == len(now.bounds) + 1 == \
            len(old.buckets):
        return None
    counts = tuple(a - b for a, b in zip(now.buckets, old.buckets, strict=True))
    return counts if counts[-1] > 0 else None


def _quantile(q: float, bounds: tuple[float, ...], counts: tuple[int, ...] | None) -> Value:
    return None if counts is None else histogram_quantile(q, bounds, counts)


def _div(a: float, b: float) -> float | None:
    return a / b if b else None  # x/0 is Inf or NaN in PromQL: no reading


def _gt(a: float, b: float) -> float | None:
    return a if a > b else None  # a filter, as PromQL's comparison without bool


def _lt(a: float, b: float) -> float | None:
    return a if a < b else None


_OPS = {"+": "operator.add", "-": "operator.sub", "*": "operator.mul", "/": "_div",
        ">": "_gt", "<": "_lt"}
_COMPARISONS = (_gt, _lt)


def _or(a: Value, b: Value) -> Value:
    """PromQL's ``or``: ``a``'s series, and ``b``'s where ``a`` has none of that label."""
    if isinstance(a, dict) or isinstance(b, dict):
        return {**(b if isinstance(b, dict) else {}), **(a if isinstance(a, dict) else {})}
    return a if a is not None else b


def _matching(matcher: str, label: str | None) -> Callable[[str], object] | None:
    """A matcher of ``label`` (``mode=~"idle|iowait"``, ``mode="iowait"``) as a label value's
    test; None (every series) for no matcher."""
    if not matcher:
        return None
    found = re.fullmatch(r'(\w+)(=~|=)"(.*)"', matcher)
    if found is None or found[1] != label:
        raise ValueError(f"{matcher!r} is no matcher of the label {label!r}")
    return re.compile(found[3] if found[2] == "=~" else re.escape(found[3])).fullmatch


def _filtered(value: Value, keep: Callable[[str], object] | None) -> Value:
    """The series of ``value`` whose label ``keep`` matches (all with no ``keep``)."""
    if keep is None or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if keep(k)}


def _aggregate(op: Callable[[Iterable[float]], float], value: Value) -> Value:
    """``sum`` or ``max`` of a value's series; None where it has none."""
    if not isinstance(value, dict):
        return value
    return op(value.values()) if value else None


def _binary(fn: Callable[[float, float], float | None], a: Value, b: Value) -> Value:
    """``fn`` of two values, None where either is; one by label meets a number label by
    label (as ``on (rank) group_left``), two by label where both have the label. A comparison
    keeps the series' own values, whichever side they are on (as PromQL's filter does)."""
    if a is None or b is None:
        return None
    if isinstance(a, dict):
        if isinstance(b, dict):
            return {k: v for k, x in a.items() if k in b and (v := fn(x, b[k])) is not None}
        return {k: v for k, x in a.items() if (v := fn(x, b)) is not None}
    if isinstance(b, dict):
        if fn in _COMPARISONS:
            return {k: y for k, y in b.items() if fn(a, y) is not None}
        return {k: v for k, y in b.items() if (v := fn(a, y)) is not None}
    return fn(a, b)


_HELPERS = {"_rate": _rate, "_scalar": _scalar, "_quantile": _quantile,
            "_increase": _increase, "_div": _div, "_lt": _lt, "_or": _or, "_filtered": _filtered,
            "_aggregate": _aggregate, "sum": sum, "max": max,
            "_gt": _gt, "_binary": _binary, "operator": operator}

Evaluation = Callable[[Point, Point, Env, object], tuple[Value, ...]]


class _Code:
    """The function's lines: each node's value computed once into a name."""

    def __init__(self, kept: Mapping[str, int]) -> None:
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.kept = kept  # where each counter is in a point's values
        self.names_of: dict[str, str] = {}  # shared values, by their expression
        self.constants: dict[str, object] = {}

    def constant(self, value: object) -> str:
        """A name for ``value`` in the function's globals."""
        name = f"c{len(self.constants)}"
        self.constants[name] = value
        return name

    def shared(self, value: str) -> str:
        """A name for ``value`` (a Python expression of the points), computed once."""
        if value not in self.names_of:
            self.names_of[value] = name = f"s{len(self.names_of)}"
            self.lines.append(f"    {name} = {value}")
        return self.names_of[value]

    def counter(self, point: str, name: str) -> str:
        """A counter's sample at ``point`` ("old" or "now"): None where points keep none."""
        i = self.kept.get(name)
        return "None" if i is None else f"{point}.values[{i}]"

    def name(self, node: Expr) -> str:
        if id(node) not in self.names:
            value = node.emit(self)  # its children first
            self.names[id(node)] = name = f"v{len(self.names)}"
            self.lines.append(f"    {name} = {value}")
        return self.names[id(node)]


def compiled(trees: Iterable[Expr], kept: Mapping[str, int],
             fields: Iterable[tuple[str, Expr]] = ()) -> Evaluation:
    """One function of ``(old, now, env, out)`` over points whose ``values`` hold the counters
    at the positions ``kept`` gives: it sets each of ``fields`` (attribute, tree) on ``out``
    to the tree's value (one by label: {} where unknown), and returns each of ``trees``'
    values, in order."""
    code = _Code(kept)
    assign = []
    for attribute, tree in fields:
        value = code.name(tree)
        assign.append(f"    out.{attribute} = {value}" if not tree.keyed else
                      f"    out.{attribute} = {{}} if {value} is None else {value}")
    results = [code.name(tree) for tree in trees]
    source = "\n".join(["def evaluate(old, now, env, out):", "    dt = now.t - old.t",
                        *code.lines, *assign,
                        f"    return ({', '.join(results)}{',' if results else ''})"])
    namespace: dict = {**_HELPERS, **code.constants}
    exec(compile(source, "<exporter.heuristics.expr>", "exec"), namespace)
    return namespace["evaluate"]
