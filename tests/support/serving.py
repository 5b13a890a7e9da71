"""Helpers for tests that run a real servelm server on localhost."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

# A server of the tiny Llama with this context (the `long_llama_dir` fixture) and `--max-model-len HOLD_CONTEXT`
# takes HOLD: a streaming request that runs for minutes (tens of thousands of steps) until its client leaves.
HOLD_CONTEXT = 65536
HOLD = {"prompt": [1, 2, 3, 4], "max_tokens": HOLD_CONTEXT - 8, "ignore_eos": True, "stream": True}
HOLD_BLOCKS = -(-HOLD_CONTEXT // 16)  # KV blocks of 16 tokens for one HOLD to its end: it is never preempted


def pid_alive(pid: int) -> bool:
    """Whether pid runs: a zombie, exited but not yet reaped, counts as gone. Every thread must be one: SIGKILL
    makes the main thread a zombie while the process's other threads (an engine's compute threads) are still
    being torn down, and until the last one is gone its parent's waitpid() does not report the exit, so the
    parent rightly still sees it alive."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):  # that thread is gone already
            pass
    return False


def grammar_backends() -> list:
    """The structured output backends, as pytest params of a fixture (xgrammar skipped where it is not
    installed: the `structured` extra; CI's test extra has it)."""
    import importlib.util

    import pytest

    missing = importlib.util.find_spec("xgrammar") is None
    return ["llguidance", pytest.param("xgrammar", marks=pytest.mark.skipif(missing, reason="xgrammar is not "
                                                                                       "installed"))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float = 60.0, what: str = "condition"):
    """Poll until cond() is truthy (a bounded wait for a state, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _ready(url: str, **client) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2, **client).status_code == 200
    except httpx.HTTPError:
        return False


def stats(url: str, headers: dict | None = None) -> dict:
    return httpx.get(url + "/server/stats", headers=headers).json()


def _ready_on(uds: str) -> bool:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=2) as client:
            return client.get("http://localhost/ready").status_code == 200
    except httpx.HTTPError:
        return False


def start_server(model_dir, *extra: str, env: dict | None = None, tls: dict | None = None, uds: str | None = None):
    """`tls`: the server speaks HTTPS; httpx's `verify` (and `cert`) to reach it with. `uds`: it listens on that
    Unix domain socket (the URL returned is then http://localhost, for a client with httpx's uds transport)."""
    port = _free_port()
    # model_dir None: no MODEL argument (the config file's models: list is what is served)
    head = [] if model_dir is None else [str(model_dir), "--served-model-name", "tiny"]
    where = ["--uds", uds] if uds else ["--port", str(port)]
    cmd = [sys.executable, "-m", "servelm.entrypoints.cli", "serve", *head, *where, "--dtype", "float32", *extra]
    fd, log_path = tempfile.mkstemp(prefix="servelm-test-", suffix=".log")
    with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True,
                                env={**os.environ, **(env or {})})
    proc.log_path = log_path
    url = "http://localhost" if uds else f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    ready = (lambda: _ready_on(uds)) if uds else (lambda: _ready(url, **(tls or {})))
    try:
        _wait(lambda: proc.poll() is not None or ready(), 300, "the server to become ready")
    except AssertionError:
        proc.kill()
        raise
    if proc.poll() is not None:
        raise RuntimeError(f"server exited: {Path(proc.log_path).read_text()[-3000:]}")
    return proc, url


def stop_server(proc) -> int:
    """SIGTERM, and the exit code. A clean exit leaves a clean log: no process of the server reports objects
    leaked at its exit (Triton's extension counts its own, and a heap left frozen kept them all alive)."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if code == 0 and getattr(proc, "log_path", None):
        with open(proc.log_path) as f:
            leaked = [line for line in f if "nanobind: leaked" in line]
        assert not leaked, f"the server's exit reported leaked objects: {leaked}"
    return code




def raw_request(url: str, path: str, body: dict, headers: dict | None = None) -> socket.socket:
    """Send a POST and return the open socket: closing it is a client that goes away, at a moment of the
    test's choosing (an HTTP client would block until the response headers arrive)."""
    u = urlparse(url)
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", "Content-Type: application/json",
            f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    return s


def server_log_lines(proc) -> list[dict]:
    """The JSON request lines the server has logged so far."""
    out = []
    with open(proc.log_path) as f:
        for line in f:
            if line.startswith("{"):
                out.append(json.loads(line))
    return out
