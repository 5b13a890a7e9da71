"""The prediction log on a real server: an entry is durable before its response completes, so killing the
server with SIGKILL while other requests are still running loses no answered request (RPO 0); streamed and
non-streamed; and feedback lands on what served the request."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import start_server

pytestmark = pytest.mark.server
ADMIN_KEY = "sk-admin-predlog-1"


def test_kill_9_right_after_responses_loses_no_answered_request(llama_dir, tmp_path):
    from servelm.control import db
    from servelm.control.predictions import PredictionLog

    data = tmp_path / "data"
    proc, url = start_server(llama_dir, "--num-kv-blocks", "64", "--max-model-len", "256", "--embedding-model",
                             "none", "--data-dir", str(data), "--admin-key", ADMIN_KEY, "--prediction-log",
                             "tiny=full,*=off")
    answered: list[str] = []
    lock = threading.Lock()
    enough = threading.Event()

    def one(i: int) -> None:
        rid = f"pl-{i}"
        body = {"model": "tiny", "prompt": [1, 500 + i, 600], "max_tokens": 4, "ignore_eos": True,
                "stream": i % 2 == 1, "user": f"user-{i % 3}"}
        try:
            r = httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=60)
            r.read()
        except httpx.HTTPError:
            return  # cut off by the kill: not answered
        if r.status_code == 200 and (not body["stream"] or r.text.rstrip().endswith("data: [DONE]")):
            with lock:
                answered.append(rid)
                if len(answered) >= 12:
                    enough.set()

    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"x-request-id": "first"}, timeout=60)
        assert r.status_code == 200 and "x-servelm-arm" not in r.headers  # no policy: no arm
        fb = httpx.post(url + "/v1/feedback", json={"request_id": "first", "score": 0.5}, timeout=10)
        assert fb.status_code == 200 and fb.json()["model"] == "tiny", fb.text
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(40)]
            enough.wait(120)
            os.killpg(proc.pid, signal.SIGKILL)  # requests still in flight; those answered must be logged
            for f in futures:
                f.result()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert len(answered) >= 12
    log = PredictionLog(db.open_engine(db.default_url(data)))
    rows = {r["request_id"]: r for r in log.entries()}
    missing = [rid for rid in answered if rid not in rows]
    assert not missing, f"answered but not logged: {missing}"
    row = rows[answered[0]]
    assert row["model"] == "tiny" and row["completion_tokens"] == 4 and row["output"] is not None
    assert row["user"] and row["prompt"] is not None
