"""Gradient communication of a DistributedDataParallel model, read from DDP's own timers.

DDP's reducer times every iteration it samples (CUDA events on GPUs, CPU timers on gloo): when
its gradient all-reduce ran and how much of it the backward pass overlapped. Its logger records
an iteration's times at the *next* synchronised forward, which is where this module reads them
(a forward hook on the training thread): no CUDA synchronisation is added, and reading them
costs one dictionary copy per sampled iteration. DDP samples its first ten iterations and one
in every hundred after them; on a CPU model (gloo, CPU timers, nothing to synchronise) every
iteration is sampled. An iteration DDP did not sample counts the latest sampled one's times.

What it leaves out, on purpose or not:

- the exposed time is the reducer's: communication that ran after the last gradient was ready
  (``backward_comm_time`` less ``backward_compute_comm_overlap_time``). Where communication
  slows the compute it overlaps (gloo's threads share the CPU cores with the backward pass;
  NCCL's kernels share the SMs), the step loses more than that: on a 2-core machine DDP's
  figure is about half of the difference with and without gradient sync;
- iterations under ``no_sync()`` have no communication, and count none;
- the bytes are the gradient buckets' (what is all-reduced), not what a compression hook sends.

The DDP calls used here are private (``_get_ddp_logging_data``,
``_set_ddp_runtime_logging_sample_rate``); ``tests/test_comm.py`` pins them for the torch
versions in ``tests/frameworks.txt``. Where they move, the meter says so once in the log and
reports nothing: no communication measured, no verdict that needs it.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any

log = logging.getLogger("exporter.client")

_NS = 1e-9
# DDP's reducer samples its first iterations, then one in DDP_SAMPLE_RATE (its
# kDDPRuntimeLoggingSampleRate)
DDP_FIRST_SAMPLED = 10
DDP_SAMPLE_RATE = 100


def find_ddp(model: Any) -> Any | None:
    """The DistributedDataParallel module of ``model``: itself, one it wraps (Lightning's
    ``trainer.strategy.model``), or, in a process group, the one that wraps it (the model a
    transformers Trainer hands its callbacks, which accelerate wrapped); None where none."""
    torch = sys.modules.get("torch")
    if torch is None or model is None:
        return None
    try:
        ddp_type = torch.nn.parallel.DistributedDataParallel
    except AttributeError:
        return None
    inner = model
    for _ in range(4):  # a wrapper of a wrapper, at most a few deep
        if isinstance(inner, ddp_type):
            return inner
        inner = getattr(inner, "module", None)
        if inner is None:
            break
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return _wrapper(model, ddp_type)


def _wrapper(model: Any, ddp_type: type) -> Any | None:
    """The DDP module whose ``module`` is ``model``, found among the objects that refer to it
    (its ``_modules`` dict, that dict's owner): once, at the start of training."""
    frontier, seen = [model], {id(model)}
    for _ in range(3):
        found = []
        for obj in frontier:
            for ref in gc.get_referrers(obj):
                if id(ref) in seen:
                    continue
                seen.add(id(ref))
                if isinstance(ref, ddp_type) and getattr(ref, "module", None) is model:
                    return ref
                if isinstance(ref, dict):
                    found.append(ref)
        frontier = found[:64]  # bounded: a model referred to from everywhere is no DDP's
    return None


def _bucket_bytes(data: dict[str, Any]) -> float | None:
    """The bytes of all gradient buckets, from DDP's comma-separated bucket sizes."""
    text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    if not isinstance(text, str):
        return None
    try:
        return float(sum(int(x) for x in text.replace(" ", "").split(",") if x))
    except ValueError:
        return None


class DDPComm:
    """Totals of one DDP model's gradient communication: seconds in collectives, the exposed
    part of them (the step waited), and bytes all-reduced. Updated on the training thread by a
    forward hook; :meth:`totals` may be read from any thread (each total only grows)."""

    def __init__(self, ddp: Any) -> None:
        self.comm_seconds = 0.0
        self.exposed_seconds = 0.0
        self.bytes = 0.0
        # one iteration's communication seconds, exposed seconds and bytes
        self._latest: tuple[float, float, float] | None = None
        self._synced = 0  # synchronised forwards seen
        self._syncing = False  # the forward in progress synchronises gradients
        self._iteration = -1  # the reducer iteration of the latest sample read
        self._rate = DDP_SAMPLE_RATE
        self._ddp = ddp
        self.working = hasattr(ddp, "_get_ddp_logging_data")
        if not self.working:
            log.warning("gputrain: this torch's DistributedDataParallel has no "
                        "_get_ddp_logging_data(): gradient communication is not measured")
            return
        if getattr(ddp, "device_type", None) == "cpu":
            # CPU timers: sampling every iteration adds no synchronisation
            try:
                ddp._set_ddp_runtime_logging_sample_rate(1)
                self._rate = 1
            except Exception as exc:  # moved or refused: DDP's own rate stands
                log.debug("cannot set DDP's logging sample rate: %s", exc)
        self._pre = ddp.register_forward_pre_hook(self._before_forward)
        self._post = ddp.register_forward_hook(self._after_forward)

    def _before_forward(self, module: Any, args: Any) -> None:
        torch = sys.modules["torch"]
        self._syncing = torch.is_grad_enabled() and bool(
            getattr(module, "require_backward_grad_sync", True))

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        """After a synchronised forward, the previous synchronised iteration has finished its
        backward, and DDP has just logged its times if it sampled it."""
        if not self._syncing:
            return
        done = self._synced  # synchronised iterations finished before this one
        self._synced = done + 1
        if done == 0:
            return
        if done <= DDP_FIRST_SAMPLED or done % self._rate == 0:
            self._read()
        latest = self._latest
        if latest is not None:
            comm, exposed, nbytes = latest
            self.comm_seconds += comm
            self.exposed_seconds += exposed
            self.bytes += nbytes

    def _read(self) -> None:
        try:
            data = self._ddp._get_ddp_logging_data()
        except Exception as exc:  # the private API moved under us: stop, say so once
            log.warning("gputrain: cannot read DDP's logging data (%s): gradient "
                        "communication is no longer measured", exc)
            self.close()
            return
        iteration = data.get("iteration")
        comm = data.get("backward_comm_time")
        overlap = data.get("backward_compute_comm_overlap_time")
        if iteration == self._iteration or not isinstance(comm, int) or comm < 0:
            return  # nothing new sampled
        self._iteration = iteration
        overlap = overlap if isinstance(overlap, int) and overlap >= 0 else 0
        nbytes = _bucket_bytes(data)
        self._latest = (comm * _NS, max(0, comm - overlap) * _NS,
                        nbytes if nbytes is not None else 0.0)

    def totals(self) -> dict[str, float]:
        """The pushed fields: ``comm_seconds``, ``comm_exposed_seconds``, ``comm_bytes``."""
        exposed = self.exposed_seconds  # before the comm seconds: never more exposed than all
        return {"comm_seconds": max(self.comm_seconds, exposed),
                "comm_exposed_seconds": exposed, "comm_bytes": self.bytes}

    def close(self) -> None:
        """Stop reading (the hooks are removed; the totals stay)."""
        self.working = False
        for handle in (getattr(self, "_pre", None), getattr(self, "_post", None)):
            if handle is not None:
                handle.remove()
