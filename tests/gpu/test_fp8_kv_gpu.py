"""The fp8 KV cache on a GPU: the compiled Triton kernels (single-pass and split-KV, in a captured CUDA graph)
against the PyTorch backend over the same fp8 cache, and the engine with kv_cache_dtype=fp8 under CUDA graphs:
the same tokens as eagerly, first-step logits close to the float cache's, twice the blocks of bfloat16 for the
same memory. Skipped without a CUDA device of compute capability 8.9 or newer (CI runs the kernels under Triton's
interpreter: tests/kernels/test_triton_fp8_kv.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts, run

from servelm import LLM, SamplingParams
from servelm.model.attention import AttentionMetadata, PrefillSpan, TorchPagedAttention
from servelm.model.attention.kv_quant import FP8, KVCache, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA device of compute capability 8.9 or newer")


def _fp8_cache(nb: int, bs: int, hkv: int, d: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    return KVCache(quantize(kc * 4, 0.5), quantize(vc, 1.5), 0.5, 1.5)


def _cuda(cache: KVCache) -> KVCache:
    return KVCache(cache[0].cuda(), cache[1].cuda(), cache.k_scale, cache.v_scale)


@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("window", [None, 40])
def test_compiled_kernels_over_an_fp8_cache_match_the_reference(window, splits):
    """bf16 queries over an fp8 cache: decodes, a chunk after a cached prefix, a fresh prompt; head size 128."""
    from servelm.model.attention import triton_paged

    hq, hkv, d, bs, nb = 8, 2, 128, 16, 64
    cache = _fp8_cache(nb, bs, hkv, d, 0)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1))
    # every sequence its own blocks: 19 for each decode (300 positions), 6 for the 90-token context, 1 more
    dec_lens, tables = torch.tensor([1, 100, 300]), perm[:57].view(3, 19)
    spans = [PrefillSpan(3, 40, 90, perm[57:63]), PrefillSpan(43, 5, 5, perm[63:])]
    slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(dec_lens.tolist())]
    for s in spans:
        slots += [int(s.block_table[p // bs]) * bs + p % bs for p in range(s.ctx_len - s.q_len, s.ctx_len)]
    meta = AttentionMetadata(torch.tensor(slots), torch.arange(3), tables, dec_lens, spans, bs)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(48, h, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    ref_cache = KVCache(cache[0].clone(), cache[1].clone(), cache.k_scale, cache.v_scale)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, ref_cache, meta, window)
    dev = _cuda(cache)
    m = meta.to("cuda")
    m = AttentionMetadata(m.slot_mapping, m.decode_idx, m.decode_block_tables, m.decode_seq_lens,
                          [PrefillSpan(s.start, s.q_len, s.ctx_len, s.block_table.cuda()) for s in spans], bs)
    attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, split_kv=splits is not None, num_splits=splits)
    out = attn.forward(q.cuda(), k.cuda(), v.cuda(), dev, m, window)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(dev[0].cpu().view(torch.uint8), ref_cache[0].view(torch.uint8))


def test_split_kv_over_an_fp8_cache_replays_in_a_cuda_graph():
    from servelm.model.attention import triton_paged

    hq, hkv, d, bs = 8, 2, 64, 16
    cache = _fp8_cache(64, bs, hkv, d, 3)
    tables = torch.randperm(64, generator=torch.Generator().manual_seed(4))[:60].view(3, 20)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.arange(3), tables, torch.tensor([300] * 3), [], bs)
    q = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, num_splits=8)
    dev, q_d = _cuda(cache), q.cuda()
    static = meta.to("cuda")
    static.derived = attn.derive(meta).to("cuda")
    attn.attend(q_d, dev, static, None)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.attend(q_d, dev, static, None)
    for lens in ([300, 300, 300], [1, 129, 33]):
        step = AttentionMetadata(meta.slot_mapping, meta.decode_idx, tables, torch.tensor(lens), [], bs)
        for dst, src in zip(static.derived, attn.derive(step), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref = TorchPagedAttention(hq, hkv, d, d**-0.5)._decode(q, cache, step, None)
        torch.testing.assert_close(out.cpu().float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_engine_with_an_fp8_cache_under_cuda_graphs(model_dirs):
    """Graph replays and eager steps over the fp8 cache give the same greedy tokens (prefix hits and chunked
    prefill included), graphs really replayed; bfloat16 fp8 blocks are half the bytes: twice the blocks."""
    shared = random_prompts(1, 40, 40, seed=3)[0]
    prompts = [shared + own for own in random_prompts(6, 5, 20, seed=4)] + random_prompts(4, 3, 60, seed=5)
    kw = dict(dtype="float32", device="cuda", num_kv_blocks=256, max_num_batched_tokens=32, kv_cache_dtype="fp8")
    graphs = LLM(str(model_dirs["llama"]), **kw)
    assert graphs.engine.core.runner.kv_caches[0][0].dtype == FP8
    got = run(graphs, prompts)
    assert graphs.engine.core.runner.num_graph_steps > 0
    assert graphs.engine.get_stats().prefix_cache_hits > 0
    del graphs
    torch.cuda.empty_cache()
    assert run(LLM(str(model_dirs["llama"]), enforce_eager=True, **kw), prompts) == got
    torch.cuda.empty_cache()
    sized = dict(dtype="bfloat16", device="cuda", kv_cache_memory_gb=0.0625, enforce_eager=True)
    auto = LLM(str(model_dirs["llama"]), **sized).engine.core.kv_plan.num_blocks
    torch.cuda.empty_cache()
    fp8 = LLM(str(model_dirs["llama"]), kv_cache_dtype="fp8", **sized)
    assert fp8.engine.core.kv_plan.num_blocks == 2 * auto
    out = fp8.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
