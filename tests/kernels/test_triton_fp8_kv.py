"""The Triton paged-attention kernels over an fp8 KV cache (loads converted and scaled in registers) against the
PyTorch backend over the same cache, under Triton's interpreter on the CPU and compiled on a GPU: the single-pass
kernel (decodes, a chunk over a cached prefix, a fresh prompt), split-KV decodes, sliding windows, GQA and scales
other than 1. The reference reads exactly the dequantized values, so the tolerances are the float kernels'."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's definition

from test_triton_attention import DECODE_LENS, _decode_batch, _on_device, _step  # noqa: E402

from servelm.model.attention import TorchPagedAttention, triton_paged  # noqa: E402
from servelm.model.attention.kv_quant import KVCache, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_paged.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# numpy, under the interpreter, has no bfloat16: it is checked where the kernel really compiles (a GPU)
DTYPES = [(torch.float32, 2e-5), (torch.float16, 5e-3)] + ([(torch.bfloat16, 3e-2)] if DEVICE == "cuda" else [])


def _fp8_on(cache: KVCache, device) -> KVCache:
    return KVCache(cache[0].to(device), cache[1].to(device), cache.k_scale, cache.v_scale)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("window", [None, 7])
def test_mixed_step_over_an_fp8_cache(window, dtype, tol, splits):
    """The mixed step of test_triton_attention (3 decodes, a 20-token chunk after a 27-token cached prefix, a
    9-token prompt), the decodes single-pass or in 3 splits; the kernel writes the reference's bytes."""
    hq, hkv, d = 4, 2, 16
    kc, vc, meta, t = _step(hkv, d, 8, 24, torch.float32)
    fp8 = KVCache(quantize(kc, 0.5), quantize(vc * 3, 2.0), 0.5, 2.0)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    ref_cache = KVCache(fp8[0].clone(), fp8[1].clone(), fp8.k_scale, fp8.v_scale)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5).forward(q, k, v, ref_cache, meta, window)
    cache = _fp8_on(fp8, DEVICE)
    attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, split_kv=splits is not None, num_splits=splits)
    out = attn.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache, _on_device(meta), window).cpu()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    for got, want in zip(cache, ref_cache, strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("splits", [1, 4])
def test_decodes_over_an_fp8_cache(splits, window, dtype, tol):
    """Every context length of DECODE_LENS (inside, at and past the split boundaries) over an fp8 cache: the
    single-pass kernel and 4 splits, whole and within a window."""
    hq, hkv, d, bs = 4, 2, 32, 8
    kc, vc, meta = _decode_batch(hkv, d, bs, DECODE_LENS, torch.float32)
    fp8 = KVCache(quantize(kc * 2, 0.75), quantize(vc, 1.5), 0.75, 1.5)
    q = torch.randn(len(DECODE_LENS), hq, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = TorchPagedAttention(hq, hkv, d, d**-0.5)._decode(q, fp8, meta, window)
    attn = triton_paged.TritonPagedAttention(hq, hkv, d, d**-0.5, split_kv=splits > 1, num_splits=splits)
    out = attn.attend(q.to(DEVICE), _fp8_on(fp8, DEVICE), _on_device(meta), window).cpu()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_engine_on_the_triton_backend_with_an_fp8_cache(llama_dir, monkeypatch):
    """The whole engine on the Triton backend with kv_cache_dtype=fp8 gives the PyTorch backend's greedy tokens
    with the same fp8 cache (prefix-cache hits and chunked prefill included): both read the same quantized
    values."""
    from tiny_models import random_prompts

    from servelm import LLM, SamplingParams
    from servelm.model.loading import loader

    kw = dict(dtype="float32", device=DEVICE, num_kv_blocks=128, max_num_batched_tokens=24, kv_cache_dtype="fp8")
    shared = random_prompts(1, 20, 20, seed=7)[0]
    prompts = [shared + own for own in random_prompts(3, 3, 15, seed=8)] + random_prompts(1, 30, 40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    monkeypatch.setattr(loader, "get_backend", lambda device: TorchPagedAttention)
    ref = [o.outputs[0].token_ids for o in LLM(str(llama_dir), **kw).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(loader, "get_backend", lambda device: triton_paged.TritonPagedAttention)
    llm = LLM(str(llama_dir), **kw)
    assert isinstance(llm.engine.loaded.model.attn, triton_paged.TritonPagedAttention)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert llm.engine.get_stats().prefix_cache_hits > 0
