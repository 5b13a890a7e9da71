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


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/embeddings", b'{"input": ["\\ud800"]}', "input.0"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias.\ud800"),
])
def test_lone_surrogates_are_400(server, path, raw, param):
    err = error(httpx.post(server + path, content=raw, headers={"content-type": "application/json"}))
    assert err["param"] == param
    assert err["code"] == "invalid_unicode"


def test_a_valid_surrogate_pair_is_text(server):
    r = httpx.post(server + "/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_errors_keep_the_keep_alive_connection(server):
    bad = b'{"prompt": "\\ud800", "max_tokens": 2}'
    with httpx.Client(base_url=server, limits=httpx.Limits(max_connections=1)) as client:
        for _ in range(20):
            r = client.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("raw, param", [
    (b'{"max_num_seqs": 1e20}', "engine.max_num_seqs"),  # was a 500, yet GET showed it applied
    (b'{"max_num_seqs": 18446744073709551616}', "engine.max_num_seqs"),
    (b'{"queue_timeout_s": 1e400}', "admission.queue_timeout_s"),  # a float infinity
    (b'{"max_num_seqs": 5, "default_priority": "urgent"}', "admission.default_priority"),
    (b'{"\\ud800": 1}', "\ud800"),
])
def test_admin_patch_is_validated_and_all_or_nothing(server, raw, param):
    before = httpx.get(server + "/admin/config", headers=ADMIN).json()["config"]
    r = httpx.patch(server + "/admin/config", content=raw, headers=ADMIN)
    assert error(r)["param"] == param
    assert httpx.get(server + "/admin/config", headers=ADMIN).json()["config"] == before
    ok = httpx.patch(server + "/admin/config", json={"max_num_seqs": 8}, headers=ADMIN)
    assert ok.status_code == 200 and ok.json()["applied"] == {"engine.max_num_seqs": 8}
