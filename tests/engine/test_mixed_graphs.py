"""Steps with prompt chunks through the mixed-step graphs' padded static buffers (engine/mixed_graphs.py),
without capture: on the CPU the interpreted Triton backend over a CPU model, on a GPU the compiled one. Greedy
tokens equal transformers' through chunked prefill, prefix-cache hits and decodes beside prompt chunks; the
attention grid is the graph's fixed tile count whatever the step; steps the graphs do not take run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_spy import record_grids
from tiny_models import random_prompts, reference, run

from servelm import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_llm(model_dirs, monkeypatch):
    from servelm.model.attention import triton_paged
    from servelm.model.loading import loader

    if not triton_paged.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(loader, "get_backend", lambda device: triton_paged.TritonPagedAttention)

    def make(arch: str = "llama", **kw) -> LLM:
        return LLM(str(model_dirs[arch]), dtype="float32", device=DEVICE, enforce_eager=True, num_kv_blocks=96,
                   block_size=4, **kw)

    return make


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_steps_in_graph_buffers_match_transformers(arch, triton_llm, hf_models, monkeypatch):
    from servelm.model.attention import triton_paged

    grids = record_grids(monkeypatch, triton_paged, "_paged_attention_kernel")
    shared = random_prompts(1, 14, 14, seed=31)[0]
    prompts = [shared + p for p in random_prompts(3, 2, 9, seed=32)] + random_prompts(2, 20, 30, seed=33)
    llm = triton_llm(arch, max_num_batched_tokens=24, max_num_seqs=4)
    runner = llm.engine.core.runner
    runner.enable_mixed_graphs([8, 16, 24], max_rows=4, capture=False)
    graphs = runner.mixed
    assert run(llm, prompts) == reference(hf_models, arch, prompts)
    assert runner.num_mixed_graph_steps > 0 and llm.engine.get_stats().prefix_cache_hits > 0
    assert {g[0] for g in grids} >= {graphs.tiles[s] for s in (8, 24)}  # each step: its graph's fixed number of programs


def test_a_step_is_padded_to_its_graph_and_the_rest_of_the_vector_to_inert_values(triton_llm):
    """Tokens past the step's go to the spare block at position 0, rows past its rows have no queries and the
    spare block for a table, every tile past its tiles names the last row (never a step's), tables keep each
    row's blocks where they were (columns past the step's width: the spare block)."""
    llm = triton_llm()
    runner = llm.engine.core.runner
    runner.enable_mixed_graphs([16], max_rows=4, capture=False)
    g, spare, bs = runner.mixed, runner.spare_block, runner.block_size
    q_lens = np.array([1, 9])
    g._stage(np.array([5] * 10), np.arange(10), np.arange(100, 110), np.array([0, 1]), q_lens, np.array([7, 12]),
             np.array([0, 9]), np.array([[3, 4, 0], [6, 7, 8]]), 16)
    ids, positions, meta, logits_idx = g._unstage(16)
    assert ids.tolist() == [5] * 10 + [0] * 6 and positions.tolist() == list(range(10)) + [0] * 6
    assert meta.slot_mapping.tolist() == list(range(100, 110)) + [spare * bs] * 6
    rows = meta.derived
    assert rows.q_lens.tolist() == [1, 9, 0, 0, 0] and rows.ctx_lens.tolist() == [7, 12, 0, 0, 0]
    assert logits_idx.tolist() == [0, 9, 0, 0, 0]
    want_rows, want_ids = llm.engine.loaded.model.attn.mixed_tiles(q_lens)
    n = len(want_rows)
    assert rows.tile_rows.tolist() == list(want_rows) + [4] * (g.tiles[16] - n)
    assert rows.tile_ids.tolist()[:n] == list(want_ids)
    bt = rows.block_tables
    assert bt[0, :3].tolist() == [3, 4, 0] and bt[1, :3].tolist() == [6, 7, 8]
    assert (bt[:2, 3:] == spare).all() and (bt[2:] == spare).all()
    assert meta.max_query_len == 16 and meta.num_decodes == 0


def test_steps_the_graphs_do_not_take_run_eagerly(triton_llm, hf_models):
    """Larger than the largest graph, more rows than it has, prompt logprobs, n = 2: eager, same tokens."""
    llm = triton_llm(max_num_batched_tokens=64, max_num_seqs=8)
    runner = llm.engine.core.runner
    runner.enable_mixed_graphs([8], max_rows=2, capture=False)
    prompts = random_prompts(3, 20, 30, seed=34)
    assert run(llm, prompts) == reference(hf_models, "llama", prompts)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    before = runner.num_mixed_graph_steps
    llm.generate(random_prompts(1, 3, 3, seed=35), params, use_tqdm=False)
    assert runner.num_mixed_graph_steps == before  # the prompt's logprobs need every position's hidden state


def test_a_backend_that_cannot_is_refused(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="cannot run mixed steps in CUDA graphs"):
        llm.engine.core.runner.enable_mixed_graphs([16], max_rows=4, capture=False)
