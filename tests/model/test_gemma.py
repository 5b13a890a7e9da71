"""Gemma 2 and Gemma 3 (text): tiny random-weight models match transformers' greedy outputs token for token,
alone and batched with prefix caching and chunked prefill, across their sliding-window and global layers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tiny_models import COMMON, build_gemma, hf_greedy, random_prompts, run  # noqa: E402

from servelm import LLM  # noqa: E402

GEMMA = dict(COMMON, head_dim=16, num_hidden_layers=2, sliding_window=24, query_pre_attn_scalar=24,
             tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"])


def _config(arch: str):
    from transformers import Gemma2Config, Gemma3TextConfig

    if arch == "gemma2":  # soft-caps as Gemma 2 ships them (attention 50, logits 30)
        return Gemma2Config(**GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    return Gemma3TextConfig(**GEMMA, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tokenizer_dir):
    """{arch: (folder, transformers model)}; norm weights randomised (Gemma initialises them to zero, which
    would hide whether (1 + w) is applied)."""
    return {arch: build_gemma(_config(arch), tmp_path_factory.mktemp(arch), tokenizer_dir)
            for arch in ("gemma2", "gemma3")}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_matches_transformers(arch, gemma):
    from servelm import SamplingParams

    folder, hf = gemma[arch]
    # longer than the 24-token window, sharing a 32-token prefix, in 16-token prefill chunks
    shared = random_prompts(1, 32, 32, seed=21)[0]
    prompts = [shared + p[1:] for p in random_prompts(2, 5, 12, seed=22)] + random_prompts(1, 40, 40, seed=23)
    refs = [hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert run(llm, prompts[:1], params) == refs[:1]  # alone
    assert run(llm, prompts[1:], params) == refs[1:]  # batched, the shared prefix from the cache
    assert llm.engine.get_stats().prefix_cache_hits >= 32
    tapes = llm.engine.core.model.tapes
    assert tapes is None or not tapes.active  # the Python layer loop (README: Models)


def test_gemma3_local_layers_use_their_own_rope_base(gemma):
    from servelm.model.loading.metadata import load_config
    from servelm.model.loading.source import resolve_model
    from servelm.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config(load_config(resolve_model(str(gemma["gemma3"][0]))))
    assert spec.sliding_windows == [24, None] and spec.local_inv_freq is not None
    assert not torch.equal(spec.local_inv_freq, spec.inv_freq)
    assert spec.attn_softcap is None and spec.final_softcap is None and spec.embed_scale == 8.0


def test_gemma3_gguf_from_llama_cpp_converter(tmp_path_factory, tokenizer_dir, monkeypatch):
    """A tiny Gemma 3 converted by llama.cpp's own converter (norms stored as 1 + w, its fixed five-local-one-
    global pattern, local RoPE base 10000) runs as the folder it came from."""
    from llama_cpp import ConverterUnavailable, convert
    from transformers import Gemma3TextConfig

    from servelm import SamplingParams

    monkeypatch.setenv("SERVELM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    cfg = dict(GEMMA, num_hidden_layers=6, query_pre_attn_scalar=16)
    del cfg["layer_types"]  # transformers' default: five sliding-window layers, then a global one
    folder, hf = build_gemma(Gemma3TextConfig(**cfg), tmp_path_factory.mktemp("gemma3_6"), tokenizer_dir, seed=1)
    try:
        gguf = convert({"g": folder}, tmp_path_factory.mktemp("gguf"))["g"]
    except ConverterUnavailable as e:
        pytest.skip(str(e))
    prompts = random_prompts(2, 30, 40, seed=24)  # past the 24-token window
    llm = LLM(str(gguf), tokenizer=str(folder), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert run(llm, prompts, params) == [hf_greedy(hf, p, 8) for p in prompts]
