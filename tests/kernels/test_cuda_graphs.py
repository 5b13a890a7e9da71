"""The decode-graph path without a GPU: pure-decode steps padded to a captured batch size and run through
static buffers (what a CUDA graph replays) give the same tokens as the eager path and the oracle."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import random_prompts, reference, run

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the Triton kernel's definition

from servelm import LLM  # noqa: E402
from servelm.engine.cuda_graphs import capture_sizes  # noqa: E402


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(5) == [1, 2, 4, 5]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert capture_sizes(1000)[-1] == 256  # larger decode batches run eagerly


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_static_padded_decode_matches_transformers(arch, model_dirs, hf_models):
    """Six sequences: with sizes up to 8 their decode steps pad to 8; with sizes up to 4 they run eagerly."""
    prompts = random_prompts(6, 3, 60, seed=11)
    llm = LLM(str(model_dirs[arch]), dtype="float32", num_kv_blocks=128, block_size=8)
    runner = llm.engine.core.runner
    runner.enable_decode_graphs([1, 2, 4, 8], capture=False)
    assert run(llm, prompts) == reference(hf_models, arch, prompts)
    steps = runner.num_graph_steps
    assert steps > 0
    runner.enable_decode_graphs([1, 2, 4], capture=False)
    assert run(llm, prompts) == reference(hf_models, arch, prompts)
    assert runner.num_graph_steps == steps  # too many decodes for the largest size: the eager path
    assert llm.engine.get_stats().num_free_blocks == 128  # the spare block is not the pool's


def test_static_padded_decode_on_the_triton_backend(model_dirs, hf_models, monkeypatch):
    """The GPU path's attention reading the graphs' padded buffers and derived rows, without capture: on a
    GPU the compiled kernel over a model on the GPU (eager, so that the runner captures nothing of its own),
    on the CPU the interpreted kernel over a CPU model."""
    from servelm.model.attention import triton_paged
    from servelm.model.loading import loader

    if not triton_paged.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(loader, "get_backend", lambda device: triton_paged.TritonPagedAttention)
    prompts = random_prompts(3, 10, 40, seed=12)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device=device, enforce_eager=True, num_kv_blocks=64,
              block_size=16)
    runner = llm.engine.core.runner
    assert runner.graphs is None and isinstance(llm.engine.loaded.model.attn, triton_paged.TritonPagedAttention)
    runner.enable_decode_graphs([2, 4], capture=False)
    assert run(llm, prompts) == reference(hf_models, "llama", prompts)
    assert runner.num_graph_steps > 0
