"""The Triton paged-attention kernels against the PyTorch reference, run by Triton's CPU interpreter.

A mixed step (decodes, a prompt chunk after a cached prefix, a fresh prompt) with GQA, with and without a
sliding window, on the single-pass kernel and with the decodes split over the context (split-KV); decode
batches whose contexts end inside, at and past the splits' boundaries; on a GPU machine the same tests run the
compiled kernels (see BENCHMARKS.md), and a captured CUDA graph of the split-KV path is replayed. Inputs are drawn
on the host and the reference computed there; the kernel gets every tensor, the step's metadata included,
on DEVICE (the GPU where there is one, else the CPU under the interpreter), and the engine tests run the
model on DEVICE.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_spy import record_grids

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's definition

from servelm.model.attention import (  # noqa: E402
    AttentionMetadata,
    PrefillSpan,
    TorchPagedAttention,
    triton_paged,  # noqa: E402
)

pytestmark = pytest.mark.skipif(not triton_paged.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(hkv: int, d: int, bs: int, nb: int, dtype):
    """A random KV cache and a batch: 3 decodes, a 20-token chunk after a 27-token prefix, a 9-token prompt."""
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    dec_lens = torch.tensor([1, 17, 40])
    dec_tables = perm[:15].view(3, 5)
    spans = [PrefillSpan(3, 20, 47, perm[15:21]), PrefillSpan(23, 9, 9, perm[21:23])]
    t = 32
    slots = []
    for i, n in enumerate(dec_lens.tolist()):
        slots.append(int(dec_tables[i, (n - 1) // bs]) * bs + (n - 1) % bs)
    for s in spans:
        for p in range(s.ctx_len - s.q_len, s.ctx_len):
            slots.append(int(s.block_table[p // bs]) * bs + p % bs)
    meta = AttentionMetadata(torch.tensor(slots), torch.arange(3), dec_tables, dec_lens, spans, bs)
    return kc, vc, meta, t


def _on_device(meta: AttentionMetadata) -> AttentionMetadata:
    """The step's metadata with every tensor on DEVICE, the prefills' block tables included."""
    m = meta.to(DEVICE)
    spans = [PrefillSpan(s.start, s.q_len, s.ctx_len, s.block_table.to(DEVICE)) for s in meta.prefills]
    return AttentionMetadata(m.slot_mapping, m.decode_idx, m.decode_block_tables, m.decode_seq_lens, spans,
                             m.block_size)


def _triton(hq: int, hkv: int, d: int, q, k, v, kc, vc, meta, window, splits: int | None = None):
    """The kernel on DEVICE: (output on the host, the key and value caches it wrote, on the host). `splits`:
    the decodes in that many splits; None: every row on the single-pass kernel."""
    kc2, vc2 = kc.to(DEVICE), vc.to(DEVICE)
    attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, split_kv=splits is not None, num_splits=splits)
    out = attn.forward(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), (kc2, vc2), _on_device(meta), window)
    assert out.device.type == torch.device(DEVICE).type
    return out.cpu(), kc2.cpu(), vc2.cpu()


# numpy, under the interpreter, has no bfloat16: it is checked where the kernel really compiles (a GPU)
HALF = [(torch.bfloat16, 3e-2)] if torch.cuda.is_available() else []


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 5e-3), *HALF])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_matches_torch_reference(window, dtype, tol, splits):
    hq, hkv, d, bs, nb = 4, 2, 16, 8, 24
    kc, vc, meta, t = _step(hkv, d, bs, nb, dtype)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, (kc.clone(), vc.clone()), meta, window)
    out, kc2, vc2 = _triton(hq, hkv, d, q, k, v, kc, vc, meta, window, splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
    ref_v.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
    torch.testing.assert_close(kc2, ref_k)  # the new keys and values were written where the slots say
    torch.testing.assert_close(vc2, ref_v)


@pytest.mark.parametrize("splits", [None, 2])
def test_head_dim_not_a_power_of_two(splits):
    hq, hkv, d, bs, nb = 2, 1, 24, 8, 24
    kc, vc, meta, t = _step(hkv, d, bs, nb, torch.float32)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, (kc.clone(), vc.clone()), meta, None)
    out, _, _ = _triton(hq, hkv, d, q, k, v, kc, vc, meta, None, splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_on_the_triton_backend_matches_transformers(arch, model_dirs, hf_models, monkeypatch):
    """The whole engine on the Triton backend (the GPU path's attention: compiled on a GPU, interpreted on
    the CPU): batching, a shared prefix from the prefix cache, chunked prefill and, for Mistral, a sliding
    window. The model runs on DEVICE: the compiled kernel cannot read a CPU model's tensors."""
    from tiny_models import hf_greedy, random_prompts

    from servelm import LLM, SamplingParams
    from servelm.model.loading import loader

    monkeypatch.setattr(loader, "get_backend", lambda device: triton_paged.TritonPagedAttention)
    llm = LLM(str(model_dirs[arch]), dtype="float32", device=DEVICE, num_kv_blocks=128, max_num_batched_tokens=24)
    assert isinstance(llm.engine.loaded.model.attn, triton_paged.TritonPagedAttention)
    shared = random_prompts(1, 20, 20, seed=7)[0]
    prompts = [shared + own for own in random_prompts(4, 3, 15, seed=8)] + random_prompts(2, 30, 40, seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 6)
    assert llm.engine.get_stats().prefix_cache_hits > 0  # the shared prefix came from the cache


