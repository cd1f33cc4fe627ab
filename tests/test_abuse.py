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


def daemon_with_descriptors(soft: int, hard: int):
    """A demo daemon started with this descriptor limit (soft, hard), not yet waited for."""
    import resource

    from conftest import Daemon

    d = Daemon("--gpu.backend=demo", "--demo.gpus=1")
    d._log = open(d.log_path, "w")  # noqa: SIM115 - closed by stop()
    d.proc = subprocess.Popen(
        d.args, cwd=ROOT, env=d.env, stdout=d._log, stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    return d


@pytest.fixture
def limited_daemon():
    """A daemon whose descriptor limit is systemd's default, 1,024."""
    d = daemon_with_descriptors(1024, 1024)
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
    it), against the 128 connections an address may hold: a connection idle for a while makes
    room for a new one (its client reconnects on its next push); while every connection is
    in recent use a new one is answered 503 with Retry-After, and a rank that waits as told
    gets through. Every push of two rounds is accepted."""
    d = limited_daemon
    sessions = [requests.Session() for _ in range(300)]
    told = set()

    def push(i: int, s: requests.Session, steps: int) -> int:
        for _ in range(10):
            r = s.post(d.ingest_url + "/api/v1/push", timeout=10,
                       json={**GOOD, "rank": str(i), "steps": steps})
            if r.status_code != 503:
                return r.status_code
            told.add(r.headers.get("Retry-After"))
            time.sleep(float(r.headers.get("Retry-After", "1")))
        return 503

    try:
        for round_ in range(2):
            codes = [push(i, s, 10 + round_) for i, s in enumerate(sessions)]
            assert codes == [200] * len(sessions), f"round {round_}: {set(codes)}"
        d.wait_sample("gputrain_ingest_series", predicate=lambda v: v == 300)
    finally:
        for s in sessions:
            s.close()
    assert told <= {"1"}
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
        started, closed, answer = time.monotonic(), False, b""
        while time.monotonic() - started < 40:
            try:
                s.sendall(b"{")
                s.settimeout(1.0)
                data = s.recv(4096)
                if data == b"":
                    closed = True
                    break
                answer += data
            except TimeoutError:
                continue  # nothing to read yet: keep trickling
            except OSError:
                closed = True
                break
        assert closed, "the trickling client kept its connection for 40 s"
        assert status_of(answer) == 408 and closes(answer), answer  # it says why
    assert requests.post(daemon.ingest_url + "/api/v1/push", json=GOOD, timeout=10).status_code \
        in (200, 429)


# -- issue 29: the event-driven server's limits, fairness and clean refusals --------------------

ATTACKER = "127.0.0.2"  # fairness is by client address: probes come from 127.0.0.1


def attacker_socket(port: int, source: str = ATTACKER) -> socket.socket:
    s = socket.socket()
    s.settimeout(5)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def limits_of(pid: int) -> tuple[int, int]:
    """The (soft, hard) descriptor limits of a process, from /proc."""
    for line in open(f"/proc/{pid}/limits").read().splitlines():  # noqa: SIM115 - /proc
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def test_the_descriptor_limit_is_raised_to_the_hard_one_at_start():
    d = daemon_with_descriptors(256, 4096)
    try:
        wait_until(lambda: requests.get(d.url + "/healthz", timeout=1).ok, timeout=20,
                   what="the exporter")
        assert limits_of(d.proc.pid) == (4096, 4096)
    finally:
        d.stop()


def test_one_address_holding_slow_connections_cannot_blind_either_port(limited_daemon):
    """A slowloris from 127.0.0.2 opens 300 connections per port that never finish their
    headers (more than one address may hold: half the port's connections, 128 with 1,024
    descriptors): the connections past its share are refused with a 503 that says why, and
    scrapes and pushes from 127.0.0.1 are answered throughout."""
    d = limited_daemon
    held, refused = [], []
    try:
        for port, head in ((d.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "),
                           (d.ingest_port, b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nX: ")):
            for _ in range(300):
                try:
                    s = attacker_socket(port)
                    s.sendall(head)
                    held.append(s)
                except OSError:
                    refused.append(b"")
        session = requests.Session()
        for i in range(5):
            r = session.get(d.url + "/metrics", timeout=10)
            assert r.status_code == 200 and "gputrain_build_info" in r.text
            r = session.post(d.ingest_url + "/api/v1/push", json={**GOOD, "steps": 1 + i},
                             timeout=10)
            assert r.status_code == 200, r.text
        import select

        readable, _, _ = select.select(held, [], [], 1.0)
        for s in readable:  # answered: refused, or (on a slow machine) past the deadline
            try:
                refused.append(s.recv(4096))
            except OSError:
                refused.append(b"")
        busy = [a for a in refused if status_of(a) == 503]
        assert len(busy) >= 100, "past its share, an address's connections are refused"
        assert all(closes(a) and b"connections from " + ATTACKER.encode() in a
                   for a in busy), busy[:1]
        assert all(status_of(a) in (503, 408) for a in refused if a), refused[:3]
    finally:
        for s in held:
            s.close()
    assert "Traceback" not in d.log_text()


def test_at_the_cap_the_address_holding_the_most_makes_room(limited_daemon):
    """Two addresses fill the web port's connections (256 with 1,024 descriptors) with
    unfinished headers; a scrape from a third is served: the heaviest address's oldest
    connection makes room."""
    from exporter.serving.connections import connection_caps

    d = limited_daemon
    per_port, per_address = connection_caps(1024)
    held = []
    try:
        for source, n in (("127.0.0.2", per_address), ("127.0.0.3", per_port - per_address)):
            for _ in range(n):
                s = attacker_socket(d.port, source)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
        for _ in range(3):
            r = requests.get(d.url + "/metrics", timeout=10)
            assert r.status_code == 200
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("case, request_bytes, status", [
    ("a 404", b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 404),
    ("no Content-Length", b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\n\r\n", 411),
    ("a chunked body", b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                       b"chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
    ("a body over 1 MiB", b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          b"2000000\r\n\r\n{", 413),
    ("a GET with a body", b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
     200),
    ("headers over 16 KiB", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                            + b"X-Pad: " + b"a" * 17000 + b"\r\n\r\n", 431),
    # the parser skips empty lines before a request line: they must not end the count
    ("headers over 16 KiB after an empty line", b"\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n"
     + b"X-Pad: " + b"a" * 17000 + b"\r\n\r\n", 431),
    ("over 64 headers", b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 70 + b"\r\n",
     431),
    ("a request line over 8 KiB", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    ("not HTTP", b"\x16\x03\x01\x00\x05hello\r\n\r\n", 400),
])
def test_every_closing_answer_says_connection_close_and_then_closes(daemon, case,
                                                                    request_bytes, status):
    answer = raw_exchange(daemon.ingest_port, request_bytes)
    assert status_of(answer) == status, (case, answer[:300])
    assert closes(answer), (case, answer[:300])
    assert answer.count(b"HTTP/1.") == 1, case  # nothing after it: the server closed
    assert "Traceback" not in daemon.log_text()


def test_empty_lines_before_a_request_are_skipped_as_the_parser_does(daemon):
    answer = raw_exchange(daemon.port, b"\r\n\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n"
                          b"Connection: close\r\n\r\n")
    assert status_of(answer) == 200 and answer.endswith(b"ok\n"), answer[:300]


def test_the_token_refusal_closes_cleanly(daemon_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-16+")
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", f"--ingest.token-file={token}")
    body = json.dumps(GOOD).encode()
    answer = raw_exchange(d.ingest_port, post(body, Content_Length=str(len(body))))
    assert status_of(answer) == 401 and closes(answer) and b"bearer token" in answer


def test_a_body_shorter_than_its_content_length_is_a_400_and_one_debug_line(daemon):
    before = pushed(daemon, "400")
    with socket.create_connection(("127.0.0.1", daemon.ingest_port), timeout=10) as s:
        s.sendall(post(b'{"version": 1', Content_Length="100"))
        s.shutdown(socket.SHUT_WR)  # the client is done: 13 of 100 bytes
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert status_of(answer) == 400 and closes(answer), answer
    assert b"shorter than Content-Length (13 of 100 bytes" in answer
    daemon.wait_sample("gputrain_ingest_requests_total", {"code": "400"},
                       lambda v: v >= before + 1)
    assert pushed(daemon, "500") == 0
    log = daemon.log_text()
    assert "Traceback" not in log
    assert log.count("shorter than Content-Length (13 of 100") == 1, "one debug line"


def test_keep_alive_clients_get_every_answer_of_a_push_that_was_applied(limited_daemon):
    """300 ranks from 16 threads on kept-alive connections, three rounds, against the 128
    connections an address may hold with 1,024 descriptors: connections are reclaimed while
    others push, yet every push the daemon applied was answered (its count of 200s is the
    clients' count)."""
    import threading

    d = limited_daemon
    ok, failed = [0], [0]
    lock = threading.Lock()

    def rank_pushes(ranks: range) -> None:
        sessions = {r: requests.Session() for r in ranks}
        for round_ in range(3):
            for r, s in sessions.items():
                try:
                    code = s.post(d.ingest_url + "/api/v1/push", timeout=20,
                                  json={**GOOD, "run": "ka", "rank": str(r),
                                        "steps": 10 + round_}).status_code
                except requests.ConnectionError:
                    code = 0  # closed before the request was read: nothing was applied
                with lock:
                    if code == 200:
                        ok[0] += 1
                    else:
                        failed[0] += 1
        for s in sessions.values():
            s.close()

    threads = [threading.Thread(target=rank_pushes, args=(range(i, 300, 16),))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert ok[0] >= 600, (ok, failed)  # most pushes get through at the first try
    assert pushed(d, "200") == ok[0], (ok, failed)
    assert "Traceback" not in d.log_text()


def test_more_long_polls_than_the_port_allows_are_answered_at_once(daemon_factory):
    """40 long-polls of a queued profile from one address: the port lets a bounded number
    wait; the others get the profile as it is at once, with Retry-After, and pushes from
    another address are answered meanwhile."""
    import threading

    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    rank = {**GOOD, "run": "polled", "capabilities": ["profile"]}
    assert requests.post(d.ingest_url + "/api/v1/push", json=rank, timeout=10).ok
    pid = requests.post(d.ingest_url + "/api/v1/profile", json={"run": "polled"},
                        timeout=10).json()["id"]
    answers: list[requests.Response] = []

    def poll() -> None:
        s = requests.Session()
        s.mount("http://", SourceAdapter(ATTACKER))
        answers.append(s.get(f"{d.ingest_url}/api/v1/profile/{pid}?wait=5", timeout=30))

    polls = [threading.Thread(target=poll) for _ in range(40)]
    for t in polls:
        t.start()
    r = requests.post(d.ingest_url + "/api/v1/push", json={**rank, "steps": 2}, timeout=10)
    assert r.status_code == 200
    for t in polls:
        t.join(timeout=60)
    assert len(answers) == 40 and all(a.status_code == 200 and a.json()["id"] == pid
                                      for a in answers)
    assert any(a.headers.get("Retry-After") for a in answers), "no long-poll was bounded"


class SourceAdapter(requests.adapters.HTTPAdapter):
    """Connections from a given source address."""

    def __init__(self, source: str) -> None:
        self._source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self._source, 0)
        return super().init_poolmanager(*args, **kwargs)


def test_a_keep_alive_flood_from_one_address_gets_an_answer_for_every_push(limited_daemon):
    """160 clients on one address, each on a kept-alive connection pushing every 0.1 s, against
    the 128 connections an address may hold with 1,024 descriptors: no push is cut without an
    answer. A client past the address's share is answered 503 with Retry-After (and comes back
    after it), the others' answers say Connection: close while the address is crowded so the
    clients take turns, every 200 is a push applied, and the log says so once for the burst."""
    import threading

    d = limited_daemon
    codes: dict[object, int] = {}
    no_retry_after = [0]
    lock = threading.Lock()
    stop = time.monotonic() + 8.0

    def client(rank: int) -> None:
        s = requests.Session()
        steps = 0
        while time.monotonic() < stop:
            steps += 1
            try:
                r = s.post(d.ingest_url + "/api/v1/push", timeout=20,
                           json={**GOOD, "run": "flood", "rank": str(rank), "steps": steps})
                code: object = r.status_code
            except requests.ConnectionError as exc:
                code = type(exc.__context__ or exc).__name__  # a cut: no answer at all
            with lock:
                codes[code] = codes.get(code, 0) + 1
                if code == 503 and r.headers.get("Retry-After") != "1":
                    no_retry_after[0] += 1
            time.sleep(1.0 if code == 503 else 0.1)
        s.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(160)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    cuts = {k: v for k, v in codes.items() if not isinstance(k, int)}
    assert not cuts, f"pushes cut without an answer: {cuts} (answers: {codes})"
    # served, refused for room, or (a client starved of CPU beside CI's burners sending its
    # body too slowly: one push in 3,533 seen) timed out: each an answer
    assert set(codes) <= {200, 503, 408} and codes.get(408, 0) <= codes[200] // 100, codes
    assert codes.get(503), f"the flood never filled the address's share: {codes}"
    assert no_retry_after[0] == 0
    assert pushed(d, "200") == codes[200]
    d.wait_sample("gputrain_ingest_series", predicate=lambda v: v == 160)  # each got through
    log = d.log_text()
    assert log.count("refusing connections on the ingest port") == 1, log[-2000:]
    assert "Traceback" not in log
