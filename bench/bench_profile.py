"""What a profile costs the training loop it profiles, beside the same loop unprofiled in the
same run (the anchor): the step that starts torch.profiler, the recorded steps, the step that
stops it, and the steps while a background thread writes the trace and the summary.

    python bench/bench_profile.py [--steps 20] [--width 1024] [--batch 64] [--repeats 3]

A CPU training loop (an MLP of three width x width layers, SGD) through ``monitor.wrap``; the
profile is handed to the monitor as the pusher hands it (no daemon: only the loop is timed).
Each step is timed from the loop's side, so the boundary work the monitor does lands in the
step that follows it, as it does in a real loop.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from exporter.client import TrainingMonitor  # noqa: E402


def run(steps: int, width: int, batch: int) -> dict[str, float]:
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(8)]

    def batches():
        while True:
            yield from data

    monitor = TrainingMonitor(run="bench", rank=0, endpoint="http://127.0.0.1:9", start=False)
    times: list[float] = []
    asked_at = done_at = None
    last = time.perf_counter()
    for i, (x, y) in enumerate(monitor.wrap(batches())):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if i == 200:
            asked_at = len(times)
            monitor._profiler.offer({"type": "profile", "version": 1, "id": "p-0123456789ab",
                                     "steps": steps})
        report = monitor._profiler.report()
        if done_at is None and report and report["state"] in ("done", "failed"):
            assert report["state"] == "done", report
            done_at = len(times)
        if done_at is not None and len(times) >= done_at + 50:
            break
    monitor.close(timeout=0.1)
    base = statistics.median(times[50:asked_at])
    # times[i] runs from the end of body i-1 to the end of body i, so it holds the boundary
    # work done when body i-1 ended: times[asked_at] starts the profiler (and is the warm-up
    # step), the next `steps` are recorded, the one after them stops the profiler; then the
    # trace is written in the background
    start = asked_at
    recorded = times[start + 1:start + 1 + steps]
    stop = start + 1 + steps
    writing = times[stop + 1:done_at]
    return {"base_ms": base * 1e3, "start_ms": times[start] * 1e3,
            "recorded_ms": statistics.median(recorded) * 1e3, "stop_ms": times[stop] * 1e3,
            "writing_ms": statistics.median(writing) * 1e3 if writing else float("nan"),
            "writing_steps": len(writing), "after_ms": statistics.median(times[done_at:]) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GPUTRAIN_TRACE_DIR", tempfile.mkdtemp(prefix="bench-profile-"))
    print(f"python {platform.python_version()}, torch {torch.__version__}, MLP 3x{ns.width}, "
          f"batch {ns.batch}, one CPU thread, {ns.steps} recorded steps, {ns.repeats} runs")
    print(f"{'run':>4}{'unprofiled':>12}{'start':>10}{'recorded':>10}{'stop':>10}"
          f"{'writing':>10}{'(steps)':>9}{'after':>10}   ms per step; x = / unprofiled")
    for r in range(ns.repeats):
        f = run(ns.steps, ns.width, ns.batch)
        b = f["base_ms"]
        writing = f["writing_steps"] > 0  # else written within the stopping step
        print(f"{r + 1:>4}{b:>12.2f}{f['start_ms']:>10.2f}{f['recorded_ms']:>10.2f}"
              f"{f['stop_ms']:>10.2f}{format(f['writing_ms'], '.2f') if writing else '-':>10}"
              f"{f['writing_steps']:>9}{f['after_ms']:>10.2f}")
        print(f"{'':>4}{'1.00x':>12}{f['start_ms'] / b:>9.2f}x{f['recorded_ms'] / b:>9.2f}x"
              f"{f['stop_ms'] / b:>9.2f}x"
              f"{(format(f['writing_ms'] / b, '.2f') + 'x') if writing else '-':>10}{'':>9}"
              f"{f['after_ms'] / b:>9.2f}x")


if __name__ == "__main__":
    main()
