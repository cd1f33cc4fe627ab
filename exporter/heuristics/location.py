"""Where a hung rank is stuck, from one py-spy dump of it: one of :data:`LOCATIONS`, and the
function that tells it; and, over the ranks of one run, the rank(s) the others wait for.

:func:`classify` reads the main thread's stack (innermost first) frame by frame, outward,
against :data:`RULES`, one table: the first frame a *decisive* row matches (a collective, the
DataLoader, checkpoint I/O, an evaluation) decides, so the innermost activity wins over the
context it runs in: a barrier inside ``evaluate()`` is a wait in a collective (it waits for its
peers), a ``__getitem__`` under an evaluation loop is data loading (the fix is in the dataset).
The *computing* rows (forward, backward, an optimizer step, torch's internals) only hint: they
decide when no decisive row matched, so ``evaluate()`` computing a forward is an evaluation.
Nothing matched: *elsewhere* (a rank idle in its own code).

What a dump cannot show: DDP's gradient all-reduce is waited for in C++
(``c10d::Reducer::finalize_backward``, under autograd's engine); a ``--nonblocking`` dump, which
has no native frames, shows that rank in ``backward`` only, so it reads as *computing* (phase
``backward``, ``native`` False) and :func:`culprit_line` says so rather than guess. Likewise a
rank whose GPU waits for an NCCL kernel shows as computing (a CUDA synchronise) either way.
Cost: one pass over at most 30 frames; each distinct (function, file) is matched against the
table once, then cached (bench/bench_location.py).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

LOCATIONS = ("collective", "data_loading", "checkpoint_io", "evaluation", "computing",
             "elsewhere")
# where a rank waits for a peer, not for its own work: before its first step such a rank is
# no compilation or warm-up (catalogue.hung_limit). A data read or a checkpoint load is not
# among them: one that is slow looks the same as one that hangs, and a run resuming a large
# model reads its checkpoint for minutes before its first batch
WAITING = ("collective",)
LOCATION_WORDS = {"collective": "waiting in a collective", "data_loading": "loading data",
                  "checkpoint_io": "in checkpoint I/O", "evaluation": "in evaluation",
                  "computing": "computing", "elsewhere": "elsewhere"}
DDP_GRADIENT = "all-reduce (DDP gradient)"
# the collectives' names, most specific first (all_gather before gather): a frame's name holds
# one of them, less underscores (c10d::ProcessGroupGloo::allreduce, all_gather_into_tensor)
COLLECTIVES = ("reduce_scatter", "all_reduce", "all_gather", "all_to_all", "broadcast",
               "barrier", "gather", "scatter", "reduce", "send", "recv")
MAX_RANK_PARTS = 8  # rank ranges shown in a line before "and N more"
MAX_NODES = 3  # nodes named for a group of ranks before "and N more"

# Top-level packages whose frames are not the program's own: a frame under none of them (nor
# the standard library) is the user's. py-spy's short file names drop site-packages, so the
# package is all there is to tell a library by.
LIBRARIES = frozenset({
    "torch", "torchvision", "torchaudio", "torchtext", "torchdata", "functorch", "triton",
    "numpy", "scipy", "sklearn", "pandas", "pyarrow", "h5py", "PIL", "cv2", "lightning",
    "pytorch_lightning", "lightning_fabric", "lightning_utilities", "transformers",
    "accelerate", "deepspeed", "safetensors", "datasets", "huggingface_hub", "tokenizers",
    "webdataset", "timm", "peft", "trl", "apex", "megatron", "fairscale", "tqdm", "wandb",
    "tensorboard", "mlflow", "fsspec", "exporter"})


@dataclass(frozen=True)
class Location:
    """Where a rank is: ``location`` (one of LOCATIONS), the telling frame's ``function``,
    ``file`` and ``line``; ``collective``: the collective's name where known (``all_reduce``,
    ``barrier``, ..., DDP_GRADIENT); ``phase``: for computing, ``forward``, ``backward`` or
    ``optimizer step`` where a frame shows it; ``native``: the stack holds native frames
    (``py-spy dump --native``), without which a wait in C++ (DDP's) looks like computing;
    None where unknown (a location rebuilt from a label)."""

    location: str
    function: str = ""
    file: str = ""
    line: int = 0
    collective: str | None = None
    phase: str | None = None
    native: bool | None = None


@dataclass(frozen=True)
class Culprit:
    """One line a user reads about a run's hang, and the ranks it blames (none when no peer
    is seen waiting for them)."""

    line: str
    ranks: tuple[str, ...]


@dataclass(frozen=True)
class Rule:
    """One row of :data:`RULES`. A frame matches when it is of ``kind`` (``native``,
    ``python``, ``user``: Python of the program's own, ``library``: Python of anything
    else), ``function`` and ``file`` (regexes) are found in its function (the name shown:
    nested functions lose their ``outer.<locals>.``) and file, and, with ``under``, a frame
    outside it has a file that matches. ``collective``: the collective's name, ``*`` for
    the one the function's name holds. ``tell``: how well the frame names the place (the
    highest, outermost, is the one reported). ``shown``: how the function is shown
    (``{}``: its last name)."""

    location: str
    kind: str
    function: str = ""
    file: str = ""
    under: str = ""
    collective: str | None = None
    tell: int = 1
    phase: str | None = None
    shown: str = ""
    patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", tuple(
            re.compile(p) for p in (self.function, self.file, self.under)))

    def matches(self, function: str, file: str, kind: str) -> bool:
        """Whether a frame matches this row, ``under`` left aside."""
        return (self.kind == kind or (self.kind == "python" and kind in ("user", "library"))) \
            and self.patterns[0].search(function) is not None \
            and self.patterns[1].search(file) is not None


_NAME = r"(^|\.)"  # a Python function's last name begins here
_EVAL = r"(?i)(^|\.)_?(\w+_)?(eval|evaluate|evaluation|validate|validation|val|test|predict" \
        r"|prediction)(_\w+)?$"

# DDP's backward waiting for its buckets' all-reduces: a row of RULES, and how a function label
# read back names DDP's gradient all-reduce (collective_named)
_DDP_WAIT = Rule("collective", "native", r"c10d::Reducer::finalize_backward",
                 collective=DDP_GRADIENT, tell=3)

# Tried in order for each frame, innermost frame first; the first row that matches a frame
# is that frame's. Computing rows are hints; every other row decides.
RULES: tuple[Rule, ...] = (
    # -- waits for peers ------------------------------------------------------------------
    # DDP's backward waits here for its buckets' all-reduces (only a --native dump shows it)
    _DDP_WAIT,
    # a collective's handle waited on (Work::wait under dist.all_reduce, barrier, ...)
    Rule("collective", "native", r"^c10d::(\w+::)*\w*Work\w*::(wait|synchronize)\b"),
    # the process group's own call of a collective
    Rule("collective", "native", r"^c10d::ProcessGroup\w*::", collective="*"),
    # a rendezvous or a store-based barrier: waiting for a peer that has not come
    Rule("collective", "native", r"^c10d::\w*Store\w*::", collective="rendezvous"),
    # the backends themselves
    Rule("collective", "native", r"^(gloo|ucc)::|^nccl|^c10d::.*(NCCL|Gloo)", collective="*"),
    Rule("collective", "native", file=r"^libnccl", collective="*"),
    Rule("collective", "python", _NAME + r"(init_process_group|new_group|_store_based_barrier"
         r"|_new_group_with_tag)$", r"^torch/distributed/distributed_c10d\.py$",
         collective="rendezvous", tell=3),
    # torch.distributed's collectives, as the program calls them
    Rule("collective", "python", file=r"^torch/distributed/(distributed_c10d|"
         r"_functional_collectives)\.py$", collective="*", tell=3),
    Rule("collective", "python", file=r"^torch/distributed/(elastic/rendezvous/|rendezvous\.py)",
         collective="rendezvous", tell=2),
    # FSDP's and DeepSpeed's communication (their waits for a shard's all-gather and so on)
    Rule("collective", "python", r"(?i)all_?gather|reduce_?scatter|all_?reduce|unshard|wait",
         r"^torch/distributed/(fsdp|_composable)/", collective="*", tell=2),
    Rule("collective", "python", file=r"^deepspeed/comm/", collective="*", tell=3),
    # -- input ------------------------------------------------------------------------------
    # the program's dataset or collate_fn, called by a DataLoader: the place to fix
    Rule("data_loading", "user", _NAME + r"(__getitem__|__getitems__|__iter__|__next__|\w*collate"
         r"\w*)$", under=r"^torch/utils/data/", tell=3),
    # a dataset read by hand (no DataLoader)
    Rule("data_loading", "user", r"(Dataset|Loader)\w*\.(__getitem__|__getitems__|__iter__"
         r"|__next__)$", tell=3),
    # the DataLoader waits on its workers' queue: the workers are slow
    Rule("data_loading", "library", _NAME + r"_try_get_data$", r"^torch/utils/data/", tell=2),
    # the DataLoader's own machinery (fetch, _next_data, __next__, pin memory)
    Rule("data_loading", "library", file=r"^(torch/utils/data/|torchdata/|webdataset/)"),
    # -- activation checkpointing recomputes a forward: no I/O, whatever its name says
    Rule("computing", "library", file=r"^torch/utils/checkpoint\.py$"),
    # -- checkpoints ------------------------------------------------------------------------
    Rule("checkpoint_io", "python", _NAME + r"(save|load)$", r"^torch/serialization\.py$",
         tell=2, shown="torch.{}"),
    Rule("checkpoint_io", "python", file=r"^torch/serialization\.py$"),
    # torch.save's zip writer calling the file object's write
    Rule("checkpoint_io", "native", r"^caffe2::serialize::|PyTorchStream(Writer|Reader)"),
    Rule("checkpoint_io", "python", file=r"^torch/distributed/checkpoint/", tell=2),
    Rule("checkpoint_io", "python", _NAME + r"(save|load)\w*$", r"^safetensors/", tell=2,
         shown="safetensors.{}"),
    # the program's or a framework's save (save_checkpoint, Trainer._save_checkpoint, ...)
    Rule("checkpoint_io", "python", r"(?i)(^|\.)\w*(checkpoint|ckpt|save_pretrained|save_model"
         r"|save_state)\w*$", r"^(?!torch/)", tell=3),
    # -- evaluation -------------------------------------------------------------------------
    # the program's evaluate / validation_step / test_step / predict
    Rule("evaluation", "user", _EVAL, tell=3),
    # a framework's (transformers' Trainer.evaluate, evaluation_loop); torch's eval() is not
    Rule("evaluation", "library", _EVAL, r"^(?!torch/)", tell=2),
    Rule("evaluation", "library", file=r"^(lightning|pytorch_lightning)/.*loops/"
         r"(evaluation|prediction)_loop\.py$", tell=2),
    # -- computing: hints only, read when nothing above matched --------------------------------
    Rule("computing", "native", r"^torch::autograd::|^THPEngine_run_backward",
         phase="backward"),
    Rule("computing", "library", file=r"^torch/autograd/", phase="backward"),
    Rule("computing", "library", _NAME + r"backward$", r"^torch/_tensor\.py$", phase="backward"),
    Rule("computing", "library", file=r"^torch/optim/", phase="optimizer step"),
    Rule("computing", "library", file=r"^torch/nn/(modules/|functional\.py|parallel/)",
         phase="forward"),
    Rule("computing", "user", _NAME + r"forward$", phase="forward"),
    Rule("computing", "user", _NAME + r"backward$", phase="backward"),
    Rule("computing", "user", _NAME + r"(optimizer_step)$", phase="optimizer step"),
    Rule("computing", "user", _NAME + r"(training_step|train_step)$"),
    Rule("computing", "library", file=r"^torch/"),
    # torch's kernels and BLAS
    Rule("computing", "native", r"^(at|c10|torch)::|(mkl|blas|gemm|cublas|cudnn)"),
)
_HINT = "computing"
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))
_LOCALS = re.compile(r"^.*<locals>\.")


@lru_cache(maxsize=4096)
def _frame(function: str, file: str) -> tuple[str, str, tuple[Rule, ...]]:
    """A frame's kind, shown name and the rows it matches (in order, before ``under``)."""
    python = file.endswith((".py", ".pyx")) or file.startswith("<")
    if not python:
        kind, shown = "native", function
    else:
        top = file.split("/", 1)[0].removesuffix(".py")
        library = file.startswith("<frozen") or top in LIBRARIES or top in _STDLIB or \
            "site-packages/" in file or "dist-packages/" in file
        kind, shown = ("library" if library else "user"), _LOCALS.sub("", function)
    return kind, shown, tuple(r for r in RULES if r.matches(shown, file, kind))