@pytest.mark.parametrize("splits", [None, 2])
@pytest.mark.parametrize("hq, hkv", [(3, 1), (8, 2)])
@pytest.mark.parametrize("bs", [4, 32])
def test_query_groups_and_block_sizes(hq, hkv, bs, splits):
    """Query heads packed per KV head (groups of 3 straddle the 16-row tiles) over caches whose block
    size is smaller or larger than the kernel's 32-position KV tile."""
    d, nb = 16, 64
    kc, vc, meta, t = _step(hkv, d, 8, nb, torch.float32)
    # the same logical step re-laid out at block size bs: token p of a sequence in block p // bs
    def relayout(n_ctx: int, first: int) -> torch.Tensor:
        return torch.arange(first, first + (n_ctx + bs - 1) // bs)
    dec_lens = meta.decode_seq_lens
    per = (64 + bs - 1) // bs
    tables = torch.stack([relayout(64, r * per) for r in range(3)])
    spans = [type(meta.prefills[0])(s.start, s.q_len, s.ctx_len, relayout(s.ctx_len, (3 + i) * per))
             for i, s in enumerate(meta.prefills)]
    g = torch.Generator().manual_seed(2)
    nblocks = 5 * per
    kc = torch.randn(nblocks, bs, hkv, d, generator=g)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g)
    slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(dec_lens.tolist())]
    for s in spans:
        slots += [int(s.block_table[p // bs]) * bs + p % bs for p in range(s.ctx_len - s.q_len, s.ctx_len)]
    meta = AttentionMetadata(torch.tensor(slots), torch.arange(3), tables, dec_lens, spans, bs)
    q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, (kc.clone(), vc.clone()), meta, None)
    out, _, _ = _triton(hq, hkv, d, q, k, v, kc, vc, meta, None, splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# Decode contexts against 4 splits of 32-position tiles: one position; shorter than one split; exactly one
# split; one past it; exactly four (each split ends on a boundary); one past four (a share of two tiles, the
# third split holds one position and the fourth none); long (two tiles a split, the last one partial).
DECODE_LENS = [1, 20, 32, 33, 128, 129, 200]


def _decode_batch(hkv: int, d: int, bs: int, lens: list[int], dtype, width: int | None = None):
    """A pure decode step over a random cache: each row's blocks scattered, tables `width` blocks wide (the
    longest context's by default; wider, as a captured graph's are, padded with block 0)."""
    g = torch.Generator().manual_seed(3)
    per = -(-max(lens) // bs)
    width = width or per
    nb = len(lens) * per + 1
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    tables[:, :per] = torch.randperm(nb, generator=g)[: len(lens) * per].view(len(lens), per)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.arange(len(lens)), tables,
                             torch.tensor(lens), [], bs)
    return kc, vc, meta


def _decode_reference(hq, hkv, d, q, kc, vc, meta, window):
    return TorchPagedAttention(hq, hkv, d, d**-0.5)._decode(q, (kc, vc), meta, window)


def _split_attend(hq, hkv, d, q, kc, vc, meta, window, **kw):
    attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, **kw)
    return attn.attend(q.to(DEVICE), (kc.to(DEVICE), vc.to(DEVICE)), _on_device(meta), window).cpu()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 5e-3), *HALF])
