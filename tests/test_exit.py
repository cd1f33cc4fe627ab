"""How a rank's process ended, said with its goodbye: real Python processes with a monitor,
pushing to a small HTTP receiver that keeps every push; each is ended its own way (close(),
a ``with`` block, a loop run to its end, an exception nobody caught, sys.exit, a signal)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import ROOT, free_port, require_module

from exporter.protocol import PUSH_PATH

# the scripts' common start: a monitor pushing to the receiver only when it ends
PRELUDE = """\
import os, signal, sys, time
from exporter.client import TrainingMonitor

def ready():  # the test may signal the process from here on
    print("ready", flush=True)

"""


class Receiver:
    """The daemon's ingest as far as a client sees it: takes each push, keeps its body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == PUSH_PATH:
                    bodies.append(json.loads(body))
                answer = b'{"instructions": []}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def goodbye(self) -> dict:
        """The one push that said goodbye (there is exactly one), the last push."""
        byes = [b for b in self.bodies if b.get("goodbye")]
        assert len(byes) == 1, self.bodies
        assert self.bodies[-1] is byes[0]
        return byes[0]


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


def start(tmp_path: Path, url: str, code: str) -> subprocess.Popen:
    """The training script ``code`` (after PRELUDE) as its own process, pushing to ``url``."""
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    return subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GPUTRAIN_URL": url, "PYTHONPATH": str(ROOT),
                                 "GPUTRAIN_TRACE_DIR": str(tmp_path / "traces")})


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    """Wait for the process; its exit status and what it wrote to stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def until_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.strip() == "ready", (line, proc.stderr.read())  # type: ignore[union-attr]


def test_close_says_closed(tmp_path, receiver):
    proc = start(tmp_path, receiver.url, """
        m = TrainingMonitor(run="t", push_interval=60)
        for _ in m.wrap(range(3), batch_size=1):
            pass
        m.close(timeout=10)
    """)
    rc, err = finish(proc)
    assert rc == 0, err
    bye = receiver.goodbye()
    assert bye["exit_reason"] == "closed" and "exit_detail" not in bye
    assert bye["steps"] == 3


@pytest.mark.parametrize("raises, reason, detail, status", [
    ("raise ValueError('bad batch')", "exception", "ValueError", 1),
    ("pass", "closed", None, 0),  # the near miss: the block left without one
    # sys.exit inside the block: status 0 is the program's clean end, any other a failure
    ("sys.exit(0)", "closed", None, 0),
    ("sys.exit()", "closed", None, 0),
    ("sys.exit(3)", "exception", "SystemExit", 3),
    ("sys.exit('no data')", "exception", "SystemExit", 1),
])
def test_a_with_block_says_closed_or_the_exception_that_left_it(tmp_path, receiver, raises,
                                                                reason, detail, status):
    proc = start(tmp_path, receiver.url, f"""
        with TrainingMonitor(run="t", push_interval=60) as m:
            for _ in m.wrap(range(3), batch_size=1):
                pass
            {raises}
    """)
    rc, err = finish(proc)
    assert rc == status, err
    bye = receiver.goodbye()
    assert bye["exit_reason"] == reason and bye.get("exit_detail") == detail


@pytest.mark.parametrize("loop, reason", [
    ("for _ in m.wrap(range(5), batch_size=1):\n    pass", "completed"),
    # a hand-written loop: the interpreter ends normally, no loop is known to have ended
    ("for _ in range(5):\n    with m.step(samples=1):\n        pass", "exited"),
    ("for _ in m.wrap(range(5), batch_size=1):\n    pass\nsys.exit(0)", "completed"),
    ("for _ in range(5):\n    with m.step(samples=1):\n        pass\nsys.exit(0)", "exited"),
])
def test_the_end_of_the_interpreter_says_completed_or_exited(tmp_path, receiver, loop, reason):
    proc = start(tmp_path, receiver.url, 'm = TrainingMonitor(run="t", push_interval=60)\n'
                 + loop + "\n")
    rc, err = finish(proc)
    assert rc == 0, err
    bye = receiver.goodbye()
    assert bye["exit_reason"] == reason and "exit_detail" not in bye
    assert bye["steps"] == 5


LOOP = "m = TrainingMonitor(run=\"t\", push_interval=60)\n"


@pytest.mark.parametrize("ending, status, reason, detail", [
    # a script's own handler that logs and exits 1 (Hydra's run_and_report does so): the
    # exception it handled
    ("try:\n    for i in m.wrap(range(5), batch_size=1):\n        if i == 3:\n"
     "            raise ValueError('bad batch')\nexcept Exception:\n"
     "    print('training failed', file=sys.stderr)\n    sys.exit(1)", 1, "exception",
     "ValueError"),
    # sys.exit(main()) with a failing status, and sys.exit('message'): the status says it
    ("def main():\n    for _ in m.wrap(range(5), batch_size=1):\n        pass\n    return 2\n"
     "sys.exit(main())", 2, "exception", "SystemExit"),
    ("for _ in m.wrap(range(5), batch_size=1):\n    pass\nsys.exit('no data')", 1,
     "exception", "SystemExit"),
    # near misses: a clean status after a handled exception, and a worker thread's
    # sys.exit(1) (it ends that thread, not the process)
    ("try:\n    raise ValueError('retried')\nexcept ValueError:\n    pass\n"
     "for _ in m.wrap(range(5), batch_size=1):\n    pass\nsys.exit(0)", 0, "completed", None),
    ("import threading\nt = threading.Thread(target=sys.exit, args=(1,))\nt.start()\n"
     "t.join()\nfor _ in m.wrap(range(5), batch_size=1):\n    pass", 0, "completed", None),
    # a SystemExit caught and survived (argparse's in a try), then the training: no failure
    ("try:\n    sys.exit(2)\nexcept SystemExit:\n    pass\n"
     "for _ in m.wrap(range(5), batch_size=1):\n    pass", 0, "completed", None),
    # the status is CPython's: 256 is 0 (its low byte), 0.0 is no integer, so 1
    ("for _ in m.wrap(range(5), batch_size=1):\n    pass\nsys.exit(256)", 0, "completed",
     None),
    ("for _ in m.wrap(range(5), batch_size=1):\n    pass\nsys.exit(0.0)", 1, "exception",
     "SystemExit"),
    # the builtins exit() and quit() (site's: they raise SystemExit themselves), as scripts
    # call them, and their near misses
    ("try:\n    for i in m.wrap(range(5), batch_size=1):\n        if i == 3:\n"
     "            raise OSError('disk full')\nexcept OSError:\n    exit(1)", 1, "exception",
     "OSError"),
    ("for _ in m.wrap(range(5), batch_size=1):\n    pass\nquit(3)", 3, "exception",
     "SystemExit"),
    ("for _ in m.wrap(range(5), batch_size=1):\n    pass\nexit()", 0, "completed", None),
    ("import _sitebuiltins\nassert isinstance(exit, _sitebuiltins.Quitter)\n"
     "assert 'exit()' in repr(exit) and quit.name == 'quit'\n"
     "for _ in m.wrap(range(5), batch_size=1):\n    pass\nexit(0)", 0, "completed", None),
    # the wrapped sys.exit still pickles by name (a pool's or a spawned process's target)
    ("import pickle\nassert pickle.loads(pickle.dumps(sys.exit)) is sys.exit\n"
     "for _ in m.wrap(range(5), batch_size=1):\n    pass", 0, "completed", None),
])
def test_a_sys_exit_with_a_failing_status_is_a_failure(tmp_path, receiver, ending, status,
                                                       reason, detail):
    """The main module ends by sys.exit(n): outside any ``with`` block the interpreter keeps
    no record of n that the goodbye could read, yet a launcher (torchrun, Slurm) calls the
    rank failed by it."""
    proc = start(tmp_path, receiver.url, LOOP + ending + "\n")
    rc, err = finish(proc)
    assert rc == status, err
    bye = receiver.goodbye()
    assert bye["exit_reason"] == reason and bye.get("exit_detail") == detail, bye


def test_a_with_block_left_by_sys_exit_1_names_the_exception_its_caller_handled(tmp_path,
                                                                                receiver):
    proc = start(tmp_path, receiver.url, """
        with TrainingMonitor(run="t", push_interval=60) as m:
            try:
                for i in m.wrap(range(5), batch_size=1):
                    if i == 3:
                        raise ValueError("bad batch")
            except ValueError:
                sys.exit(1)
    """)
    rc, err = finish(proc)
    assert rc == 1, err
    bye = receiver.goodbye()
    assert (bye["exit_reason"], bye["exit_detail"]) == ("exception", "ValueError"), bye


def test_a_forked_child_does_not_inherit_its_parents_caught_sys_exit(tmp_path, receiver):
    """The parent caught a sys.exit(3) (its record stays), then forks a rank whose loop runs
    to its end and one whose loop makes no step: both completed (the
    parent's sys.exit is not theirs); the parent, which trained after it, completed. (The
    children fork while the parent's pusher makes its first push: they once waited for ever
    on the import lock it held.)"""
    proc = start(tmp_path, receiver.url, """
        import multiprocessing as mp

        def train(rank):
            m = TrainingMonitor(run="forked", rank=rank, push_interval=60)
            for _ in m.wrap(range(5 if rank == 1 else 0), batch_size=1):
                pass

        if __name__ == "__main__":
            m = TrainingMonitor(run="forked", rank=0, push_interval=60)
            try:
                sys.exit(3)
            except SystemExit:
                pass
            for rank in (1, 2):
                child = mp.get_context("fork").Process(target=train, args=(rank,))
                child.start()
                child.join()
            for _ in m.wrap(range(5), batch_size=1):
                pass
    """)
    rc, err = finish(proc)
    assert rc == 0, err
    byes = {b["rank"]: b["exit_reason"] for b in receiver.bodies if b.get("goodbye")}
    assert byes == {"0": "completed", "1": "completed", "2": "completed"}, receiver.bodies


def test_an_uncaught_exception_says_its_type_and_the_step_it_broke_is_no_step(tmp_path,
                                                                              receiver):
    """Step 6 blocks for a second (a collective waiting for a peer), then raises: the goodbye
    says the exception, and the totals hold the five steps before it, never the blocked
    interval (steps, step seconds, histogram)."""
    proc = start(tmp_path, receiver.url, """
        m = TrainingMonitor(run="t", push_interval=60)
        for i, _ in enumerate(m.wrap(range(100), batch_size=1)):
            if i == 5:
                time.sleep(1.0)
                raise RuntimeError("Connection closed by peer")
    """)
    rc, err = finish(proc)
    assert rc == 1 and "RuntimeError: Connection closed by peer" in err, err
    bye = receiver.goodbye()
    assert (bye["exit_reason"], bye["exit_detail"]) == ("exception", "RuntimeError")
    assert bye["steps"] == 5 and bye["samples"] == 5
    assert bye["step_seconds"] < 1.0
    le_1s = bye["step_counts"][bye["step_buckets"].index(1.0)]
    assert le_1s == 5


@pytest.mark.parametrize("ending, reason, steps", [
    ("m.close(timeout=10)", "closed", 6),
    ("for _ in m.wrap(range(2), batch_size=1):\n    pass", "completed", 8),
    # an exit that says neither vouches for no step: a launcher (torch.multiprocessing.spawn)
    # may have caught the exception that closed the loop
    ("", "exited", 5),
])
def test_a_break_counts_the_step_it_left_with_its_time(tmp_path, receiver, ending, reason,
                                                       steps):
    """The near miss of the exception: step 6 takes a second and the loop is left by a
    break; it is a step like any other once training goes on or ends cleanly."""
    proc = start(tmp_path, receiver.url, textwrap.dedent("""
        m = TrainingMonitor(run="t", push_interval=60)
        for i, _ in enumerate(m.wrap(range(100), batch_size=1)):
            if i == 5:
                time.sleep(1.0)
                break
    """) + ending + "\n")
    rc, err = finish(proc)
    assert rc == 0, err
    bye = receiver.goodbye()
    assert bye["exit_reason"] == reason and bye["steps"] == steps
    over_1s = bye["steps"] - bye["step_counts"][bye["step_buckets"].index(1.0)]
    assert over_1s == (0 if reason == "exited" else 1)
    assert (bye["step_seconds"] >= 1.0) == (reason != "exited")


def test_ranks_in_forked_multiprocessing_children_say_goodbye_when_their_target_returns(
        tmp_path, receiver):
    """The pattern of PyTorch's distributed tutorial with the fork start method (Linux's
    default): each rank a ``multiprocessing.Process`` whose target trains (real gloo, a
    ``wrap()`` loop) and returns. The child then ends by ``os._exit()``, which runs no atexit
    handler, only multiprocessing's finalizers: without a goodbye the daemon, which sees the
    process gone, would read each rank killed, its run failed. Each says it completed."""
    require_module("torch")
    proc = start(tmp_path, receiver.url, f"""
        import multiprocessing as mp

        def train(rank):
            import torch, torch.distributed as dist
            dist.init_process_group("gloo", init_method="file://{tmp_path}/store",
                                    rank=rank, world_size=2)
            m = TrainingMonitor(run="forked", rank=rank, push_interval=60)
            for x in m.wrap([torch.ones(4)] * 20, batch_size=1):
                dist.all_reduce(x)
            dist.destroy_process_group()

        def fails(rank):  # its loop ran to its end, then the script raises
            m = TrainingMonitor(run="forked", rank=rank, push_interval=60)
            for _ in m.wrap(range(5), batch_size=1):
                pass
            raise RuntimeError("after the loop")

        if __name__ == "__main__":
            fork = mp.get_context("fork")
            ranks = [fork.Process(target=train, args=(r,)) for r in (0, 1)]
            ranks.append(fork.Process(target=fails, args=(2,)))
            for p in ranks:
                p.start()
            for p in ranks:
                p.join()
            print(*(p.exitcode for p in ranks), flush=True)
    """)
    rc, err = finish(proc, timeout=120)
    assert rc == 0, err
    byes = {b["rank"]: b for b in receiver.bodies if b.get("goodbye")}
    assert sorted(byes) == ["0", "1", "2"], receiver.bodies
    for r in ("0", "1"):
        assert byes[r]["exit_reason"] == "completed" and byes[r]["steps"] == 20, byes[r]
    # a child whose target raised ends with status 1: a failure, never a clean end
    assert (byes["2"]["exit_reason"], byes["2"]["exit_detail"]) == ("exception",
                                                                   "RuntimeError"), byes["2"]


def test_a_spawned_rank_that_raises_says_the_exception_its_launcher_caught(tmp_path,
                                                                            receiver):
    """``torch.multiprocessing.spawn``: its wrapper catches the rank's exception, sends the
    traceback to the parent and exits 1 (SystemExit inside its except block). The goodbye
    says the exception it caught, not an exit that says neither; a rank whose function
    returns completes; and a fork child started inside the parent's ``except`` block (a
    supervisor restarting a worker) inherits that handled exception: it is not the child's,
    whose target returns cleanly."""
    require_module("torch")
    proc = start(tmp_path, receiver.url, """
        import multiprocessing as mp
        import multiprocessing.util
        import os
        import time
        import torch.multiprocessing as tmp

        SAID = "{said}"

        def said():
            open(SAID, "w").close()

        def rank(i):
            if i == 0:  # a finalizer made before the monitor's runs after its goodbye
                multiprocessing.util.Finalize(None, said, exitpriority=0)
            m = TrainingMonitor(run="spawned", rank=i, push_interval=60)
            for _ in m.wrap(range(5), batch_size=1):
                pass
            if i == 1:
                # rank 0's goodbye first: spawn's parent ends the ranks still running once
                # one fails, and a rank it ends has no goodbye of its own to say
                deadline = time.monotonic() + 60
                while not os.path.exists(SAID) and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise ValueError("rank 1 fails after its loop")

        def supervised():
            m = TrainingMonitor(run="spawned", rank=2, push_interval=60)
            for _ in m.wrap(range(5), batch_size=1):
                pass

        if __name__ == "__main__":
            try:
                tmp.spawn(rank, nprocs=2, join=True)
            except Exception:
                child = mp.get_context("fork").Process(target=supervised)
                child.start()  # inside the except block: its stack holds the handled error
                child.join()
                print(child.exitcode, flush=True)
    """.replace("{said}", str(tmp_path / "rank-0-said-goodbye")))
    rc, err = finish(proc, timeout=120)
    assert rc == 0, err
    assert (tmp_path / "rank-0-said-goodbye").exists()  # rank 1 failed after it
    byes = {b["rank"]: b for b in receiver.bodies if b.get("goodbye")}
    assert sorted(byes) == ["0", "1", "2"], receiver.bodies
    assert byes["0"]["exit_reason"] == "completed", byes["0"]
    assert (byes["1"]["exit_reason"], byes["1"]["exit_detail"]) == ("exception",
                                                                   "ValueError"), byes["1"]
    assert byes["2"]["exit_reason"] == "completed", byes["2"]


def test_a_keyboard_interrupt_is_an_exception(tmp_path, receiver):
    proc = start(tmp_path, receiver.url, """
        m = TrainingMonitor(run="t", push_interval=60)
        m.flush(10)  # a push made: the goodbye imports nothing (see Pusher._run)
        for i, _ in enumerate(m.wrap(range(100), batch_size=1)):
            if i == 2:
                raise KeyboardInterrupt
    """)
    rc, err = finish(proc)
    assert rc == -signal.SIGINT, err  # Python still ends by SIGINT
    bye = receiver.goodbye()
    assert (bye["exit_reason"], bye["exit_detail"]) == ("exception", "KeyboardInterrupt")
    assert bye["steps"] == 2


def test_a_qualified_exception_type_is_named_with_its_module(tmp_path, receiver):
    (tmp_path / "comms.py").write_text("class DistBackendError(RuntimeError):\n    pass\n")
    proc = start(tmp_path, receiver.url, """
        import comms
        m = TrainingMonitor(run="t", push_interval=60)
        raise comms.DistBackendError("timed out")
    """)
    rc, err = finish(proc)
    assert rc == 1, err
    assert receiver.goodbye()["exit_detail"] == "comms.DistBackendError"


LOOP_FOREVER = """
    m = TrainingMonitor(run="t", push_interval=60)
    for i, _ in enumerate(m.wrap(iter(int, 1), batch_size=1)):
        if i == 3:
            ready()
        time.sleep(0.01)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_with_the_default_action_says_so_then_kills_as_before(tmp_path, receiver,
                                                                       signum):
    proc = start(tmp_path, receiver.url, LOOP_FOREVER)
    until_ready(proc)
    proc.send_signal(signum)
    rc, err = finish(proc, timeout=30)
    assert rc == -signum, err
    bye = receiver.goodbye()
    assert (bye["exit_reason"], bye["exit_detail"]) == ("signal", signal.Signals(signum).name)
    assert bye["steps"] >= 3