def _rule(frames: Sequence[tuple[str, str, tuple[Rule, ...]]], files: Sequence[str],
          i: int) -> Rule | None:
    """The row frame ``i`` is matched by (its ``under`` read over the frames outside it)."""
    return next((r for r in frames[i][2] if not r.under or
                 any(r.patterns[2].search(f) for f in files[i + 1:])), None)


def collective_named(function: str) -> str | None:
    """The collective a waiting rank's telling function names (as :func:`classify` reported
    it, a ``function`` label read back): DDP's gradient all-reduce, ``barrier``,
    ``all_gather``, ...; None where the name tells none (a ``Work::wait``, a rendezvous)."""
    if _DDP_WAIT.patterns[0].search(function):
        return _DDP_WAIT.collective
    return _named(function)


def _collective(rule: Rule, shown: str) -> str | None:
    return _named(shown) if rule.collective == "*" else rule.collective


def _named(shown: str) -> str | None:
    """The collective a function's last name holds (``c10d::ProcessGroupGloo::allreduce``,
    ``all_gather_into_tensor``), or None."""
    squashed = shown.rsplit("::", 1)[-1].rsplit(".", 1)[-1].lower().replace("_", "")
    return next((c for c in COLLECTIVES if c.replace("_", "") in squashed), None)


