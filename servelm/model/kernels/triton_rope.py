"""RoPE fused with the paged KV-cache write, in Triton, for NVIDIA GPUs.

Why: around attention a decoder layer on CUDA otherwise runs rotary embedding as PyTorch's gathers, multiplies,
adds and copy (about six kernels) and then two `index_copy_` into the paged cache. This is one kernel: it reads
each token's query and key heads straight from the fused QKV projection (strided views, no copies), rotates the
queries in place and writes the rotated keys and the values into the cache at the token's slot. The rotated keys
are not stored back into the projection: the backend reads them from the cache (`AttentionBackend.attend`).

Rounding mirrors `blocks.apply_rotary` (Llama's rotate-half convention, `x * cos + rotate_half(x) * sin` in the
model's dtype): each product is rounded to the dtype, then their sum, each step computed in float32 as PyTorch's
elementwise kernels do; fused multiply-adds are turned off so float32 gets PyTorch's bits too.

An fp8 cache (`--kv-cache-dtype fp8`) is written as model/attention/kv_quant.py's `quantize` defines: the rotated
key, and the value, divided by the layer's scale (IEEE division), saturated to +-448 and rounded to e4m3
(model/quant/triton_fp8.py's `round_e4m3`): PyTorch's bits.

Without a GPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks it
against the PyTorch path. This module imports without Triton; `HAS_TRITON` says if it can run.
"""

from __future__ import annotations

import torch

from servelm.model.attention.kv_quant import is_fp8, scales

try:
    import triton
    import triton.language as tl

    from servelm.model.quant.triton_fp8 import round_e4m3

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the kernel is simply unavailable
    HAS_TRITON = False

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 1024  # elements of one program's tile of heads x half a head (a program takes several heads)

if HAS_TRITON:

    @triton.jit
    def _rope_write_kv_kernel(
        qk_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
        num_heads, total_heads, block_size, k_scale, v_scale,
        s_qkt, s_qkh, s_vt, s_vh, s_cos, s_sin,
        s_kb, s_ks, s_kh, s_vcb, s_vcs, s_vch,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8_CACHE: tl.constexpr,
    ):
        # one program per (token, group of BLOCK_H heads of q and k together); each head as its two halves
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs = tl.arange(0, BLOCK_HALF)
        d_ok = offs < HALF
        ok = (heads < total_heads)[:, None] & d_ok[None, :]
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c1 = tl.load(cos_ptr + pos * s_cos + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + pos * s_cos + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + pos * s_sin + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + pos * s_sin + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x_ptrs = qk_ptr + t * s_qkt + heads[:, None] * s_qkh + offs[None, :]
        x1 = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptrs + HALF, mask=ok, other=0.0).to(tl.float32)
        dt = qk_ptr.dtype.element_ty
        # x * cos + cat(-x2, x1) * sin, each product rounded to the dtype and then the sum, as PyTorch does
        o1 = ((x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        q_ok = ok & (heads < num_heads)[:, None]
        tl.store(x_ptrs, o1, mask=q_ok)
        tl.store(x_ptrs + HALF, o2, mask=q_ok)
        # the key heads of this group: rotated keys and their values into the token's cache slot
        kv_ok = ok & (heads >= num_heads)[:, None]
        kv_head = (heads - num_heads)[:, None]
        slot = tl.load(slot_ptr + t).to(tl.int64)
        block = slot // block_size
        at = slot % block_size
        k_ptrs = k_cache_ptr + block * s_kb + at * s_ks + kv_head * s_kh + offs[None, :]
        v_src = v_ptr + t * s_vt + kv_head * s_vh + offs[None, :]
        v_dst = v_cache_ptr + block * s_vcb + at * s_vcs + kv_head * s_vch + offs[None, :]
        v1 = tl.load(v_src, mask=kv_ok, other=0.0)
        v2 = tl.load(v_src + HALF, mask=kv_ok, other=0.0)
        if FP8_CACHE:  # kv_quant.quantize: x / scale in float32, saturated, rounded to e4m3
            k1 = round_e4m3(tl.math.div_rn(o1.to(tl.float32), k_scale))
            k2 = round_e4m3(tl.math.div_rn(o2.to(tl.float32), k_scale))
            tl.store(k_ptrs, k1.to(tl.float8e4nv), mask=kv_ok)
            tl.store(k_ptrs + HALF, k2.to(tl.float8e4nv), mask=kv_ok)
            tl.store(v_dst, round_e4m3(tl.math.div_rn(v1.to(tl.float32), v_scale)).to(tl.float8e4nv), mask=kv_ok)
            tl.store(v_dst + HALF, round_e4m3(tl.math.div_rn(v2.to(tl.float32), v_scale)).to(tl.float8e4nv),
                     mask=kv_ok)
        else:  # the values copied, never rounded
            tl.store(k_ptrs, o1.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
            tl.store(k_ptrs + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
            tl.store(v_dst, v1, mask=kv_ok)
            tl.store(v_dst + HALF, v2, mask=kv_ok)


def applies(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the kernel takes these: one float dtype for the activations and the tables, the caches in it too
    or both fp8, unit-stride rows, an even head size and RoPE over the whole head (the tables as wide as a
    head)."""
    k_cache, v_cache = kv_cache
    d = qk.shape[-1]
    caches_ok = all(c.dtype == qk.dtype for c in kv_cache) or all(is_fp8(c) for c in kv_cache)
    return (HAS_TRITON and qk.dtype in DTYPES and qk.dim() == 3 and v.dim() == 3 and qk.shape[0] > 0
            and d % 2 == 0 and v.shape[-1] == d and v.shape[0] == qk.shape[0] and caches_ok
            and all(t.stride(-1) == 1 for t in (k_cache, v_cache))
            and all(t.dtype == qk.dtype and t.stride(-1) == 1 for t in (v, cos, sin))
            and cos.shape[-1] == d and sin.shape[-1] == d and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.shape[2:] == v.shape[1:])


def rope_write_kv(qk: torch.Tensor, v: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
    """qk [T, H + KVH, D] (queries, then keys), v [T, KVH, D], views with unit-stride rows; positions and slots
    [T]; cos/sin the [max_pos, D] tables; the caches [num_blocks, block_size, KVH, D] (fp8 ones quantized with
    the layer's scales, `kv_quant.scales`). Rotates the queries in place and writes the rotated keys and v into
    the caches at the slots (qk's keys are left as they were)."""
    k_cache, v_cache = kv_cache
    k_scale, v_scale = scales(kv_cache)
    t, total, d = qk.shape
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(total), max(1, TILE // block_half))
    _rope_write_kv_kernel[(t, triton.cdiv(total, block_h))](
        qk, v, positions, cos, sin, slots, k_cache, v_cache,
        num_heads, total, k_cache.shape[1], k_scale, v_scale,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, FP8_CACHE=is_fp8(k_cache), enable_fp_fusion=False,
    )
