"""The Triton paged-attention kernel against the PyTorch reference, run by Triton's CPU interpreter.

A mixed step (decodes, a prompt chunk after a cached prefix, a fresh prompt) with GQA, with and without a
sliding window; on a GPU machine the same tests run the compiled kernel (see BENCHMARKS.md). Inputs are drawn
on the host and the reference computed there; the kernel gets every tensor, the step's metadata included,
on DEVICE (the GPU where there is one, else the CPU under the interpreter), and the engine tests run the
model on DEVICE.
"""

from __future__ import annotations

import os

import pytest
import torch

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


def _triton(hq: int, hkv: int, d: int, q, k, v, kc, vc, meta, window):
    """The kernel on DEVICE: (output on the host, the key and value caches it wrote, on the host)."""
    kc2, vc2 = kc.to(DEVICE), vc.to(DEVICE)
    out = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5).forward(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), (kc2, vc2), _on_device(meta), window)
    assert out.device.type == torch.device(DEVICE).type
    return out.cpu(), kc2.cpu(), vc2.cpu()


# numpy, under the interpreter, has no bfloat16: it is checked where the kernel really compiles (a GPU)
HALF = [(torch.bfloat16, 3e-2)] if torch.cuda.is_available() else []


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 5e-3), *HALF])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_matches_torch_reference(window, dtype, tol):
    hq, hkv, d, bs, nb = 4, 2, 16, 8, 24
    kc, vc, meta, t = _step(hkv, d, bs, nb, dtype)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, (kc.clone(), vc.clone()), meta, window)
    out, kc2, vc2 = _triton(hq, hkv, d, q, k, v, kc, vc, meta, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
    ref_v.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
    torch.testing.assert_close(kc2, ref_k)  # the new keys and values were written where the slots say
    torch.testing.assert_close(vc2, ref_v)


def test_head_dim_not_a_power_of_two():
    hq, hkv, d, bs, nb = 2, 1, 24, 8, 24
    kc, vc, meta, t = _step(hkv, d, bs, nb, torch.float32)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, (kc.clone(), vc.clone()), meta, None)
    out, _, _ = _triton(hq, hkv, d, q, k, v, kc, vc, meta, None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_on_the_triton_backend_matches_transformers(arch, model_dirs, hf_models, monkeypatch):
    """The whole engine on the Triton backend (the GPU path's attention: compiled on a GPU, interpreted on
    the CPU): batching, a shared prefix from the prefix cache, chunked prefill and, for Mistral, a sliding
    window. The model runs on DEVICE: the compiled kernel cannot read a CPU model's tensors."""
    from conftest import hf_greedy, random_prompts

    from servelm import LLM, SamplingParams
    from servelm.model import loader

    monkeypatch.setattr(loader, "get_backend", lambda device: triton_paged.TritonPagedAttention)
    llm = LLM(str(model_dirs[arch]), dtype="float32", device=DEVICE, num_kv_blocks=128, max_num_batched_tokens=24)
    assert isinstance(llm.engine.loaded.model.attn, triton_paged.TritonPagedAttention)
    shared = random_prompts(1, 20, 20, seed=7)[0]
    prompts = [shared + own for own in random_prompts(4, 3, 15, seed=8)] + random_prompts(2, 30, 40, seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 6)
    assert llm.engine.get_stats().prefix_cache_hits > 0  # the shared prefix came from the cache


@pytest.mark.parametrize("hq, hkv", [(3, 1), (8, 2)])
@pytest.mark.parametrize("bs", [4, 32])
def test_query_groups_and_block_sizes(hq, hkv, bs):
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
    out, _, _ = _triton(hq, hkv, d, q, k, v, kc, vc, meta, None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