def _classify(frames: Sequence[Mapping[str, Any]]) -> tuple[Location, int]:
    """:func:`classify`, and how telling the reported frame is (3: the program's own)."""
    read = [_frame(str(f.get("function", "")), str(f.get("file", ""))) for f in frames]
    files = [str(f.get("file", "")) for f in frames]
    native = any(kind == "native" for kind, _, _ in read)
    rules = [_rule(read, files, i) for i in range(len(read))]
    decided = next(((i, r) for i, r in enumerate(rules) if r is not None and
                    r.location != _HINT), None)

    def at(i: int, **kw: Any) -> Location:
        shown = read[i][1]
        rule = rules[i]
        if rule is not None and rule.shown:
            shown = rule.shown.format(shown.rsplit(".", 1)[-1])
        return Location(function=shown, file=files[i], line=int(frames[i].get("line") or 0),
                        native=native, **kw)

    users = [i for i, (kind, _, _) in enumerate(read) if kind == "user"]
    if decided is None:
        hints = [i for i, r in enumerate(rules) if r is not None]
        if not hints:  # idle in the program's own code, or nothing readable
            where = users[0] if users else next(
                (i for i, (k, _, _) in enumerate(read) if k != "native"), None)
            return (at(where, location="elsewhere") if where is not None else
                    Location("elsewhere", native=native)), 0
        phase = next((r.phase for r in rules if r is not None and r.phase), None)
        return at(users[0] if users else hints[0], location="computing", phase=phase), 0
    # the run of frames outward that belong to the same place: its rows' frames and library
    # or native frames between them, up to the program's own code or another place
    start, named = decided
    location, best, collective = named.location, start, None
    for i in range(start, len(read)):
        rule = rules[i]
        if rule is None or rule.location == _HINT:
            if read[i][0] == "user":
                break
            continue
        if rule.location != location:
            break
        if collective is None and location == "collective":
            collective = _collective(rule, read[i][1])
        if rule.tell >= named.tell:
            best, named = i, rule
    if location == "collective":
        collective = _collective(named, read[best][1]) or collective
    return at(best, location=location, collective=collective), named.tell


