"""Bad input against the real daemon over raw sockets on loopback: every bad push gets a 4xx
that says what is wrong, is counted at once, and changes nothing; framing is strict; a client
that misbehaves costs one debug line, never a traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest
import requests
from conftest import ROOT, sample_value, self_signed_cert, wait_until

GOOD = {"version": 1, "run": "ok", "rank": "0", "run_id": "abc", "steps": 1,
        "step_seconds": 0.1, "data_wait_seconds": 0.0, "samples": 8}


def raw_exchange(port: int, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes or goes quiet; returns what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = s.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            chunks.append(data)
            s.settimeout(1.0)  # after the first answer, stop when the server goes quiet
        return b"".join(chunks)


def post(body: bytes, **headers: str) -> bytes:
    lines = ["POST /api/v1/push HTTP/1.1", "Host: x", "Content-Type: application/json",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from conftest import Daemon

    # a long sampler interval, so "counted at once" cannot mean "at the next snapshot"
    d = Daemon("--gpu.backend=demo", "--demo.gpus=1", "--ingest.max-series=2",
               "--sampler.interval=30s", "--log.level=debug").start()
    yield d
    d.stop()


def pushed(d, code: str) -> float:
    return sample_value(d.metrics(), "gputrain_ingest_requests_total", {"code": code}) or 0


@pytest.mark.parametrize("case, body, reason", [
    ("an integer over 1.8e308", json.dumps({**GOOD, "steps": 12345}).replace(
        "12345", "1" + "0" * 400).encode(), "too large"),
    ("an integer over 4,300 digits", json.dumps({**GOOD, "steps": 12345}).replace(
        "12345", "1" + "0" * 5000).encode(), "invalid JSON"),
    ("a run name with a final newline", json.dumps({**GOOD, "run": "evil\n"}).encode(),
     "'run' may only hold"),
])
def test_bad_values_are_a_400_that_says_why_and_is_counted_at_once(daemon, case, body, reason):
    before = pushed(daemon, "400")
    r = requests.post(daemon.ingest_url + "/api/v1/push", data=body, timeout=10)
    assert r.status_code == 400 and reason in r.text, (case, r.status_code, r.text)
    daemon.wait_sample("gputrain_ingest_requests_total", {"code": "400"},
                       lambda v: v == before + 1, timeout=10)  # not a sampler interval later
    assert "evil" not in daemon.metrics()


def status_of(answer: bytes) -> int:
    """The status of the first answer in raw bytes (HTTP/1.0 or 1.1), 0 for none."""
    line = answer.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[0].startswith(b"HTTP/1.") else 0


def closes(answer: bytes) -> bool:
    """The first answer says that the server closes the connection after it."""
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    return b"\r\nconnection: close" in head


@pytest.mark.parametrize("length", ["+8", "1_0", "-1", "8, 8"])
def test_a_content_length_that_is_not_plain_digits_is_a_400(daemon, length):
    answer = raw_exchange(daemon.ingest_port, post(b"{}" * 4, Content_Length=length))
    assert status_of(answer) == 400 and b"Content-Length" in answer.split(b"\r\n\r\n")[1], \
        answer[:300]
    assert closes(answer)


def test_two_content_lengths_are_a_400(daemon):
    req = post(b"{}", Content_Length="2").replace(b"Content-Length: 2",
                                                    b"Content-Length: 2\r\nContent-Length: 2")
    answer = raw_exchange(daemon.ingest_port, req)
    assert status_of(answer) == 400 and b"Content-Length" in answer.split(b"\r\n\r\n")[1]
    assert closes(answer)


def test_a_body_on_a_get_is_never_read_as_the_next_request(daemon):
    smuggled = json.dumps({**GOOD, "run": "smuggled"}).encode()
    inner = post(smuggled, Content_Length=str(len(smuggled)))
    outer = (f"GET /api/v1/push HTTP/1.1\r\nHost: x\r\nContent-Length: {len(inner)}\r\n\r\n"
             .encode() + inner)
    answer = raw_exchange(daemon.ingest_port, outer)
    assert answer.startswith(b"HTTP/1.1 405")
    assert answer.count(b"HTTP/1.1 ") == 1, "the body was parsed as a second request"
    assert "smuggled" not in daemon.metrics()


def test_gzip_only_when_the_client_takes_it(daemon):
    for header, gzipped in (("gzip", True), ("gzip;q=0", False), ("br, *;q=0", False),
                            ("identity", False), ("deflate, gzip;q=0.5", True)):
        r = requests.get(daemon.url + "/metrics", headers={"Accept-Encoding": header},
                         timeout=10)
        assert (r.headers.get("Content-Encoding") == "gzip") == gzipped, header
        assert r.headers.get("Vary") == "Accept-Encoding"
        assert "gputrain_build_info" in r.text


def test_a_goodbye_over_the_series_limit_is_refused_like_a_push(daemon):
    for run in ("keep-a", "keep-b"):
        r = requests.post(daemon.ingest_url + "/api/v1/push", json={**GOOD, "run": run},
                          timeout=10)
        assert r.status_code in (200, 429)
    r = requests.post(daemon.ingest_url + "/api/v1/push",
                      json={**GOOD, "run": "late", "goodbye": True}, timeout=10)
    assert r.status_code == 429 and "--ingest.max-series" in r.text
    assert 'run="late"' not in daemon.metrics()


def test_clients_that_hang_up_cost_a_debug_line_not_a_traceback(daemon):
    for partial in (b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                    b"GET /metr", b"\x16\x03\x01\x00\x05hello"):
        with socket.create_connection(("127.0.0.1", daemon.ingest_port), timeout=5) as s:
            s.sendall(partial)
    wait_until(lambda: requests.get(daemon.url + "/healthz", timeout=5).ok, timeout=20,
               what="the daemon to keep serving")
    assert requests.get(daemon.url + "/metrics", timeout=10).status_code == 200
    assert "Traceback" not in daemon.log_text()


def test_plain_http_to_the_tls_port_is_one_debug_line(tmp_path, daemon_factory):
    cert, key = self_signed_cert(tmp_path, "IP:127.0.0.1")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", "--log.level=debug",
                       f"--web.tls-cert-file={cert}", f"--web.tls-key-file={key}",
                       start=False)
    d.url_scheme = "https"
    d.proc = subprocess.Popen(d.args, cwd=ROOT, env=d.env,
                              stdout=open(d.log_path, "w"),  # noqa: SIM115 - closed at exit
                              stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{d.port}"
    wait_until(lambda: requests.get(url + "/healthz", verify=str(cert), timeout=2).ok,
               timeout=20, what="the TLS exporter")
    answer = raw_exchange(d.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", timeout=5)
    assert not answer.startswith(b"HTTP/1.1 200")
    assert requests.get(url + "/metrics", verify=str(cert), timeout=5).status_code == 200
    log = wait_until(lambda: "ended" in d.log_text() and d.log_text(), timeout=20,
                     what="the one debug line about the plain-HTTP client")
    assert "Traceback" not in log


# -- capacity: connections, descriptors, memory --------------------------------------------------

def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115 - /proc
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def limited_daemon():
    """A daemon whose descriptor limit is systemd's default, 1,024."""
    import resource

    from conftest import Daemon

    d = Daemon("--gpu.backend=demo", "--demo.gpus=1")
    d._log = open(d.log_path, "w")  # noqa: SIM115 - closed by stop()
    d.proc = subprocess.Popen(
        d.args, cwd=ROOT, env=d.env, stdout=d._log, stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    wait_until(lambda: requests.get(d.url + "/healthz", timeout=1).ok, timeout=20,
               what="the exporter")
    yield d
    d.stop()


def test_1100_slow_connections_do_not_take_the_daemon_down(limited_daemon):
    """Slowloris: 1,100 connections that trickle a header byte every second and never finish,
    against a daemon with 1,024 descriptors (a per-read timeout never fires on them). The
    ingest port serves throughout; the metrics port serves again once the whole-request
    deadline has cut the slow ones; memory stays bounded; no traceback."""
    import threading

    d = limited_daemon
    slow: list[socket.socket] = []
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(1.0):
            for s in list(slow):
                try:
                    s.send(b"X")
                except OSError:
                    slow.remove(s)  # the daemon cut it

    trickler = threading.Thread(target=trickle)
    try:
        for _ in range(1100):
            try:
                s = socket.create_connection(("127.0.0.1", d.port), timeout=2)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                slow.append(s)
            except OSError:
                pass  # refused or reset by a full server: that is the point
        trickler.start()
        r = requests.post(d.ingest_url + "/api/v1/push", json=GOOD, timeout=10)
        assert r.status_code == 200  # the other port is not starved
        started = time.monotonic()
        scrape = wait_until(lambda: requests.get(d.url + "/metrics", timeout=2), timeout=40,
                            interval=0.5, what="a scrape to get through")
        assert scrape.status_code == 200 and 'run="ok"' in scrape.text
        assert time.monotonic() - started < 40
        # the descriptors the slow clients could take are bounded: the host collectors,
        # which open /proc files every cycle, kept working through the attack
        assert 'gputrain_collector_success{collector="cpu"} 1.0' in scrape.text
    finally:
        stop.set()
        if trickler.is_alive():
            trickler.join(timeout=30)
        for s in slow:
            s.close()
    assert d.proc.poll() is None
    assert peak_rss_mb(d.proc.pid) < 200
    assert "Traceback" not in d.log_text()
    assert "Too many open files" not in d.log_text()


def test_300_ranks_keeping_connections_alive_all_get_through(limited_daemon):
    """300 ranks on one node, each with a kept-alive connection (as requests.Session keeps
    it), against the 128-connection cap: the longest-idle connection makes room for a new
    one, its client reconnects on its next push, and every push of two rounds is accepted."""
    d = limited_daemon
    sessions = [requests.Session() for _ in range(300)]
    try:
        for round_ in range(2):
            codes = [s.post(d.ingest_url + "/api/v1/push", timeout=10,
                            json={**GOOD, "rank": str(i), "steps": 10 + round_}).status_code
                     for i, s in enumerate(sessions)]
            assert codes == [200] * len(sessions), f"round {round_}: {set(codes)}"
        d.wait_sample("gputrain_ingest_series", predicate=lambda v: v == 300)
    finally:
        for s in sessions:
            s.close()
    assert "Traceback" not in d.log_text()


def test_40_connections_of_6_mb_headers_are_refused_before_the_body(limited_daemon):
    """40 clients each send 6 MB of headers that never end (99 lines of 60 KB, under the
    standard library's own limits) and hold the connection: the daemon stops reading each at
    16 KiB with a 431, so its memory stays bounded and both ports serve."""
    import threading

    d = limited_daemon
    line = b"X-Padding: " + b"a" * 60000 + b"\r\n"
    sent, done = [], threading.Event()

    def attack() -> None:
        try:
            with socket.create_connection(("127.0.0.1", d.ingest_port), timeout=10) as s:
                s.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\n")
                for _ in range(99):
                    s.sendall(line)
                sent.append(True)
                done.wait(30)  # hold it open, headers unfinished
        except OSError:
            sent.append(False)  # the daemon answered 431 and closed: the rest was not read

    threads = [threading.Thread(target=attack) for _ in range(40)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(sent) == 40, timeout=60, what="the 40 attackers to finish sending")
        assert requests.post(d.ingest_url + "/api/v1/push", json=GOOD, timeout=10).status_code \
            == 200
        assert requests.get(d.url + "/metrics", timeout=10).status_code == 200
        assert peak_rss_mb(d.proc.pid) < 150
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    answer = raw_exchange(d.ingest_port, b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\n" + line
                          + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431")


def test_a_body_that_trickles_in_is_cut_at_the_request_deadline(daemon):
    """The whole request, body included, must arrive within the deadline (10 s): a client that
    sends its body a byte a second loses the connection, and the port keeps serving."""
    with socket.create_connection(("127.0.0.1", daemon.ingest_port), timeout=5) as s:
        s.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        started, closed = time.monotonic(), False
        while time.monotonic() - started < 40:
            try:
                s.sendall(b"{")
                s.settimeout(1.0)
                if s.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue  # nothing to read yet: keep trickling
            except OSError:
                closed = True
                break
        assert closed, "the trickling client kept its connection for 40 s"
    assert requests.post(daemon.ingest_url + "/api/v1/push", json=GOOD, timeout=10).status_code \
        in (200, 429)
