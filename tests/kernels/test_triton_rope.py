"""RoPE fused with the paged KV-cache write (model/kernels/triton_rope.py) against the path it replaces on CUDA
(`blocks.rotary_` then `AttentionBackend.write_kv`), run by Triton's CPU interpreter; on a GPU machine the same
tests run the compiled kernel, bfloat16 included; fp8 caches with the bits of the unfused quantized write. Then
the decoder's use of it in the decode-graph path: the same greedy tokens as transformers, and over an fp8 cache
the same tokens as the unfused path."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import random_prompts, reference, run

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition

from servelm import LLM  # noqa: E402
from servelm.model.attention.base import AttentionBackend  # noqa: E402
from servelm.model.kernels import triton_rope  # noqa: E402
from servelm.model.layers import blocks as layers  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_rope.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# float32 and float16 give PyTorch's bits (each product rounded, then the sum, no fused multiply-add). numpy,
# under the interpreter, has no bfloat16: it is checked where the kernel compiles (a GPU), to one bf16 ulp.
HALF = [(torch.bfloat16, 8e-3)] if torch.cuda.is_available() else []
DTYPES = [(torch.float32, 0.0), (torch.float16, 0.0), *HALF]


def _tables(d: int, max_pos: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's tables as DecoderLM builds them: [max_pos, D], the frequencies repeated over both halves."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _split(qkv: torch.Tensor, h: int, kvh: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's views of a fused projection: qk [T, H + KVH, D] and v [T, KVH, D], no copies."""
    t = qkv.shape[0]
    return qkv[:, :(h + kvh) * d].view(t, h + kvh, d), qkv[:, (h + kvh) * d:].view(t, kvh, d)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("h, kvh, d", [(4, 4, 16), (8, 2, 64), (6, 1, 32), (4, 2, 48), (40, 8, 128)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_rotary_then_write_kv(h, kvh, d, block_size, dtype, tol):
    """MHA, GQA and MQA, a head size that is no power of two (the tail masked), more heads than one program
    takes (40 + 8 of 128); tokens at scattered positions and slots in several blocks, the last one a graph's
    padding row: position 0, the spare block's first slot."""
    t, num_blocks, max_pos = 7, 12, 300
    g = torch.Generator().manual_seed(h * 1000 + d + block_size)
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3).to(dtype)
    cos, sin = _tables(d, max_pos, dtype)
    positions = torch.tensor([0, 1, 5, 37, 299, 120, 0])
    capacity = (num_blocks - 1) * block_size  # the last block is the spare one
    slots = torch.randperm(capacity, generator=g)[: t - 1]
    slots = torch.cat([slots, torch.tensor([(num_blocks - 1) * block_size])])
    k_cache = (torch.randn(num_blocks, block_size, kvh, d, generator=g)).to(dtype)
    v_cache = (torch.randn(num_blocks, block_size, kvh, d, generator=g)).to(dtype)

    want_qkv, want_k, want_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    qk, v = _split(want_qkv, h, kvh, d)
    layers.rotary_(qk, cos, sin, positions)
    AttentionBackend.write_kv(qk[:, h:], v, (want_k, want_v), slots)

    dev = qkv.to(DEVICE, copy=True)
    kc, vc = k_cache.to(DEVICE, copy=True), v_cache.to(DEVICE, copy=True)
    qk_d, v_d = _split(dev, h, kvh, d)
    assert not qk_d.is_contiguous() and triton_rope.applies(qk_d, v_d, cos.to(DEVICE), sin.to(DEVICE), (kc, vc))
    triton_rope.rope_write_kv(qk_d, v_d, h, positions.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), (kc, vc),
                              slots.to(DEVICE))
    got_q, got_rest = dev[:, : h * d].cpu(), dev[:, h * d:].cpu()
    torch.testing.assert_close(got_q.float(), want_qkv[:, : h * d].float(), atol=tol, rtol=tol)
    assert torch.equal(got_rest, qkv[:, h * d:])  # keys and values in the projection are left as they were
    torch.testing.assert_close(kc.cpu().float(), want_k.float(), atol=tol, rtol=tol)
    assert torch.equal(vc.cpu(), want_v)  # values are copied, never rounded
    if tol == 0.0:
        assert torch.equal(got_q, want_qkv[:, : h * d]) and torch.equal(kc.cpu(), want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.01, 0.37)])