def classify(frames: Sequence[Mapping[str, Any]]) -> Location:
    """Where a thread is, from its stack: ``frames`` innermost first, each ``{"function",
    "file", "line"}`` as the daemon holds a dump (a native frame's file is its shared
    library's name, or empty)."""
    return _classify(frames)[0]


def _main_thread(process: Mapping[str, Any]) -> Mapping[str, Any] | None:
    threads = process.get("threads") or []
    return next((t for t in threads if t.get("name") == "MainThread"),
                threads[0] if threads else None)


def classify_dump(processes: Sequence[Mapping[str, Any]]) -> Location:
    """Where a rank is, from its dump as the daemon holds it (``processes``, the main process
    first, each with its ``threads`` and their ``frames``): its main process's main thread
    (named MainThread, else its first). A main process that waits on its DataLoader workers
    is named by the workers' own dataset frame, where they show one."""
    main = next((p for p in processes if p.get("role") == "main"),
                processes[0] if processes else None)
    thread = _main_thread(main) if main is not None else None
    if thread is None:
        return Location("elsewhere")
    where, tell = _classify(thread.get("frames") or [])
    if where.location != "data_loading" or tell >= 3:
        return where
    for p in processes:
        worker = _main_thread(p) if p.get("role") == "loader_workers" else None
        if worker is not None:
            theirs, their_tell = _classify(worker.get("frames") or [])
            if theirs.location == "data_loading" and their_tell >= 3:
                return Location("data_loading", theirs.function, theirs.file, theirs.line,
                                native=where.native)
    return where


# -- one line over the ranks of a run -------------------------------------------------------------

def _rank_key(rank: str) -> tuple[int, int, str]:
    return (0, int(rank), "") if _numeric(rank) else (1, 0, rank)


def _numeric(rank: str) -> bool:
    return rank.isascii() and rank.isdecimal() and str(int(rank)) == rank


