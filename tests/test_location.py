"""Where a hung rank is stuck (exporter/heuristics/location.py), read from real py-spy dumps.

The fixtures (tests/data/stacks/*.json) are py-spy's own ``dump --json`` output of real
processes stuck in each place (tests/data/stacks/scenarios.py records them: ``python
tests/data/stacks/scenarios.py record``), taken both with ``--native`` and ``--nonblocking``;
each goes through the client's parse and the daemon's validation of a push, as the daemon holds
it, before it is classified. One test records live: two gloo ranks hung by one of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ENV_BIN, free_port, wait_until

from exporter.client.stacks import parse_dump
from exporter.heuristics.location import (
    DDP_GRADIENT,
    LOCATION_WORDS,
    LOCATIONS,
    Location,
    classify,
    classify_dump,
    culprit_line,
    rank_words,
)
from exporter.serving.profiles import parse_stacks_report

STACKS = Path(__file__).resolve().parent / "data" / "stacks"
SCENARIOS = STACKS / "scenarios.py"


def held(dumps: dict[int, Any], main_pid: int) -> list[dict[str, Any]]:
    """py-spy's JSON of a rank's processes as the daemon holds it: the client's parse, then
    the daemon's validation of the push that carries it."""
    report = {"id": "p-0123456789ab", "state": "done", "mode": "dump",
              "file": "/tmp/rank.dump.json", "file_bytes": 1,
              "processes": parse_dump(dumps, main_pid)}
    return parse_stacks_report(json.loads(json.dumps(report)))["result"]["processes"]


def recorded(name: str) -> list[dict[str, Any]]:
    doc = json.loads((STACKS / f"{name}.json").read_text())
    return held({int(pid): raw for pid, raw in doc["dumps"].items()}, doc["main_pid"])


def where(name: str) -> Location:
    return classify_dump(recorded(name))


BOTH = ("native", "nonblocking")


# -- each place, from real dumps --------------------------------------------------------------

@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("name, location, function, collective", [
    # rank 1 of a DDP run sleeps in its dataset; rank 0 waits for it (below, per mode)
    ("ddp_getitem-rank1", "data_loading", "DS.__getitem__", None),
    # an explicit all-reduce (called from sync_metrics) and the peer it waits for, evaluating
    ("allreduce_eval-rank0", "collective", "all_reduce", "all_reduce"),
    ("allreduce_eval-rank1", "evaluation", "evaluate", None),
    # near miss: a barrier inside evaluate() waits for its peers: a collective, not evaluation
    ("barrier_eval-rank0", "collective", "barrier", "barrier"),
    # idle in the program's own code (time.sleep): nothing to name but the function
    ("barrier_eval-rank1", "elsewhere", "idle", None),
    # torch.save blocked on a slow write: named by the program's save function
    ("save_slow-rank0", "checkpoint_io", "save_checkpoint", None),
    # busy matmuls in a forward pass: the innermost frame of the program's own
    ("forward_spin-rank0", "computing", "Model.forward", None),
    # the main process waits on its workers' queue: named by the workers' dataset frame
    ("loader_workers-rank0", "data_loading", "DS.__getitem__", None),
    # near miss: a dataset read under an evaluation loop is data loading (the innermost
    # activity decides: the rank waits for its data, and the fix is in the dataset)
    ("eval_getitem-rank0", "data_loading", "DS.__getitem__", None),
])
def test_a_real_dump_says_where_the_rank_is(name, location, function, collective, mode):
    got = where(f"{name}-{mode}")
    assert (got.location, got.function, got.collective) == (location, function, collective)
    assert got.native is (mode == "native")  # the fixture is what its name says


