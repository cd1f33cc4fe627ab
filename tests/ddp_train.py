"""A data-parallel training run for the tests: real torch.distributed over gloo on the CPU,
DDP over a stack of Linear layers, each rank with its own TrainingMonitor watching the DDP
model's gradient communication (``watch_communication``).

``--rounds`` rounds of ``--steps`` steps with gradient sync, then ``--reference-rounds`` rounds
of as many steps with sync, each followed by as many under ``no_sync()``: the step time with
sync less the step time without it is the independent reference of the communication the step
waits for, taken on the same machine under the same load, with nothing else running beside.
The monitor counts the synchronised steps only. Each rank writes ``{"sync": s, "nosync": s,
"differences": [s, ...], "exposed": s, "exposed_total": s}`` (mean seconds a step over the
reference rounds, and each round's difference; the exposed total it pushed) to
``--out``/rank<N>.json. ``--slow-rank`` computes ``--slow-seconds`` longer each step (a sleep
after its forward), or fetches that much longer with ``--slow-input``. With ``--until FILE``
the rounds go on (up to ``--rounds``) until FILE exists: a test judges the run while it
trains, then lets it finish. ``--gpus`` lists demo GPU <rank> as each rank's GPU.
``--bucket-cap-mb`` sets DDP's bucket size (one bucket as large as the gradients: the
all-reduce starts after the backward pass, nothing overlaps).

Run as ``python tests/ddp_train.py --endpoint URL --run NAME --out DIR ...`` (two ranks by
default; DIR also holds the process group's file store).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def worker(rank: int, a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from exporter.client import TrainingMonitor

    # a file store: no rendezvous port to race other tests for
    dist.init_process_group("gloo", init_method=f"file://{Path(a.out).resolve()}/store",
                            rank=rank, world_size=a.world)
    torch.set_num_threads(1)  # each rank one core's worth of compute; gloo's threads beside it
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a.width, a.width) for _ in range(a.layers)]
    model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=a.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(a.batch, a.width)
    slow = a.slow_seconds if rank == a.slow_rank else 0.0

    def fetch() -> torch.Tensor:
        if slow and a.slow_input:
            time.sleep(slow)
        return x

    def train_step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        out = model(batch)
        if slow and not a.slow_input:
            time.sleep(slow)  # a slower compute: the other ranks wait for it in the all-reduce
        out.square().mean().backward()
        opt.step()

    for _ in range(3):  # DDP rebuilds its buckets after the first iteration
        train_step(fetch())
    if a.gpus:
        os.environ["GPUTRAIN_GPUS"] = str(rank)
    monitor = TrainingMonitor(run=a.run, rank=rank, endpoint=a.endpoint, push_interval=0.5)
    assert monitor.watch_communication(model), "DDP's communication cannot be measured"
    for done in range(a.rounds):  # training, judged live by a test
        stop = torch.tensor([int(bool(a.until) and done >= a.min_rounds
                                 and Path(a.until).exists())])
        dist.broadcast(stop, 0)  # every rank stops after the same round
        if stop.item():
            break
        dist.barrier()
        monitor.new_epoch()  # the time since the last synchronised step is no step
        for _ in range(a.steps):
            with monitor.data_wait():
                batch = fetch()
            with monitor.step(samples=a.batch):
                train_step(batch)
    # the reference, once nothing else runs beside: rounds with and without gradient sync
    sync, nosync, steps = 0.0, 0.0, 0
    differences = []  # each round's step time with sync less without, seconds a step
    before = monitor.totals().get("comm_exposed_seconds", 0.0)
    for _ in range(a.reference_rounds):
        dist.barrier()
        monitor.new_epoch()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            with monitor.data_wait():
                batch = fetch()
            with monitor.step(samples=a.batch):
                train_step(batch)
        with_sync = time.perf_counter() - t0
        steps += a.steps
        dist.barrier()
        t0 = time.perf_counter()
        with model.no_sync():
            for _ in range(a.steps):
                train_step(fetch())
        without = time.perf_counter() - t0
        sync, nosync = sync + with_sync, nosync + without
        differences.append((with_sync - without) / a.steps)
    dist.barrier()
    # DDP logs an iteration's times at the next synchronised forward: one more, outside steps
    monitor.new_epoch()
    model(x)
    totals = monitor.totals()
    if not monitor.flush(timeout=10):
        raise SystemExit(f"rank {rank}: the daemon did not take the final push")
    # the meter's counts since `before`: the last training step's and the reference steps'
    counted = steps + 1
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(
        {"sync": sync / steps if steps else None, "nosync": nosync / steps if steps else None,
         "differences": differences,
         "exposed": (totals.get("comm_exposed_seconds", 0.0) - before) / counted,
         "exposed_total": totals.get("comm_exposed_seconds")}))
    dist.barrier()
    monitor.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--min-rounds", type=int, default=0)
    p.add_argument("--until", default="", help="go on until this file exists")
    p.add_argument("--gpus", action="store_true")
    p.add_argument("--reference-rounds", type=int, default=0,
                   help="rounds with and without gradient sync at the end, for the reference")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP's gradient bucket size in MB (25, DDP's default: the all-reduce "
                        "of a bucket overlaps the backward pass of the layers before it)")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--slow-input", action="store_true")
    a = p.parse_args(argv)
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(a,), nprocs=a.world, join=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