def rank_words(ranks: Iterable[str]) -> str:
    """``rank 3``, ``ranks 0-2 and 4-7``, ``ranks 0, 2 and worker-a``: numbers in order and
    in ranges, other names after them."""
    names = sorted(set(ranks), key=_rank_key)
    parts: list[str] = []
    run: list[int] = []

    def close() -> None:
        if len(run) >= 3:
            parts.append(f"{run[0]}-{run[-1]}")
        else:
            parts.extend(str(n) for n in run)
        run.clear()

    for name in names:
        if _numeric(name):
            if run and int(name) != run[-1] + 1:
                close()
            run.append(int(name))
        else:
            close()
            parts.append(name)
    close()
    if len(parts) > MAX_RANK_PARTS:
        parts = [*parts[:MAX_RANK_PARTS], f"{len(parts) - MAX_RANK_PARTS} more"]
    label = "rank" if len(names) == 1 else "ranks"
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{label} {text}"


def collective_words(names: Iterable[str | None]) -> str:
    """``the all-reduce``; ``a collective (all-reduce, barrier)`` where they differ;
    ``a collective`` where none is known."""
    known = sorted({n.replace("_", "-") for n in names if n})
    if len(known) == 1:
        return f"the {known[0]}"
    return "a collective" + (f" ({', '.join(known)})" if known else "")


def where_words(where: Location) -> str:
    """``in `DS.__getitem__` (loading data)``: a rank's place, after "is"."""
    if where.location == "collective":
        return f"waiting in {collective_words([where.collective])}" + (
            f" (`{where.function}`)" if where.function else "")
    what = LOCATION_WORDS[where.location]
    if where.location == "computing":
        what += f", in {where.phase}" if where.phase else ""
        if where.native is False:
            what += ("; native frames unavailable: a wait in a collective may show as "
                     "computing")
    return f"in `{where.function}` ({what})" if where.function else what


def _nodes(nodes: Iterable[str]) -> str:
    named = sorted({n for n in nodes if n})
    if not named:
        return ""
    shown = ", ".join(named[:MAX_NODES])
    more = len(named) - MAX_NODES
    return f" on {shown}" + (f" and {more} more" if more > 0 else "")


def culprit_line(ranks: Iterable[tuple[str, str, Location]]) -> Culprit:
    """One line on the ranks of one run, each ``(rank, node, Location)``, and the culprits:
    the ranks not waiting in a collective while a peer is. Where every rank waits, or none
    does, nobody is blamed: the line says where each group is."""
    rows = sorted(ranks, key=lambda r: _rank_key(r[0]))
    if not rows:
        return Culprit("no rank's stacks to read", ())
    waiting = [r for r in rows if r[2].location == "collective"]
    groups: dict[Location, list[tuple[str, str, Location]]] = {}
    for r in rows:
        if r[2].location != "collective":
            key = Location(r[2].location, r[2].function, collective=None, phase=r[2].phase,
                           native=r[2].native)
            groups.setdefault(key, []).append(r)
    ordered = sorted(groups.items(), key=lambda g: (LOCATIONS.index(g[0].location),
                                                    len(g[1]), _rank_key(g[1][0][0])))
    parts = []
    for where, members in ordered:
        verb = "is" if len({m[0] for m in members}) == 1 else "are"
        parts.append(f"{rank_words(m[0] for m in members)}{_nodes(m[1] for m in members)} "
                     f"{verb} {where_words(where)}")
    if waiting and groups:
        names = {m[0] for m in waiting}
        verb = "waits" if len(names) == 1 else "wait"
        parts.append(f"{rank_words(names)} {verb} in "
                     f"{collective_words(m[2].collective for m in waiting)}")
        culprits = sorted({r[0] for r in rows} - names, key=_rank_key)
        return Culprit("; ".join(parts), tuple(culprits))
    if waiting:
        by_name: dict[str | None, list[str]] = {}
        for m in waiting:
            by_name.setdefault(m[2].collective, []).append(m[0])
        if len([n for n in by_name if n]) > 1:
            each = ", ".join(f"{rank_words(rs)} in {collective_words([n])}"
                             for n, rs in sorted(by_name.items(),
                                                 key=lambda g: _rank_key(g[1][0])))
            return Culprit("every rank waits in a collective, not all in the same one: "
                           f"{each} (a rank took another code path)", ())
        known = [n.replace("_", "-") for n in by_name if n]
        return Culprit("every rank waits in a collective" + (f" ({known[0]})" if known else "")
                       + ": a lost peer or a network fault", ())
    return Culprit("; ".join(parts), ())