def test_a_rank_waiting_in_ddps_gradient_all_reduce_is_seen_with_native_frames_only():
    """The DDP all-reduce is waited for in C++ under backward: the native dump shows the
    reducer; the nonblocking one shows backward only, which reads as computing, said as
    such (no collective is invented)."""
    native = where("ddp_getitem-rank0-native")
    assert native.location == "collective" and native.collective == DDP_GRADIENT
    assert native.function == "c10d::Reducer::finalize_backward"
    python_only = where("ddp_getitem-rank0-nonblocking")
    assert (python_only.location, python_only.phase, python_only.collective) == \
        ("computing", "backward", None)
    assert python_only.function == "train_step"


# -- one line over a run's ranks, from real dumps -----------------------------------------------

def run_of(scenario: str, mode: str) -> list[tuple[str, str, Location]]:
    return [(str(r), f"node{r}", where(f"{scenario}-rank{r}-{mode}")) for r in (0, 1)]


def test_the_line_names_the_rank_the_others_wait_for():
    got = culprit_line(run_of("ddp_getitem", "native"))
    assert got.ranks == ("1",)
    assert got.line == ("rank 1 on node1 is in `DS.__getitem__` (loading data); rank 0 waits "
                        "in the all-reduce (DDP gradient)")
    got = culprit_line(run_of("allreduce_eval", "nonblocking"))
    assert got == culprit_line(run_of("allreduce_eval", "native"))
    assert got.ranks == ("1",) and got.line == ("rank 1 on node1 is in `evaluate` (in "
                                                "evaluation); rank 0 waits in the all-reduce")
    got = culprit_line(run_of("barrier_eval", "native"))
    assert got.ranks == ("1",)
    assert got.line == "rank 1 on node1 is in `idle` (elsewhere); rank 0 waits in the barrier"


def test_without_native_frames_the_line_blames_nobody_it_cannot_see_waiting():
    got = culprit_line(run_of("ddp_getitem", "nonblocking"))
    assert got.ranks == ()
    assert got.line == (
        "rank 1 on node1 is in `DS.__getitem__` (loading data); rank 0 on node0 is in "
        "`train_step` (computing, in backward; native frames unavailable: a wait in a "
        "collective may show as computing)")


# -- the rules' near misses, on stacks written out ------------------------------------------------

def frames(*spec: str) -> list[dict[str, Any]]:
    """Frames innermost first from ``"function @ file"`` (a native frame: a library file)."""
    out = []
    for s in spec:
        function, _, file = s.partition(" @ ")
        out.append({"function": function, "file": file, "line": 0 if ".py" not in file else 7})
    return out


def test_torch_save_called_from_no_save_function_is_named_torch_save():
    got = classify(frames("posix.write @ libc.so.6", "_save @ torch/serialization.py",
                          "save @ torch/serialization.py", "on_epoch_end @ train.py",
                          "main @ train.py"))
    assert (got.location, got.function) == ("checkpoint_io", "torch.save")


def test_activation_checkpointing_is_computing_not_checkpoint_io():
    got = classify(frames("Linear.forward @ torch/nn/modules/linear.py",
                          "Block.forward @ model.py",
                          "CheckpointFunction.forward @ torch/utils/checkpoint.py",
                          "checkpoint @ torch/utils/checkpoint.py",
                          "Model.forward @ model.py", "train @ train.py"))
    assert (got.location, got.function, got.phase) == ("computing", "Block.forward", "forward")


def test_a_getitem_outside_any_dataloader_is_not_data_loading():
    got = classify(frames("Vocab.__getitem__ @ model.py", "Model.forward @ model.py",
                          "Module._call_impl @ torch/nn/modules/module.py", "train @ train.py"))
    assert got.location == "computing"
    by_hand = classify(frames("TextDataset.__getitem__ @ data.py", "train @ train.py"))
    assert (by_hand.location, by_hand.function) == ("data_loading", "TextDataset.__getitem__")


