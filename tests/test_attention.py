"""Attention backends: the C++ decode kernel against the PyTorch reference, and the engine on either."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts

from servelm import LLM, SamplingParams
from servelm.model import cpu_kernels
from servelm.model.attention import AttentionMetadata, CpuPagedAttention, TorchPagedAttention
from servelm.model.attention.torch_paged import _window_mask

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")


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
def test_decode_batch_matches_naive_attention(backend, window, dtype, tol, d):
    if backend == "kernel" and kernels is None:
        pytest.skip("CPU kernels could not be compiled here")
    torch.manual_seed(0)
    hq, hkv, bs, nb = 6, 2, 4, 80
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

