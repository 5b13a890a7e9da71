"""Operational hardening on a real server (issue 27): per-request work caps, fair embedding batches, health and
stats that say what is true now, a header read timeout, failed-authentication limits, and API keys kept out of
the command line. The engine-kill test runs last: it leaves the engine restarting."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from urllib.parse import urlparse

import httpx
import pytest
from serving import HOLD, HOLD_BLOCKS, HOLD_CONTEXT, _wait, pid_alive, start_server, stop_server

pytestmark = pytest.mark.server

KEY = "sk-ops-hardening-01"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"x-api-key": "sk-ops-admin-0001"}


@pytest.fixture(scope="module")
def ops(long_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("ops")
    (d / "api.key").write_text(KEY + "\n")  # keys from files: nothing secret on the command line
    (d / "admin.key").write_text(ADMIN["x-api-key"])
    # admission caps at their defaults (max_n 16) except max_request_tokens, set through the env on purpose
    # room for three HOLD requests to their ends (the engine-kill test), so none is ever preempted
    proc, url = start_server(long_llama_dir, "--num-kv-blocks", str(3 * HOLD_BLOCKS), "--max-model-len",
                             str(HOLD_CONTEXT),
                             "--max-embedding-inputs", "8", "--api-key-file", str(d / "api.key"),
                             "--admin-key-file", str(d / "admin.key"), "--header-timeout-s", "1",
                             "--auth-failures-per-minute", "5", "--data-dir", str(d / "data"),  # an audit trail
                             env={"SERVELM_MAX_REQUEST_TOKENS": "120"})
    yield proc, url
    assert stop_server(proc) == 0


def _post(url: str, path: str, body: dict, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, headers=headers)


def test_n_over_the_default_cap_is_400_naming_the_limit(ops):
    _, url = ops
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 128}  # no max_tokens: whole contexts
    r = _post(url, "/v1/chat/completions", chat)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "max_n" in err["message"] and "16" in err["message"]
    assert _post(url, "/v1/completions", {"prompt": "hi", "n": 17, "max_tokens": 1}).status_code == 400
    assert _post(url, "/v1/completions", {"prompt": "hi", "n": 16, "max_tokens": 1}).status_code == 200


def test_total_tokens_cap_refuses_explicit_and_bounds_default_max_tokens(ops):
    _, url = ops
    r = _post(url, "/v1/completions", {"prompt": [1, 2, 3, 4], "n": 4, "max_tokens": 30})  # 4 + 4 x 30 > 120
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "max_request_tokens" in err["message"] and "120" in err["message"]
    # several prompts count together: 3 x (4 + 30) = 102 fits, 4 x (4 + 30) = 136 does not
    ok = _post(url, "/v1/completions", {"prompt": [[1, 2, 3, 4]] * 3, "max_tokens": 30, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert _post(url, "/v1/completions", {"prompt": [[1, 2, 3, 4]] * 4, "max_tokens": 30}).status_code == 400
    # no max_tokens: the default is what fits the cap, not the rest of the context per sample
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 4, "ignore_eos": True}
    r = _post(url, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 120


def test_embedding_inputs_cap(ops):
    _, url = ops
    r = _post(url, "/v1/embeddings", {"input": ["a text"] * 9})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and "max_embedding_inputs" in err["message"] and "8" in err["message"]
    assert _post(url, "/embeddings", {"input": ["a text"] * 9}).status_code == 400
    assert len(_post(url, "/v1/embeddings", {"input": ["a text"] * 8}).json()["data"]) == 8


def _process_tree(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return [pid] + [p for k in kids for p in _process_tree(k)]


def test_keys_from_files_authenticate_and_stay_out_of_the_command_line(ops):
    proc, url = ops
    assert _post(url, "/tokenize", {"prompt": "hi"}).status_code == 200
    assert _post(url, "/tokenize", {"prompt": "hi"}, headers={}).status_code == 401
    assert httpx.get(url + "/admin/config", headers=ADMIN).status_code == 200
    pids = _process_tree(proc.pid)
    assert len(pids) >= 3  # the API process, the engine process, the embedding process
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert b"api.key" in cmdline or pid != proc.pid
        assert KEY.encode() not in cmdline and ADMIN["x-api-key"].encode() not in cmdline


def test_key_file_settings_are_validated(tmp_path):
    from servelm.config.engine import ConfigError
    from servelm.config.settings import load

    good, short = tmp_path / "good.key", tmp_path / "short.key"
    good.write_text("sk-from-a-file-1\n")
    short.write_text("sk-1\n")
    assert load({"api_key_file": str(good)}, env={}).server.secret("api_key") == "sk-from-a-file-1"
    assert load({}, env={"SERVELM_API_KEY": "sk-from-env-0001"}).server.secret("api_key") == "sk-from-env-0001"
    for cli, env, bad in [({"api_key_file": str(short)}, {}, "api_key"),
                          ({"admin_key_file": str(tmp_path / "missing")}, {}, "admin_key_file"),
                          ({"api_key_file": str(good)}, {"SERVELM_API_KEY": "sk-from-env-0001"}, "api_key_file")]:
        with pytest.raises(ConfigError) as e:
            load(cli, env=env)
        assert bad in e.value.key and "sk-1" not in str(e.value)


def _client(address: str) -> httpx.Client:
    """A client whose connections come from `address` (any 127.x.y.z is this machine)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def test_failed_authentications_are_limited_per_client_address(ops):
    _, url = ops
    wrong = {"Authorization": "Bearer sk-not-the-key-0"}
    with _client("127.0.0.3") as guesser, _client("127.0.0.1") as other, _client("127.0.0.4") as third:
        for _ in range(5):  # --auth-failures-per-minute 5
            assert guesser.get(url + "/v1/models", headers=wrong).status_code == 401
        r = guesser.get(url + "/v1/models", headers=wrong)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "too_many_auth_failures" and int(r.headers["retry-after"]) >= 1
        # refused whatever it sends now, so a right guess is indistinguishable from a wrong one
        assert guesser.get(url + "/v1/models", headers=AUTH).status_code == 429
        assert guesser.get(url + "/admin/config", headers=ADMIN).status_code == 429
        assert guesser.get(url + "/health").status_code == 200  # probes need no key
        # other addresses are unaffected: the right key works, a wrong one is a plain 401
        assert other.get(url + "/v1/models", headers=AUTH).status_code == 200
        assert third.get(url + "/v1/models", headers=wrong).status_code == 401
        # a missing key is not a guess and is not counted
        for _ in range(6):
            assert third.get(url + "/v1/models").status_code == 401


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server sends until it closes the connection; socket.timeout if it never does."""
    sock.settimeout(limit_s)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_slow_request_head_is_closed_after_the_header_timeout(ops):
    _, url = ops
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port)) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")  # and never the rest
        assert _read_until_closed(slow, 30).startswith(b"HTTP/1.1 408")
    # a kept-alive connection that starts a second head and stalls is closed the same way
    with socket.create_connection((u.hostname, u.port)) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.settimeout(30)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        conn.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert b"408" in _read_until_closed(conn, 30)
    # a whole request is unaffected, and so is a handler that takes longer than the timeout
    r = _post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def test_engine_kill_is_reported_at_once_with_no_ghost_requests(ops):
    """Last in the module: the engine restarts after it."""
    _, url = ops
    cap = httpx.patch(url + "/admin/config", json={"max_request_tokens": HOLD_CONTEXT}, headers=ADMIN)
    assert cap.status_code == 200, cap.text  # the caps are run-time settings
    body = HOLD  # each runs until the kill
    with contextlib.ExitStack() as streams:
        for _ in range(3):
            r = streams.enter_context(httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH,
                                                           timeout=60))
            lines = r.iter_lines()
            assert r.status_code == 200 and next(lines).startswith("data: ")  # it is running
            streams.callback(lambda lines=lines: list(lines))  # drain: the error event and [DONE]
        before = httpx.get(url + "/server/stats", headers=AUTH).json()
        assert before["running"] == 3 and before["engine"]["in_flight"] == 3, before
        pid, up_since = before["engine"]["pid"], before["engine"]["up_since"]
        assert up_since is not None
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: not pid_alive(pid), 30, "the engine process to die")
        # asked right after the death is observable: nothing may still say it is up or busy
        ready = httpx.get(url + "/ready").status_code
        st = httpx.get(url + "/server/stats", headers=AUTH).json()
        metrics = httpx.get(url + "/metrics").text
        after = httpx.get(url + "/server/stats", headers=AUTH).json()["engine"]
        if after["ready"]:  # its replacement came up during these checks (a kill slow to land on a loaded machine)
            assert after["pid"] not in (None, pid) and after["restarts"] >= 1 and after["up_since"] > up_since, after
        else:  # down throughout the checks: every view says so
            assert ready == 503
            assert st["engine"]["status"] == "down"
            for gauge in ("servelm:engine_up", "servelm:num_requests_running", "servelm:num_requests_waiting"):
                assert f'{gauge}{{model_name="tiny"}} 0.0' in metrics, gauge
        assert (st["running"], st["waiting"], st["engine"]["in_flight"], st["queue"]["depth"]) == (0, 0, 0, 0)
    # the replacement is in the audit trail, once it is ready
    new = _wait(lambda: (e := httpx.get(url + "/server/stats", headers=AUTH).json()["engine"])["ready"] and e["pid"],
                120, "the replacement engine to be ready")
    entries = _wait(lambda: [e for e in httpx.get(url + "/admin/audit", params={"target": "tiny"},
                                                  headers=ADMIN).json()["entries"] if e["action"] == "replace_worker"],
                    30, "the replaced worker's audit entry")
    assert [(e["actor"], e["before"], e["after"]) for e in entries] == [
        ("system", {"pid": pid, "exit_code": -signal.SIGKILL, "cause": "died"}, {"pid": new, "restarts": 1})]
    assert httpx.get(url + "/admin/audit", headers=ADMIN).json()["ok"] is True
