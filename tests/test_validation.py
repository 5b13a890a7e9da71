"""Bad input on a real server: every refusal is a 4xx in OpenAI's error shape naming the field, never a 500, and
no bad request leaves anything behind (a queue slot, a stream, a KV block, a dead engine)."""

from __future__ import annotations

import httpx
import pytest
from conftest import VOCAB
from serving import start_server, stats, stop_server

pytestmark = pytest.mark.server

ADMIN = {"x-api-key": "sk-admin-000000"}
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    # a high watermark of 4: four leaked queue slots would turn every later request into a 503
    proc, url = start_server(llama_dir, "--num-kv-blocks", "64", "--max-model-len", "512", "--admin-key",
                             ADMIN["x-api-key"], "--queue-high-watermark", "4", "--queue-low-watermark", "0")
    yield url
    assert stop_server(proc) == 0


def error(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI error object of a refused request, after checking its status and shape."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, "seed"),
    (CHAT, {"messages": MSGS, "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": [1, 2**64]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, VOCAB]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, "top_k"),  # killed the engine
    ("/v1/completions", {"prompt": "hi", "min_tokens": 2**64}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(2**64): 1}}, None),
])
def test_out_of_range_numbers_are_400_and_leak_nothing(server, path, body, param):
    for _ in range(6):  # more than the high watermark: a leaked slot per request would shed the next request
        err = error(httpx.post(server + path, json={"max_tokens": 2, **body}))
        if param is not None:
            assert err["param"] == param
    ok = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text
    s = stats(server)
    assert s["engine"]["in_flight"] == 0 and s["queue"]["depth"] == 0 and s["engine"]["restarts"] == 0
