"""Attention backends: the C++ decode kernel against the PyTorch reference, and the engine on either."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import cpu_vendor, hf_greedy, random_prompts

from servelm import LLM, SamplingParams
from servelm.model.attention import AttentionMetadata, CpuPagedAttention, PrefillSpan, TorchPagedAttention
from servelm.model.attention.torch_paged import _window_mask
from servelm.model.kernels import cpu as cpu_kernels

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")
needs_prefill_kernel = pytest.mark.skipif(
    kernels is None or not kernels.prefill_attention_supported(torch.empty(1, 1, 64, dtype=torch.bfloat16)),
    reason="no AVX512-BF16 on this CPU")


def _naive(q, k, v, q_pos, window):
    """Plain softmax attention of queries at q_pos over keys 0..len(k)-1, with GQA by repetition."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * q.shape[-1] ** -0.5
    s = s.masked_fill(~_window_mask(q_pos, k.shape[0], window)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("backend", ["torch", "kernel"])
@pytest.mark.parametrize("d", [16, 64, 128])  # 64 and 128 take the kernel's AVX512-BF16 path in bf16
@pytest.mark.parametrize("hq, hkv", [(6, 2), (18, 1)])  # the kernel's P @ V takes groups 1-4 per pass
def test_decode_batch_matches_naive_attention(backend, window, dtype, tol, d, hq, hkv):
    if backend == "kernel" and kernels is None:
        pytest.skip("CPU kernels could not be compiled here")
    torch.manual_seed(0)
    bs, nb = 4, 80
    kc, vc = torch.randn(nb, bs, hkv, d).to(dtype), torch.randn(nb, bs, hkv, d).to(dtype)
    lens = torch.tensor([1, 5, 16, 30, 47])  # the kernel sums scores 16 positions at a time
    tables = torch.randperm(nb)[: 5 * 12].view(5, 12)
    q = torch.randn(5, hq, d).to(dtype)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), torch.arange(5), tables, lens, [], bs)
    be = (TorchPagedAttention(hq, hkv, d, d**-0.5) if backend == "torch"
          else CpuPagedAttention(hq, hkv, d, d**-0.5, kernels=kernels))
    out = be._decode(q, (kc, vc), meta, window)
    for b, n in enumerate(lens.tolist()):
        k = kc[tables[b]].reshape(-1, hkv, d)[:n]
        v = vc[tables[b]].reshape(-1, hkv, d)[:n]
        ref = _naive(q[b:b + 1], k, v, torch.tensor([n - 1]), window)[0]
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_kernel_matches_index_copy(dtype):
    torch.manual_seed(1)
    hq, hkv, d, bs, nb = 4, 2, 64, 16, 10
    qkv = torch.randn(37, (hq + 2 * hkv) * d).to(dtype)  # k and v as views into a fused projection
    k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    slots = torch.randperm(nb * bs)[:37]
    ref = (torch.randn(nb, bs, hkv, d).to(dtype), torch.randn(nb, bs, hkv, d).to(dtype))
    got = (ref[0].clone(), ref[1].clone())
    TorchPagedAttention.write_kv(k, v, ref, slots)
    CpuPagedAttention(hq, hkv, d, 1.0, kernels=kernels).write_kv(k, v, got, slots)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv(got[0], got[1], k[:1], v[:1], torch.tensor([nb * bs]))


