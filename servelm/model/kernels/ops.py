"""The C++ CPU kernels as Python functions over tensors: each checks its tensors (dtype, shape, layout),
allocates what it returns, and calls the library's C entry point through ctypes with raw pointers. The
library itself knows nothing of torch (kernels/build.py says why); a failed check here or in C raises
RuntimeError with the kernel's message."""

from __future__ import annotations

import ctypes
import struct
import threading
from pathlib import Path

import torch

from servelm.model.quant.gguf import packed_bytes

_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double
_INT = ctypes.c_int

# C signatures: name -> (return type, argument types)
_SIGNATURES: dict[str, tuple] = {
    "servelm_last_error": (ctypes.c_char_p, ()),
    "servelm_avx512_bf16_compiled": (_INT, ()),
    "servelm_rms_norm": (_INT, (ctypes.c_int32, _P, _I, _I, _I, _I, _P, _I, _I, _I, _I, _P, _I, _D)),
    "servelm_add_rms_norm": (_INT, (ctypes.c_int32, _P, _P, _P, _P, _I, _I, _D)),
    "servelm_rotary": (_INT, (ctypes.c_int32, _P, _I, _I, _I, _I, _I, _P, _P, _P, _I)),
    "servelm_silu_mul": (_INT, (ctypes.c_int32, _P, _P, _I, _I)),
    "servelm_amx_linear_supported": (_INT, (_I,)),
    "servelm_amx_linear": (_INT, (_P, _P, _I, _I, _I, _P, _I, _P, _INT)),
    "servelm_avx512_linear_supported": (_INT, (_I,)),
    "servelm_avx512_linear": (_INT, (_P, _P, _I, _I, _I, _P, _I, _P, _INT)),
    "servelm_dense_linear": (_INT, (ctypes.c_int32, _P, _P, _I, _I, _I, _P, _I, _P, _INT)),
    "servelm_bf16_dot": (_INT, ()),
    "servelm_set_bf16_dot": (None, (_INT,)),
    "servelm_prefill_attention_supported": (_INT, (_I,)),
    "servelm_paged_prefill_attention": (_INT, (_P, _I, _I, _P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _I, _P, _I, _I,
                                              _D, _I)),
    "servelm_paged_decode_attention": (_INT, (ctypes.c_int32, _P, _P, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _P,
                                             _D, _I)),
    "servelm_write_kv": (_INT, (_P, _P, _I, _I, _P, _I, _P, _I, _P, _I)),
    "servelm_argmax_rows": (_INT, (_P, ctypes.c_int32, _I, _I, _P)),
    "servelm_sample_rows": (_INT, (_P, ctypes.c_int32, _I, _I, _P, _P, _P, _P, _P, _P)),
    "servelm_copy_rows": (_INT, (_P, _I, _P, _I, _I, _I)),
    "servelm_run_tape": (_INT, (_P, _I)),
    # quant_linear.cpp: GGUF block-quantized weights
    "servelm_quant_linear_supported": (_INT, (_INT, _I)),
    "servelm_quant_linear": (_INT, (_P, _P, _I, _I, _I, _INT, _P, _I, _P, _INT, _I)),
    "servelm_quant_unpack": (_INT, (_P, _INT, _P, _I, _I)),
}
# entry points that compute nothing (queries and settings) or run a tape: never recorded on one
_NOT_RECORDED = ("servelm_last_error", "servelm_avx512_bf16_compiled", "servelm_amx_linear_supported",
                 "servelm_avx512_linear_supported", "servelm_bf16_dot", "servelm_set_bf16_dot",
                 "servelm_prefill_attention_supported", "servelm_run_tape", "servelm_quant_linear_supported")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# what a linear kernel stores (csrc/kernels.h Store): its sums rounded to the input's dtype, silu(gate) * up,
# or its float32 sums as they are (`out_dtype=torch.float32`: a bf16 model's logits)
_STORE_AS_INPUT, _STORE_SILU_MUL, _STORE_FLOAT32 = 0, 1, 2


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _store(silu_mul: bool, out_dtype: torch.dtype | None, x: torch.Tensor, name: str) -> tuple[int, torch.dtype]:
    """The kernel's `store` argument and the output's dtype."""
    _require(out_dtype in (None, x.dtype, torch.float32), f"{name}: out_dtype must be the input's dtype or float32")
    _require(not (silu_mul and out_dtype not in (None, x.dtype)), f"{name}: silu_mul stores the input's dtype")
    if silu_mul:
        return _STORE_SILU_MUL, x.dtype
    if out_dtype is None or out_dtype == x.dtype:
        return _STORE_AS_INPUT, x.dtype
    return _STORE_FLOAT32, torch.float32


