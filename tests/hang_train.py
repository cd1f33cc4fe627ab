"""A data-parallel run that hangs, for the hang tests: one rank of real torch.distributed over
gloo on the CPU, launched once per rank as torchrun launches its workers (``RANK``,
``WORLD_SIZE``; a file store, so no rendezvous port to race for).

Each rank trains a small DDP model on batches from a DataLoader (``monitor.wrap``), its
communication watched, pushing to ``--endpoint``. After ``--block-after`` steps, rank
``--block-rank`` blocks where ``--block`` says, for ``--block-seconds`` (0: for ever), while
its peers go on into the gradient all-reduce and wait there:

- ``data``: in its data set's ``__getitem__`` (a read that never returns);
- ``checkpoint``: inside ``torch.save`` to a file whose writes never return, outside any
  declared phase (a save to storage that hangs);
- ``checkpoint-phase``: the same save inside ``monitor.phase("checkpoint")``, after which the
  others wait for it at a barrier (a long checkpoint, declared: no hang);
- ``freeze``: in its first step (its first batch in hand), the whole process stops (SIGSTOP:
  a rank frozen, its pushes too), while its peers wait in their first step's all-reduce;
- ``slow-start``: in its first step the rank runs its own code for ``--block-seconds`` (as a
  first step that compiles does), while its peers wait in the all-reduce: no hang;
- ``freeze-before``: before its first batch the whole process stops (SIGSTOP), while its peers
  wait at a barrier before theirs (as a script's ranks wait for rank 0 to prepare the data);
- ``prepare``: before its first batch the rank runs its own code for ``--block-seconds`` (a
  data set prepared) while its peers wait at that barrier: no hang;
- ``phase-collective``: after ``--block-after`` steps the blocking rank enters its
  ``evaluation`` phase and there calls a barrier its peers never join (a collective only it
  calls: a metric's all-gather on rank 0 alone), while its peers go on into their next step's
  all-reduce: nobody works, a hang inside a declared phase;
- ``phase-freeze``: after ``--block-after`` steps every rank evaluates inside its
  ``evaluation`` phase, an all-reduce of its metric each batch (0.05 s apart), for
  ``--block-seconds`` (0: for ever); the blocking rank freezes (SIGSTOP) at its 60th batch,
  its peers wait for it in their all-reduce (a rank dead or frozen inside the evaluation);
  with no blocking rank, an evaluation that syncs its metrics: no hang;
- ``eval-undeclared``: after ``--block-after`` steps the blocking rank validates its model
  for ``--block-seconds`` (``model.eval()``, forward passes under ``torch.no_grad()``, no
  phase declared), then ``model.train()``, while every other rank waits for it at a barrier;
- ``prepare-in-step``: in its first step (its first batch in hand) the blocking rank runs its
  own code for ``--block-seconds`` (a data set prepared) while every other rank waits for it
  at a barrier there, inside the step;
- ``loader-start``: after ``--block-after`` steps every rank starts a new epoch (a new
  ``wrap()`` of its DataLoader), and the blocking rank's first fetch of it never returns (a
  DataLoader whose start hangs), while its peers go on into their epoch's first all-reduce;
  ``--block-rank -1`` blocks every rank's start (for ``--block-seconds``): none waits for
  another;
- ``oom``: once the file ``allocate`` exists in ``--out``, the blocking rank allocates memory
  (64 MiB at a time, written) until the kernel's OOM killer kills it (run it inside a memory
  cgroup's limit);
- ``none``: no rank blocks.

``--first-step-seconds`` makes every rank's first step run its own code that long first (a
compilation every rank does, after whatever ``--block`` did before it).
``--timeout`` sets the process group's collective timeout in seconds (gloo's stands in for
NCCL's watchdog); when it passes, the waiting ranks' collective raises and their processes end
by that exception. ``--compile`` trains a ``torch.compile``d model (its first steps compile).
``--until FILE`` stops every rank cleanly at the next round once FILE exists.

Run as ``python tests/hang_train.py --rank R --world N --endpoint URL --run NAME --out DIR``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from pathlib import Path


class SlowFile:
    """A file whose first write blocks for ``seconds`` (0: for ever): storage that hangs."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.blocked = False

    def write(self, data: bytes) -> int:
        if not self.blocked:
            self.blocked = True
            time.sleep(self.seconds or 1e9)
        return len(data)

    def flush(self) -> None:
        pass


def build_kernels(seconds: float) -> None:
    """The training script's own start-up work inside its first step (as compiling is)."""
    time.sleep(seconds or 1e9)


def prepare_data(seconds: float) -> None:
    """The training script's own preparation before its first batch (a download, an index)."""
    time.sleep(seconds or 1e9)


def save_checkpoint(state: dict, seconds: float) -> None:
    """The training script's own save: torch.save into storage that hangs."""
    import torch

    torch.save(state, SlowFile(seconds))  # type: ignore[arg-type]


