"""GGUF block-quantized linear weights kept as the file stores them (quantization=gguf), and run by servelm's
own C++ kernels (csrc/quant_linear.cpp).

Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K and Q6_K tensors are repacked at load (`pack_blocks`: codes and scales
exact, 16 output rows interleaved per group of 32 inputs, see quant_linear.cpp; the Q5 types as 4-bit nibbles and
a plane of fifth bits, 5 bits a weight as in the file) and multiplied with bf16 activations by one kernel for every
number of rows, llama.cpp's scheme: each row of x is rounded to int8 in blocks of 32 (scale max|x| / 127) and the
dot products are integer (AVX512-VNNI, or AVX2), one float32 scale per group: the exact product of the dequantized
weight with the int8-rounded x, up to float32 rounding (`ReferenceMatmul` computes it in torch). Each row is
rounded and summed by itself in one fixed order, so a token gets the same bits in a decode batch of any size and
in a prompt chunk of any length.

The kernel library also has a bf16 tile path for many rows (AMX, AVX512-BF16: the weight's blocks dequantized to
bf16 as the tile loop reaches them). The engine does not use it: its sums are the bf16 model's, not the int8
kernel's, so a token would get other bits in a batch of more than a few rows than in a small one, and a
request's output would depend on what it was batched with. `bench/gguf_tiles_ab.py` measures the two.

Without the kernels (SERVELM_CPU_KERNELS=0, a CPU without AVX2, a float32 model) the Q4 types go to
PyTorch's int4 kernels (model/quant/weight_only.py) and the rest (Q8_0, Q5_*, Q6_K) is dequantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from servelm.config import env

logger = logging.getLogger(__name__)

# Kernel format codes (quant_linear.cpp's Format) and their record bytes per 16 rows x 32 inputs.
FORMATS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4, "Q5_0": 5, "Q5_1": 6, "Q5_K": 7}
_STRIDES = {0: 512 + 32, 1: 256 + 32, 2: 256 + 64, 3: 256 + 128, 4: 512 + 128,
            5: 320 + 32, 6: 320 + 64, 7: 320 + 128}  # Q5: 4-bit nibbles (256) and a plane of high bits (64)
_FIVE_BIT = ("Q5_0", "Q5_1", "Q5_K")


def packed_bytes(fmt: int, n: int, k: int) -> int:
    """Bytes of a weight of n rows and k inputs packed for format `fmt` (rows padded to 32)."""
    return (n + 31) // 32 * 2 * (k // 32) * _STRIDES[fmt]


@dataclass
class GGUFBlocks:
    """A linear's [N, K] weight as a GGUF file's blocks ([N, row bytes] uint8, rows in the model's order)."""

    qtype: str  # a FORMATS key
    raw: torch.Tensor
    in_features: int
    dtype: torch.dtype  # the model's dtype

    @property
    def source(self) -> str:
        return self.qtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.in_features

    def to(self, device: torch.device | str) -> GGUFBlocks:
        """Itself on the CPU; the GGUF kernels are CPU only (quantization gguf is refused on a GPU)."""
        if torch.device(device).type != "cpu":
            raise ValueError("GGUF blocks (quantization gguf) run on the CPU only")
        return self

    def chunk(self, parts: int) -> tuple[GGUFBlocks, ...]:
        """Row slices, as torch.chunk (Phi-3's gate_up_proj holds gate and up)."""
        return tuple(GGUFBlocks(self.qtype, r.contiguous(), self.in_features, self.dtype)
                     for r in self.raw.chunk(parts))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """gguf's float32 values, then `dtype` (default the model's)."""
        import gguf

        from servelm.model.loading.gguf_loader import dequantize

        arr = dequantize(self.raw.numpy(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(dtype or self.dtype)

    def to_int4(self):
        """The same weight as model/quant/weight_only.py's int4 QuantWeight (Q4 types only): PyTorch's int4 kernel path."""
        from servelm.model.loading.gguf_loader import int4_blocks
        from servelm.model.quant.weight_only import QuantWeight

        parts = int4_blocks(self.raw.numpy(), self.qtype)
        codes, scales, zeros = (torch.from_numpy(np.ascontiguousarray(p)) for p in parts)
        return QuantWeight("int4", codes, scales, zeros, 32, self.dtype, self.qtype)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def block_fields(w: GGUFBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes u [N, K] uint8 and per-32 scales d and offsets m [N, K / 32] (float16, or float32 for Q4_K/Q5_K; m
    None for Q8_0/Q4_0/Q5_0) such that w = d * u + m, or d * (u - o) without m (o: 128 for Q8_0, stored as
    q + 128, 8 for Q4_0, 16 for Q5_0). Q6_K: d per 16 inputs [N, K / 16] (float32 d * sc, exact), o = 32."""
    raw = w.raw.numpy()
    n, k = w.shape
    g = k // 32
    if w.qtype == "Q8_0":
        b = raw.reshape(n, g, 34)
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return u.reshape(n, k), _f16(b[..., 0:2]), None
    if w.qtype in ("Q4_0", "Q4_1"):
        size = 18 if w.qtype == "Q4_0" else 20
        b = raw.reshape(n, g, size)
        qs = b[..., size - 16:]
        u = np.concatenate([qs & np.uint8(0x0F), qs >> 4], axis=-1)  # elements 0-15 low nibbles, 16-31 high
        return u.reshape(n, k), _f16(b[..., 0:2]), (_f16(b[..., 2:4]) if w.qtype == "Q4_1" else None)
    if w.qtype in ("Q5_0", "Q5_1"):
        size = 22 if w.qtype == "Q5_0" else 24
        b = raw.reshape(n, g, size)  # d (float16), [m (float16)], qh (32 high bits), qs (16 bytes of nibbles)
        qs = b[..., size - 16:]
        qh = np.ascontiguousarray(b[..., size - 20:size - 16]).view("<u4")  # bit j: element j's fifth bit
        high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
        u = np.concatenate([qs & np.uint8(0x0F), qs >> 4], axis=-1) | (high << 4)
        return u.reshape(n, k), _f16(b[..., 0:2]), (_f16(b[..., 2:4]) if w.qtype == "Q5_1" else None)
    if w.qtype in ("Q4_K", "Q5_K"):
        import gguf

        five = w.qtype == "Q5_K"
        b = raw.reshape(-1, 176 if five else 144)  # d, dmin, 12 bytes of sub-scales and mins, [qh,] codes

        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        d = _f16(b[:, 0:2]).astype(np.float32)[:, None] * sc.astype(np.float32)  # exact: 11 x 6 bits
        m = -(_f16(b[:, 2:4]).astype(np.float32)[:, None] * mn.astype(np.float32))
        qs = b[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        u = qs & np.uint8(0x0F)  # 32 bytes hold two sub-blocks: low nibbles first, then high
        if five:  # Q5_K: 32 bytes qh, bit i of byte l the fifth bit of sub-block i's element l
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            u = u.reshape(-1, 8, 32) | ((qh & np.uint8(1)) << 4)
        return u.reshape(n, k), d.reshape(n, g), m.reshape(n, g)
    if w.qtype == "Q6_K":
        b = raw.reshape(-1, 210)  # ql (128 bytes), qh (64), 16 int8 sub-scales, d (float16)
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        u = (ql & np.uint8(0x0F)).reshape(-1, 256) | ((qh & np.uint8(0x03)).reshape(-1, 256) << 4)
        d = _f16(b[:, 208:210]).astype(np.float32)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
        return u.reshape(n, k), d.reshape(n, k // 16), None
    raise ValueError(f"no kernel format for {w.qtype}")


def gate_up_order(n: int) -> np.ndarray:
    """Row order of a [gate; up] weight for the fused SiLU-and-multiply: 16 gate rows, then the 16 matching up
    rows, per block of 32 (pack_weight_for_tiles' gate_up order)."""
    return np.arange(n).reshape(2, n // 32, 16).transpose(1, 0, 2).reshape(-1)


def pack_blocks(w: GGUFBlocks, gate_up: bool = False) -> torch.Tensor:
    """The kernel's layout (quant_linear.cpp): per run of 16 rows, per group of 32 inputs, a record of codes
    (8 quads [16 rows][4]; 4-bit: quad t low nibbles, t + 4 high; 5-bit: the 4-bit layout of the low bits,
    then per quad the 64 high bits, bit i of byte i of the quad), then the 16 d, then the 16 m."""
    u, d, m = block_fields(w)
    n, k = u.shape
    g = k // 32
    if gate_up:
        order = gate_up_order(n)
        u, d, m = u[order], d[order], None if m is None else m[order]
    pad = (n + 31) // 32 * 32 - n
    if pad:
        u, d = np.pad(u, ((0, pad), (0, 0))), np.pad(d, ((0, pad), (0, 0)))
        m = None if m is None else np.pad(m, ((0, pad), (0, 0)))
    runs = (n + pad) // 16
    u = u.reshape(runs, 16, g, 32)
    if w.qtype in ("Q8_0", "Q6_K"):
        codes = u.reshape(runs, 16, g, 8, 4).transpose(0, 2, 3, 1, 4).reshape(runs, g, 512)
    else:
        lo = u[..., :16].reshape(runs, 16, g, 4, 4).transpose(0, 2, 3, 1, 4) & np.uint8(0x0F)
        hi = u[..., 16:].reshape(runs, 16, g, 4, 4).transpose(0, 2, 3, 1, 4) & np.uint8(0x0F)
        codes = (lo | (hi << 4)).reshape(runs, g, 256)
        if w.qtype in _FIVE_BIT:  # [runs, g, 8 quads, 64 bytes] -> 8 little-endian 64-bit words of fifth bits
            quads = u.reshape(runs, 16, g, 8, 4).transpose(0, 2, 3, 1, 4).reshape(runs, g, 8, 64) >> 4
            plane = np.packbits(quads, axis=-1, bitorder="little").reshape(runs, g, 64)
            codes = np.concatenate([codes, plane], axis=-1)

    def per_run(a: np.ndarray) -> np.ndarray:  # [rows, g * h] -> [runs, g, h sets of 16 values, as bytes]
        h = a.shape[1] // g  # Q6_K: two scales per row and group (inputs 0-15, 16-31)
        a = np.ascontiguousarray(a.reshape(runs, 16, g, h).transpose(0, 2, 3, 1))
        return a.view(np.uint8).reshape(runs, g, -1)

    parts = [codes, per_run(d)] + ([] if m is None else [per_run(m)])
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded as the kernel rounds it (float32): per block of 32, d = max|x| / 127 and
    x ~ d * round(x / d), half to even, as float32 arithmetic gives it (x * (1 / d))."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    d = g.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(g * inv).clamp_(-127, 127) * d).reshape(m, k)


class ReferenceMatmul:
    """What the kernels compute, in torch: int8-rounded x times the dequantized weight (float32), bf16 out. The
    reference for tests (SERVELM_QUANT_KERNEL=reference selects it); keeps a float32 copy of the weight."""

    def __init__(self, w: GGUFBlocks) -> None:
        self.kind, self.dtype = w.qtype, w.dtype
        self.out_features, self.in_features = w.shape
        self.weight = w.dequantize(torch.float32)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = quantize_activations(x) @ self.weight.T
        return (y if bias is None else y + bias.float()).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4


class GGUFMatmul:
    """x W^T for a GGUFBlocks weight through quant_linear.cpp (bf16 activations). With `gate_up` the weight is
    [gate; up] and a call may fuse SiLU(gate) * up into the store."""

    def __init__(self, w: GGUFBlocks, kernels, gate_up: bool = False) -> None:
        self.kind, self.dtype, self.fmt, self.kernels = w.qtype, w.dtype, FORMATS[w.qtype], kernels
        self.out_features, self.in_features = w.shape
        self.packed = pack_blocks(w, gate_up)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """bf16 out, or with out_dtype=torch.float32 the float32 sums unrounded."""
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        # every row count through the int8-activation kernel: one summation order for a token
        return self.kernels.quant_linear(x, self.packed, self.fmt, self.out_features, bias, silu_mul,
                                         out_dtype=out_dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def gguf_kernels(w: GGUFBlocks):
    """The C++ kernels when they run this weight (bf16 model, CPU, a format and build they take), else None."""
    from servelm.model.kernels import cpu as cpu_kernels

    if w.dtype != torch.bfloat16 or w.qtype not in FORMATS or w.in_features % 32:
        return None
    k = cpu_kernels.load()
    return k if k is not None and k.quant_linear_supported(FORMATS[w.qtype], w.in_features) else None


def auto_quantization(kind: str, device: str, dtype: torch.dtype) -> str:
    """What quantization=auto means for a checkpoint of `kind` (gguf, safetensors): gguf for a GGUF file in
    bfloat16 on a CPU whose kernel build runs the GGUF formats (the int8-activation kernel: AVX512-VNNI or AVX2),
    else none."""
    from servelm.model.kernels import cpu as cpu_kernels

    if kind != "gguf" or not device.startswith("cpu") or dtype != torch.bfloat16:
        return "none"
    k = cpu_kernels.load()
    return "gguf" if k is not None and k.quant_linear_supported(FORMATS["Q4_0"], 64) >= 1 else "none"


def reference_selected() -> bool:
    """SERVELM_QUANT_KERNEL=reference: GGUF weights run ReferenceMatmul (tests, debugging)."""
    return env.quant_kernel_reference()


def gguf_matmul(w: GGUFBlocks, gate_up: bool = False):
    """The matmul for a kept GGUF weight: servelm's kernels (GGUFMatmul), the torch reference where
    SERVELM_QUANT_KERNEL=reference, PyTorch's int4 kernels for Q4 types where ours do not apply, or None
    (the caller dequantizes)."""
    from servelm.model.quant.weight_only import quant_matmul

    if reference_selected() and w.qtype in FORMATS:
        return ReferenceMatmul(w)
    k = gguf_kernels(w)
    if k is not None:
        return GGUFMatmul(w, k, gate_up)
    if w.qtype in ("Q4_0", "Q4_1", "Q4_K"):
        return quant_matmul(w.to_int4())
    return None


def kept_at_load(qtype: str, in_features: int, dtype: torch.dtype) -> bool:
    """Whether `gguf_matmul` keeps a linear weight of this GGUF type, inputs and model dtype quantized (servelm's
    kernels, the torch reference, or PyTorch's int4 kernel for the Q4 types, whose shape checks may still refuse
    one and say so). The loader dequantizes the rest as it reads them, so its counts are what runs."""
    if qtype not in FORMATS:
        return False
    if reference_selected() or qtype in ("Q4_0", "Q4_1", "Q4_K"):
        return True
    return gguf_kernels(GGUFBlocks(qtype, torch.empty(0, dtype=torch.uint8), in_features, dtype)) is not None
