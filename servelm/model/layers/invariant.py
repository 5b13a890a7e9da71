"""The `batch_invariant` mode: a guarantee, checked at start-up, that every token gets the same bits whatever
it was batched with, however its prompt was chunked, cached or preempted.

servelm's C++ CPU kernels give that by construction on every build variant (csrc/dense_linear.cpp,
amx_linear.cpp, avx512_linear.cpp and quant_linear.cpp sum each row in one fixed order whatever the row
count; paged_attention.cpp and prefill_attention.cpp give each query its own fixed order), and the other
per-token operations (norms, rotary, residual adds, the sampler) work row by row. So the default CPU path is
batch invariant already, and the mode changes no computation: it refuses, at start-up and naming why, a model
or setting whose path makes no such promise, instead of serving with one silently:

- no C++ kernels (SERVELM_CPU_KERNELS=0, or not built): PyTorch's matmuls (oneDNN, MKL) and SDPA pick their
  blocking by shape and by CPU, and on AMD Zen and AVX2 CPUs changed rows' sums with the row count;
- Gemma's GeGLU MLP and soft-capped attention, and mixture-of-experts routing (PyTorch ops);
- linears left to PyTorch: int8/int4 quantization (PyTorch's kernels), float16, or weights no kernel takes.
"""

from __future__ import annotations

from servelm.model.decoder import DecoderLM
from servelm.model.layers.blocks import GateUpLinear, Linear, PartsLinear


def _runs_in_a_kernel(lin) -> bool:
    """Whether a linear runs in one of the kernels that sum each row in a fixed order."""
    if isinstance(lin, PartsLinear):
        return all(_runs_in_a_kernel(p) for p in lin.parts)
    if isinstance(lin, GateUpLinear):  # the SiLU-and-multiply fused into a kernel's store, not PyTorch's silu
        return lin.kernel is not None and lin.kernel.fixed_order
    if isinstance(lin, Linear):
        return lin.kernel.fixed_order
    return False


def check_batch_invariant(model: DecoderLM) -> None:
    """Raises ValueError naming what keeps `model` from being batch invariant; marks it invariant otherwise."""
    from servelm.model.attention import CpuPagedAttention

    if model.embed.device.type != "cpu":
        raise ValueError("batch_invariant runs on the CPU only")
    if not isinstance(model.attn, CpuPagedAttention):
        raise ValueError("batch_invariant needs servelm's C++ CPU kernels, which are off or not built here "
                         "(SERVELM_CPU_KERNELS=0, or a checkout built without a compiler): PyTorch's matmuls "
                         "and attention change a row's sums with the batch on some CPUs")
    spec = model.spec
    if spec.sandwich_norms or spec.post_norms_only or spec.moe is not None or spec.attn_softcap:
        raise ValueError(f"batch_invariant is not supported for {spec.architecture} (its norms, MLP, attention "
                         "or expert routing run in PyTorch ops)")
    linears = [model.lm_head] + [lin for lw in model.layers for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
    left = [lin for lin in linears if not _runs_in_a_kernel(lin)]
    if left:
        raise ValueError(f"batch_invariant: {len(left)} linear layers run in PyTorch's kernels here (dtype "
                         f"{str(model.dtype).removeprefix('torch.')}, quantization {model.quantization}); use "
                         "float32 or bfloat16 with quantization none, auto or gguf")
    model.batch_invariant = True