class _Recording(threading.local):
    tape = None  # the recorder (model/kernels/tape.py) of this thread's calls, while it records


class _Recordable:
    """A computing C entry point that, on a thread recording a tape, also appends its call to the tape: the
    address of its `_tape` twin (tape.h) and its arguments as int64 words, with which of them are pointers.
    An entry without a twin makes the recorder refuse the tape (it would run without that call)."""

    __slots__ = ("name", "fn", "twin", "kinds", "recording")

    def __init__(self, lib: ctypes.CDLL, name: str, fn, argtypes: tuple, recording: _Recording) -> None:
        self.name, self.fn, self.recording = name, fn, recording
        self.kinds = tuple("p" if t is _P else "d" if t is _D else "i" for t in argtypes)
        self.twin = None
        if hasattr(lib, name + "_tape"):
            arity = getattr(lib, name + "_tape_arity")
            arity.restype, arity.argtypes = _I, ()
            _require(arity() == len(argtypes), f"{name}: the library takes {arity()} arguments, kernels/ops.py "
                     f"{len(argtypes)}")
            self.twin = ctypes.cast(getattr(lib, name + "_tape"), ctypes.c_void_p).value

    def __call__(self, *args):
        tape = self.recording.tape
        if tape is not None:
            if self.twin is None:
                tape.refuse(f"{self.name} has no tape entry")
            else:
                tape.append(self.twin, [_word(a, k) for a, k in zip(args, self.kinds, strict=True)], self.kinds)
        return self.fn(*args)


def _word(a, kind: str) -> int:
    """An argument as the int64 word a tape entry reads (tape.h): pointers as addresses, doubles as bits."""
    if kind == "d":
        return struct.unpack("<q", struct.pack("<d", float(a)))[0]
    return 0 if a is None else int(a)


