"""Real training processes stuck where a hang leaves a rank, and the recorder of their py-spy
dumps (the fixtures beside this file, read by tests/test_location.py).

    python tests/data/stacks/scenarios.py record            # rewrite every fixture here
    python tests/data/stacks/scenarios.py run NAME RANK DIR # one rank (MASTER_ADDR/PORT set)

Each rank writes ``DIR/<NAME>-rank<RANK>.ready`` when it reaches the place it stays in, so a
recorder polls for the file instead of sleeping. The scenarios (two gloo ranks unless said):

- ``ddp_getitem``: DDP training; rank 1 blocks forever in ``DS.__getitem__`` (a sleep), so
  rank 0 waits in its backward's gradient all-reduce (``c10d::Reducer::finalize_backward``).
- ``allreduce_eval``: rank 0 blocks in ``dist.all_reduce`` (``sync_metrics``); rank 1 computes
  forever in ``evaluate()`` under ``torch.no_grad``.
- ``barrier_eval``: rank 0 blocks in ``dist.barrier()`` inside ``evaluate()``; rank 1 sleeps
  in its own top-level code.
- ``save_slow`` (one rank): ``save_checkpoint`` blocks in ``torch.save`` writing to a file
  object whose ``write`` sleeps.
- ``forward_spin`` (one rank): a forward pass of endless matmuls.
- ``loader_workers`` (one rank): a DataLoader with two forked workers that sleep in
  ``__getitem__``; the main process waits on their queue.
- ``eval_getitem`` (one rank): ``evaluate()`` iterates a DataLoader whose ``__getitem__``
  blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
PY_SPY = Path(sys.executable).parent / "py-spy"
FOREVER = 3600.0  # seconds a blocked rank sleeps: far longer than any recording
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
SCENARIOS = {"ddp_getitem": 2, "allreduce_eval": 2, "barrier_eval": 2, "save_slow": 1,
             "forward_spin": 1, "loader_workers": 1, "eval_getitem": 1}


def allow_any_tracer(*_: object) -> None:
    """Let py-spy, started by whoever started this rank, read it under Yama ptrace_scope 1
    (a test program only: any process of the user may then attach)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


