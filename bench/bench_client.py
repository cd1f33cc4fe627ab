"""Cost of TrainingMonitor on the training thread, against two anchors in the same run.

    python bench/bench_client.py [--steps 1000000]

Anchors: a bare loop over the same iterable (the floor), and a loop that times each step and
calls prometheus_client's Histogram.observe directly (what a hand-rolled in-process metric
costs). Prints nanoseconds per step and the added cost over the bare loop.

With torch installed, also the gradient-communication meter (``watch_communication``) on a
one-rank gloo DDP model: what its two forward hooks cost a step, at DDP's own sampling (GPUs:
DDP's logging data read once in a hundred steps) and at every step (a CPU model), each with
the hook dispatch they add to the model's call (a module called with and without them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, Histogram

from exporter.client import DEFAULT_BUCKETS, TrainingMonitor


def bare(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    return time.perf_counter() - t0


def histogram_observe(n: int) -> float:
    h = Histogram("step_seconds", "x", buckets=DEFAULT_BUCKETS, registry=CollectorRegistry())
    clock = time.perf_counter
    t0 = prev = clock()
    for _ in range(n):
        now = clock()
        h.observe(now - prev)
        prev = now
    return time.perf_counter() - t0


def monitor_wrap(n: int) -> float:
    m = TrainingMonitor(run="bench", endpoint="http://127.0.0.1:9", push_interval=3600,
                        start=False)
    t0 = time.perf_counter()
    for _ in m.wrap(range(n), batch_size=32):
        pass
    elapsed = time.perf_counter() - t0
    assert m.totals()["steps"] == n
    return elapsed


def monitor_context_managers(n: int) -> float:
    m = TrainingMonitor(run="bench", endpoint="http://127.0.0.1:9", push_interval=3600,
                        start=False)
    it = iter(range(n))
    t0 = time.perf_counter()
    for _ in range(n):
        with m.data_wait():
            next(it)
        with m.step(samples=32):
            pass
    return time.perf_counter() - t0


def _ddp_meter(every_step: bool):
    """A meter on a one-rank gloo DDP model that has trained a few steps (so DDP's logging
    data is full), and the model."""
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from exporter.client.comm import DDPComm

    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ddp = DDP(torch.nn.Linear(64, 64))
    meter = DDPComm(ddp)
    x = torch.randn(4, 64)
    for _ in range(12):
        ddp(x).sum().backward()
    meter._rate = 1 if every_step else 100
    return meter, ddp


def comm_meter(n: int, every_step: bool) -> float:
    """The meter's two hooks per step, and the dispatch of two hooks on a module's call."""
    import torch

    meter, ddp = _ddp_meter(every_step)
    before, after = meter._before_forward, meter._after_forward
    meter._synced = 20  # past DDP's first ten sampled iterations
    plain, hooked = torch.nn.Identity(), torch.nn.Identity()
    hooked.register_forward_pre_hook(lambda m, a: None)
    hooked.register_forward_hook(lambda m, a, o: None)
    x = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(n):
        before(ddp, ())
        after(ddp, (), None)
    hooks = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        hooked(x)
    with_dispatch = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        plain(x)
    without = time.perf_counter() - t0
    meter.close()
    # the bare loop's floor is added back by main(): report hooks + dispatch + one empty loop
    return hooks + max(0.0, with_dispatch - without) + bare(n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    cases = {"bare loop": bare, "Histogram.observe": histogram_observe,
             "TrainingMonitor.wrap": monitor_wrap,
             "data_wait()+step()": monitor_context_managers}
    try:
        import torch  # noqa: F401

        cases["comm, DDP's sampling"] = lambda n: comm_meter(n, every_step=False)
        cases["comm, every step (CPU)"] = lambda n: comm_meter(n, every_step=True)
    except ImportError:
        pass
    results: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, fn in cases.items():
            results[name].append(fn(args.steps) / args.steps * 1e9)
    floor = statistics.median(results["bare loop"])
    hist = statistics.median(results["Histogram.observe"])
    print(f"python {sys.version.split()[0]}, {args.steps} steps x {args.repeats} repeats, "
          "median ns per step")
    print(f"{'case':24} {'ns/step':>9} {'added ns':>9} {'x Histogram.observe':>20} "
          f"{'% of a 10 ms step':>18}")
    for name, values in results.items():
        med = statistics.median(values)
        added = med - floor
        ratio = added / (hist - floor) if name != "bare loop" else 0.0
        print(f"{name:24} {med:9.1f} {added:9.1f} {ratio:20.2f} {added / 1e5:17.4f}%")


if __name__ == "__main__":
    main()
