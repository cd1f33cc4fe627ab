"""Shared test helpers: a settable clock, free ports, real servers started as subprocesses."""

from __future__ import annotations

import inspect
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from exporter.reading.collectors import COLLECTORS

ROOT = Path(__file__).resolve().parent.parent
# The environment under test: its interpreter is sys.executable and its scripts sit beside it
# (.venv/bin). Tests start the project from here, never from a bare `python3` or PATH.
ENV_BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# The daemon's flags that turn its host collectors off (cpu, memory, disk, network). A test that
# asserts a run's verdict runs its daemon with them: the verdict is then the run's alone, never
# refined by the load of the machine the test runs on (saturated CPUs or a busy disk on a loaded
# CI machine rightly make input-bound "cpu-preprocessing" or "disk-io"). The refinements
# themselves are judged on scripted host readings (test_agreement.py, rule_cases.py).
NO_HOST = tuple(f"--no-collector.{name}" for name, entry in COLLECTORS.items()
                if entry.host is not None and entry.default)


_PORTS_GIVEN: set[int] = set()
# the listening ports tests hand out lie below the kernel's ephemeral range, so no outgoing
# connection takes one between its choice and its bind; each pytest-xdist worker has its own
# slice of them, so two workers never hand out one port
_PORTS_LOW = 20000


def _port_slice() -> range:
    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    span = (max(high, _PORTS_LOW + 1000) - _PORTS_LOW) // workers
    return range(_PORTS_LOW + worker * span, _PORTS_LOW + (worker + 1) * span)


def free_port() -> int:
    """A loopback port nothing listens on, never one this session handed out before (a
    daemon's web and ingest ports, picked before either is bound, must differ), from this
    worker's own slice below the ephemeral range."""
    ports = _port_slice()
    start = random.randrange(len(ports))
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {ports}")


def require_binary(name: str, *alternatives: str,
                   package: str = "prometheus prometheus-alertmanager") -> str:
    """The path of a system tool the test needs (under any of its names); its absence fails
    the test. Never for the project's own commands: those come from :data:`ENV_BIN`."""
    for candidate in (name, *alternatives):
        path = shutil.which(candidate)
        if path:
            return path
    # a failure, never a skip: the README's test command installs every tool the suite needs
    pytest.fail(f"{name} is not installed (Debian: apt-get install {package}); the README's "
                "test command (scripts/test.sh) installs it")


