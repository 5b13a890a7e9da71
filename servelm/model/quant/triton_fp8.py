"""Rounding to float8_e4m3fn inside Triton kernels, and per-token activation quantization as one kernel.

`round_e4m3` rounds float32 values to the nearest e4m3 value (ties to even), saturated at +-448, and returns
them still as float32: the cast to `tl.float8e4nv` that follows is then exact. Why not cast directly: the
compiled cast rounds correctly, but Triton's interpreter (how CI runs these kernels on the CPU) rounds some
values wrongly (127.3 to 64, 100 to 104), and kernels that store fp8 must give PyTorch's bits in both. The
arithmetic works on float32 bits: a normal value keeps three mantissa bits by rounding the low 20 to nearest
even (a carry moves into the exponent as it should); below 2^-6 e4m3's subnormals step by 2^-9, which adding and
subtracting 2^14 (whose float32 spacing is 2^-9) rounds to.

`quantize_rows` is model/quant/fp8.py's `quantize_rows` (scale = absmax / 448 per row, codes = x / scale) in
one kernel instead of four PyTorch ones, bit for bit: divisions are IEEE (`div_rn`), as PyTorch's are. The fp8
KV-cache write fused with RoPE (model/kernels/triton_rope.py) rounds with `round_e4m3` too.
"""

from __future__ import annotations

import torch

from servelm.model.quant.fp8 import FP8, MIN_SCALE

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

ROW_BLOCK = 1024  # elements of a row one program reads at a time

if HAS_TRITON:

    @triton.jit
    def round_e4m3(v):
        """float32 -> the nearest float8_e4m3fn value (ties to even, saturating at +-448: fp8.FP8_MAX), as
        float32."""
        a = tl.minimum(tl.abs(v), 448.0)
        bits = a.to(tl.int32, bitcast=True)
        sign = v.to(tl.int32, bitcast=True) & -0x80000000
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        subnormal = (a + 16384.0) - 16384.0
        r = tl.where(a < 0.015625, subnormal, normal)
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, MIN_SCALE: tl.constexpr,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), MIN_SCALE)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):  # the row again (from the L2 cache, as a rule)
            rk = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
            code = round_e4m3(tl.math.div_rn(x, scale)).to(tl.float8e4nv)
            tl.store(q_ptr + row * stride_q + rk, code, mask=rk < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of x [T, K] in one kernel: (e4m3 codes [T, K], float32 scales [T, 1]),
    the bits of model/quant/fp8.py's `quantize_rows`."""
    t, k = x.shape
    codes = torch.empty(t, k, dtype=FP8, device=x.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        if x.stride(-1) != 1:
            x = x.contiguous()
        _quantize_rows_kernel[(t,)](x, codes, scales, k, x.stride(0), codes.stride(0), MIN_SCALE=MIN_SCALE,
                                    BLOCK=min(ROW_BLOCK, triton.next_power_of_2(k)))
    return codes, scales