@pytest.mark.parametrize("window", [None, 7, 50])
@pytest.mark.parametrize("splits", [4, 7])
def test_split_kv_decode_matches_torch_reference(splits, window, dtype, tol):
    """Every context length of DECODE_LENS, split 4 ways (shares of whole tiles) and 7 (not a power of two:
    the merge reads a masked tile of splits), whole, and within windows shorter than a tile and longer than
    one split."""
    hq, hkv, d, bs = 2, 1, 16, 8
    kc, vc, meta = _decode_batch(hkv, d, bs, DECODE_LENS, dtype)
    q = torch.randn(len(DECODE_LENS), hq, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = _decode_reference(hq, hkv, d, q, kc, vc, meta, window)
    out = _split_attend(hq, hkv, d, q, kc, vc, meta, window, num_splits=splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("hq, hkv", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("bs", [4, 64])
def test_split_kv_query_groups_and_block_sizes(hq, hkv, bs):
    """Groups of 1, 3 and 8 query heads per KV head (a KV head's heads padded to the 16-row tile), over
    blocks smaller and larger than the 32-position KV tile; tables twice as wide as the longest context, as
    a captured graph's are."""
    d = 32
    lens = [1, 33, 129, 200]
    kc, vc, meta = _decode_batch(hkv, d, bs, lens, torch.float32, width=2 * -(-200 // bs))
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(5))
    ref = _decode_reference(hq, hkv, d, q, kc, vc, meta, None)
    out = _split_attend(hq, hkv, d, q, kc, vc, meta, None, num_splits=4)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_the_default_split_count_follows_the_batch_not_the_contexts():
    """Small batches split (enough programs to fill the device), large ones run the single-pass kernel, and
    the count is bounded by MAX_SPLITS and by the tables' width in tiles; contexts play no part, so a
    captured graph's count holds for every replay. With split_kv=False nothing splits."""
    attn = triton_paged.TritonPagedAttention(32, 8, 128, 128**-0.5)
    attn._target[torch.device("cpu")] = attn.PROGRAMS_PER_SM * 132  # an H100/H200's SMs
    assert attn.splits_for(1, 4096, "cpu") == attn.MAX_SPLITS == 32
    assert attn.splits_for(4, 4096, "cpu") == 9
    assert attn.splits_for(32, 4096, "cpu") == 2
    assert attn.splits_for(64, 4096, "cpu") == 1
    assert attn.splits_for(256, 4096, "cpu") == 1
    assert attn.splits_for(1, 64, "cpu") == 2  # a 64-position table: two tiles, two splits at most
    assert attn.splits_for(0, 4096, "cpu") == 1
    assert triton_paged.TritonPagedAttention(32, 8, 128, 1.0, split_kv=False).splits_for(1, 4096, "cpu") == 1
    assert triton_paged.TritonPagedAttention(32, 8, 128, 1.0, num_splits=5).splits_for(256, 32, "cpu") == 5


def test_the_default_choice_splits_a_small_decode_batch_and_matches_the_reference(monkeypatch):
    """The backend as the engine builds it: a 2-row decode batch is split (the merge kernel runs) and the
    output matches the reference; with split_kv=False the merge never runs."""
    hq, hkv, d, bs = 4, 2, 16, 8
    lens = [45, 300]
    kc, vc, meta = _decode_batch(hkv, d, bs, lens, torch.float32)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(6))
    ref = _decode_reference(hq, hkv, d, q, kc, vc, meta, None)
    merges = record_grids(monkeypatch, triton_paged, "_combine_splits_kernel")
    torch.testing.assert_close(_split_attend(hq, hkv, d, q, kc, vc, meta, None), ref, atol=2e-5, rtol=2e-5)
    assert len(merges) == 1
    out = _split_attend(hq, hkv, d, q, kc, vc, meta, None, split_kv=False)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert len(merges) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a CUDA device")
@pytest.mark.parametrize("window", [None, 50])
def test_split_kv_replays_in_a_cuda_graph(window):
    """The split-KV path captured once (its scratch allocated inside the capture) and replayed after the
    contexts and tables change in place, as the engine's decode graphs are."""
    hq, hkv, d, bs = 8, 2, 64, 16
    attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, num_splits=8)
    kc, vc, meta = _decode_batch(hkv, d, bs, [300, 300, 300], torch.bfloat16)
    q = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    kc_d, vc_d, q_d = kc.cuda(), vc.cuda(), q.cuda()
    static = _on_device(meta)
    static.derived = attn.derive(meta).to("cuda")
    attn.attend(q_d, (kc_d, vc_d), static, window)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.attend(q_d, (kc_d, vc_d), static, window)
    for lens in ([300, 300, 300], [1, 129, 33], [64, 2, 299]):
        step = AttentionMetadata(meta.slot_mapping, meta.decode_idx, meta.decode_block_tables.flip(0),
                                 torch.tensor(lens), [], bs)
        for dst, src in zip(static.derived, attn.derive(step), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref = _decode_reference(hq, hkv, d, q, kc, vc, step, window)
        torch.testing.assert_close(out.cpu().float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_decode_rows_derived_on_the_device_are_the_hosts():
    """A decode graph's rows, derived from its device buffers (`derive_decode`), hold what `derive` gives the
    eager path, in the same integer types: the compiled kernels refuse int64 lengths beside their int32 loop
    bounds, which the interpreter lets through."""
    attn = triton_paged.TritonPagedAttention(8, 2, 64, 64**-0.5)
    _, _, meta = _decode_batch(2, 64, 16, [300, 17, 64], torch.float32, width=24)
    host, device = attn.derive(meta), attn.derive_decode(meta)
    for a, b in zip(host, device, strict=True):
        assert a.dtype == b.dtype == torch.int32
        assert torch.equal(a, b)


def test_single_pass_programs_are_the_rows_tiles_and_no_more(monkeypatch):
    """The single-pass kernel launches one program per query tile a row has (per KV head), listed row by row:
    a mixed step's decodes take one tile each beside the chunks' several, where a grid of rows x the longest
    row's tiles would launch idle programs for every decode. With the decodes split over their context, the
    single pass takes the chunks' tiles alone. The mixed-step outputs are checked against the reference by
    test_triton_matches_torch_reference."""
    import numpy as np

    hq, hkv, d = 8, 2, 16
    kc, vc, meta, t = _step(hkv, d, 16, 30, torch.float32)
    rows = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5).derive(meta)
    group, block_m = hq // hkv, 64
    want = [-(-q * group // block_m) for q in (1, 1, 1, 20, 9)]  # 3 decodes, chunks of 20 and 9 queries
    assert rows.tile_rows.tolist() == [r for r, n in enumerate(want) for _ in range(n)]
    assert rows.tile_ids.tolist() == [i for n in want for i in range(n)]
    rows_np, ids_np = triton_paged.tile_map(np.array([1, 3, 40]), group=4, block_m=16)
    assert rows_np.tolist() == [0] + [1] * 1 + [2] * 10 and ids_np.tolist() == [0, 0, *range(10)]

    grids = record_grids(monkeypatch, triton_paged, "_paged_attention_kernel")
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(1))
    cache = (kc.to(DEVICE), vc.to(DEVICE))
    for splits, programs in ((1, sum(want)), (3, sum(want[3:]))):
        grids.clear()
        attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, split_kv=splits > 1, num_splits=splits)
        attn.attend(q.to(DEVICE), cache, _on_device(meta), None)
        assert grids == [(programs, hkv)]


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("tiling", [dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
                                    dict(block_m=16, block_n=16), dict(block_m=32, block_n=128, num_stages=4)])
def test_other_prefill_tilings_cut_the_work_not_the_result(tiling, splits, monkeypatch):
    """The launch settings the GPU check sweeps for prompt chunks (`PrefillTiling`) change the tiles, and with
    them the programs launched (one per block_m pairs of a row, per KV head), not the result; a step of
    decodes alone keeps its own tiles of DECODE_BLOCK_M pairs."""
    hq, hkv, d, bs, nb = 4, 2, 16, 8, 24
    kc, vc, meta, t = _step(hkv, d, bs, nb, torch.float32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    for window in (None, 7):
        ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, (kc.clone(), vc.clone()), meta, window)
        attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, split_kv=splits is not None, num_splits=splits,
                                                 prefill=triton_paged.PrefillTiling(**tiling))
        grids = record_grids(monkeypatch, triton_paged, "_paged_attention_kernel")
        out = attn.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), (kc.to(DEVICE), vc.to(DEVICE)),
                           _on_device(meta), window)
        torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)
        group = hq // hkv
        tiles = [-(-n * group // tiling["block_m"]) for n in (1, 1, 1, 20, 9)]
        assert grids == [(sum(tiles if splits is None else tiles[3:]), hkv)]
    assert triton_paged.block_m_for(1, attn.prefill) == triton_paged.DECODE_BLOCK_M


def test_a_prefill_tiling_must_be_powers_of_two():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        triton_paged.PrefillTiling(block_n=48)
