"""The decode-graph path without a GPU: pure-decode steps padded to a captured batch size and run through
static buffers (what a CUDA graph replays) give the same tokens as the eager path and the oracle."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from tiny_models import random_prompts, reference, run

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the Triton kernel's definition

from servelm import LLM  # noqa: E402
from servelm.engine.cuda_graphs import capture_graphs, capture_sizes  # noqa: E402


class _Finalized:
    """A reference cycle whose finalizer records whether a capture was under way when it ran."""

    def __init__(self, log: list, capturing: dict) -> None:
        self.me, self.log, self.capturing = self, log, capturing

    def __del__(self) -> None:
        self.log.append(self.capturing["on"])


def test_no_garbage_is_collected_while_a_graph_is_captured(monkeypatch):
    """The collector's finalizers (an old engine's graphs, pinned buffers, events) must not run inside a
    capture, where their CUDA calls invalidate it or abort the process: garbage from before is collected first,
    garbage made during a capture waits until the captures end, and the collector is back on after."""
    capturing, finalized, seen = {"on": False}, [], []

    class FakeCapture:
        def __init__(self, graph, pool=None) -> None:
            pass

        def __enter__(self):
            capturing["on"] = True
            seen.append(gc.isenabled())

        def __exit__(self, *exc):
            capturing["on"] = False

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)

    def forward(size: int) -> torch.Tensor:
        _Finalized(finalized, capturing)  # garbage at once: only the cycle collector can free it
        junk = [[] for _ in range(5 * gc.get_threshold()[0])]  # enough allocations to trigger a collection
        del junk
        return torch.zeros(size, 3)

    _Finalized(finalized, capturing)  # garbage from before the captures
    assert gc.isenabled()
    graphs = capture_graphs([1, 2, 4], lambda size: None, forward)
    assert sorted(graphs) == [1, 2, 4] and seen == [False, False, False]
    assert gc.isenabled()
    gc.collect()
    assert finalized and not any(finalized)  # every finalizer ran, none inside a capture
    assert len(finalized) == 1 + 2 * 3  # the one from before and those of three warm-ups and three captures


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


def test_staged_inputs_reach_the_static_buffers_at_the_steps_width(model_dirs):
    """A step's rows are staged at the width of its longest block table and spread on the device into the
    graphs' [rows, max_blocks] table: each row's blocks where they were, padding rows as dummy decodes in the
    spare block, every column past the width the spare block (never a value left from an earlier, wider step)."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=256)
    runner = llm.engine.core.runner
    runner.enable_decode_graphs([2, 4], capture=False)
    graphs, spare = runner.graphs, runner.spare_block
    wide = np.arange(1, 1 + 4 * 9, dtype=np.int64).reshape(4, 9)  # an earlier step: 4 rows, 9 blocks each
    graphs._stage(*(np.arange(4, dtype=np.int64) + k for k in (10, 20, 30)), wide, np.full(4, 70), 4)
    tables = np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int64)  # then 3 rows at width 3
    ids, pos, slots, lens = (np.array([11, 12, 13]), np.array([17, 9, 3]), np.array([47, 72, 33]),
                             np.array([18, 10, 4]))
    graphs._stage(ids, pos, slots, np.vstack([tables, [[4, 0, 0]]]), lens, 4)
    got_ids, got_pos, meta = graphs._unstage(4)
    assert got_ids.tolist() == [11, 12, 13, 0] and got_pos.tolist() == [17, 9, 3, 0]
    assert meta.slot_mapping.tolist() == [47, 72, 33, spare * 8]
    assert meta.decode_seq_lens.tolist() == [18, 10, 4, 1]
    bt = meta.decode_block_tables
    assert bt.shape == (4, graphs.max_blocks)
    assert bt[:2, :3].tolist() == tables.tolist() and bt[2, 0] == 4
    assert bt[3, 0] == spare and bool((bt[:, 3:] == spare).all())
