"""The paged decode attention kernel on every build this CPU runs (AVX512-BF16's kernel for bf16, the 8-lane
vector kernel for float32 and for bf16 elsewhere, in AVX2 registers or, on the portable build, in pairs of SSE
registers, and the generic loop for head sizes that are not a multiple of 8): each matches plain softmax
attention, and a query's output is the same bits alone, in any batch and on any thread count, so a token's
bits never depend on what it was scheduled with. The rows of a prompt chunk (one sequence's block table, walked
together in blocks of positions) get the bits each gets alone. Head sizes and query groups cover the vector kernel's
register tiles of P @ V (up to 3 groups by up to 8 chunks of 8 dimensions, more in several passes). The ARM
build runs the same cases under an emulator: test_arm_kernels.py."""

from __future__ import annotations

import pytest
import torch
from decode_attention_cases import LENS, SHAPES, case, chunk_case, naive
from kernel_variants import runnable_variants

from servelm.model.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels could not be compiled here")


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 10])
@pytest.mark.parametrize("d, hq, hkv", SHAPES)
def test_the_decode_kernel_matches_softmax_attention(variant, dtype, tol, window, d, hq, hkv):
    kern = cpu_kernels.load_variant(variant)
    q, kc, vc, tables, lens, bs = case(dtype, d, hq, hkv, seed=d + hq)
    out = torch.empty_like(q)
    kern.paged_decode_attention(out, q, kc, vc, tables, lens, d**-0.5, window)
    for b, n in enumerate(LENS):
        ref = naive(q[b], kc, vc, tables[b], n, bs, window)
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol, msg=lambda m, b=b: f"row {b}: {m}")


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(variant, dtype):
    kern = cpu_kernels.load_variant(variant)
    d, hq, hkv = 64, 6, 2
    q, kc, vc, tables, lens, bs = case(dtype, d, hq, hkv, seed=3)
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


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("d, hq, hkv", [(64, 6, 2), (40, 3, 1), (128, 4, 2), (8, 5, 1)])
def test_a_prompt_chunks_rows_get_the_bits_each_gets_alone(variant, dtype, tol, window, d, hq, hkv):
    """A prompt chunk's rows share a block table, and the kernel walks them together; every row's output is the
    bits it gets alone, in the chunk beside another sequence's rows, in another order, and matches softmax
    attention."""
    kern = cpu_kernels.load_variant(variant)
    q, kc, vc, tables, lens, bs = chunk_case(dtype, d, hq, hkv, seed=d + hq)
    out = torch.empty_like(q)
    kern.paged_decode_attention(out, q, kc, vc, tables, lens, d**-0.5, window)
    for i in range(q.shape[0]):
        alone = torch.empty_like(q[i:i + 1])
        kern.paged_decode_attention(alone, q[i:i + 1].contiguous(), kc, vc, tables[i:i + 1].contiguous(),
                                    lens[i:i + 1].contiguous(), d**-0.5, window)
        assert torch.equal(out[i], alone[0]), i
        ref = naive(q[i], kc, vc, tables[i], int(lens[i]), bs, window)
        torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol, msg=lambda m, i=i: f"row {i}: {m}")
    # the chunk's rows out of order, with a row of another sequence (another table) between them
    other = torch.randperm(kc.shape[0], generator=torch.Generator().manual_seed(1))[: tables.shape[1]]
    order = torch.tensor([3, 17, 4, 5, 0, 18, 2, 9, 8, 7, 6, 1])
    mixed_q = torch.cat([q[order[:6]], q[:1], q[order[6:]]])
    mixed_tables = torch.cat([tables[order[:6]], other[None], tables[order[6:]]])
    mixed_lens = torch.cat([lens[order[:6]], torch.tensor([33]), lens[order[6:]]])
    mixed = torch.empty_like(mixed_q)
    kern.paged_decode_attention(mixed, mixed_q.contiguous(), kc, vc, mixed_tables.contiguous(), mixed_lens.contiguous(),
                                d**-0.5, window)
    assert torch.equal(torch.cat([mixed[:6], mixed[7:]]), out[order])