def test_torchs_own_eval_is_not_an_evaluation_but_a_frameworks_is():
    assert classify(frames("Module.eval @ torch/nn/modules/module.py",
                           "train @ train.py")).location == "computing"
    got = classify(frames("Linear.forward @ torch/nn/modules/linear.py",
                          "Model.forward @ model.py",
                          "Trainer.prediction_step @ transformers/trainer.py",
                          "Trainer.evaluation_loop @ transformers/trainer.py",
                          "Trainer.evaluate @ transformers/trainer.py", "main @ train.py"))
    assert (got.location, got.function) == ("evaluation", "Trainer.evaluate")


def test_framework_and_rendezvous_waits_are_collectives():
    ds = classify(frames("all_reduce @ deepspeed/comm/torch.py",
                         "all_reduce @ deepspeed/comm/comm.py", "Engine.step @ engine.py"))
    assert (ds.location, ds.collective) == ("collective", "all_reduce")
    join = classify(frames("c10d::TCPStore::doWait @ libtorch_cpu.so",
                           "init_process_group @ torch/distributed/distributed_c10d.py",
                           "main @ train.py"))
    assert (join.location, join.function, join.collective) == \
        ("collective", "init_process_group", "rendezvous")
    fsdp = classify(frames("c10d::ProcessGroupNCCL::allgather_into_tensor_coalesced @ "
                           "libtorch_cuda.so", "pybind11::cpp_function::dispatcher @ "
                           "libtorch_python.so", "foreach_all_gather @ torch/distributed/"
                           "fsdp/_fully_shard/_fsdp_collectives.py", "Model.forward @ m.py"))
    assert (fsdp.location, fsdp.collective) == ("collective", "all_gather")


def test_a_native_only_wait_is_a_collective_named_by_its_backend_call():
    gloo = classify(frames("pthread_cond_wait @ libc.so.6",
                           "gloo::transport::tcp::UnboundBuffer::waitRecv @ libtorch_cpu.so",
                           "c10d::ProcessGroupGloo::allreduce @ libtorch_cpu.so",
                           "start_thread @ libc.so.6"))
    assert (gloo.location, gloo.collective, gloo.native) == ("collective", "all_reduce", True)
    nccl = classify(frames("c10d::ProcessGroupNCCL::WorkNCCL::synchronize @ libtorch_cuda.so",
                           "Tensor.item @ torch/_tensor.py", "train @ train.py"))
    assert nccl.location == "collective"
    # near miss: DDP's hook copying a gradient into its bucket is backward's work, no wait
    hook = classify(frames("memcpy @ libc.so.6", "c10d::Reducer::autograd_hook @ "
                           "libtorch_cpu.so", "torch::autograd::Engine::thread_main @ "
                           "libtorch_cpu.so", "backward @ torch/autograd/__init__.py",
                           "train @ train.py"))
    assert (hook.location, hook.phase) == ("computing", "backward")


def test_nothing_recognisable_is_elsewhere():
    assert (classify([]).location, classify([]).function) == ("elsewhere", "")
    assert classify(frames("select @ selectors.py", "serve @ server.py")).location == \
        "elsewhere"
    assert classify_dump([]) == Location("elsewhere")
    assert classify_dump([{"pid": 1, "role": "main", "threads": [], "error": "gone"}]) == \
        Location("elsewhere")


def test_the_dump_is_read_at_its_main_thread_or_else_its_first():
    barrier = frames("barrier @ torch/distributed/distributed_c10d.py", "main @ train.py")
    sleeping = frames("run @ helper.py")
    process = {"pid": 1, "role": "main", "threads": [
        {"name": "Thread-1", "frames": sleeping}, {"name": "MainThread", "frames": barrier}]}
    assert classify_dump([process]).location == "collective"
    unnamed = {"pid": 1, "role": "main", "threads": [
        {"name": "", "frames": barrier}, {"name": "", "frames": sleeping}]}
    assert classify_dump([unnamed]).location == "collective"


# -- the line's words ----------------------------------------------------------------------------

def at(location: str, function: str = "", collective: str | None = None, **kw: Any
       ) -> Location:
    return Location(location, function, collective=collective, native=True, **kw)


