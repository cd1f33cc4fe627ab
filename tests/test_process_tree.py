"""ProcessTree against a fake /proc, as prometheus_client's ProcessCollector test does."""

from __future__ import annotations

import os

import pytest

from exporter.client.process_tree import CLOCK_TICKS, PAGE_SIZE, ProcessTree


def write_proc(root, pid: int, ppid: int, comm: str, utime: int, stime: int, rss_pages: int,
               rchar: int) -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(
        f"{pid} ({comm}) S {ppid} 1 1 0 -1 4194560 0 0 0 0 {utime} {stime} 0 0 20 0 1 0 "
        f"100 1000000 {rss_pages} 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 0 0 0\n")
    (d / "io").write_text(f"rchar: {rchar}\nwchar: 0\nsyscr: 1\nsyscw: 0\n"
                          "read_bytes: 0\nwrite_bytes: 0\ncancelled_write_bytes: 0\n")


def test_the_tree_is_the_process_and_its_descendants(tmp_path):
    write_proc(tmp_path, 100, 1, "python train.py", 100, 50, 1000, 5000)
    write_proc(tmp_path, 101, 100, "pt_data_worker", 30, 10, 200, 7000)
    write_proc(tmp_path, 102, 101, "sh (odd) name)", 5, 5, 10, 0)
    write_proc(tmp_path, 200, 1, "someone else", 999, 999, 9999, 99999)
    (tmp_path / "self").mkdir()  # not a pid
    tree = ProcessTree(100, proc=str(tmp_path))
    first = tree.read()
    assert first["cpu_seconds"] == pytest.approx((150 + 40 + 10) / CLOCK_TICKS)
    assert first["resident_memory_bytes"] == (1000 + 200 + 10) * PAGE_SIZE
    assert first["read_bytes"] == 12000
    assert first["pid"] == 100


def test_a_worker_that_exits_keeps_its_share(tmp_path):
    write_proc(tmp_path, 100, 1, "python", 100, 0, 1000, 0)
    write_proc(tmp_path, 101, 100, "worker", 60, 0, 500, 3000)
    tree = ProcessTree(100, proc=str(tmp_path))
    tree.read()
    for f in (tmp_path / "101").iterdir():
        f.unlink()
    (tmp_path / "101").rmdir()  # the worker exited
    write_proc(tmp_path, 100, 1, "python", 110, 0, 1000, 100)
    write_proc(tmp_path, 103, 100, "worker", 20, 0, 400, 50)  # a new worker
    second = tree.read()
    assert second["cpu_seconds"] == pytest.approx((110 + 60 + 20) / CLOCK_TICKS)
    assert second["read_bytes"] == 3000 + 100 + 50
    assert second["resident_memory_bytes"] == (1000 + 400) * PAGE_SIZE


def test_this_process_through_the_real_proc():
    reading = ProcessTree(os.getpid()).read()
    assert reading["cpu_seconds"] > 0 and reading["resident_memory_bytes"] > 10 * 2**20
