"""Model FLOPs per training sample, for ``TrainingMonitor(flops_per_sample=...)``.

Count once, before training, then let the monitor multiply by the samples of each step:

    from exporter.client.flops import count_training_flops
    flops = count_training_flops(model, example_batch, loss_fn)   # forward + backward
    monitor = TrainingMonitor(run="resnet18", flops_per_sample=flops)

or, for a transformer language model, the usual estimate: ``transformer_flops_per_sample(
parameters, tokens_per_sample)`` is ``6 x parameters x tokens`` (2 for the forward pass, 4 for
the backward; attention's own FLOPs left out, as in the PaLM and torchtitan MFU figures).

A FLOP here is one floating-point multiply or add: a multiply-add counts 2, as
``torch.utils.flop_counter`` and the GPUs' peak figures count them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def count_training_flops(model: Any, example: Any, loss_fn: Callable[[Any], Any] | None = None,
                         batch_size: int | None = None) -> float:
    """FLOPs of one training sample of ``model``: one forward and backward pass on
    ``example`` (a batch, or a tuple of positional inputs) counted with
    ``torch.utils.flop_counter.FlopCounterMode``, divided by the batch size (``batch_size``,
    else the first input's first dimension). ``loss_fn`` turns the output into the scalar to
    differentiate (default: its sum). The gradients it leaves are zeroed again."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = example if isinstance(example, tuple) else (example,)
    n = batch_size if batch_size is not None else len(inputs[0])
    if n <= 0:
        raise ValueError("the example batch is empty")
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(*inputs)
        loss = loss_fn(out) if loss_fn is not None else out.sum()
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return counter.get_total_flops() / n


def transformer_flops_per_sample(parameters: float, tokens_per_sample: float) -> float:
    """The ``6 x parameters x tokens`` estimate of a transformer LM's training FLOPs per
    sample (a sequence of ``tokens_per_sample`` tokens)."""
    if parameters <= 0 or tokens_per_sample <= 0:
        raise ValueError("parameters and tokens_per_sample must be positive")
    return 6.0 * parameters * tokens_per_sample
