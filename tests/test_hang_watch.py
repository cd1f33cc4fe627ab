"""When the daemon takes a run's stacks (exporter.serving.hangs.HangWatch), on a fake clock
through its own ingest and history: a run whose ranks are all still in their first step past
the ceiling is captured, and again while it stays so; a job's own collective timeout lowers
both (half of it), so its stacks are in before the timeout ends it."""

from __future__ import annotations

from test_departed import Node, T

from exporter.serving.hangs import HangWatch


class Board:
    """The profile board as the hang watch asks it: each capture asked for, by run."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[str]]] = []

    def capture_hang(self, run: str, ranks: list[str]) -> list[str]:
        self.asked.append((run, ranks))
        return [f"hang-{len(self.asked)}-{r}" for r in ranks]


def first_step(node: Node, seconds: float, **over) -> None:
    """``seconds`` of ranks 0 and 1 pushing every 5 s, both in their first step since their
    process started (no step yet)."""
    for _ in range(int(seconds / 5)):
        node.now += 5.0
        for r in ("0", "1"):
            node.push(r, steps=0, step_seconds=0.0, data_wait_seconds=0.0, samples=0.0,
                      last_step_timestamp=None, elapsed_seconds=node.now - 1000.0, **over)
        node.observe()


def test_a_short_collective_timeout_takes_the_stacks_at_half_of_it_and_again_each_half():
    node, board = Node(), Board()
    watch = HangWatch(node.history, board, T)  # type: ignore[arg-type]
    first_step(node, 15, collective_timeout_seconds=40)
    watch.check()
    assert board.asked == []  # 15 s: under the ceiling, 20 s
    first_step(node, 10, collective_timeout_seconds=40)
    watch.check()
    assert board.asked == [("r", ["0", "1"])]  # 25 s: past it, both ranks asked
    first_step(node, 10, collective_timeout_seconds=40)
    watch.check()
    assert len(board.asked) == 1  # 10 s since: not yet again
    first_step(node, 15, collective_timeout_seconds=40)
    watch.check()
    assert len(board.asked) == 2  # 25 s since: again (each 20 s, not each hung_min_seconds)


def test_near_miss_without_a_timeout_the_first_step_keeps_the_300_s_ceiling():
    node, board = Node(), Board()
    watch = HangWatch(node.history, board, T)  # type: ignore[arg-type]
    first_step(node, 100)
    watch.check()
    assert board.asked == []
    first_step(node, 60, collective_timeout_seconds=3600)  # an hour's: 300 s still
    watch.check()
    assert board.asked == []
    first_step(node, 160, collective_timeout_seconds=3600)
    watch.check()
    assert board.asked == [("r", ["0", "1"])]
