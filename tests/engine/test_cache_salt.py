"""The cache salt the API gives each request: from its API key under --prefix-cache-isolation key, from the
request's own cache_salt, both, or neither (in-process, with an engine stand-in that records what it got)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from servelm.config.engine import ConfigError
from servelm.config.settings import load
from servelm.outputs import CompletionOutput, RequestOutput


class _RecordingEngine:
    ready, stats, info, max_model_len = True, None, SimpleNamespace(vocab_size=49152), 1024
    on_ready = on_down = on_step = None

    def __init__(self) -> None:
        self.salts: list[str | None] = []

    def num_queued(self) -> int:
        return 0

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, salt=None):
        self.salts.append(salt)
        yield RequestOutput(rid, prompt, ids, [CompletionOutput(0, " x", [5], finish_reason="length")], True)


def _salts(tokenizer, tmp_path, isolation: str, calls: list[tuple[str, dict]]) -> list[str | None]:
    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {name: a, key: sk-tenant-aaaa}\n  - {name: b, key: sk-tenant-bbbb}\n")
    config = load({"embedding_model": "none", "log_requests": False, "api_keys_file": str(keys),
                   "prefix_cache_isolation": isolation}, env={})
    engine = _RecordingEngine()
    app = build_app(build_state(config, tokenizer, engine, "tiny"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            for key, extra in calls:
                r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, **extra},
                                      headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text

    asyncio.run(main())
    return engine.salts


CALLS = [("sk-tenant-aaaa", {}), ("sk-tenant-aaaa", {}), ("sk-tenant-bbbb", {}),
         ("sk-tenant-aaaa", {"cache_salt": "s"}), ("sk-tenant-bbbb", {"cache_salt": "s"})]


def test_isolation_by_key_and_cache_salt(tokenizer, tmp_path):
    a, a_again, b, a_salted, b_salted = _salts(tokenizer, tmp_path, "key", CALLS)
    assert a == a_again and a is not None  # one key, one namespace
    assert len({a, b, a_salted, b_salted}) == 4  # another key, or a salt, is another namespace
    assert "sk-tenant" not in "".join([a, b, a_salted, b_salted])  # derived from the key, never the key


def test_isolation_none_shares_across_keys_but_keeps_explicit_salts(tokenizer, tmp_path):
    a, a_again, b, a_salted, b_salted = _salts(tokenizer, tmp_path, "none", CALLS)
    assert a is None and a_again is None and b is None  # everyone shares
    assert a_salted == b_salted is not None  # the same salt is one namespace whoever sends it


def test_isolation_setting_is_validated():
    assert load({}, env={"SERVELM_PREFIX_CACHE_ISOLATION": "none"}).server.auth_config.prefix_cache_isolation == "none"
    assert load({}, env={}).server.auth_config.prefix_cache_isolation == "key"
    with pytest.raises(ConfigError, match="prefix_cache_isolation must be key or none"):
        load({"prefix_cache_isolation": "tenant"}, env={})
