"""How the HTTP server was chosen (issue 29): CPU per request and idle memory of each
candidate serving one push-sized POST, beside the standard library's ThreadingHTTPServer (the
anchor: the server the daemon had before), in the same run.

    python bench/bench_servers.py [--requests 4000] [--rounds 2]

8 clients on kept-alive connections POST 1.5 KB and read 'ok'. Candidates: aiohttp's
low-level server (what the daemon uses), uvicorn with httptools and a bare ASGI app (only if
installed: pip install uvicorn httptools; not a dependency of the project).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import socket
import subprocess
import sys
import threading
import time

import psutil
import requests

BODY = b"{" + b'"x": 1.0, ' * 150 + b'"y": 1}'


def stdlib(port: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"ok\n")

        def log_message(self, *args) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def aiohttp_server(port: int) -> None:
    from aiohttp import web

    async def handle(request: web.BaseRequest) -> web.Response:
        await request.content.readexactly(int(request.headers["Content-Length"]))
        return web.Response(body=b"ok\n", content_type="text/plain")

    async def main() -> None:
        server = web.Server(handle, access_log=None)
        await asyncio.get_running_loop().create_server(server, "127.0.0.1", port)
        await asyncio.Event().wait()

    asyncio.run(main())


def uvicorn_server(port: int) -> None:
    import uvicorn

    async def app(scope, receive, send) -> None:
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok\n"})

    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="asyncio",
                access_log=False, log_level="warning", lifespan="off")


SERVERS = {"stdlib (anchor)": stdlib, "aiohttp": aiohttp_server, "uvicorn+httptools":
           uvicorn_server}


def measure(name: str, requests_n: int) -> tuple[float, float]:
    """(CPU microseconds per request, idle RSS MB) of one candidate in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", name, str(port)])
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(200):
            try:
                requests.post(url, data=BODY, timeout=1)
                break
            except requests.RequestException:
                time.sleep(0.05)
        ps = psutil.Process(proc.pid)
        rss = ps.memory_info().rss / 2**20
        cpu0 = sum(ps.cpu_times()[:2])

        def client() -> None:
            session = requests.Session()
            for _ in range(requests_n // 8):
                session.post(url, data=BODY, timeout=10)

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (sum(ps.cpu_times()[:2]) - cpu0) / requests_n * 1e6, rss
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        SERVERS[sys.argv[2]](int(sys.argv[3]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    names = [n for n in SERVERS if n != "uvicorn+httptools" or (
        importlib.util.find_spec("uvicorn") and importlib.util.find_spec("httptools"))]
    print(f"python {sys.version.split()[0]}, {args.requests} POSTs of {len(BODY)} bytes from 8 "
          "kept-alive clients, per round")
    print(f"{'server':20} {'us CPU/request':>15} {'x anchor':>9} {'idle RSS MB':>12}")
    for _ in range(args.rounds):
        anchor = None
        for name in names:
            cpu, rss = measure(name, args.requests)
            anchor = anchor or cpu
            print(f"{name:20} {cpu:15.1f} {cpu / anchor:9.2f} {rss:12.1f}", flush=True)


if __name__ == "__main__":
    main()
