"""ProcessTree against a fake /proc, as prometheus_client's ProcessCollector test does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from exporter.client.process_tree import (
    CLOCK_TICKS,
    PAGE_SIZE,
    PSS_INTERVAL_SECONDS,
    PSS_MAX_DUTY,
    ProcessTree,
)

FIXTURES = Path(__file__).parent / "fixtures" / "proc"
GIB = 2**30


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


# --- the tree's proportional set size (PSS) from smaps_rollup ------------------------------

def with_rollup(root, pid: int, fixture: str) -> None:
    """A kernel's smaps_rollup (tests/fixtures/proc) as process ``pid``'s."""
    shutil.copy(FIXTURES / f"smaps_rollup-{fixture}", root / str(pid) / "smaps_rollup")


def trainer_and_worker(root) -> None:
    """A trainer (3 GiB RSS, 2.25 GiB PSS) and its DataLoader worker (1.25 GiB RSS of which
    most is the trainer's pages shared after fork, 0.5 GiB PSS), beside another process."""
    write_proc(root, 100, 1, "python train.py", 100, 50, 786432, 0)
    write_proc(root, 101, 100, "pt_data_worker", 30, 10, 327680, 0)
    write_proc(root, 200, 1, "someone else", 1, 1, 9999, 0)
    with_rollup(root, 100, "trainer")
    with_rollup(root, 101, "worker")
    with_rollup(root, 200, "trainer")


def test_the_trees_pss_counts_a_shared_page_once_where_rss_counts_it_per_process(tmp_path):
    trainer_and_worker(tmp_path)
    reading = ProcessTree(100, proc=str(tmp_path)).read()
    assert reading["proportional_memory_bytes"] == 2.25 * GIB + 0.5 * GIB
    assert reading["resident_memory_bytes"] == (786432 + 327680) * PAGE_SIZE


@pytest.mark.parametrize("unreadable", ["no permission", "old kernel"])
def test_a_tree_with_a_process_whose_pss_cannot_be_read_pushes_rss_alone(tmp_path, unreadable):
    trainer_and_worker(tmp_path)
    rollup = tmp_path / "101" / "smaps_rollup"
    rollup.unlink()
    if unreadable == "no permission":  # reading it fails (root reads any mode: a directory)
        rollup.mkdir()
    reading = ProcessTree(100, proc=str(tmp_path)).read()
    # no PSS at all, rather than the trainer's alone (a sum without the worker would read as
    # memory freed), and never zero; RSS stays
    assert "proportional_memory_bytes" not in reading
    assert reading["resident_memory_bytes"] == (786432 + 327680) * PAGE_SIZE


def test_a_worker_that_exits_between_the_walk_and_its_rollup_is_no_gap(tmp_path):
    trainer_and_worker(tmp_path)

    def clock() -> float:  # a read looks at its clock after the walk, before the rollups
        shutil.rmtree(tmp_path / "101", ignore_errors=True)  # gone: its memory went with it
        return 0.0

    reading = ProcessTree(100, proc=str(tmp_path), clock=clock).read()
    assert reading["proportional_memory_bytes"] == 2.25 * GIB
    assert reading["resident_memory_bytes"] == (786432 + 327680) * PAGE_SIZE  # walked: both


def test_pss_is_read_at_most_once_a_minute_and_pushed_between_reads(tmp_path):
    trainer_and_worker(tmp_path)
    now = [1000.0]
    tree = ProcessTree(100, proc=str(tmp_path), clock=lambda: now[0])
    assert tree.read()["proportional_memory_bytes"] == 2.75 * GIB
    with_rollup(tmp_path, 101, "trainer")  # the worker copied what it touched
    now[0] += PSS_INTERVAL_SECONDS - 1  # pushes every 5 s: the last reading, not a new one
    assert tree.read()["proportional_memory_bytes"] == 2.75 * GIB
    now[0] += 1
    assert tree.read()["proportional_memory_bytes"] == 4.5 * GIB


def test_a_tree_slow_to_read_is_read_less_often(tmp_path):
    """The read's cost stays under PSS_MAX_DUTY of the pusher's time however large the tree."""
    trainer_and_worker(tmp_path)
    now = [0.0]
    tree = ProcessTree(100, proc=str(tmp_path), clock=lambda: now[0])
    read = tree._read_pss

    def slow(pids):
        now[0] += 3.0  # a tree of hundreds of GiB: 3 s to walk its page tables
        return read(pids)

    tree._read_pss = slow
    tree.read()  # at 0, done at 3: next at 0 + 3 / PSS_MAX_DUTY
    now[0] = 3.0 / PSS_MAX_DUTY - 1
    tree.read()
    assert now[0] == 3.0 / PSS_MAX_DUTY - 1, "read again before its duty cycle allows"
    now[0] = 3.0 / PSS_MAX_DUTY
    tree.read()
    assert now[0] == 3.0 / PSS_MAX_DUTY + 3.0


def test_copy_on_access_in_a_real_forked_worker_shows_in_pss_while_rss_stays_flat():
    """The issue's DataLoader leak on the real kernel: a child forked from a process holding
    128 MiB reads it (its RSS counts the shared pages), then writes it (each page copied):
    the tree's RSS does not move, its PSS grows by the copies."""
    size = 128 * 2**20
    data = bytearray(b"x" * size)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            os.close(go_w)
            os.close(done_r)
            sum(data[i] for i in range(0, size, 4096))  # touch: shared, counted in RSS
            os.write(done_w, b"r")
            os.read(go_r, 1)
            for i in range(0, size, 4096):  # write: each page copied
                data[i] = 121
            os.write(done_w, b"w")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(done_w)
    try:
        now = [0.0]
        tree = ProcessTree(os.getpid(), clock=lambda: now[0])
        assert os.read(done_r, 1) == b"r"
        shared = tree.read()
        os.write(go_w, b"1")
        assert os.read(done_r, 1) == b"w"
        now[0] += PSS_INTERVAL_SECONDS
        copied = tree.read()
    finally:
        os.write(go_w, b"1")
        os.waitpid(pid, 0)
    rss = copied["resident_memory_bytes"] - shared["resident_memory_bytes"]
    pss = copied["proportional_memory_bytes"] - shared["proportional_memory_bytes"]
    assert abs(rss) < 16 * 2**20, f"RSS moved {rss / 2**20:.0f} MiB"
    assert pss > 96 * 2**20, f"PSS grew {pss / 2**20:.0f} MiB"
