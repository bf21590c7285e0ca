"""A uvicorn server in a background thread on a free loopback port, and plain stdlib HTTP requests to it, for the
server tests (no HTTP client library needed, so that the raw protocol is what is tested). Every wait is bounded."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import uvicorn


class Reply:
    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None):
        self.status_code, self.text = status, body.decode("utf-8", "replace")
        self.headers = headers or {}

    def json(self):
        return json.loads(self.text)


def connect(url: str, timeout: float) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def request(url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
            timeout: float = 30.0) -> Reply:
    """One plain HTTP request; a dict body is sent as JSON, with a JSON content type unless `headers` set one."""
    conn = connect(url, timeout)
    try:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=raw, headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return Reply(r.status, r.read(), {k.lower(): v for k, v in r.getheaders()})
    finally:
        conn.close()


class RunningServer:
    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    @property
    def engine(self):
        return self.app.state.server.engine

    def metrics(self) -> dict[str, float]:
        text = request(self.url, "GET", "/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def wait_until(self, check, what: str, seconds: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + seconds
        while True:
            m = self.metrics()
            if check(m):
                return m
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {m}"
            time.sleep(0.05)

    def idle(self) -> dict[str, float]:
        """Wait until no request runs or waits; the metrics then (every KV block should be back)."""
        return self.wait_until(lambda m: m["cudflash_requests_running"] == 0 and m["cudflash_requests_waiting"] == 0,
                               "the server to go idle")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
