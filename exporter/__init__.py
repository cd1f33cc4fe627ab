"""gputrain-exporter: is each GPU of a training job busy, and if not, what starves it."""

__version__ = "0.1.0"