def _paged(ctx_len, bs, hkv, d, seed):
    """A bf16 cache of random keys/values with the sequence's blocks scattered through it."""
    torch.manual_seed(seed)
    nb = -(-ctx_len // bs) + 5
    kc, vc = torch.randn(nb, bs, hkv, d).bfloat16(), torch.randn(nb, bs, hkv, d).bfloat16()
    table = torch.randperm(nb)[: -(-ctx_len // bs)]
    k, v = (c[table].reshape(-1, hkv, d)[:ctx_len] for c in (kc, vc))
    return (kc, vc), table, k, v


@needs_prefill_kernel
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("window", [None, 5, 40])
# (queries, context, block size): one token; partial tiles; a cached prefix; blocks that do not divide 16
@pytest.mark.parametrize("q_len, ctx_len, bs", [(1, 1, 16), (37, 37, 16), (100, 300, 16), (20, 77, 7), (64, 64, 3)])
def test_kernel_prefill_matches_naive_attention(d, window, q_len, ctx_len, bs, dot):
    hq, hkv = 6, 2
    cache, table, k, v = _paged(ctx_len, bs, hkv, d, seed=q_len + d)
    q = torch.randn(q_len, hq, d).bfloat16()
    span = PrefillSpan(0, q_len, ctx_len, table)
    be = CpuPagedAttention(hq, hkv, d, d**-0.5, kernels=kernels)
    assert be.kernel_prefill
    out = be._prefill(q, k[-q_len:], v[-q_len:], cache, span, bs, window)
    ref = _naive(q, k, v, torch.arange(ctx_len - q_len, ctx_len), window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # as close to the exact result as PyTorch's own bf16 attention
    sdpa = TorchPagedAttention(hq, hkv, d, d**-0.5)._prefill(q, k[-q_len:], v[-q_len:], cache, span, bs, window)
    assert (out.float() - ref).abs().mean() <= 1.25 * (sdpa.float() - ref).abs().mean() + 1e-4


@needs_prefill_kernel
# the kernel's work items group a kv head's query heads (up to six, more split) and, where fewer, several
# query blocks of each: one head per kv head, a group that splits, a group of one
@pytest.mark.parametrize("hq, hkv", [(4, 4), (16, 2), (7, 1)])
def test_kernel_prefill_matches_naive_attention_for_any_group_size(hq, hkv):
    d, q_len, ctx_len, bs = 64, 83, 211, 16
    cache, table, k, v = _paged(ctx_len, bs, hkv, d, seed=hq)
    q = torch.randn(q_len, hq, d).bfloat16()
    be = CpuPagedAttention(hq, hkv, d, d**-0.5, kernels=kernels)
    out = be._prefill(q, k[-q_len:], v[-q_len:], cache, PrefillSpan(0, q_len, ctx_len, table), bs, None)
    ref = _naive(q, k, v, torch.arange(ctx_len - q_len, ctx_len), None)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
def test_kernel_prefill_is_the_same_whatever_the_chunking_and_threads(dot):
    """Each query's result depends only on its own keys: chunked prefill over a cached prefix, any thread
    count, and interleaving with oneDNN's and PyTorch's own AMX kernels all give the same bits."""
    hq, hkv, d, n, bs = 8, 2, 64, 203, 16
    cache, table, k, v = _paged(n, bs, hkv, d, seed=5)
    q = torch.randn(n, hq, d).bfloat16()
    be = CpuPagedAttention(hq, hkv, d, d**-0.5, kernels=kernels)
    whole = be._prefill(q, k, v, cache, PrefillSpan(0, n, n, table), bs, None)
    parts = [be._prefill(q[a:b], k[a:b], v[a:b], cache, PrefillSpan(0, b - a, b, table), bs, None)
             for a, b in [(0, 37), (37, 38), (38, 150), (150, n)]]
    assert torch.equal(torch.cat(parts), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(be._prefill(q, k, v, cache, PrefillSpan(0, n, n, table), bs, None), whole)
    finally:
        torch.set_num_threads(threads)
    # other AMX users before and after (they set their own tile configuration; so do we)
    x, w = torch.randn(64, 512).bfloat16(), torch.randn(256, 512).bfloat16()
    qs, ks = torch.randn(1, 4, 300, 64).bfloat16(), torch.randn(1, 4, 300, 64).bfloat16()
    lin, att = F.linear(x, w), F.scaled_dot_product_attention(qs, ks, ks, is_causal=True)
    assert torch.equal(be._prefill(q, k, v, cache, PrefillSpan(0, n, n, table), bs, None), whole)
    assert torch.equal(F.linear(x, w), lin)
    assert torch.equal(F.scaled_dot_product_attention(qs, ks, ks, is_causal=True), att)
    if cpu_vendor() == "GenuineIntel" and not kernels.amx_linear_supported(64):
        # the float-FMA form adds each pair's odd product first, as Intel's dot-product instruction does
        kernels.set_bf16_dot("bf16" if dot == "fma" else "fma")
        assert torch.equal(be._prefill(q, k, v, cache, PrefillSpan(0, n, n, table), bs, None), whole)


@needs_prefill_kernel
def test_kernel_prefill_refuses_bad_block_tables():
    cache, table, k, v = _paged(40, 16, 2, 64, seed=3)
    q, out = torch.randn(40, 4, 64).bfloat16(), torch.empty(40, 4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.paged_prefill_attention(out, q, *cache, torch.tensor([0, 1, 999]), 40, 0.125, 0)
    with pytest.raises(RuntimeError, match="cover"):
        kernels.paged_prefill_attention(out, q, *cache, table[:1], 40, 0.125, 0)


def test_engine_without_kernels_matches_transformers(monkeypatch, model_dirs, hf_models):
    monkeypatch.setenv("SERVELM_CPU_KERNELS", "0")
    llm = LLM(str(model_dirs["mistral"]), dtype="float32", num_kv_blocks=128)
    layer_backend = llm.engine.core.model.attn
    assert type(layer_backend) is TorchPagedAttention
    prompts = random_prompts(5, 10, 40, seed=30)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models["mistral"], p, 16)


@needs_kernels
def test_engine_uses_kernels_by_default(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=16)
    assert isinstance(llm.engine.core.model.attn, CpuPagedAttention)