class CpuKernels:
    """One loaded variant of the kernel library (`variant`, e.g. "amx"), with the functions of the former
    torch extension module under the same names."""

    def __init__(self, path: Path, variant: str) -> None:
        self.path, self.variant = Path(path), variant
        self._lib = ctypes.CDLL(str(path))
        self._recording = _Recording()
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            if name not in _NOT_RECORDED:
                fn = _Recordable(self._lib, name, fn, argtypes, self._recording)
            setattr(self, "_" + name.removeprefix("servelm_"), fn)
        self.avx512_bf16 = bool(self._avx512_bf16_compiled())

    def __repr__(self) -> str:
        return f"CpuKernels({self.variant!r}, {str(self.path)!r})"

    def _ok(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(self._last_error().decode(errors="replace"))

    # --- fused elementwise kernels, float32 or bf16 ----------------------------------------------------------

    def fused_elementwise_supported(self, t: torch.Tensor) -> bool:
        """Whether the fused norm/rotary/SiLU kernels take rows like `t`: float32 or bf16 on the CPU with a unit
        last stride (bf16 in AVX512-BF16 vectors where the build has them, else in the generic loops)."""
        return t.dtype in (torch.float32, torch.bfloat16) and t.is_cpu and t.stride(-1) == 1

    @staticmethod
    def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
        if t.dim() == 3:
            return t.shape[0], t.shape[1], t.stride(0), t.stride(1)
        return t.shape[0], 1, t.stride(0), 0

    def rms_norm(self, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        """out[r] = RMSNorm(x[r]) * w for each row of x ([T, D] or [T, H, D], unit last stride); out may be x."""
        _require(self.fused_elementwise_supported(x) and self.fused_elementwise_supported(out) and x.dim() in (2, 3)
                 and w.is_contiguous() and w.dtype == x.dtype == out.dtype and out.shape == x.shape
                 and w.shape[0] == x.shape[-1], "rms_norm needs float32 or bf16 rows with a unit last stride")
        self._ok(self._rms_norm(_DTYPES[x.dtype], out.data_ptr(), *self._rows(out), x.data_ptr(), *self._rows(x),
                                w.data_ptr(), x.shape[-1], eps))

    def add_rms_norm(self, out: torch.Tensor, delta: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> None:
        """residual += delta (in place, rounded to the dtype), out = RMSNorm(residual) * w; all contiguous [T, D]."""
        _require(self.fused_elementwise_supported(delta) and delta.is_contiguous() and residual.is_contiguous()
                 and out.is_contiguous() and delta.dtype == residual.dtype == out.dtype == w.dtype
                 and w.is_contiguous() and residual.dim() == 2 and w.shape[0] == residual.shape[1]
                 and delta.shape == residual.shape == out.shape,
                 "add_rms_norm needs contiguous float32 or bf16 [T, D] tensors of one dtype")
        self._ok(self._add_rms_norm(_DTYPES[delta.dtype], out.data_ptr(), delta.data_ptr(), residual.data_ptr(),
                                    w.data_ptr(), residual.shape[0], residual.shape[1], eps))

    def rotary_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates x [T, H, D] (unit last stride) in place at positions, reading the [max_pos, D] tables."""
        _require(self.fused_elementwise_supported(x) and x.dim() == 3 and cos.is_contiguous() and sin.is_contiguous()
                 and cos.dtype == sin.dtype == x.dtype and positions.dtype == torch.int64
                 and positions.is_contiguous() and x.shape[2] % 2 == 0,
                 "rotary_ needs float32 or bf16 [T, H, D] with a unit last stride, tables of its dtype and int64 "
                 "positions")
        _require(positions.numel() == x.shape[0] and cos.shape[-1] == x.shape[2] and sin.shape == cos.shape,
                 "rotary_: shapes differ")
        T, H, D = x.shape
        self._ok(self._rotary(_DTYPES[x.dtype], x.data_ptr(), T, H, D, x.stride(0), x.stride(1), positions.data_ptr(),
                              cos.data_ptr(), sin.data_ptr(), cos.shape[0]))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> [T, I]: silu(gate) * up, rounded as the op chain in the dtype rounds."""
        _require(self.fused_elementwise_supported(x) and x.dim() == 2 and x.is_contiguous() and x.shape[1] % 2 == 0,
                 "silu_mul needs contiguous float32 or bf16 [T, 2I]")
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        self._ok(self._silu_mul(_DTYPES[x.dtype], out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1] // 2))
        return out

    # --- bf16 linear layers over weights packed by layers.pack_weight_for_tiles ------------------------------

    def amx_linear_supported(self, K: int) -> bool:
        return bool(self._amx_linear_supported(K))

    def avx512_linear_supported(self, K: int) -> bool:
        return bool(self._avx512_linear_supported(K))

    def _packed_linear(self, fn, name: str, x: torch.Tensor, packed: torch.Tensor, N: int,
                       bias: torch.Tensor | None, silu_mul: bool, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        _require(x.dim() == 2 and x.dtype == torch.bfloat16 and packed.dtype == torch.bfloat16,
                 f"{name}: bf16 [M, K] input and packed weight")
        M, K = x.shape
        _require(K % 32 == 0 and N > 0 and packed.is_contiguous() and packed.numel() == (N + 31) // 32 * 32 * K,
                 f"{name}: a weight packed for {N} x {K} (K a multiple of 32)")
        _require(bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.numel() == N),
                 f"{name}: bias must be bf16 [N]")
        store, dtype = _store(silu_mul, out_dtype, x, name)
        if x.stride(1) != 1:
            x = x.contiguous()
        out = x.new_empty(M, N // 2 if silu_mul else N, dtype=dtype)
        self._ok(fn(out.data_ptr(), x.data_ptr(), M, K, x.stride(0), packed.data_ptr(), N,
                    None if bias is None else bias.data_ptr(), store))
        return out

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, N: int, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ w.T (+ bias) on AMX tiles, w packed by pack_weight_for_tiles: bf16, or with
        `out_dtype=torch.float32` the float32 sums unrounded."""
        return self._packed_linear(self._amx_linear, "amx_linear", x, packed, N, bias, False, out_dtype)

    def amx_linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor, N: int) -> torch.Tensor:
        """silu(gate) * up from x @ w.T, w a [gate; up] weight packed with gate_up=True."""
        return self._packed_linear(self._amx_linear, "amx_linear", x, packed, N, None, True)

    def avx512_linear(self, x: torch.Tensor, packed: torch.Tensor, N: int, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ w.T (+ bias) for bf16 rows, w packed by pack_weight_for_tiles (AVX512-BF16): bf16, or with
        `out_dtype=torch.float32` the float32 sums unrounded."""
        return self._packed_linear(self._avx512_linear, "avx512_linear", x, packed, N, bias, False, out_dtype)

    def avx512_linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor, N: int) -> torch.Tensor:
        return self._packed_linear(self._avx512_linear, "avx512_linear", x, packed, N, None, True)

    def dense_linear(self, x: torch.Tensor, packed: torch.Tensor, N: int, bias: torch.Tensor | None = None,
                     silu_mul: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] @ w.T (+ bias), or silu(gate) * up for a gate/up weight, w packed by `pack_dense_weight`
        (float32 or bf16, the dtype of x; `out_dtype=torch.float32`: the float32 sums unrounded): every output
        summed over K in order, whatever M (dense_linear.cpp)."""
        _require(x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and packed.dtype == x.dtype,
                 "dense_linear: float32 or bf16 [M, K] input and a packed weight of its dtype")
        M, K = x.shape
        _require(packed.is_contiguous() and packed.numel() == (N + 31) // 32 * 32 * K,
                 f"dense_linear: not a weight packed for {N} x {K}")
        _require(bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.numel() == N),
                 "dense_linear: bias must be [N] in the input's dtype")
        _require(not silu_mul or (N % 32 == 0 and bias is None), "dense_linear: silu_mul needs N % 32 == 0, no bias")
        store, dtype = _store(silu_mul, out_dtype, x, "dense_linear")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = x.new_empty(M, N // 2 if silu_mul else N, dtype=dtype)
        self._ok(self._dense_linear(_DTYPES[x.dtype], out.data_ptr(), x.data_ptr(), M, K, x.stride(0),
                                    packed.data_ptr(), N, None if bias is None else bias.data_ptr(), store))
        return out

    def bf16_dot(self) -> str:
        """How avx512_linear and paged_prefill_attention multiply bf16 pairs: 'bf16' or 'fma' ('none')."""
        return {1: "fma", 0: "bf16"}.get(self._bf16_dot(), "none")

    def set_bf16_dot(self, mode: str) -> None:
        _require(mode in ("bf16", "fma"), f"set_bf16_dot: 'bf16' or 'fma', not '{mode}'")
        self._set_bf16_dot(mode == "fma")

    # --- attention over the paged KV cache -------------------------------------------------------------------

    def prefill_attention_supported(self, q: torch.Tensor) -> bool:
        return q.dtype == torch.bfloat16 and q.dim() == 3 and bool(self._prefill_attention_supported(q.shape[2]))

    @staticmethod
    def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, name: str) -> None:
        _require(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                 and k_cache.dim() == 4 and k_cache.dtype == v_cache.dtype,
                 f"{name}: caches must be contiguous [blocks, block_size, kv_heads, head_dim] of one dtype")

    def paged_prefill_attention(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int, scale: float,
                                window: int) -> None:
        """Causal attention of one sequence's query chunk q [Q, H, D] (the last Q of ctx_len positions) over
        its paged cache, into out."""
        _require(self.prefill_attention_supported(q),
                 "paged_prefill_attention: needs AVX512-BF16, bf16 and head_dim % 32 == 0")
        self._check_caches(k_cache, v_cache, "paged_prefill_attention")
        _require(q.stride(2) == 1 and out.stride(2) == 1 and out.shape == q.shape and out.dtype == torch.bfloat16
                 and k_cache.dtype == torch.bfloat16 and k_cache.shape[3] == q.shape[2],
                 "paged_prefill_attention: q and out must be [tokens, heads, head_dim] with unit stride rows")
        _require(block_table.dtype == torch.int64 and block_table.is_contiguous(),
                 "paged_prefill_attention: the block table must be contiguous int64")
        nb, bs, kv, _ = k_cache.shape
        Q, H, D = q.shape
        self._ok(self._paged_prefill_attention(
            out.data_ptr(), out.stride(0), out.stride(1), q.data_ptr(), q.stride(0), q.stride(1), Q, H, D,
            k_cache.data_ptr(), v_cache.data_ptr(), nb, bs, kv, block_table.data_ptr(), block_table.numel(),
            ctx_len, scale, window))

    def paged_decode_attention(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, window: int) -> None:
        """out, q: [B, Hq, D]; block_tables [B, max_blocks] and seq_lens [B] int64; window <= 0: none."""
        _require(q.is_contiguous() and out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype
                 and q.dim() == 3, "paged_decode_attention needs contiguous tensors")
        self._check_caches(k_cache, v_cache, "paged_decode_attention")
        _require(block_tables.is_contiguous() and seq_lens.is_contiguous() and block_tables.dtype == torch.int64
                 and seq_lens.dtype == torch.int64 and block_tables.dim() == 2, "tables must be contiguous")
        _require(q.dtype in _DTYPES and k_cache.dtype == q.dtype and k_cache.shape[3] == q.shape[2],
                 "paged_decode_attention: float32, bfloat16 or float16 queries and caches of one head size")
        nb, bs, kv, D = k_cache.shape
        self._ok(self._paged_decode_attention(
            _DTYPES[q.dtype], out.data_ptr(), q.data_ptr(), q.shape[0], q.shape[1], k_cache.data_ptr(),
            v_cache.data_ptr(), nb, bs, kv, D, block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
            scale, window))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """Copies each token's keys and values (k, v [T, Hkv, D], heads contiguous) into its cache slot."""
        _require(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                 and k_cache.dim() == 4 and k.dim() == 3 and k.shape == v.shape and k.shape[1] == k_cache.shape[2]
                 and k.shape[2] == k_cache.shape[3], "write_kv: caches [blocks, block_size, Hkv, D] and k, v [T, Hkv, D]")
        _require(k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "write_kv: dtypes differ")
        for t in (k, v):
            _require(t.stride(2) == 1 and t.stride(1) == t.shape[2], "write_kv: each token's heads must be contiguous")
        _require(slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == k.shape[0],
                 "write_kv: one int64 slot per token")
        size = k.element_size()
        self._ok(self._write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0] * k_cache.shape[1],
                                k.shape[1] * k.shape[2] * size, k.data_ptr(), k.stride(0) * size, v.data_ptr(),
                                v.stride(0) * size, slots.data_ptr(), k.shape[0]))

    # --- the rest -------------------------------------------------------------------------------------------

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Index of the first maximum of each row of float32 or bf16 [B, V] logits, as torch.argmax."""
        _require(logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2,
                 "argmax_rows needs float32 or bf16 [B, V]")
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._ok(self._argmax_rows(logits.data_ptr(), _DTYPES[logits.dtype], logits.shape[0], logits.shape[1],
                                   out.data_ptr()))
        return out

    def sample_rows(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of float32 or bf16 [B, V] logits from its temperature (> 0), top-k (0: off), top-p
        (1: off) and min-p (0: off) distribution, drawn with the row's uniform number u in [0, 1): sample.cpp
        defines the distribution and the draw (engine/sampler.py's torch path is the same definition)."""
        _require(logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2 and logits.is_cpu,
                 "sample_rows needs float32 or bf16 [B, V] on the CPU")
        B = logits.shape[0]
        cols = [t.to(dtype).contiguous() for t, dtype in ((temperature, torch.float32), (top_k, torch.int64),
                                                           (top_p, torch.float32), (min_p, torch.float32),
                                                           (u, torch.float32))]
        _require(all(c.shape == (B,) for c in cols), "sample_rows: one temperature, top_k, top_p, min_p and u per row")
        logits = logits.contiguous()
        out = torch.empty(B, dtype=torch.int64)
        self._ok(self._sample_rows(logits.data_ptr(), _DTYPES[logits.dtype], B, logits.shape[1],
                                   *(c.data_ptr() for c in cols), out.data_ptr()))
        return out

    def copy_rows(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [T, ...] (contiguous) = x, whose rows (first dimension) are each contiguous but may be apart (a
        column slice of a fused projection)."""
        _require(out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype and x.dim() >= 2
                 and x.stride()[1:] == out.stride()[1:] and x.is_cpu and out.is_cpu,
                 "copy_rows: rows laid out contiguously, into a contiguous tensor of the same shape")
        size = x.element_size()
        self._ok(self._copy_rows(out.data_ptr(), out.stride(0) * size, x.data_ptr(), x.stride(0) * size, x.shape[0],
                                 out.stride(0) * size))

    def copy_into_rows(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [T, C] = x [T, C], each with contiguous rows that may be apart (out: a column slice of a fused
        projection's output, which one part's linear fills)."""
        _require(out.shape == x.shape and out.dtype == x.dtype and x.dim() == 2 and x.stride(1) == 1
                 and out.stride(1) == 1 and x.is_cpu and out.is_cpu,
                 "copy_into_rows: [T, C] tensors of one dtype with contiguous rows")
        size = x.element_size()
        self._ok(self._copy_rows(out.data_ptr(), out.stride(0) * size, x.data_ptr(), x.stride(0) * size, x.shape[0],
                                 x.shape[1] * size))

    # --- GGUF block-quantized linears (quant_linear.cpp; weights packed by gguf_quant.pack_blocks) ----------

    def quant_linear_supported(self, fmt: int, K: int) -> int:
        """0: this build or CPU does not run format `fmt` for K inputs; 1: the int8-activation kernel only
        (any number of rows); 2: that kernel for few rows and the bf16 tile path for many."""
        return int(self._quant_linear_supported(fmt, K))

    def quant_linear(self, x: torch.Tensor, packed: torch.Tensor, fmt: int, N: int, bias: torch.Tensor | None = None,
                     silu_mul: bool = False, int_rows: int | None = None, out_dtype: torch.dtype | None = None
                     ) -> torch.Tensor:
        """x [M, K] bf16 times a packed GGUF weight of N rows (+ bias; or SiLU(gate) * up for a gate/up weight
        packed with gate_up=True): [M, N] or [M, N / 2] bf16, or with `out_dtype=torch.float32` [M, N] of the
        float32 sums unrounded. Up to `int_rows` rows (default: any number) take the int8-activation kernel,
        more the bf16 tile path where the build has it."""
        _require(x.dim() == 2 and x.dtype == torch.bfloat16 and packed.dtype == torch.uint8 and packed.is_contiguous(),
                 "quant_linear: bf16 [M, K] input and a packed uint8 weight")
        M, K = x.shape
        _require(packed.numel() == packed_bytes(fmt, N, K), f"quant_linear: not a weight packed for {N} x {K}")
        _require(bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.numel() == N),
                 "quant_linear: bias must be bf16 [N]")
        store, dtype = _store(silu_mul, out_dtype, x, "quant_linear")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = x.new_empty(M, N // 2 if silu_mul else N, dtype=dtype)
        self._ok(self._quant_linear(out.data_ptr(), x.data_ptr(), M, K, x.stride(0), fmt, packed.data_ptr(), N,
                                    None if bias is None else bias.data_ptr(), store,
                                    M if int_rows is None else int_rows))
        return out

    def quant_unpack(self, packed: torch.Tensor, fmt: int, N: int, K: int) -> torch.Tensor:
        """The packed weight's float32 values [N, K] (gguf's dequantized tensor, bit for bit)."""
        _require(packed.dtype == torch.uint8 and packed.is_contiguous() and packed.numel() == packed_bytes(fmt, N, K),
                 f"quant_unpack: not a weight packed for {N} x {K}")
        out = torch.empty(N, K)
        self._ok(self._quant_unpack(out.data_ptr(), fmt, packed.data_ptr(), N, K))
        return out

    # --- kernel tapes (model/kernels/tape.py) ------------------------------------------------------------------------

    def recording(self, tape) -> _RecordingOn:
        """A context in which this thread's kernel calls are also appended to `tape` (they still run)."""
        return _RecordingOn(self._recording, tape)

    def run_tape(self, words: torch.Tensor) -> None:
        """Replays a recorded tape: int64 words, per call [entry, n, n argument words]."""
        self._ok(self._run_tape(words.data_ptr(), words.numel()))


class _RecordingOn:
    def __init__(self, recording: _Recording, tape) -> None:
        self.recording, self.tape = recording, tape

    def __enter__(self):
        _require(self.recording.tape is None, "already recording a tape on this thread")
        self.recording.tape = self.tape
        return self.tape

    def __exit__(self, *exc) -> None:
        self.recording.tape = None
