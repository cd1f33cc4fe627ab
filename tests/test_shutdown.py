"""SIGTERM during load: the daemon stops accepting, answers every request it already holds
(each answer closing its connection), closes the connections that hold none, and exits. A push
answered 200 was applied; nothing in flight is cut without an answer."""

from __future__ import annotations

import json
import signal
import socket
import time

from conftest import wait_until

from exporter.protocol import PROFILE_PATH, PUSH_PATH, SCHEMA_VERSION


def push_body(run: str, rank: str, steps: int) -> bytes:
    now = time.time()
    return json.dumps({"version": SCHEMA_VERSION, "run": run, "rank": rank, "run_id": "a1",
                       "steps": steps, "step_seconds": 0.1 * steps,
                       "data_wait_seconds": 0.01 * steps, "samples": 8 * steps,
                       "elapsed_seconds": 0.1 * steps, "last_step_timestamp": now,
                       "gpus": ["0"], "capabilities": ["profile"]}).encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (status, headers, body by Content-Length); raises ConnectionError
    where the connection closes before a whole one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed without an answer (had {data[:80]!r})")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed in the middle of an answer")
        body += chunk
    return status, headers, body[:length]


def request(port: int, head: str, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode() + body)
    return sock


def test_a_sigterm_answers_every_request_already_in_and_closes_the_rest(daemon_factory):
    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    port = d.ingest_port
    body = push_body("r", "0", 1)
    head = (f"POST {PUSH_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")

    def pushed() -> socket.socket | None:
        # (a daemon just started on a loaded box may read a first body late and refuse it
        # as slow: not what this test is about)
        s = request(port, head, body)
        if read_response(s)[0] == 200:
            return s
        s.close()
        return None

    first = wait_until(pushed, timeout=30, what="the first push")
    # a profile the rank never takes: a GET of it with ?wait= long-polls for up to 5 s
    ask = json.dumps({"run": "r", "steps": 5}).encode()
    first.sendall(f"POST {PROFILE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {len(ask)}\r\n\r\n".encode() + ask)
    status, _, body = read_response(first)
    assert status in (200, 202), body
    pid = json.loads(body)["id"]

    # in flight when the signal comes, each on a connection the daemon has accepted (it has
    # answered one request on it first):
    polls, pushes, idle = [], [], []
    for _ in range(6):  # long-polls
        s = request(port, f"GET {PROFILE_PATH}/{pid} HTTP/1.1\r\nHost: x\r\n\r\n")
        read_response(s)
        s.sendall(f"GET {PROFILE_PATH}/{pid}?wait=5 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        polls.append(s)
    for _ in range(4):  # keep-alive connections between requests
        s = request(port, f"GET {PROFILE_PATH}/{pid} HTTP/1.1\r\nHost: x\r\n\r\n")
        read_response(s)
        idle.append(s)
    for i in range(6):  # pushes whose bodies are still coming: the daemon said 100 Continue
        body = push_body("r", str(i + 1), 10)
        s = request(port, f"POST {PUSH_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(body)}\r\n"
                          "Expect: 100-continue\r\n\r\n")
        status, _, _ = read_response(s)
        assert status == 100
        pushes.append((s, body))

    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    for s, body in pushes:  # at once: a body that comes a second after its 100 is cut as slow
        s.sendall(body)
    # the listening socket closes at once: a new connection is refused, not left hanging
    wait_until(lambda: _refused(port), timeout=10, what="new connections to be refused")
    answers = [read_response(s) for s in polls] + [read_response(s) for s, _ in pushes]
    assert [a[0] for a in answers] == [200] * 12, answers
    # a long-poll is answered by the drain, which closes its connection (a push may have been
    # answered before the signal was handled)
    assert all(a[1].get("connection", "").lower() == "close" for a in answers[:6])
    assert all(json.loads(a[2])["state"] not in ("done", "failed") for a in answers[:6])
    for s in idle:  # no request on them: closed, with nothing to answer
        s.settimeout(10)
        assert s.recv(1) == b""
    assert d.proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 15  # the 5 s grace, not the long-polls' own 5 s each
    assert "not answered" not in d.log_text()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_goodbye_answered_before_a_restart_stays_said(daemon_factory):
    """A rank that closed (its goodbye answered 200), then the daemon is stopped and another
    takes its port: the new one never lists that rank, since nothing pushes it again; a rank
    still training is listed again (its next push), as a rank whose goodbye is not answered
    would be."""
    from exporter.client import TrainingMonitor

    d = daemon_factory("--gpu.backend=demo", "--demo.gpus=1")
    done = TrainingMonitor(run="done", rank=0, endpoint=d.ingest_url, push_interval=0.2)
    going = TrainingMonitor(run="going", rank=0, endpoint=d.ingest_url, push_interval=0.2)
    try:
        for _ in range(3):
            for m in (done, going):
                with m.step(samples=8):
                    pass
        d.wait_sample("gputrain_training_steps_total", {"run": "done", "rank": "0"})
        done.close()
        d.wait_sample("gputrain_training_finished", {"run": "done", "rank": "0"},
                      predicate=lambda v: v == 1)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=30) == 0
        again = daemon_factory("--gpu.backend=demo", "--demo.gpus=1", ingest_port=d.ingest_port)
        with going.step(samples=8):
            pass
        again.wait_sample("gputrain_training_steps_total", {"run": "going", "rank": "0"},
                          timeout=30)
        # three pushes of the rank that trains: the closed one, at the same interval, would
        # have pushed by then
        again.wait_sample("gputrain_ingest_requests_total", {"code": "200"},
                          predicate=lambda v: v >= 3, timeout=30)
        assert 'run="done"' not in again.metrics()
    finally:
        going.close()
        done.close()
