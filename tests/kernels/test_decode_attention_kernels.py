"""The paged decode attention kernel on every build this CPU runs (AVX512-BF16's kernel, the AVX2 one for
float32 and bf16 caches, the generic loop of the portable build): each matches plain softmax attention, and
a query's output is the same bits alone, in any batch and on any thread count, so a token's bits never
depend on what it was scheduled with. Head sizes and query groups cover the AVX2 kernel's register tiles
of P @ V (up to 3 groups by up to 8 chunks of 8 dimensions, more in several passes) and the generic loop's
head sizes that are not a multiple of 8."""

from __future__ import annotations

import pytest
import torch
from kernel_variants import runnable_variants

from servelm.model.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels could not be compiled here")
LENS = [1, 7, 8, 9, 16, 31, 64, 77]  # 8 and 16 positions per score pass; blocks of 4; contexts ending inside


def _case(dtype, d, hq, hkv, seed=0, bs=4):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-max(LENS) // bs)
    nb = blocks * len(LENS) + 3
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: len(LENS) * blocks].view(len(LENS), blocks).contiguous()
    q = torch.randn(len(LENS), hq, d, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(LENS), bs


def _naive(q, kc, vc, table, n, bs, window):
    hq, d = q.shape
    k = kc[table].reshape(-1, *kc.shape[2:])[:n].float()
    v = vc[table].reshape(-1, *vc.shape[2:])[:n].float()
    start = max(0, n - window) if window else 0
    k, v = k[start:].repeat_interleave(hq // k.shape[1], 1), v[start:].repeat_interleave(hq // v.shape[1], 1)
    s = torch.einsum("hd,khd->hk", q.float(), k) * d**-0.5
    return torch.einsum("hk,khd->hd", s.softmax(-1), v)


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 10])
# head sizes: 1, 5, 8, 16 and 32 chunks of 8 (one, a partial and several passes), and 12 (the generic loop);
# groups of 1, 2, 3 and 5 query heads per kv head (one pass of up to 3 groups, or 3 then 2)
@pytest.mark.parametrize("d, hq, hkv", [(8, 2, 1), (40, 6, 2), (64, 5, 1), (128, 4, 2), (256, 2, 2), (12, 3, 1)])
def test_the_decode_kernel_matches_softmax_attention(variant, dtype, tol, window, d, hq, hkv):
    kern = cpu_kernels.load_variant(variant)
    q, kc, vc, tables, lens, bs = _case(dtype, d, hq, hkv, seed=d + hq)
    out = torch.empty_like(q)
    kern.paged_decode_attention(out, q, kc, vc, tables, lens, d**-0.5, window)
    for b, n in enumerate(LENS):
        ref = _naive(q[b], kc, vc, tables[b], n, bs, window)
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol, msg=lambda m, b=b: f"row {b}: {m}")


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(variant, dtype):
    kern = cpu_kernels.load_variant(variant)
    d, hq, hkv = 64, 6, 2
    q, kc, vc, tables, lens, bs = _case(dtype, d, hq, hkv, seed=3)
    whole = torch.empty_like(q)
    kern.paged_decode_attention(whole, q, kc, vc, tables, lens, d**-0.5, 0)
    for b in range(len(LENS)):
        alone = torch.empty_like(q[b:b + 1])
        kern.paged_decode_attention(alone, q[b:b + 1].contiguous(), kc, vc, tables[b:b + 1].contiguous(),
                                    lens[b:b + 1].contiguous(), d**-0.5, 0)
        assert torch.equal(alone[0], whole[b]), b
    order = torch.tensor([5, 0, 7, 2])  # other neighbours, in another order
    part = torch.empty_like(q[order])
    kern.paged_decode_attention(part, q[order].contiguous(), kc, vc, tables[order].contiguous(), lens[order].contiguous(),
                                d**-0.5, 0)
    assert torch.equal(part, whole[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = torch.empty_like(q)
        kern.paged_decode_attention(other, q, kc, vc, tables, lens, d**-0.5, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(other, whole)