def self_signed_cert(directory: Path, alt_name: str) -> tuple[Path, Path]:
    """A one-day self-signed certificate and its key, written in ``directory``, for
    ``alt_name`` (``DNS:gputrain-exporter``, ``IP:127.0.0.1``; also its common name)."""
    openssl = require_binary("openssl", package="openssl")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={alt_name.partition(':')[2]}", "-addext",
                    f"subjectAltName={alt_name}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def edited_package(tmp: Path, edits: list[tuple[str, str, str]]) -> Path:
    """A copy of the package in ``tmp`` with ``edits`` made: (file under exporter/, an anchor
    in it once, the text). The text goes after an anchor that ends a line (a field), before
    one that starts a row. Returns the copy's root (for PYTHONPATH)."""
    shutil.copytree(ROOT / "exporter", tmp / "exporter",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for where, anchor, text in edits:
        path = tmp / "exporter" / where
        source = path.read_text()
        assert source.count(anchor) == 1, f"{anchor!r} is not once in {where}"
        path.write_text(source.replace(anchor, anchor + text if anchor.endswith("\n")
                                       else text + anchor, 1))
    return tmp


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.2,
               what: str | Callable[[], str] = "condition"):
    """Poll until predicate() returns a truthy value; fail the test after timeout seconds.
    ``what`` may be a callable, called only on failure (a log read when the wait gave up)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not ready yet
            last_exc = exc
        time.sleep(interval)
    if callable(what):
        what = what()
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f" (last error: {last_exc})" if last_exc else ""))


class Daemon:
    """The exporter as a user runs it: `python -m exporter ...` in a subprocess."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 ingest_port: int | None = None) -> None:
        """``ingest_port``: take pushes where another daemon took them (one that was
        killed), so its clients find this one; by default a free port."""
        self.port = free_port()
        self.ingest_port = ingest_port or free_port()
        self.args = [
            sys.executable, "-m", "exporter",
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--ingest.listen-address=127.0.0.1:{self.ingest_port}",
            *args,
        ]
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gputrain-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ingest_url(self) -> str:
        return f"http://127.0.0.1:{self.ingest_port}"

    def start(self) -> Daemon:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        # a generous bound: a daemon starts in well under a second, but on a CI machine with
        # every core taken by torch ranks it has been seen to take over 20 s; one that exits
        # fails at once, with its log
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                # pytest.fail is no Exception: wait_until's retry does not swallow it
                pytest.fail(f"the exporter exited ({proc.returncode}): {self.log_text()}")
            return requests.get(self.url + "/healthz", timeout=2).status_code == 200

        wait_until(up, timeout=90,
                   what=lambda: f"the exporter on {self.url} (log: {self.log_text()!r})")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def kill(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def metrics(self) -> str:
        """The page, holding every push answered before this call (?fresh=1)."""
        return requests.get(self.url + "/metrics?fresh=1", timeout=10).text

    def wait_sample(self, name: str, labels: dict[str, str] | None = None, predicate=None,
                    timeout: float = 10.0) -> float:
        """Poll /metrics until the sample exists (and passes ``predicate``): the page is built
        off the request path, a few tens of milliseconds after a push."""
        def ready():
            v = sample_value(self.metrics(), name, labels)
            return v is not None and (predicate is None or predicate(v)) and (v,)

        return wait_until(ready, timeout=timeout, interval=0.05,
                          what=f"{name}{labels or ''} on {self.url}/metrics")[0]


@pytest.fixture
def daemon_factory() -> Iterator:
    started: list[Daemon] = []

    def make(*args: str, env: dict[str, str] | None = None, start: bool = True,
             ingest_port: int | None = None) -> Daemon:
        d = Daemon(*args, env=env, ingest_port=ingest_port)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        d.stop()


def rules_file(tmp: Path, overrides: dict) -> Path:
    """The shipped rules as ``gputrain-exporter rules --config`` writes them for ``overrides``
    (a thresholds file: short `for`s and recording interval for a test), in ``tmp``."""
    import yaml

    cfg = tmp / "thresholds.yml"
    cfg.write_text(yaml.safe_dump(overrides))
    rules = tmp / "gputrain.rules.yml"
    rules.write_text(subprocess.run(
        [sys.executable, "-m", "exporter", "rules", "--config", str(cfg)], cwd=ROOT,
        check=True, capture_output=True, text=True).stdout)
    return rules


def synthetic_client(run: str, endpoint: str, *args: str, rank: int = 0,
                     gpu: int = 0) -> subprocess.Popen:
    """``examples/synthetic_client.py`` as rank ``rank`` pushing to ``endpoint`` every 0.5 s
    on GPU ``gpu`` until killed; ``args`` are its flags (--data-wait-ms, --compute-ms, ...)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "synthetic_client.py"), "--run", run,
         "--push-interval", "0.5", *args], cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GPUTRAIN_URL": endpoint,
             "CUDA_VISIBLE_DEVICES": str(gpu), "RANK": str(rank)})


def sample_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample in an exposition text, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


class Server:
    """A server binary on loopback as a user runs it: ``args``, its log in ``dir``, ready once
    ``url + ready`` answers 200."""

    def __init__(self, args: list[str], dir: Path, url: str, ready: str = "/-/ready") -> None:
        self.args, self.dir, self.url, self.ready = args, dir, url, ready
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self._log = open(self.dir / "log.txt", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(lambda: requests.get(self.url + self.ready, timeout=1).status_code == 200,
                   timeout=30, what=f"{Path(self.args[0]).name} on {self.url} to be ready "
                                    f"({(self.dir / 'log.txt').read_text()[-500:]})")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:  # a slow flush on a loaded machine: no leak
                self.proc.kill()
                self.proc.wait(timeout=15)
        if getattr(self, "_log", None):
            self._log.close()


class Prometheus(Server):
    """A real Prometheus server on loopback, scraping what the test points it at."""

    def __init__(self, tmp_path: Path, targets: list[str], rule_files: list[str] | None = None,
                 scrape_interval: str = "1s", alertmanager: str | None = None,
                 extra_args: list[str] | None = None, config_file: Path | None = None) -> None:
        """Scrapes ``targets`` as job gputrain, or runs the given ``config_file`` as is."""
        binary = require_binary("prometheus")
        self.port = free_port()
        dir = tmp_path / f"prometheus-{self.port}"
        dir.mkdir()
        config_file = config_file or dir / "prometheus.yml"
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": "gputrain", "static_configs": [{"targets": targets}]}],
            "rule_files": rule_files or [],
        }
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [
                {"targets": [alertmanager]}]}]}
        import yaml

        if not config_file.exists():
            config_file.write_text(yaml.safe_dump(config))
        super().__init__([binary, f"--config.file={config_file}",
                          f"--storage.tsdb.path={dir / 'data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}", *(extra_args or [])],
                         dir, f"http://127.0.0.1:{self.port}")

    def query(self, expr: str) -> list[dict]:
        r = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]


class Alertmanager(Server):
    """A real Alertmanager (Debian's prometheus-alertmanager) on loopback, without clustering."""

    def __init__(self, tmp_path: Path, config_file: Path) -> None:
        binary = require_binary("prometheus-alertmanager", "alertmanager")
        self.port = free_port()
        dir = tmp_path / f"alertmanager-{self.port}"
        dir.mkdir()
        super().__init__([binary, f"--config.file={config_file}",
                          f"--storage.path={dir / 'data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}",
                          "--cluster.listen-address="], dir, f"http://127.0.0.1:{self.port}")


class Webhook:
    """An Alertmanager webhook receiver: keeps every alert it is sent."""

    def __init__(self) -> None:
        self.alerts: list[dict] = []
        received = self.alerts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.extend(body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def find(self, alertname: str, **labels: str) -> list[dict]:
        return [a for a in list(self.alerts) if a["labels"].get("alertname") == alertname
                and all(a["labels"].get(k) == v for k, v in labels.items())]


def stop_all(started: list) -> None:
    """Stop what a fixture started, last first: processes are killed, servers stopped."""
    for thing in reversed(started):
        if isinstance(thing, subprocess.Popen):
            thing.kill()
            thing.wait()
        else:
            thing.stop()


@pytest.fixture
def prometheus_factory(tmp_path) -> Iterator:
    started: list[Prometheus] = []

    def make(targets: list[str], **kw) -> Prometheus:
        p = Prometheus(tmp_path, targets, **kw)
        started.append(p)
        return p.start()

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def one_rank(tmp_path) -> Iterator[None]:
    """A gloo process group of one rank in this process (a file store: no port to race for)."""
    dist = require_module("torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cgroup_tree(tmp_path: Path, pod_max: str, leaf_max: str = "max",
                cpuset: str = "0-127", throttled_usec: int = 0) -> tuple[Path, Path]:
    """A fake /proc/<pid>/cgroup and cgroup v2 tree: kubepods/pod/ctr, limits on the pod."""
    root = tmp_path / "cgroup"
    pod, leaf = root / "kubepods" / "pod1", root / "kubepods" / "pod1" / "ctr"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (pod / "cpu.max").write_text(f"{pod_max}\n")
    (leaf / "cpu.max").write_text(f"{leaf_max}\n")
    (leaf / "cpuset.cpus.effective").write_text(f"{cpuset}\n")
    (leaf / "cpu.stat").write_text(f"usage_usec 1000\nthrottled_usec {throttled_usec}\n")
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text("0::/kubepods/pod1/ctr\n")
    return proc, root


def require_module(name: str):
    """Import a module a test needs; its absence fails the test (never a skip)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is not installed ({exc}); the README's test command "
                    "(scripts/test.sh) installs it")


def pytest_addoption(parser) -> None:
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite the golden files from the current output, then review the diff")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With GPUTRAIN_TEST_CPU_LOG set (a path), append each test's CPU seconds (its process
    and the children it reaped: the servers a module's fixtures started count in the test
    whose teardown stops them) and wall seconds to that file: where CI's two cores go
    (bench/RESULTS.md)."""
    path = os.environ.get("GPUTRAIN_TEST_CPU_LOG")
    if not path:
        yield
        return
    import resource

    def cpu() -> float:
        return sum(getattr(resource.getrusage(who), f) for who in
                   (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))

    cpu0, wall0 = cpu(), time.monotonic()
    yield
    with open(path, "a") as f:
        f.write(f"{item.nodeid}\t{cpu() - cpu0:.2f}\t{time.monotonic() - wall0:.2f}\n")


@pytest.fixture
def update_golden(request) -> bool:
    """True when the golden files are to be rewritten (--update-golden or UPDATE_GOLDEN=1)."""
    return bool(request.config.getoption("--update-golden") or os.environ.get("UPDATE_GOLDEN"))


def series_parts(selector: str) -> dict[str, str]:
    """PromQL counting the series of one rank, one GPU and one node among ``selector``'s: a
    rank's series carry ``rank``; a GPU's ``gpu`` and no ``rank``; the node's neither (the
    sizes of tests/test_scaleout.py and bench/bench_fleet.py)."""
    return {
        "rank": f'count by (instance, run, rank) ({{{selector}, rank!=""}})',
        "gpu": f'count by (instance, gpu) ({{{selector}, gpu!="", rank=""}})',
        "node": f'count by (instance) ({{{selector}, gpu="", rank=""}})',
    }


# What a test (or a fixture or module helper it uses) does that makes it an integration test:
# it starts a process, a server or a socket of its own.
_STARTS = ("Daemon(", "Prometheus(", "Alertmanager(", "Webhook(", "subprocess.", "Popen(",
           "sys.executable", "ENV_BIN", "synthetic_client(", "_factory(", "socket.socket(",
           "mp.spawn(", "multiprocessing", "ThreadingHTTPServer(", "web.AppRunner(",
           "TCPSite(", "start_server(", "unshare", "serve(")


def _source(func) -> str | None:
    """``func``'s source, read once a session (a thousand tests share a few hundred
    functions and fixtures: reading each anew cost 9 s of every collection)."""
    if func not in _SOURCES:
        try:
            _SOURCES[func] = inspect.getsource(func)
        except (OSError, TypeError):
            _SOURCES[func] = None
    return _SOURCES[func]


_SOURCES: dict = {}
_STARTERS: dict = {}


def _starts_something(func, module, depth: int = 3, seen: set | None = None) -> bool:
    """Whether ``func``'s source, or a module-level function of ``module`` it names (to
    ``depth`` calls), starts a process, server or socket."""
    if seen is None:  # a test's own function or fixture: the answer is the same every time
        if (func, module) not in _STARTERS:
            _STARTERS[func, module] = _starts_something(func, module, depth, set())
        return _STARTERS[func, module]
    if func in seen or depth < 0:
        return False
    seen.add(func)
    source = _source(func)
    if source is None:
        return False
    if any(s in source for s in _STARTS):
        return True
    for name, obj in vars(module).items():
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and \
                getattr(obj, "__module__", None) == module.__name__ and \
                f"{name}(" in source and \
                _starts_something(obj, module, depth - 1, seen):
            return True
    return False


# the test files that take longest, longest first: their summed test times in a 4-worker run
# (junit), 357 s (test_hangs) down to 35 s (test_daemon). scripts/test.sh keeps this order
# (xdist's --no-loadscope-reorder: by default it sends the files with the most tests first,
# which left test_rules, test_hangs and test_regime, few tests each, for the end)
SLOW_FIRST = ("test_hang_phases.py", "test_hangs.py", "test_hang_ceiling.py", "test_rules.py",
              "test_hang_places.py",
              "test_profile.py", "test_regime.py", "test_comm.py", "test_agreement.py",
              "test_exit.py", "test_stacks.py", "test_gpu_proof.py", "test_scaleout.py",
              "test_tour.py", "test_replay.py", "test_status.py", "test_alerting.py",
              "test_fleet.py", "test_abuse.py", "test_staleness.py", "test_utilisation.py",
              "test_gpu_recording.py", "test_daemon.py")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark every test that starts a process, server or socket (itself, through a fixture, or
    through a helper of its module) ``integration``: ``pytest -m "not integration"`` is the
    fast loop (CONTRIBUTING.md). Only where a mark expression names it: a run of the whole
    suite (CI) or of another mark has no use for it."""
    marked = "integration" in (config.option.markexpr or "")
    for item in items if marked else ():
        if item.get_closest_marker("integration") or not isinstance(item, pytest.Function):
            continue
        module = item.module
        funcs = [item.function]
        for name in item.fixturenames:
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                funcs.append(fixturedef.func)
        if any(_starts_something(f, inspect.getmodule(f) or module) for f in funcs):
            item.add_marker(pytest.mark.integration)
    # the files that wait longest first, so parallel workers (scripts/test.sh) do not end on
    # one of them alone; the rest in their order
    gone = [name for name in SLOW_FIRST if not (Path(__file__).parent / name).exists()]
    if gone:
        raise pytest.UsageError(f"conftest.SLOW_FIRST names files that are gone: {gone}")
    first = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: first.get(Path(str(item.fspath)).name, len(first)))
