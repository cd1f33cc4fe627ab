"""A rank the kernel's OOM killer ends, end to end: one rank of real torch.distributed (gloo on
the CPU) inside a memory cgroup of its own (v1 or v2: CI runs as root), pushing to a real
daemon, allocates past the cgroup's limit and is killed (SIGKILL: no handler of its runs, no
goodbye). The daemon, which saw its process run, finds it gone and says how it ended: failed,
``killed``, ``OOMKilled`` (the node's OOM kill count, /proc/vmstat, grew while it died).

The near misses (a process the daemon never saw, a stopped one, a goodbye, a kill before the
rank's last push) are in ``test_departed.py``, on a fixture /proc; a rank killed by SIGKILL in
a run of four, its alert and ``diagnose``, in ``test_hangs.py``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NO_HOST, sample_value, wait_until
from test_hangs import Job, run_of

pytestmark = pytest.mark.torch

LIMIT = 1536 << 20  # bytes: the rank imports torch and trains under it, then allocates past it


def _own_cgroup() -> tuple[str, Path]:
    """("v1", the memory hierarchy's directory of this process) or ("v2", its cgroup's)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return "v1", Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    for line in lines:
        if line.startswith("0::"):
            return "v2", Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    raise AssertionError(f"no memory cgroup in /proc/self/cgroup: {lines}")


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A new cgroup with ``limit`` bytes of memory and no swap; yields its ``cgroup.procs``."""
    version, parent = _own_cgroup()
    if version == "v2":  # a child of the root of a delegated subtree, memory enabled there
        parent = Path("/sys/fs/cgroup")
        (parent / "cgroup.subtree_control").write_text("+memory")
    group = parent / f"gputrain-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        if version == "v1":
            (group / "memory.limit_in_bytes").write_text(str(limit))
            swap = group / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))
        else:
            (group / "memory.max").write_text(str(limit))
            (group / "memory.swap.max").write_text("0")
        yield group / "cgroup.procs"
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def test_a_rank_the_oom_killer_ends_reads_failed_oom_killed(daemon_factory, tmp_path):
    assert os.geteuid() == 0, "a memory cgroup of its own needs root (CI runs as root)"
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", *NO_HOST)
    with memory_cgroup(LIMIT) as procs:
        job = Job(tmp_path, "oom", [d.ingest_url], "--block", "oom", "--block-rank", "0",
                  preexec_fn=lambda: procs.write_text(str(os.getpid())))
        try:
            wait_until(lambda: run_of(d, "oom"), timeout=120, interval=1,
                       what=lambda: f"rank 0 pushing: {job.log(0)}")
            (job.out / "allocate").touch()
            def ended() -> dict | None:
                card = run_of(d, "oom")
                rank = card["ranks"][0] if card else {}
                return rank if rank.get("exit_reason") else None

            rank = wait_until(ended, timeout=240, interval=1,
                              what=lambda: f"rank 0's end ({run_of(d, 'oom')}): {job.log(0)}")
            assert job.procs[0].wait(timeout=60) == -9, job.log(0)  # the OOM killer's SIGKILL
            assert rank["failed"] and rank["verdict"] == "failed", rank
            assert (rank["exit_reason"], rank["exit_detail"]) == ("killed", "OOMKilled"), rank
            assert "OOM killer" in rank["reason"], rank
            assert "OOM killer most likely ended it" in rank["advice"], rank
            assert sample_value(d.metrics(), "gputrain_training_exit_info",
                                {"run": "oom", "rank": "0", "reason": "killed",
                                 "detail": "OOMKilled"}) == 1.0
            assert "OOM killer" in d.log_text()
        finally:
            job.stop()
