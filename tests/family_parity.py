"""Shared by the per-family parity tests (tests/test_phi3.py, tests/test_moe.py): build a tiny random-weight model
from a transformers config, and check servelm's greedy tokens against transformers' on a scheduling mix."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import hf_greedy, random_prompts, run

from servelm import LLM, SamplingParams

GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def save_tiny(config, out: Path, tokenizer_dir: Path, seed: int = 0, **save_kwargs) -> Path:
    """A random-weight model of `config` saved with the SmolLM2 tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, **save_kwargs)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def mixed_prompts() -> list[list[int]]:
    """A 32-token shared prefix with two short tails, then a 40-token prompt (past a 24-token window)."""
    shared = random_prompts(1, 32, 32, seed=21)[0]
    return [shared + p[1:] for p in random_prompts(2, 5, 12, seed=22)] + random_prompts(1, 40, 40, seed=23)


_refs: dict = {}


def references(folder: Path, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy 8 tokens for each prompt, its model loaded in `dtype` (computed once per folder)."""
    key = (str(folder), dtype, tuple(map(tuple, prompts)))
    if key not in _refs:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        _refs[key] = [hf_greedy(hf, p, 8) for p in prompts]
    return _refs[key]


def check_parity(folder: Path, dtype: str, **llm_kwargs) -> LLM:
    """The first prompt alone, then the rest batched (the shared prefix from the cache) in 16-token prefill
    chunks: every token as transformers'. Returns the LLM for further checks."""
    prompts = mixed_prompts()
    refs = references(folder, dtype, prompts)
    llm = LLM(str(folder), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=16, **llm_kwargs)
    assert run(llm, prompts[:1], GREEDY8) == refs[:1]  # alone
    assert run(llm, prompts[1:], GREEDY8) == refs[1:]  # batched, chunked, the shared prefix from the cache
    assert llm.engine.get_stats().prefix_cache_hits >= 32
    return llm
