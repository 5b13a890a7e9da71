"""--kv-cache-persist and /admin/kv/save|load on a real server: a restarted server keeps its prefix hits and
answers the same; damaged files are rejected (400) and another model's file refused (409), the cache intact."""

from __future__ import annotations

import os

import httpx
import pytest
from serving import start_server, stats, stop_server
from tiny_models import random_prompts

pytest.importorskip("torch")

ADMIN_KEY = "kv-admin-key-123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(1, 48, 48, seed=11)[0]  # 3 full blocks of 16 shared by every prompt
    return [shared + p[1:] for p in random_prompts(3, 10, 20, seed=12)]


def _complete(url: str, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def _hits(url: str) -> int:
    return stats(url)["prefix_cache"]["hits"]


@pytest.fixture(scope="module")
def restarted(llama_dir, prompts, tmp_path_factory):
    """A server that served `prompts` and was stopped, then a second one on the same directory."""
    persist = tmp_path_factory.mktemp("persist")
    args = ("--kv-cache-persist", str(persist), "--num-kv-blocks", "64")
    env = {"SERVELM_ADMIN_KEY": ADMIN_KEY}
    proc, url = start_server(llama_dir, *args, env=env)
    try:
        first = _complete(url, prompts)
        first_hits = _hits(url)
    finally:
        assert stop_server(proc) == 0
    files = list(persist.glob("*.kvcache"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    proc, url = start_server(llama_dir, *args, env=env)
    yield url, first, first_hits, files[0]
    stop_server(proc)


def test_restart_keeps_prefix_hits_and_outputs(restarted, prompts):
    url, first, first_hits, _ = restarted
    assert _hits(url) == 0
    assert _complete(url, prompts) == first
    # the first run hit only the shared prefix of the 2nd and 3rd prompts; after the restart every prompt
    # finds all of its own full blocks too
    assert _hits(url) > first_hits
    assert _hits(url) >= sum(len(p) // 16 * 16 for p in prompts) - 16


def _bad(url: str, path, status: int, code: str) -> None:
    r = httpx.post(url + "/admin/kv/load", headers=ADMIN, json={"path": str(path)}, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_admin_save_load_and_refusals(restarted, prompts, tmp_path):
    url, first, _, saved = restarted
    assert httpx.post(url + "/admin/kv/save", json={}).status_code == 401  # admin routes need the admin key
    r = httpx.post(url + "/admin/kv/save", headers=ADMIN, json={"path": str(tmp_path / "copy.kvcache")}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["num_blocks"] > 0 and r.json()["size_bytes"] == os.path.getsize(tmp_path / "copy.kvcache")
    data = (tmp_path / "copy.kvcache").read_bytes()
    (tmp_path / "short.kvcache").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[len(data) * 2 // 3] ^= 0x04
    (tmp_path / "flipped.kvcache").write_bytes(bytes(flipped))
    hits = _hits(url)
    _bad(url, tmp_path / "short.kvcache", 400, "kv_cache_corrupt")
    _bad(url, tmp_path / "flipped.kvcache", 400, "kv_cache_corrupt")
    _bad(url, tmp_path / "missing.kvcache", 404, "kv_cache_not_found")
    _bad(url, _other_model_file(tmp_path, tmp_path / "copy.kvcache"), 409, "kv_cache_mismatch")
    assert _complete(url, prompts) == first  # the cache is as it was
    assert _hits(url) > hits
    r = httpx.post(url + "/admin/kv/load", headers=ADMIN, json={"path": str(tmp_path / "copy.kvcache")}, timeout=60)
    assert r.status_code == 200 and r.json()["num_blocks"] == 0  # every block is cached already


def _other_model_file(tmp_path, saved):
    """An intact file (both checksums right) whose header names another model."""
    import hashlib
    import json
    import struct

    data = saved.read_bytes()
    hlen = struct.unpack("<I", data[12:16])[0]
    header = json.loads(data[16:16 + hlen])
    header["model_hash"] = "f" * 64
    head = data[:12] + b"".join([struct.pack("<I", len(raw := json.dumps(header).encode())), raw])
    head += hashlib.sha256(head).digest()
    body = head + data[16 + hlen + 32:-32]
    path = tmp_path / "other.kvcache"
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


def test_reset_prefix_cache_forgets_every_prefix(restarted, prompts):
    """vLLM's POST /reset_prefix_cache (admin key): a prompt served again after it computes every token anew."""
    url = restarted[0]
    body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 2, "temperature": 0}

    def cached() -> int:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached()
    assert cached() >= 48  # served again: its full blocks from the cache
    assert httpx.post(url + "/reset_prefix_cache").status_code == 401
    r = httpx.post(url + "/reset_prefix_cache", headers=ADMIN)
    assert r.status_code == 200 and r.json()["model"] == "tiny" and r.json()["num_blocks"] >= 3
    assert cached() == 0
    r = httpx.post(url + "/reset_prefix_cache", params={"model": "other"}, headers=ADMIN)
    assert r.status_code == 404


def test_reset_prefix_cache_while_requests_are_in_flight_is_a_409(tokenizer):
    """The engine refuses a reset while requests hold blocks (LLM.reset_prefix_cache's test): the route says so.
    In-process, with a stub engine that is busy."""
    from fakes import IdleEngine
    from starlette.testclient import TestClient

    from servelm.config.settings import load
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    class Busy(IdleEngine):
        async def kv_cache(self, action, path=None): ...

        async def reset_prefix_cache(self):
            return None  # requests in flight

    config = load({"embedding_model": "none", "log_requests": False, "admin_key": ADMIN_KEY}, env={})
    with TestClient(build_app(build_state(config, tokenizer, Busy(), "tiny"))) as client:
        r = client.post("/reset_prefix_cache", headers=ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "prefix_cache_in_use"
