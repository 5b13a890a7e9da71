"""Paged decode attention inputs and the softmax attention they must match, shared by the tests of every
build's decode kernel (this CPU's builds, and the ARM build under an emulator)."""

from __future__ import annotations

import torch

LENS = [1, 7, 8, 9, 16, 31, 64, 77]  # 8 and 16 positions per score pass; blocks of 4; contexts ending inside

# head sizes: 1, 5, 8, 16 and 32 chunks of 8 (one, a partial and several register passes), and 12 (the generic
# loop); groups of 1, 2, 3 and 5 query heads per kv head (one pass of up to 3 groups, or 3 then 2)
SHAPES = [(8, 2, 1), (40, 6, 2), (64, 5, 1), (128, 4, 2), (256, 2, 2), (12, 3, 1)]


def case(dtype, d, hq, hkv, seed=0, bs=4):
    """q [len(LENS), hq, d], caches [blocks, bs, hkv, d] in dtype, shuffled block tables and LENS."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-max(LENS) // bs)
    nb = blocks * len(LENS) + 3
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: len(LENS) * blocks].view(len(LENS), blocks).contiguous()
    q = torch.randn(len(LENS), hq, d, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(LENS), bs


def naive(q, kc, vc, table, n, bs, window):
    """Softmax attention of one sequence's queries [hq, d] over its first n cached positions, in float32."""
    hq, d = q.shape
    k = kc[table].reshape(-1, *kc.shape[2:])[:n].float()
    v = vc[table].reshape(-1, *vc.shape[2:])[:n].float()
    start = max(0, n - window) if window else 0
    k, v = k[start:].repeat_interleave(hq // k.shape[1], 1), v[start:].repeat_interleave(hq // v.shape[1], 1)
    s = torch.einsum("hd,khd->hk", q.float(), k) * d**-0.5
    return torch.einsum("hk,khd->hd", s.softmax(-1), v)


def chunk_case(dtype, d, hq, hkv, seed=0, bs=16, ctx=200, q_len=37):
    """A prompt chunk as the CPU backend hands it to the decode kernel: q_len queries of one sequence at the
    last positions of a ctx-token context, each its own row with the sequence's block table and its context
    up to and including itself (a group of 32 rows and a remainder; contexts over several 64-position blocks)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-ctx // bs)
    nb = blocks + 7
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:blocks]
    tables = table[None].expand(q_len, -1).contiguous()
    lens = torch.arange(ctx - q_len + 1, ctx + 1, dtype=torch.int64)
    q = torch.randn(q_len, hq, d, generator=g).to(dtype)
    return q, kc, vc, tables, lens, bs
