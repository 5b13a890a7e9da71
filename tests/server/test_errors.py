"""The last line of defence, in process: an unexpected exception (a bug) is answered as OpenAI's JSON error object
with status 500, and the keep-alive connection it came on still serves the next request."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest
import uvicorn
from fastapi import FastAPI
from serving import _free_port, _wait

from servelm.config import settings
from servelm.server.errors import install_error_handlers
from servelm.server.middleware.admission import Admission
from servelm.server.middleware.auth import KeyStore
from servelm.server.middleware.gateway import Gateway
from servelm.server.observability.metrics import Metrics
from servelm.server.observability.telemetry import Telemetry


@pytest.fixture
def url():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    config = settings.load(env={})
    metrics = Metrics("m")
    state = SimpleNamespace(config=config, keys=KeyStore.from_config(None, None, None), metrics=metrics,
                            admission=Admission(config, metrics, lambda: 0),
                            telemetry=Telemetry(metrics, False, False, None))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(Gateway(app, state), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started, 30, "uvicorn to start")
    yield port
    server.should_exit = True
    thread.join(30)


def _exchange(sock: socket.socket, path: str) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request on an open connection: (status, headers, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_unexpected_exception_is_json_500_and_the_connection_lives_on(url):
    import json

    with socket.create_connection(("127.0.0.1", url), timeout=30) as sock:
        for _ in range(3):
            status, headers, body = _exchange(sock, "/boom")
            assert status == 500 and headers["content-type"] == "application/json"
            err = json.loads(body)["error"]
            assert err == {"message": "internal server error", "type": "internal_error", "param": None,
                           "code": "internal_error"}
            assert "a bug" not in body.decode()  # internals stay in the log
            status, _, body = _exchange(sock, "/fine")  # same connection
            assert status == 200 and json.loads(body) == {"ok": True}