def test_sigterm_kills_a_rank_that_waits_inside_a_cpp_collective(tmp_path, receiver):
    """The main thread waits in C++ (gloo's rendezvous for a peer that never comes, 120 s at
    most), where Python runs no signal handler: the monitor's thread says goodbye and the
    process still dies by SIGTERM, long before the wait's own end."""
    require_module("torch.distributed")
    proc = start(tmp_path, receiver.url, f"""
        import datetime
        import torch.distributed as dist
        m = TrainingMonitor(run="t", push_interval=60)
        for _ in m.wrap(range(3), batch_size=1):
            pass
        ready()
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0,
                                world_size=2, timeout=datetime.timedelta(seconds=120))
    """)
    until_ready(proc)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc, timeout=60)
    assert rc == -signal.SIGTERM, err
    bye = receiver.goodbye()
    assert (bye["exit_reason"], bye["exit_detail"]) == ("signal", "SIGTERM")
    assert bye["steps"] == 3


def test_a_handler_of_the_scripts_own_keeps_the_signal(tmp_path, receiver):
    """SIGTERM handled by the script (a launcher's or a framework's handler) is theirs: the
    monitor installs none; the process ends as the handler says (here sys.exit(3))."""
    proc = start(tmp_path, receiver.url, textwrap.dedent("""
        def mine(signum, frame):
            print("handled", signum, file=sys.stderr, flush=True)
            sys.exit(3)

        signal.signal(signal.SIGTERM, mine)
    """) + textwrap.dedent(LOOP_FOREVER))
    until_ready(proc)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc, timeout=30)
    assert rc == 3 and f"handled {int(signal.SIGTERM)}" in err, err
    # ... by sys.exit(3): a failing status, as the launcher reads it
    bye = receiver.goodbye()
    assert (bye["exit_reason"], bye["exit_detail"]) == ("exception", "SystemExit")


