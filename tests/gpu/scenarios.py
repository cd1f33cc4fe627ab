"""The scenarios the GPU harness runs: seed 003's ladder and seed 002's injected bottlenecks,
each as flags of ``examples/pytorch_train.py``, with what the seeds measured and the alerts
their diagnosis implies (checked when a recording is replayed through the shipped rules).

``fire``: alerts that must fire. ``silent``: alerts that must not. An alert in neither is not
asserted (the seeds do not say). Names are without the ``GpuTrain`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scenario:
    name: str
    args: tuple[str, ...]
    seed: str                 # what the seed reported for the same case
    fire: frozenset[str] = field(default_factory=frozenset)
    silent: frozenset[str] = field(default_factory=frozenset)
    warmup: float | None = None   # seconds left out of the summary, if not the harness's
    seconds: float | None = None  # training time, if not the harness's


def _s(*names: str) -> frozenset[str]:
    return frozenset(names)


EVERY_ALERT = _s(
    "GPUUnderutilized", "InputBound", "CPUPreprocessingBound", "DiskIOBound",
    "NetworkInputBound", "HostToDeviceBound", "GPUMemoryUnderused", "LaunchBound",
    "TensorCoresIdle", "HostOverheadBound", "StepTimeStalls", "StragglerRank",
    "HostMemoryLeak", "GPUMemoryNearLimit", "Throttling", "Stalled", "GPULost", "XidErrors",
    "CollectorFailing", "ExporterDown")
INPUT = _s("InputBound", "CPUPreprocessingBound", "DiskIOBound", "NetworkInputBound")
# seed 003: ResNet18 on fake CIFAR (images resized to 224 as in the PyTorch tutorial)
RESNET = ("--model", "resnet18", "--image-size", "224")
HEALTHY = (*RESNET, "--workers", "8", "--pin-memory", "--batch-size", "256",
           "--uint8-transfer", "--amp")

LADDER = [
    Scenario("s003-1-workers0", (*RESNET, "--batch-size", "32", "--workers", "0"),
             "31.65% GPU, 80 ms steps: DataLoader-bound",
             fire=_s("InputBound", "GPUUnderutilized"), silent=_s("HostToDeviceBound")),
    Scenario("s003-2-workers8", (*RESNET, "--batch-size", "32", "--workers", "8"),
             "72.81% GPU, 37 ms steps; copies still synchronous",
             silent=_s("CPUPreprocessingBound")),
    Scenario("s003-3-pinned", (*RESNET, "--batch-size", "32", "--workers", "8",
                               "--pin-memory"),
             "92.37% GPU, 1200 samples/s; < 1 GB of 16 GB used",
             fire=_s("GPUMemoryUnderused"), silent=INPUT),
    Scenario("s003-4-batch512", (*RESNET, "--batch-size", "512", "--workers", "8",
                                 "--pin-memory"),
             "11.3 GB used, 1584 samples/s", silent=INPUT | _s("GPUMemoryUnderused")),
    # the walk-through's fp32 is true fp32: PyTorch's default runs its convolutions as TF32
    Scenario("s003-5-uint8", (*RESNET, "--batch-size", "512", "--workers", "8",
                              "--pin-memory", "--uint8-transfer", "--no-tf32"),
             "97.51% GPU, 1670 samples/s; tensor cores 0%",
             fire=_s("TensorCoresIdle"), silent=INPUT | _s("GPUUnderutilized")),
    # PyTorch's default "fp32": convolutions as TF32 (read beside s003-5 on the GPU: its
    # fp32-without-TF32 run read 12x the input's bytes on the PCIe link, this one tells whether
    # TF32 is what differs)
    Scenario("s003-5-tf32", (*RESNET, "--batch-size", "512", "--workers", "8",
                             "--pin-memory", "--uint8-transfer"),
             "-", silent=INPUT | _s("GPUUnderutilized")),
    Scenario("s003-6-amp", (*RESNET, "--batch-size", "1024", "--workers", "8",
                            "--pin-memory", "--uint8-transfer", "--amp"),
             "2477 samples/s (+50%); tensor cores 26.3%",
             silent=INPUT | _s("TensorCoresIdle")),
    Scenario("s003-7-compile", (*RESNET, "--batch-size", "1024", "--workers", "8",
                                "--pin-memory", "--uint8-transfer", "--amp", "--compile"),
             "3268 samples/s (+32%)", silent=INPUT | _s("TensorCoresIdle"),
             warmup=90, seconds=180),  # compilation takes the first minute
]

SIX = [
    Scenario("s002-small-batch", (*RESNET, "--workers", "8", "--pin-memory",
                                  "--batch-size", "2", "--uint8-transfer", "--amp"),
             "batch 2: 40 samples/s, GPU 60%, memory 23%",
             fire=_s("GPUMemoryUnderused"), silent=INPUT),
    Scenario("s002-slow-input", (*HEALTHY, "--input-sleep-ms", "20"),
             "network input capped: 77.8% of the step waiting, 22 samples/s",
             fire=_s("InputBound", "GPUUnderutilized")),
    Scenario("s002-cpu-preprocessing", (*HEALTHY, "--cpu-work", "40", "--workers", "16"),
             "CPU 66% -> 96%, GPU at most 36%, 25 samples/s",
             fire=_s("InputBound", "GPUUnderutilized", "CPUPreprocessingBound")),
    Scenario("s002-h2d-copy", (*RESNET, "--workers", "8", "--batch-size", "128", "--amp",
                               "--uint8-transfer", "--h2d-inflate", "20"),
             "a ten times larger input tensor: 84 samples/s", fire=_s("HostToDeviceBound")),
    Scenario("s002-gpu-waste", (*HEALTHY, "--gpu-waste", "8"),
             "an extra 11x11 convolution: 96 samples/s, the GPU stays busy",
             silent=INPUT | _s("GPUUnderutilized", "HostOverheadBound")),
    Scenario("s002-callback", (*HEALTHY, "--callback-ms", "200"),
             "heavy post-processing: GPU 46%, idle half of each step, 43 samples/s",
             fire=_s("HostOverheadBound"), silent=INPUT),
    Scenario("s002-checkpoint", (*HEALTHY, "--checkpoint-every", "50",
                                 "--checkpoint-seconds", "4"),
             "periodic stalls hurt the average", fire=_s("StepTimeStalls")),
]

ALL = LADDER + SIX
BY_NAME = {s.name: s for s in ALL}

# The seeds measured on a 16 GB GPU; on an H200 (141 GB, 16 host cores) the same flags starve
# other stages, and the recordings of tests/data/gpu/ must say so. Each line's reason is the
# recording's own figure (docs/gpu-proof.md's table).
ON_GPU: dict[str, dict[str, tuple[frozenset[str], frozenset[str]]]] = {"H200": {
    # SM 88 % busy, tensor 0.2 %, 13 % of memory, MFU 3 %: the seed's verdict, and more
    "s003-5-uint8": (_s("TensorCoresIdle", "GPUMemoryUnderused", "LowMFU"),
                     INPUT | _s("GPUUnderutilized", "HostToDeviceBound", "HostOverheadBound")),
    # TF32 (PyTorch's default) on tensor cores: 11 % tensor activity, 15 % of memory
    "s003-5-tf32": (_s("GPUMemoryUnderused"),
                    INPUT | _s("TensorCoresIdle", "GPUUnderutilized", "HostToDeviceBound")),
    # 14 % of memory at batch 1024; its busy 85 % and slow steps come from the profile taken
    "s003-6-amp": (_s("GPUMemoryUnderused"), INPUT | _s("TensorCoresIdle", "HostToDeviceBound")),
    # 3 MB a sample made by 8 workers: data wait 78 % with the link 1.4 % used, so the loader,
    # not the link, is what the seed's larger tensor costs here
    "s002-h2d-copy": (_s("InputBound", "GPUUnderutilized", "GPUMemoryUnderused"),
                      _s("HostToDeviceBound", "HostOverheadBound", "TensorCoresIdle")),
    "s003-1-workers0": (_s("InputBound", "GPUUnderutilized", "GPUMemoryUnderused"),
                        _s("HostToDeviceBound", "HostOverheadBound")),
    # batch 32 on an H200: 44 % busy with 1.4 % data wait, the host's launches the limit
    "s003-3-pinned": (_s("GPUMemoryUnderused", "GPUUnderutilized", "HostOverheadBound"), INPUT),
}}


def expected_on(name: str, gpu_name: str) -> Scenario:
    """Scenario ``name`` with what must fire and what must not on the GPU named
    ``gpu_name`` (nvidia-smi's name): ON_GPU's where it has that GPU, else the seed's."""
    from dataclasses import replace

    sc = BY_NAME[name]
    for model, cases in ON_GPU.items():
        if model in gpu_name and name in cases:
            fire, silent = cases[name]
            return replace(sc, fire=fire, silent=silent)
    return sc

# What scripts/gpu-proof.sh runs in one loan of a GPU machine (about 5 minutes of training):
# nvidia-smi agreement and the fp32 baseline (tensor cores idle), GPM activity rising with AMP
# (and the one torch profile), PCIe bytes per sample rising with a larger transfer, an
# input-bound and a memory-underused case. torch.compile needs a C compiler: not there.
PROOF = ("s003-5-uint8", "s003-6-amp", "s002-h2d-copy", "s003-1-workers0", "s003-3-pinned")
PROOF_PROFILED = "s003-6-amp"
CPU_PROOF = ("cpu-slow-input", "cpu-healthy")

# On a CPU-only machine the harness runs these with the demo GPU backend: the training
# signals are real (torch on the CPU), the GPU's are simulated. They prove the harness and the
# replay end to end; the GPU scenarios above need a GPU.
CPU_DEMO = [
    Scenario("cpu-slow-input", ("--batch-size", "32", "--input-sleep-ms", "3"),
             "-", fire=_s("InputBound"), silent=EVERY_ALERT - _s("InputBound")),
    Scenario("cpu-callback", ("--batch-size", "32", "--callback-ms", "120"),
             "-", fire=_s("HostOverheadBound"), silent=EVERY_ALERT - _s("HostOverheadBound")),
    Scenario("cpu-healthy", ("--batch-size", "32"), "-", silent=EVERY_ALERT),
]
CPU_BY_NAME = {s.name: s for s in CPU_DEMO}