def test_one_rank_off_among_eight_is_named_with_the_ranges_of_the_rest():
    ranks = [(str(r), f"node{r // 2}", at("collective", "all_reduce", "all_reduce"))
             for r in range(8) if r != 3]
    ranks.append(("3", "node2", at("data_loading", "MyDataset.__getitem__")))
    got = culprit_line(ranks)
    assert got.ranks == ("3",)
    assert got.line == ("rank 3 on node2 is in `MyDataset.__getitem__` (loading data); "
                        "ranks 0-2 and 4-7 wait in the all-reduce")


def test_every_rank_waiting_blames_no_rank():
    got = culprit_line([(str(r), "n", at("collective", "all_reduce", "all_reduce"))
                        for r in range(4)])
    assert got == culprit_line([(str(r), "n", at("collective", "x", "all_reduce"))
                                for r in range(4)])
    assert got.ranks == ()
    assert got.line == "every rank waits in a collective (all-reduce): a lost peer or a " \
        "network fault"
    split = culprit_line([("0", "n", at("collective", "all_reduce", "all_reduce")),
                          ("1", "n", at("collective", "barrier", "barrier"))])
    assert split.ranks == ()
    assert split.line == ("every rank waits in a collective, not all in the same one: rank 0 "
                          "in the all-reduce, rank 1 in the barrier (a rank took another "
                          "code path)")


def test_the_hang_line_reads_each_ranks_collective_back_and_names_a_silent_peer():
    """What every surface reads (the ``location`` and ``function`` labels of
    gputrain_training_stack_location, read back into reports): ranks 0 and 2 in DDP's gradient
    all-reduce while rank 1 waits at a barrier its peers never reach is a mismatch of code
    paths, not a lost peer; every rank in the same one is."""
    from exporter.heuristics.catalogue import hang_line
    from exporter.heuristics.readings import RankReport

    def rank(r: str, function: str) -> RankReport:
        rep = RankReport("", "n1", "job", r)
        rep.location, rep.location_detail = {"collective": 1.0}, function
        return rep

    split = hang_line([rank("0", "c10d::Reducer::finalize_backward"), rank("1", "barrier"),
                       rank("2", "c10d::Reducer::finalize_backward")])
    assert split == ("every rank waits in a collective, not all in the same one: ranks 0 and 2 "
                     "in the all-reduce (DDP gradient), rank 1 in the barrier (a rank took "
                     "another code path)")
    same = hang_line([rank(r, "c10d::Reducer::finalize_backward") for r in "012"])
    assert same == ("every rank waits in a collective (all-reduce (DDP gradient)): a lost peer "
                    "or a network fault")
    unnamed = hang_line([rank("0", "c10d::Work::wait"), rank("1", "barrier")])
    assert unnamed.endswith("a lost peer or a network fault"), unnamed
    # a rank killed outright (no goodbye, no stacks) is the peer the others may wait for
    dead = RankReport("", "n1", "job", "2")
    dead.seconds_since_push = 75.0
    line = hang_line([rank(r, "c10d::Reducer::finalize_backward") for r in "01"], [dead])
    assert line == ("every rank waits in a collective (all-reduce (DDP gradient)): a lost peer "
                    "or a network fault; rank 2 has not pushed for 75 s, without a goodbye: "
                    "gone or frozen, the peer they may wait for")
    # uneven inputs: a rank that finished first, and one that ended without finishing
    first = RankReport("", "n1", "job", "0")
    first.finished, first.exit, first.seconds_since_push = True, {"completed": 1.0}, 120.0
    crashed = RankReport("", "n1", "job", "3")
    crashed.failed, crashed.exit, crashed.exit_detail = True, {"exception": 1.0}, "ValueError"
    crashed.seconds_since_push = 20.0
    line = hang_line([rank("1", "c10d::Reducer::finalize_backward")], [first, crashed])
    assert line.endswith("; rank 3 ended 20 s ago without finishing (an exception "
                         "(ValueError)): the peer they may wait for; rank 0 finished 2 min ago, "
                         "before the others: they may wait for it in a collective (uneven "
                         "inputs: a rank that ran out of batches first)"), line


