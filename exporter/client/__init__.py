"""The training-side client: measure step time, data-wait time and samples, push them.

    from exporter.client import TrainingMonitor

    monitor = TrainingMonitor(run="resnet18")
    for batch in monitor.wrap(train_loader, batch_size=32):
        train_step(batch)
    monitor.close()

Framework integrations live in ``exporter.client.lightning``, ``.keras`` and ``.transformers``
and import their framework only when used.
"""

from exporter.client.monitor import (
    DEFAULT_BUCKETS,
    OUTSIDE_STEP_PHASES,
    HookTimer,
    Integration,
    TrainingMonitor,
    batch_len,
)

__all__ = ["DEFAULT_BUCKETS", "OUTSIDE_STEP_PHASES", "HookTimer", "Integration",
           "TrainingMonitor", "batch_len"]
