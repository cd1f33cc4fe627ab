"""Train a small CNN on synthetic CIFAR-sized images, measured by gputrain-exporter's client.

The flags follow the optimisation ladder of a well-known PyTorch tuning walk-through (ResNet18
on fake CIFAR went from 31.65 % to 97.51 % GPU use): --workers, --pin-memory, --batch-size,
--uint8-transfer, --amp, --compile. Other flags inject the bottlenecks of a TensorFlow
performance study's case studies (slow input, CPU preprocessing, a large host-to-device copy,
needless GPU work, a slow callback, checkpoint stalls), to see what the alerts say about each.

    PYTHONPATH=. .venv/bin/python examples/pytorch_train.py --steps 200 --workers 8 --pin-memory
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from exporter.client import TrainingMonitor
from exporter.client.flops import count_training_flops

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


class SyntheticImages(Dataset):
    """Random 3x32x32 images and labels, with optional per-sample CPU work or input delay."""

    def __init__(self, size: int, uint8: bool, cpu_work: int, input_sleep_ms: float,
                 inflate: int, image_size: int = 32) -> None:
        self.size, self.uint8, self.cpu_work = size, uint8, cpu_work
        self.image_size = image_size
        self.input_sleep = input_sleep_ms / 1000.0
        self.inflate = inflate

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        side = self.image_size
        img = torch.randint(0, 256, (3, side * self.inflate, side), generator=g,
                            dtype=torch.uint8)
        if self.input_sleep:
            time.sleep(self.input_sleep)  # slow storage or network input
        if self.cpu_work:  # heavy CPU augmentation, whatever crosses PCIe after it
            work = augment(img.float().div_(255), self.cpu_work)
            img = work.mul_(255).clamp_(0, 255).to(torch.uint8) if self.uint8 else work
        elif not self.uint8:
            img = img.float().div_(255)
        return img, i % 10


def augment(img: torch.Tensor, rounds: int) -> torch.Tensor:
    """Heavy CPU augmentation: ``rounds`` shifts and blends of the image (--cpu-work)."""
    for _ in range(rounds):
        img = torch.roll(img, 1, dims=2).mul_(0.999).add_(0.001)
    return img


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.conv2 = nn.Conv2d(64, 128, 3, padding=1)
        self.conv3 = nn.Conv2d(128, 256, 3, padding=1)
        self.fc = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps to run")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="stop after this many seconds instead (0: run --steps)")
    p.add_argument("--model", choices=("small", "resnet18"), default="small",
                   help="a small CNN, or torchvision's ResNet18 as in the PyTorch walk-through")
    p.add_argument("--image-size", type=int, default=32, help="square image side, pixels")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    p.add_argument("--pin-memory", action="store_true", help="pin_memory + non_blocking copies")
    p.add_argument("--uint8-transfer", action="store_true",
                   help="send uint8 images and normalise on the GPU (4x less PCIe traffic)")
    p.add_argument("--amp", action="store_true", help="automatic mixed precision (bf16/fp16)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="true fp32: no TF32 tensor cores for matmuls and convolutions (cuDNN "
                        "allows TF32 convolutions by default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--run", default=None, help="run label (default: GPUTRAIN_RUN or the script)")
    p.add_argument("--cpu-work", type=int, default=0, help="inject: CPU preprocessing per sample")
    p.add_argument("--input-sleep-ms", type=float, default=0.0,
                   help="inject: slow input, ms per sample in the loader")
    p.add_argument("--h2d-inflate", type=int, default=1,
                   help="inject: send N times larger images, discarded on the GPU")
    p.add_argument("--gpu-waste", type=int, default=0, help="inject: needless heavy GPU ops")
    p.add_argument("--callback-ms", type=float, default=0.0,
                   help="inject: a slow per-step callback (phase 'callbacks')")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="inject: a checkpoint stall every N steps (phase 'checkpoint')")
    p.add_argument("--checkpoint-seconds", type=float, default=2.0)
    p.add_argument("--torch-profiler", action="store_true",
                   help="run under torch.profiler and print its DataLoader time beside the "
                        "client's data wait")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if not args.tf32:  # PyTorch's "fp32" convolutions run as TF32 on tensor cores by default
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    steps_wanted = args.steps if not args.seconds else 10**9
    data = SyntheticImages(min(steps_wanted * args.batch_size, 10**9), args.uint8_transfer,
                           args.cpu_work, args.input_sleep_ms, args.h2d_inflate,
                           args.image_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False,
                        num_workers=args.workers, pin_memory=args.pin_memory,
                        persistent_workers=args.workers > 0)
    if args.model == "resnet18":
        import torchvision  # only this model needs it

        model = torchvision.models.resnet18(num_classes=10).to(device)
    else:
        model = SmallCNN().to(device)
    waste = torch.randn(1024, 1024, device=device) / 32 if args.gpu_waste else None
    amp_dtype = torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported() \
        else torch.float16
    # the model's FLOPs per sample, counted once on the eager model (a forward and backward
    # pass), so the exporter can give its MFU; the injected waste is not the model's work
    example = torch.randn(8, 3, args.image_size, args.image_size, device=device)
    flops = count_training_flops(model, example, batch_size=8)
    # MFU against the mixed-precision peak even without --amp, so that it shows what AMP
    # would win (as torchtitan measures against the bf16 peak)
    precision = "fp16" if args.amp and amp_dtype == torch.float16 else "bf16"
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    monitor = TrainingMonitor(run=args.run, flops_per_sample=flops, precision=precision)
    profiler = contextlib.nullcontext()
    if args.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU]
                           + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))
    started = time.perf_counter()
    steps = 0
    with profiler:
        steps = train(args, monitor, loader, model, opt, waste, device, amp_dtype, started)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    totals = monitor.totals()
    monitor.close()
    result = {"steps": steps, "seconds": elapsed,
              "samples_per_second": steps * args.batch_size / elapsed,
              "data_wait_ratio": totals["data_wait_seconds"] / max(totals["step_seconds"], 1e-9),
              "flops_per_sample": flops, "precision": precision}
    if args.torch_profiler:
        result["client_data_wait_seconds"] = totals["data_wait_seconds"]
        result["profiler_data_wait_seconds"] = sum(
            e.cpu_time_total for e in profiler.key_averages()
            if e.key.startswith("enumerate(DataLoader)")) / 1e6
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in result.items()))
    return result


def train(args: argparse.Namespace, monitor: TrainingMonitor, loader: DataLoader,
          model: torch.nn.Module, opt: torch.optim.Optimizer, waste: torch.Tensor | None,
          device: torch.device, amp_dtype: torch.dtype, started: float) -> int:
    """The training loop; returns the steps done."""
    steps = 0
    for images, labels in monitor.wrap(loader, batch_size=args.batch_size):
        images = images.to(device, non_blocking=args.pin_memory)
        labels = labels.to(device, non_blocking=args.pin_memory)
        if args.h2d_inflate > 1:
            images = images[:, :, :args.image_size, :]  # the extra rows crossed PCIe for nothing
        if images.dtype == torch.uint8:
            images = images.float().div_(255)
        images = (images - MEAN.to(device)) / STD.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            loss = F.cross_entropy(model(images), labels)
            for _ in range(args.gpu_waste):  # a needless heavy op (the GPU case)
                loss = loss + 0.0 * torch.tanh(waste @ waste).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.callback_ms:
            with monitor.phase("callbacks"):
                loss.item()  # a callback that syncs and does host work every step
                time.sleep(args.callback_ms / 1000.0)
        steps += 1
        if args.checkpoint_every and steps % args.checkpoint_every == 0:
            with monitor.phase("checkpoint"):
                time.sleep(args.checkpoint_seconds)
        if args.seconds and time.perf_counter() - started >= args.seconds:
            break
        if not args.seconds and steps >= args.steps:
            break
    return steps


if __name__ == "__main__":
    main()