def test_several_culprits_on_several_nodes_and_names_that_are_no_numbers():
    got = culprit_line([
        ("10", "b", at("checkpoint_io", "save_checkpoint")),
        ("2", "a", at("checkpoint_io", "save_checkpoint")),
        ("worker-a", "c", at("collective", "barrier", "barrier")),
        ("1", "a", at("collective", "barrier", "barrier"))])
    assert got.ranks == ("2", "10")
    assert got.line == ("ranks 2 and 10 on a, b are in `save_checkpoint` (in checkpoint I/O); "
                        "ranks 1 and worker-a wait in the barrier")


def test_no_rank_waiting_says_where_each_group_is():
    got = culprit_line([
        ("0", "", at("computing", "train_step", phase="forward")),
        ("1", "", at("computing", "train_step", phase="forward")),
        ("2", "", at("evaluation", "evaluate"))])
    assert got.ranks == ()
    assert got.line == ("rank 2 is in `evaluate` (in evaluation); ranks 0 and 1 are in "
                        "`train_step` (computing, in forward)")
    assert culprit_line([]).ranks == ()
    # a location rebuilt from a label does not know its dump's frames: no note on them
    assert culprit_line([("0", "n", Location("computing", "train_step"))]).line == \
        "rank 0 on n is in `train_step` (computing)"


def test_rank_words_compress_and_sort():
    assert rank_words(["7", "0", "1", "2", "5", "4"]) == "ranks 0-2, 4, 5 and 7"
    assert rank_words(["3"]) == "rank 3"
    assert rank_words(["b", "01", "10", "9"]) == "ranks 9, 10, 01 and b"
    many = rank_words(str(r) for r in range(0, 200, 2))
    assert many.endswith("and 92 more") and len(many) < 80


def test_every_location_has_words():
    assert set(LOCATION_WORDS) == set(LOCATIONS)


# -- live ------------------------------------------------------------------------------------------

def py_spy_dump(pid: int) -> list:
    spy = ENV_BIN / "py-spy"
    assert spy.exists(), "py-spy is missing: pip install -e '.[stacks]'"
    done = subprocess.run([str(spy), "dump", "--pid", str(pid), "--native", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_live_two_rank_hang_names_the_rank_in_its_dataset(tmp_path):
    """Two gloo ranks train DDP; rank 1 blocks in ``DS.__getitem__``: py-spy --native of both,
    and the line names rank 1 and its dataset."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, str(SCENARIOS), "run", "ddp_getitem", str(r),
                               str(tmp_path)], env=env) for r in (0, 1)]
    try:
        for r in (0, 1):
            wait_until(lambda r=r: (tmp_path / f"ddp_getitem-rank{r}.ready").exists(),
                       timeout=120, what=f"rank {r} to reach its place")
        last: list[list[str]] = [[]]

        def settled() -> list | None:
            # rank 0 is in its backward; two dumps alike in a row: it waits, not on its way
            raw = py_spy_dump(ranks[0].pid)
            now = [f["name"] for f in raw[0]["frames"]]
            alike, last[0] = now == last[0], now
            return raw if alike and "_engine_run_backward" in now else None

        rank0 = wait_until(settled, timeout=60, what="rank 0 to settle in its backward")
        got = culprit_line([
            ("0", "node0", classify_dump(held({ranks[0].pid: rank0}, ranks[0].pid))),
            ("1", "node1", classify_dump(held({ranks[1].pid: py_spy_dump(ranks[1].pid)},
                                              ranks[1].pid)))])
        assert got.ranks == ("1",)
        assert got.line == ("rank 1 on node1 is in `DS.__getitem__` (loading data); rank 0 "
                            "waits in the all-reduce (DDP gradient)")
    finally:
        for p in ranks:
            p.kill()
            p.wait()