def run(name: str, rank: int, out: Path) -> None:
    """Rank ``rank`` of scenario ``name``; never returns while its peers live."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    allow_any_tracer()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ready = out / f"{name}-rank{rank}.ready"

    def arrived() -> None:
        ready.write_text(str(os.getpid()))

    class DS(Dataset):
        def __init__(self, blocks: bool) -> None:
            self.blocks = blocks

        def __len__(self) -> int:
            return 1000

        def __getitem__(self, i: int) -> torch.Tensor:
            if self.blocks:
                arrived()
                time.sleep(FOREVER)
            return torch.ones(16)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16, 16)
            self.w = torch.randn(256, 256) / 16  # no parameter: DDP would wait for its grad

        def forward(self, x: torch.Tensor, spin: bool = False) -> torch.Tensor:
            y = torch.randn(256, 256)
            first = True
            while spin:  # busy matmuls, forever
                y = torch.tanh(y @ self.w)
                if first:
                    arrived()
                    first = False
            return self.layer(x)

    def evaluate(model: Model, loader: DataLoader | None = None, then_barrier: bool = False
                 ) -> None:
        with torch.no_grad():
            if loader is not None:
                for x in loader:
                    model(x)
            model(torch.ones(4, 16), spin=not then_barrier and loader is None)
        if then_barrier:
            arrived()
            dist.barrier()

    def sync_metrics() -> None:
        arrived()
        dist.all_reduce(torch.ones(4))

    def save_checkpoint(model: Model) -> None:
        class SlowFile:
            def write(self, data: bytes) -> int:
                arrived()
                time.sleep(FOREVER)
                return len(data)

            def flush(self) -> None:
                pass

        torch.save(model.state_dict(), SlowFile())

    def idle() -> None:
        arrived()
        time.sleep(FOREVER)

    if SCENARIOS[name] > 1:
        dist.init_process_group("gloo", rank=rank, world_size=SCENARIOS[name])
    model = Model()
    if name == "ddp_getitem":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)

        def train_step(x: torch.Tensor) -> None:
            loss = ddp(x).square().mean()
            arrived()  # rank 0: its backward's all-reduce waits for rank 1
            loss.backward()

        for x in DataLoader(DS(blocks=rank == 1), batch_size=4):
            train_step(x)
    elif name == "allreduce_eval":
        sync_metrics() if rank == 0 else evaluate(model)
    elif name == "barrier_eval":
        evaluate(model, then_barrier=True) if rank == 0 else idle()
    elif name == "save_slow":
        save_checkpoint(model)
    elif name == "forward_spin":
        for _ in range(10):
            model(torch.ones(4, 16), spin=True)
    elif name == "loader_workers":
        loader = DataLoader(DS(blocks=True), batch_size=4, num_workers=2,
                            multiprocessing_context="fork", worker_init_fn=allow_any_tracer)
        for x in loader:
            model(x)
    elif name == "eval_getitem":
        evaluate(model, DataLoader(DS(blocks=True), batch_size=4))


# -- the recorder ---------------------------------------------------------------------------------

def py_spy_dump(pid: int, native: bool) -> list:
    """``py-spy dump --json`` of one process, ``--native`` (pauses it) or ``--nonblocking``;
    a nonblocking read torn by a running process is taken again."""
    mode = "--native" if native else "--nonblocking"
    for _ in range(20):
        done = subprocess.run([str(PY_SPY), "dump", "--pid", str(pid), mode, "--json"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return json.loads(done.stdout)
    raise RuntimeError(f"py-spy dump {mode} of {pid} failed: {done.stderr}")


def tree(pid: int) -> list[int]:
    import psutil

    return [pid, *sorted(c.pid for c in psutil.Process(pid).children(recursive=True))]


def poll(predicate: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def main_functions(raw: list) -> list[str]:
    return [f["name"] for t in raw[:1] for f in t["frames"]]


def settled(pid: int) -> list:
    """A native dump of ``pid`` once two in a row show the same main-thread stack: a rank
    that blocks in C++ (a gradient all-reduce) is then in its wait, not on its way."""
    last: list[list[str]] = [[]]

    def same() -> list | None:
        raw = py_spy_dump(pid, native=True)
        now = main_functions(raw)
        stable, last[0] = now == last[0], now
        return raw if stable else None

    raw = poll(same, f"process {pid} to settle")
    assert raw is not None
    return raw


def record_one(name: str, out: Path) -> None:
    world = SCENARIOS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "run", name, str(r), str(out)],
                              env=env) for r in range(world)]
    try:
        for r in range(world):
            poll(lambda r=r: (out / f"{name}-rank{r}.ready").exists(), f"{name} rank {r}")
        for r, p in enumerate(procs):
            spinning = name in ("forward_spin",) or (name == "allreduce_eval" and r == 1)
            for native in (True, False):
                pids = tree(p.pid)
                dumps = {pid: py_spy_dump(pid, native) for pid in pids}
                if native and not spinning:
                    dumps[p.pid] = settled(p.pid)
                doc = {"scenario": name, "rank": str(r), "mode": "native" if native else
                       "nonblocking", "main_pid": p.pid,
                       "dumps": {str(k): v for k, v in dumps.items()}}
                path = HERE / f"{name}-rank{r}-{doc['mode']}.json"
                path.write_text(json.dumps(doc, indent=1) + "\n")
                print(path.name, [len(t["frames"]) for t in dumps[p.pid]])
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                for pid in tree(p.pid)[1:]:  # DataLoader workers, orphaned by their rank
                    os.kill(pid, 9)
            p.kill()
            p.wait()


def main(argv: list[str]) -> None:
    if argv[:1] == ["run"]:
        run(argv[1], int(argv[2]), Path(argv[3]))
    elif argv[:1] == ["record"]:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="stacks-") as tmp:
            for name in argv[1:] or SCENARIOS:
                record_one(name, Path(tmp))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