def validate(model, seconds: float) -> None:
    """The script's own validation, declared nowhere: ``model.eval()``, forward passes
    without gradients for ``seconds``, then ``model.train()``."""
    import torch

    model.eval()
    with torch.no_grad():
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            model.module(torch.randn(8, 64))  # the module: DDP's forward would sync buffers
            time.sleep(0.05)
    model.train()


def evaluate(monitor, freezes: bool, seconds: float) -> None:
    """An evaluation inside its declared phase, its metric all-reduced each batch, for
    ``seconds`` (0: for ever); with ``freezes`` the rank stops (SIGSTOP) at its 60th batch
    (after its pushes have shown it in the phase)."""
    import torch
    import torch.distributed as dist

    with monitor.phase("evaluation"):
        end, batch = time.monotonic() + (seconds or 1e9), 0
        while time.monotonic() < end:
            batch += 1
            if freezes and batch == 60:
                os.kill(os.getpid(), signal.SIGSTOP)
            dist.all_reduce(torch.ones(4))
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--block", choices=("none", "data", "checkpoint", "checkpoint-phase",
                                       "freeze", "slow-start", "freeze-before", "prepare",
                                       "loader-start", "phase-collective", "phase-freeze",
                                       "eval-undeclared", "oom", "prepare-in-step"),
                   default="none")
    p.add_argument("--block-rank", type=int, default=3)
    p.add_argument("--block-after", type=int, default=200)
    p.add_argument("--block-seconds", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--first-step-seconds", type=float, default=0.0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps-per-round", type=int, default=50)
    p.add_argument("--until", default="")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from exporter.client import TrainingMonitor

    dist.init_process_group("gloo", init_method=f"file://{Path(a.out).resolve()}/store",
                            rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = a.block != "none" and a.block_rank in (a.rank, -1)
    # phase-collective: a group every rank makes (new_group is collective) and one joins
    side = dist.new_group(backend="gloo") if a.block == "phase-collective" else None
    restarted = [False]  # loader-start: the epoch after --block-after steps has begun
    batch = 8

    class Samples(torch.utils.data.Dataset):
        """Random samples; the blocking rank's read of the batch after ``--block-after``
        steps never returns (or takes ``--block-seconds``)."""

        def __len__(self) -> int:
            return 1 << 30

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if blocks and a.block == "data" and i == a.block_after * batch:
                time.sleep(a.block_seconds or 1e9)
            if blocks and a.block == "loader-start" and restarted[0]:
                restarted[0] = False  # the start's first read only
                time.sleep(a.block_seconds or 1e9)
            return torch.randn(64), torch.randn(1)

    model: torch.nn.Module = DDP(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    monitor = TrainingMonitor(run=a.run, rank=a.rank, endpoint=a.endpoint, push_interval=1.0)
    monitor.watch_communication(model)
    if a.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Samples(), batch_size=batch, num_workers=0)
    if a.block in ("freeze-before", "prepare"):  # the others wait for it before any batch
        if blocks and a.block == "freeze-before":
            os.kill(os.getpid(), signal.SIGSTOP)
        if blocks and a.block == "prepare":
            prepare_data(a.block_seconds)
        dist.barrier()
    done = 0
    it = iter(monitor.wrap(loader))
    while True:
        stop = torch.tensor([int(bool(a.until) and Path(a.until).exists())])
        dist.broadcast(stop, 0)  # every rank stops after the same round
        if stop.item():
            break
        for _ in range(a.steps_per_round):
            x, y = next(it)
            if blocks and a.block == "freeze" and done == 0:
                os.kill(os.getpid(), signal.SIGSTOP)  # inside its first step, pushes and all
            if blocks and a.block == "slow-start" and done == 0:
                build_kernels(a.block_seconds)
            if a.block == "prepare-in-step" and done == 0:
                if blocks:
                    prepare_data(a.block_seconds)
                dist.barrier()  # inside the first step: no phase between, no step ends
            if a.first_step_seconds and done == 0:
                build_kernels(a.first_step_seconds)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            if done == a.block_after and a.block == "loader-start":
                restarted[0] = True
                it = iter(monitor.wrap(loader))  # a new epoch: its DataLoader starts again
            if blocks and done == a.block_after and a.block == "checkpoint":
                save_checkpoint(model.state_dict(), a.block_seconds)
            if blocks and done == a.block_after and a.block == "phase-collective":
                with monitor.phase("evaluation"):
                    dist.barrier(group=side)  # its peers never join: it waits for ever
            if done == a.block_after and a.block == "eval-undeclared":
                if blocks:
                    validate(model, a.block_seconds)
                dist.barrier()  # the others wait for its validation
            if blocks and a.block == "oom" and (Path(a.out) / "allocate").exists():
                hog = []
                while True:  # until the OOM killer ends the process: no handler runs
                    hog.append(b"\x01" * (64 << 20))
            if done == a.block_after and a.block == "phase-freeze":
                evaluate(monitor, blocks, a.block_seconds)
            if done == a.block_after and a.block == "checkpoint-phase":
                if blocks:
                    with monitor.phase("checkpoint"):
                        save_checkpoint(model.state_dict(), a.block_seconds)
                dist.barrier()  # the others wait for its save
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
