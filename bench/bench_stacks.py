"""What a py-spy capture (`profile --stacks`) costs the training loop it samples, beside the
same loop without one in the same run (the anchor): the median step before the capture, while
py-spy samples the rank's process tree (--nonblocking, 100 Hz), and after it; and the CPU
py-spy itself used.

    python bench/bench_stacks.py [--seconds 10] [--workers 2] [--repeats 3]

A CPU training loop (an MLP of three 512 x 512 layers, SGD, one torch thread) fed by a
DataLoader with ``--workers`` forked workers whose transform spins 2 ms a sample; the capture
is handed to the monitor as the pusher hands it (no daemon: only the loop is timed), so py-spy
runs as the loop's own child, as it does in training.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from exporter.client import TrainingMonitor  # noqa: E402

WIDTH, BATCH = 512, 32


def transform(x: torch.Tensor) -> torch.Tensor:
    """2 ms of Python per sample: the loader's work py-spy is to find."""
    t = time.perf_counter()
    while time.perf_counter() - t < 0.002:
        pass
    return x


class Samples(Dataset):
    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, i: int) -> torch.Tensor:
        return transform(torch.ones(WIDTH))


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(seconds: int, workers: int, settle: float) -> dict[str, float]:
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(Samples(), batch_size=BATCH, num_workers=workers)
    monitor = TrainingMonitor(run="bench", rank=0, endpoint="http://127.0.0.1:9", start=False)
    phase = "warm-up"
    times: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    started = time.perf_counter()
    cpu_before = 0.0
    last = time.perf_counter()
    for x in monitor.wrap(loader):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.perf_counter()
        if phase in times:
            times[phase].append(now - last)
        last = now
        elapsed = now - started
        if phase == "warm-up" and elapsed > settle:
            phase, mark = "before", now
        elif phase == "before" and now - mark > seconds:
            phase = "during"
            cpu_before = children_cpu()
            spy_started = now
            monitor._stacks.offer({"type": "stacks", "version": 1, "id": "p-0123456789ab",
                                   "mode": "record", "seconds": seconds})
        elif phase == "during":
            report = monitor._stacks.report()
            if report and report["state"] in ("done", "failed"):
                assert report["state"] == "done", report
                spy_seconds = now - spy_started
                spy_cpu = children_cpu() - cpu_before
                top = next(r for r in report["roles"] if r["role"] == "loader_workers")["top"][0]
                phase, mark = "after", now
        elif phase == "after" and now - mark > seconds:
            break
    monitor.close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {**med, "spy_cpu": spy_cpu, "spy_seconds": spy_seconds,
            "found": top["function"] == "transform", "share": top["share"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=10, help="capture length (10)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settle", type=float, default=5.0, help="warm-up seconds before timing")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GPUTRAIN_TRACE_DIR", tempfile.mkdtemp(prefix="bench-stacks-"))
    print(f"python {platform.python_version()}, torch {torch.__version__}, MLP 3x{WIDTH}, "
          f"batch {BATCH}, one CPU thread, {args.workers} workers spinning 2 ms a sample, "
          f"{args.seconds} s capture at 100 Hz, --nonblocking, {os.cpu_count()} CPUs")
    print(f"{'run':>4}{'before ms':>11}{'during ms':>11}{'after ms':>10}{'during/before':>15}"
          f"{'py-spy CPU s':>14}{'of a core':>11}  found")
    for i in range(1, args.repeats + 1):
        r = run(args.seconds, args.workers, args.settle)
        print(f"{i:>4}{r['before']:>11.2f}{r['during']:>11.2f}{r['after']:>10.2f}"
              f"{r['during'] / r['before']:>14.2f}x{r['spy_cpu']:>14.2f}"
              f"{r['spy_cpu'] / r['spy_seconds']:>10.0%}  "
              f"{'transform' if r['found'] else 'NOT transform'} {r['share']:.0%}")


if __name__ == "__main__":
    main()
