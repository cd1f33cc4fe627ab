r"""A training loop without a model: sleeps stand in for the data loader, the GPU step and a
callback, measured by gputrain-exporter's client. It needs no torch and no GPU, so the demo
stack (and anyone trying the dashboards) has a run to look at.

    PYTHONPATH=. .venv/bin/python examples/synthetic_client.py --run demo \
        --data-wait-ms 30 --compute-ms 10
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Iterator

from exporter.client import TrainingMonitor


def slow_loader(wait_s: float, batch_size: int, fixed_when: str | None = None,
                fixed_wait_s: float = 0.0) -> Iterator[list[int]]:
    """Yields batches, each after ``wait_s`` seconds (a data loader that cannot keep up), or
    after ``fixed_wait_s`` once the file ``fixed_when`` exists (the loader fixed mid-run)."""
    fixed = False
    for _ in itertools.count():
        fixed = fixed or (fixed_when is not None and os.path.exists(fixed_when))
        if wait := fixed_wait_s if fixed else wait_s:
            # (never sleep(0): it gives the core away, and on a busy machine the batch then
            # waits a scheduler's time slice for it, a data wait the loop did not have)
            time.sleep(wait)
        yield [0] * batch_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="synthetic", help="run label (default: synthetic)")
    p.add_argument("--steps", type=int, default=0, help="stop after N steps (0: run forever)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--data-wait-ms", type=float, default=30.0, help="time to get a batch")
    p.add_argument("--compute-ms", type=float, default=10.0, help="time of the step itself")
    p.add_argument("--fixed-when", metavar="FILE",
                   help="once FILE exists, the loader waits --fixed-data-wait-ms instead (a fix "
                        "made mid-run: touch FILE)")
    p.add_argument("--fixed-data-wait-ms", type=float, default=0.0,
                   help="time to get a batch once --fixed-when's file exists (default 0)")
    p.add_argument("--callback-ms", type=float, default=0.0, help="a per-step callback phase")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save a checkpoint (a phase outside the steps) every N steps")
    p.add_argument("--checkpoint-ms", type=float, default=200.0, help="time of one save")
    p.add_argument("--flops-per-sample", type=float, default=None,
                   help="model FLOPs per sample to report (for MFU on the demo H100s)")
    p.add_argument("--push-interval", type=float, default=5.0,
                   help="seconds between pushes to the exporter")
    args = p.parse_args()

    monitor = TrainingMonitor(run=args.run, push_interval=args.push_interval,
                              flops_per_sample=args.flops_per_sample)
    batches = monitor.wrap(slow_loader(args.data_wait_ms / 1000, args.batch_size,
                                       args.fixed_when, args.fixed_data_wait_ms / 1000),
                           batch_size=args.batch_size)
    for step, _batch in enumerate(batches, 1):
        time.sleep(args.compute_ms / 1000)
        if args.callback_ms:
            with monitor.phase("callbacks"):
                time.sleep(args.callback_ms / 1000)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            with monitor.phase("checkpoint"):
                time.sleep(args.checkpoint_ms / 1000)
        if args.steps and step >= args.steps:
            break
    monitor.close()


if __name__ == "__main__":
    main()