def test_a_forked_child_dies_by_sigterm_without_a_goodbye(tmp_path, receiver):
    """A forked child (a DataLoader worker) gets SIGTERM: it dies as it would have, saying
    nothing; the parent's goodbye is the only one."""
    proc = start(tmp_path, receiver.url, """
        m = TrainingMonitor(run="t", push_interval=60)
        for _ in m.wrap(range(3), batch_size=1):
            pass
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        print(child, flush=True)
        _, status = os.waitpid(child, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
        m.close(timeout=10)
    """)
    child = int(proc.stdout.readline())  # type: ignore[union-attr]
    os.kill(child, signal.SIGTERM)
    assert proc.stdout.readline().strip() == str(-signal.SIGTERM)  # type: ignore[union-attr]
    rc, err = finish(proc)
    assert rc == 0, err
    assert receiver.goodbye()["exit_reason"] == "closed"


@contextlib.contextmanager
def silent_daemon():
    """An address that takes connections and never answers (a daemon hung or overloaded)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("down", ["refused", "silent"])
def test_a_daemon_that_is_down_never_holds_up_the_kill(tmp_path, down):
    """The goodbye at a signal waits under a second: the process dies by SIGTERM at once
    whether the daemon refuses it or takes the connection and never answers."""
    with contextlib.ExitStack() as stack:
        url = (f"http://127.0.0.1:{free_port()}" if down == "refused"
               else stack.enter_context(silent_daemon()))
        proc = start(tmp_path, url, LOOP_FOREVER)
        until_ready(proc)
        proc.send_signal(signal.SIGTERM)
        # generous: the kill is owed within about a second
        rc, err = finish(proc, timeout=10)
    assert rc == -signal.SIGTERM, err


LIGHTNING = """
import torch
import lightning.pytorch as pl
from exporter.client.lightning import GpuTrainCallback

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        if FAIL and i == 3:
            raise RuntimeError("NCCL timeout")
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

loader = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)
trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False,
                     callbacks=[GpuTrainCallback(run="t", push_interval=60)])
trainer.fit(Model(), loader)
"""


@pytest.mark.parametrize("fail, reason, detail", [
    (True, "exception", "RuntimeError"),
    (False, "closed", None),  # fit ran to its end: the callback's close
])
def test_lightning_says_the_exception_that_ended_fit(tmp_path, receiver, fail, reason, detail):
    require_module("lightning")
    proc = start(tmp_path, receiver.url, f"FAIL = {fail}\n" + LIGHTNING)
    rc, err = finish(proc, timeout=120)
    assert rc == (1 if fail else 0), err
    bye = receiver.goodbye()
    assert bye["exit_reason"] == reason and bye.get("exit_detail") == detail
    assert bye["steps"] == (3 if fail else 8)
