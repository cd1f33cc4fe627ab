"""The README's laptop tour, every command as the README writes it, read from the README (a
command changed there is the command run here), in the quick start's environment.

What is the test's own: `.venv/bin/` is the environment under test (``ENV_BIN``), `prometheus`
is Debian's binary, and the tour's three ports (19400, 19401, 19090) are free ones: the
daemon gets them as flags (the tour starts it with the defaults), the training and `profile`
find its ingest through `GPUTRAIN_URL`, `top` gets `--url`, and Prometheus reads
`deploy/prometheus/local.yml` with only its target's port changed, beside a link to the
repository's alerts/. The daemon also runs with its host collectors off (conftest.NO_HOST):
the CPU training loads this machine's CPUs, which would rightly refine the verdict the tour
names, input-bound, into CPU preprocessing on a busy CI machine. The pip command runs with
`--dry-run`: it must find nothing to install in the tested environment, whose torch is
tests/frameworks.txt's. Long-running commands run in the background until the end; each check
waits for what the README says a user sees."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from conftest import ENV_BIN, NO_HOST, ROOT, free_port, require_binary, wait_until
from test_readme import README, code_blocks, section, shell_lines

pytestmark = [pytest.mark.integration, pytest.mark.torch]

TOUR = section(README, "## A tour on a laptop")
COMMANDS = [line for block in code_blocks(TOUR, "sh") for line in shell_lines(block)]
# Each command of the tour, by what it does; a command none of these matches fails the test.
STEPS = {
    "daemon": r"\.venv/bin/gputrain-exporter --gpu\.backend=demo",
    "torch": r"\.venv/bin/pip install torch==\S+ numpy\S*",
    "train": r"\.venv/bin/python examples/pytorch_train\.py --device cpu .*",
    "prometheus": r"prometheus --config\.file=deploy/prometheus/local\.yml .*",
    "top": r"\.venv/bin/gputrain-exporter top",
    "diagnose": r"\.venv/bin/gputrain-exporter diagnose .*",
    # before "profile": the first name a command matches is its step
    "stacks": r"\.venv/bin/gputrain-exporter profile --stacks .*",
    "profile": r"\.venv/bin/gputrain-exporter profile .*",
}
RUN = "pytorch_train"  # the example's run: named after the script
ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][A-Z0-9]|[=>])")


def steps() -> dict[str, str]:
    found: dict[str, str] = {}
    for command in COMMANDS:
        names = [name for name, pattern in STEPS.items() if re.fullmatch(pattern, command)]
        assert names, f"the tour has a command this test does not know how to run: {command}"
        assert names[0] not in found, f"the tour runs {names[0]} twice"
        found[names[0]] = command
    assert sorted(found) == sorted(STEPS), f"the tour lacks {sorted(set(STEPS) - set(found))}"
    return found


class Tour:
    """The tour's processes, on the test's ports, in the test's folder."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.web, self.ingest, self.prom = free_port(), free_port(), free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRAIN_")}
        self.env.update(GPUTRAIN_URL=f"http://127.0.0.1:{self.ingest}",
                        GPUTRAIN_TRACE_DIR=str(tmp / "traces"), PYTHONUNBUFFERED="1")
        self.started: list[subprocess.Popen] = []

    def argv(self, command: str) -> list[str]:
        for default, port in ((19400, self.web), (19401, self.ingest), (19090, self.prom)):
            command = command.replace(f":{default}", f":{port}")
        command = command.replace("/tmp/gputrain-prometheus", str(self.tmp / "prometheus-data"))
        command = command.replace("deploy/prometheus/local.yml", str(self.local_config()))
        args = shlex.split(command)
        if args[0].startswith(".venv/bin/"):
            args[0] = str(ENV_BIN / args[0].removeprefix(".venv/bin/"))
        elif args[0] == "prometheus":
            args[0] = require_binary("prometheus")
        return args

    def local_config(self) -> Path:
        folder = self.tmp / "repo" / "deploy" / "prometheus"
        if not folder.exists():
            folder.mkdir(parents=True)
            (self.tmp / "repo" / "alerts").symlink_to(ROOT / "alerts")
            text = (ROOT / "deploy" / "prometheus" / "local.yml").read_text()
            text, n = re.subn(r'targets: \["localhost:19400"\]',
                              f'targets: ["localhost:{self.web}"]', text)
            assert n == 1
            (folder / "local.yml").write_text(text)
        return folder / "local.yml"

    def start(self, name: str, args: list[str], **kw) -> subprocess.Popen:
        if "stdout" not in kw:
            kw["stdout"] = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - the process's
            kw["stderr"] = subprocess.STDOUT
        proc = subprocess.Popen(args, cwd=ROOT, env=self.env, **kw)
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def status(self) -> dict:
        return requests.get(f"http://localhost:{self.web}/api/v1/status", timeout=10).json()

    def stop(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def tour(tmp_path) -> Iterator[Tour]:
    t = Tour(tmp_path)
    yield t
    t.stop()


def _default_sigint() -> None:
    """Ctrl-C as a shell leaves it: the default disposition, not blocked (both are inherited
    across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Terminal:
    """A process on a pseudo-terminal of 200 x 60, as `top` runs in a terminal; ``text`` is
    what it drew, escape sequences left out."""

    def __init__(self, tour: Tour, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
        # as a shell starts it: Ctrl-C's default disposition, whatever an earlier test in
        # this pytest process left (an ignored or blocked SIGINT is inherited across exec, and
        # Python then raises no KeyboardInterrupt: both fresh-clone CI runs hung here, alone it
        # passed)
        self.proc = tour.start("top", args, stdin=slave, stdout=slave, stderr=slave,
                               start_new_session=True,
                               preexec_fn=_default_sigint)
        os.close(slave)
        self.raw = b""

    def read(self) -> str:
        while select.select([self.master], [], [], 0.2)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # the process closed its side
                break
            if not chunk:
                break
            self.raw += chunk
        return ANSI.sub("", self.raw[-200_000:].decode("utf-8", "replace"))

    def shows(self, *texts: str) -> bool:
        frame = self.read()
        return all(t in frame for t in texts)


def test_the_laptop_tour_runs_as_written(tour):
    found = steps()

    # 1. the demo daemon
    tour.start("daemon", [*tour.argv(found["daemon"]),
                          f"--web.listen-address=localhost:{tour.web}",
                          f"--ingest.listen-address=127.0.0.1:{tour.ingest}", *NO_HOST])
    wait_until(lambda: requests.get(f"http://localhost:{tour.web}/healthz", timeout=2).ok,
               timeout=60, what=f"the demo daemon ({tour.log('daemon')})")
    # the serving line is logged just after the servers' threads start: /healthz may answer
    # first (a busy run's race)
    wait_until(lambda: "(demo backend)" in tour.log("daemon"), timeout=30,
               what=f"the daemon's serving line ({tour.log('daemon')})")

    # 2. torch as the tests pin it, then the example training
    pin = re.search(r"torch==(\S+)", found["torch"]).group(1)
    assert f"torch=={pin}\n" in (ROOT / "tests" / "frameworks.txt").read_text(), \
        "the tour's torch is not tests/frameworks.txt's"
    pip = tour.run([*tour.argv(found["torch"]), "--dry-run"], timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert "Would install" not in pip.stdout, f"the tour's pip would change the tested " \
                                              f"environment: {pip.stdout}"
    train = tour.start("train", tour.argv(found["train"]))
    gpu0 = wait_until(lambda: [g for g in tour.status()["gpus"] if g["gpu"] == "0"
                               and {"run": RUN, "rank": "0"} in g["ranks"]],
                      timeout=180, what=f"{RUN} pushing, on demo GPU 0 ({tour.log('train')})")
    assert gpu0

    # 3. the status page and the metrics
    page = requests.get(f"http://localhost:{tour.web}/", timeout=10)
    assert page.ok and "<title>gputrain-exporter</title>" in page.text
    metrics = requests.get(f"http://localhost:{tour.web}/metrics", timeout=10).text
    assert f'gputrain_training_steps_total{{rank="0",run="{RUN}"}}' in metrics or \
        f'gputrain_training_steps_total{{run="{RUN}",rank="0"}}' in metrics

    def page_verdict():
        runs = [r for r in tour.status()["runs"] if r["run"] == RUN]
        return runs and runs[0]["verdicts"] and runs[0]["verdicts"][0]["verdict"]

    wait_until(lambda: page_verdict() == "input-bound", timeout=180,
               what=f"the status page's verdict on {RUN}: input-bound")

    # 4. the local Prometheus with the shipped rules
    prom = f"http://localhost:{tour.prom}"
    tour.start("prometheus", tour.argv(found["prometheus"]))

    def query(expr: str) -> list:
        return requests.get(prom + "/api/v1/query", params={"query": expr},
                            timeout=10).json()["data"]["result"]

    wait_until(lambda: query('up{job="gputrain"} == 1'), timeout=120,
               what=f"Prometheus scraping the daemon ({tour.log('prometheus')[-2000:]})")

    # 5. top in a terminal, and diagnose against Prometheus
    top = Terminal(tour, [*tour.argv(found["top"]), "--url", f"http://localhost:{tour.web}"])
    wait_until(lambda: top.shows(f"run {RUN}", "H100"), timeout=120,
               what=f"top drawing the run ({top.read()[-2000:]})")

    def diagnosed():
        out = tour.run(tour.argv(found["diagnose"]))
        if out.returncode == 1 and "verdict: input-bound " in out.stdout:
            return out
        return None

    out = wait_until(diagnosed, timeout=240, interval=5,
                     what="diagnose to say input-bound")
    assert f"run {RUN} rank 0" in out.stdout and "advice: " in out.stdout
    wait_until(lambda: query('ALERTS{alertname="GpuTrainInputBound"}'), timeout=300,
               interval=2, what="GpuTrainInputBound pending in the local Prometheus")

    # 6. a profile of the running rank
    profile = tour.run(tour.argv(found["profile"]), timeout=400)
    assert profile.returncode == 0, profile.stdout + profile.stderr
    assert "Where each step's time went" in profile.stdout
    # the loader sleeps 5 ms a sample, 128 a batch: at least 640 ms of each step is data
    # loading, however busy the machine; that it is most of the step holds where the CPU has
    # time to spare (README: under a loaded CI machine, backward took more)
    mean = re.search(r"^\s+mean\s+([\d.]+)\s+([\d.]+)", profile.stdout, re.M)
    assert mean and float(mean.group(2)) >= 0.95 * 640, profile.stdout
    assert re.search(r"^Most of a step: (data loading|the (forward|backward) pass), \d+% of it",
                     profile.stdout, re.M), profile.stdout
    trace = re.search(r"Trace: (\S+)", profile.stdout).group(1)
    assert Path(trace).is_file() and Path(trace).is_relative_to(tour.tmp / "traces")
    wait_until(lambda: top.shows("profile p-"), timeout=60, what="top listing the profile")
    assert tour.status()["profiles"][0]["state"] == "done"

    # 7. py-spy stacks of the running rank: the main process's time is in the slow dataset
    stacks = tour.run(tour.argv(found["stacks"]), timeout=400)
    assert stacks.returncode == 0, stacks.stdout + stacks.stderr
    main = next(line for line in stacks.stdout.splitlines() if "main process: " in line)
    assert re.search(r"main process: .*\d+ % in SyntheticImages\.__getitem__ "
                     r"\(pytorch_train\.py:\d+\)", main), stacks.stdout
    flame = re.search(r"Flame graph: (\S+)", stacks.stdout).group(1)
    assert Path(flame).is_file() and Path(flame).is_relative_to(tour.tmp / "traces")
    wait_until(lambda: top.shows("py-spy stacks"), timeout=60,
               what="top showing the stacks beside the run")

    # Ctrl-C ends top cleanly; the training never warned about numpy
    os.killpg(top.proc.pid, signal.SIGINT)
    # a terminal keeps reading what top writes while it leaves (its last frame, the screen
    # restored): a pty nobody reads fills up and blocks the writer
    wait_until(lambda: top.read() is not None and top.proc.poll() is not None, timeout=30,
               what="top to end on Ctrl-C")
    assert top.proc.returncode == 0
    assert train.poll() is None, tour.log("train")
    train.terminate()
    train.wait(timeout=30)
    assert "Failed to initialize NumPy" not in tour.log("train")
    assert "Traceback" not in tour.log("train")
