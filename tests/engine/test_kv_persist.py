"""Prefix-cache persistence in the engine: save, restore into a fresh engine (hits, same outputs), and the
files a restore must refuse (another model, dtype, block size) or reject (truncated, bit-flipped, forged)."""

from __future__ import annotations

import hashlib

import pytest
from tiny_models import random_prompts, run

torch = pytest.importorskip("torch")

from servelm import LLM, SamplingParams  # noqa: E402
from servelm.engine import kv_persist  # noqa: E402
from servelm.engine.block_pool import is_partial  # noqa: E402
from servelm.engine.kv_persist import KVFormatError, KVMismatchError  # noqa: E402
from servelm.model.loading.source import resolve_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, **kw)


def _digest(llm: LLM, model_dir) -> str:
    return kv_persist.model_hash(resolve_model(str(model_dir)), llm.engine.core.model.spec)


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(1, 40, 40, seed=7)[0]  # 2 full blocks of 16 shared by every prompt
    return [shared + p[1:] for p in random_prompts(3, 12, 20, seed=8)]


@pytest.fixture(scope="module")
def saved(llama_dir, prompts, tmp_path_factory):
    """A file saved by an engine that served `prompts`, with that engine's outputs."""
    llm = _llm(llama_dir)
    outputs = run(llm, prompts, GREEDY)
    # a prompt-only request leaves a partly filled block in the prefix cache, which the file must not hold
    llm.generate([prompts[0][:37]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    core = llm.engine.core
    path = tmp_path_factory.mktemp("kv") / "cache.kvcache"
    # least recently used first, as saved; full blocks only (a partly filled one holds stale slots past its key)
    order = [key for _, key, content in core.kv.pool.cached_blocks() if not is_partial(content)]
    result = kv_persist.save(core, path, _digest(llm, llama_dir))
    assert result.num_blocks == len(order) > 0 and len(core.kv.pool.cached) > len(order)
    assert result.size_bytes == path.stat().st_size
    assert path.stat().st_mode & 0o077 == 0  # it holds prompts: its owner's only
    result.keys = order
    return path, outputs, result


@pytest.fixture(scope="module")
def fresh(llama_dir):
    """One more engine on the same model, its cache emptied before each use."""
    return _llm(llama_dir)


def _empty(llm: LLM) -> LLM:
    llm.engine.core.kv.pool.reset_prefix_cache()
    return llm


def test_restore_gives_prefix_hits_and_the_same_outputs(saved, fresh, llama_dir, prompts):
    path, outputs, result = saved
    core = _empty(fresh).engine.core
    before = core.kv.prefix_hits
    loaded = kv_persist.load(core, path, _digest(fresh, llama_dir))
    assert loaded.num_blocks == result.num_blocks and loaded.num_skipped == 0
    assert run(fresh, prompts, GREEDY) == outputs
    # every prompt's full blocks come from the file (at least the shared prefix, for each prompt)
    assert core.kv.prefix_hits - before >= len(prompts) * 32
    again = kv_persist.load(core, path, _digest(fresh, llama_dir))  # all there already: nothing duplicated
    assert again.num_blocks == 0 and again.num_skipped == result.num_blocks


def _damaged(tmp_path, path, edit) -> object:
    data = bytearray(path.read_bytes())
    edit(data)
    out = tmp_path / "damaged.kvcache"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.__delitem__(slice(len(d) - 1000, None)), "truncated"),
    (lambda d: d.__delitem__(slice(len(d) - 10, None)), "truncated"),
    (lambda d: d.__setitem__(len(d) // 2, d[len(d) // 2] ^ 0x10), "checksum"),  # a flipped bit in a payload
    (lambda d: d.__setitem__(20, d[20] ^ 0x01), "header"),
    (lambda d: d.__setitem__(0, 0), "magic"),
])
def test_damaged_file_is_rejected_and_leaves_the_cache_as_it_was(saved, fresh, llama_dir, tmp_path, edit,
                                                                  message):
    path, _, _ = saved
    core = _empty(fresh).engine.core
    free_before = core.kv.pool.num_free
    with pytest.raises(KVFormatError, match=message):
        kv_persist.load(core, _damaged(tmp_path, path, edit), _digest(fresh, llama_dir))
    assert core.kv.pool.cached == {} and core.kv.pool.num_free == free_before


def test_forged_record_is_rejected(saved, fresh, llama_dir, tmp_path):
    """Tokens changed and the file checksum recomputed: the key no longer hashes its tokens."""
    path, _, _ = saved
    core = _empty(fresh).engine.core
    with open(path, "rb") as f:
        kv_persist.read_header(f)
        first = f.tell() + 32 + 4 + 32  # the first record's first token id (after key, length, parent key)

    def forge(d: bytearray) -> None:
        d[first] ^= 0x01
        d[-32:] = hashlib.sha256(bytes(d[:-32])).digest()

    with pytest.raises(KVFormatError, match="not the hash of its tokens"):
        kv_persist.load(core, _damaged(tmp_path, path, forge), _digest(fresh, llama_dir))
    assert core.kv.pool.cached == {}


def test_other_model_dtype_or_block_size_is_refused(saved, fresh, model_dirs, llama_dir, monkeypatch):
    path, _, _ = saved
    other = _llm(model_dirs["qwen3"])
    with pytest.raises(KVMismatchError, match="different model"):
        kv_persist.load(other.engine.core, path, _digest(other, model_dirs["qwen3"]))
    assert other.engine.core.kv.pool.cached == {}
    core = _empty(fresh).engine.core
    digest = _digest(fresh, llama_dir)
    with monkeypatch.context() as mp:  # the same engine as if it ran another block size, then another dtype
        mp.setattr(core.config.cache_config, "block_size", 8)
        with pytest.raises(KVMismatchError, match="different block size"):
            kv_persist.load(core, path, digest)
    with monkeypatch.context() as mp:
        mp.setattr(core.model, "dtype", torch.bfloat16)
        with pytest.raises(KVMismatchError, match="different dtype"):
            kv_persist.load(core, path, digest)
    assert core.kv.pool.cached == {}


def test_restore_into_a_busy_pool_keeps_the_most_recent_blocks(saved, fresh, llama_dir):
    path, _, result = saved
    pool = _empty(fresh).engine.core.kv.pool
    busy = [pool.take_plain() for _ in range(pool.num_free - 4)]  # as if requests held all but 4 blocks
    try:
        loaded = kv_persist.load(fresh.engine.core, path, _digest(fresh, llama_dir))
        assert loaded.num_blocks == 4 and loaded.num_skipped == result.num_blocks - 4
        assert pool.num_free == 4  # restored blocks stay free (evictable) for new requests
        assert sorted(pool.cached) == sorted(result.keys[-4:])
    finally:
        pool.return_plain(busy)


def test_start_restore_ignores_a_damaged_file_with_a_warning(saved, fresh, llama_dir, tmp_path, caplog):
    """--kv-cache-persist at start: a damaged file is a warning, never a failed start; the next save
    replaces it with a good one."""
    from servelm.worker.kv_store import KVStore

    path, _, result = saved
    core = _empty(fresh).engine.core
    store = KVStore(core, resolve_model(str(llama_dir)), str(tmp_path))
    target = kv_persist.default_file(tmp_path, store.digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x80
    target.write_bytes(bytes(data))
    store.restore_at_start()
    assert core.kv.pool.cached == {}
    assert "damaged" in caplog.text
    kv_persist.load(core, path, store.digest)  # now a good cache, saved at "shutdown" over the bad file
    store.save_at_shutdown()
    _empty(fresh)
    store.restore_at_start()
    assert len(core.kv.pool.cached) == result.num_blocks


def test_persist_needs_prefix_caching():
    from servelm.config.engine import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="kv_cache_persist"):
        EngineConfig(kv_cache_persist="/tmp/kv", enable_prefix_caching=False)