def test_fp8_cache_gets_the_bits_of_rotary_then_write_kv(k_scale, v_scale, dtype):
    """An fp8 cache: the rotated keys and the values quantized with the layer's scales as kv_quant.quantize
    does (divided, saturated, rounded to e4m3), bit for bit, and the queries rotated as before. A scale of
    0.01 pushes keys past 448, so saturation is checked too."""
    from servelm.model.attention.kv_quant import KVCache

    h, kvh, d, t, bs, num_blocks = 8, 2, 64, 6, 4, 5
    g = torch.Generator().manual_seed(int(k_scale * 100))
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3).to(dtype)
    cos, sin = _tables(d, 64, dtype)
    positions = torch.tensor([0, 3, 9, 17, 40, 63])
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    fp8 = torch.float8_e4m3fn
    empty = torch.zeros(num_blocks, bs, kvh, d, dtype=fp8)

    want_qkv, want_k, want_v = qkv.clone(), empty.clone(), empty.clone()
    qk, v = _split(want_qkv, h, kvh, d)
    layers.rotary_(qk, cos, sin, positions)
    AttentionBackend.write_kv(qk[:, h:], v, KVCache(want_k, want_v, k_scale, v_scale), slots)
    assert (want_k.float().abs() == 448).any() == (k_scale < 0.1)

    dev = qkv.to(DEVICE, copy=True)
    cache = KVCache(empty.to(DEVICE, copy=True), empty.to(DEVICE, copy=True), k_scale, v_scale)
    qk_d, v_d = _split(dev, h, kvh, d)
    assert triton_rope.applies(qk_d, v_d, cos.to(DEVICE), sin.to(DEVICE), cache)
    triton_rope.rope_write_kv(qk_d, v_d, h, positions.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), cache,
                              slots.to(DEVICE))
    assert torch.equal(dev[:, : h * d].cpu(), want_qkv[:, : h * d])
    for got, want in zip(cache, (want_k, want_v), strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_what_the_kernel_takes():
    """One dtype for activations and tables, the caches in it too or both fp8, the tables as wide as a head
    (partial RoPE stays on PyTorch), an even head size."""
    h, kvh, d = 4, 2, 16
    qk, v = _split(torch.zeros(3, (h + 2 * kvh) * d), h, kvh, d)
    cos, sin = _tables(d, 8, torch.float32)
    cache = (torch.zeros(2, 4, kvh, d), torch.zeros(2, 4, kvh, d))
    assert triton_rope.applies(qk, v, cos, sin, cache)
    assert not triton_rope.applies(qk, v, cos, sin, tuple(c.half() for c in cache))
    assert triton_rope.applies(qk, v, cos, sin, tuple(c.to(torch.float8_e4m3fn) for c in cache))
    assert not triton_rope.applies(qk, v, cos, sin, (cache[0].to(torch.float8_e4m3fn), cache[1]))
    assert not triton_rope.applies(qk, v, cos.half(), sin.half(), cache)
    assert not triton_rope.applies(qk, v, cos[:, :8], sin[:, :8], cache)
    odd, odd_v = _split(torch.zeros(3, (h + 2 * kvh) * 5), h, kvh, 5)
    odd_table, odd_cache = torch.zeros(8, 5), torch.zeros(2, 4, kvh, 5)
    assert not triton_rope.applies(odd, odd_v, odd_table, odd_table, (odd_cache, odd_cache))
    # the rule of the other fused Triton kernels: never for a CPU tensor, nor for an eager CUDA step
    assert layers._gpu_rope(qk) is None
    assert not layers.rotary_write_kv(qk, v, h, cos, sin, torch.zeros(3, dtype=torch.long), cache,
                                      torch.zeros(3, dtype=torch.long))
    if torch.cuda.is_available():
        assert layers._gpu_rope(qk.cuda()) is None


def _graph_steps_fuse_rope(monkeypatch) -> list[int]:
    """The Triton backend, with the fused kernel chosen in graph steps (run through the static buffers without
    capture) as a capture would choose it; returns the list each fused call appends its row count to."""
    from servelm.engine.cuda_graphs import DecodeGraphs
    from servelm.model.attention import triton_paged
    from servelm.model.loading import loader

    monkeypatch.setattr(loader, "get_backend", lambda device: triton_paged.TritonPagedAttention)
    in_graph, calls = [False], []
    monkeypatch.setattr(layers, "_gpu_rope", lambda x: triton_rope if in_graph[0] else None)
    real_forward, real_kernel = DecodeGraphs._forward, triton_rope.rope_write_kv

    def graph_forward(self, size):
        in_graph[0] = True
        try:
            return real_forward(self, size)
        finally:
            in_graph[0] = False

    monkeypatch.setattr(DecodeGraphs, "_forward", graph_forward)
    monkeypatch.setattr(triton_rope, "rope_write_kv", lambda *a: calls.append(a[0].shape[0]) or real_kernel(*a))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_graph_path_with_fused_rope_matches_transformers(arch, model_dirs, hf_models, monkeypatch):
    """Graph steps with the fused kernel, prompts run eagerly through the strided views. Llama (GQA) and Qwen3
    (q/k norms before RoPE) give transformers' greedy tokens."""
    from servelm.model.attention import triton_paged

    calls = _graph_steps_fuse_rope(monkeypatch)
    prompts = random_prompts(3, 10, 40, seed=13)
    llm = LLM(str(model_dirs[arch]), dtype="float32", device=DEVICE, enforce_eager=True, num_kv_blocks=64,
              block_size=16)
    runner = llm.engine.core.runner
    assert isinstance(llm.engine.loaded.model.attn, triton_paged.TritonPagedAttention)
    runner.enable_decode_graphs([2, 4], capture=False)
    assert run(llm, prompts) == reference(hf_models, arch, prompts)
    layers_n = llm.engine.loaded.model.spec.num_layers
    assert runner.num_graph_steps > 0 and len(calls) == runner.num_graph_steps * layers_n
    assert set(calls) <= {2, 4}  # graph steps only, padded to a captured size


def test_decode_graph_path_with_fused_rope_over_an_fp8_cache(model_dirs, monkeypatch):
    """Over an fp8 cache, graph steps writing it with the fused kernel give the greedy tokens of the same
    engine writing it unfused (the quantized entries are the same bits)."""
    prompts = random_prompts(3, 10, 40, seed=14)
    kw = dict(dtype="float32", device=DEVICE, enforce_eager=True, num_kv_blocks=64, block_size=16,
              kv_cache_dtype="fp8")
    calls = _graph_steps_fuse_rope(monkeypatch)
    unfused = LLM(str(model_dirs["llama"]), **kw)
    want = run(unfused, prompts)
    assert not calls
    llm = LLM(str(model_dirs["llama"]), **kw)
    llm.engine.core.runner.enable_decode_graphs([2, 4], capture=False)
    assert run(llm, prompts) == want
    assert llm.engine.core.runner.num_graph_steps > 0 and calls
