"""quantization fp8 on a GPU with FP8 tensor cores (compute capability >= 8.9): `torch._scaled_mm` with
per-token activation scales against the same arithmetic in float32 and against the reference path, the
weight-only Triton kernel at the 8B shape's sizes, the kernel choice on CUDA, and the engine end to end (CUDA
graphs and eager) close to the reference path.
Skipped without CUDA or below sm89."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_checkpoints import write_fp8_checkpoint
from tiny_models import build_model, random_prompts, run

from servelm import LLM, SamplingParams
from servelm.model.layers.linear_kernels import Fp8Kernel, select_linear
from servelm.model.quant.fp8 import (
    WEIGHT_ONLY_ROWS,
    Fp8ByRows,
    Fp8ReferenceMatmul,
    Fp8ScaledMatmul,
    Fp8Weight,
    fp8_matmul,
    quantize_fp8,
    quantize_rows,
)
from servelm.model.quant.triton_matmul import TritonFp8Matmul

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA device of compute capability >= 8.9 (FP8 tensor cores)")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _emulated(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """What the fast path computes, in float32: per-token fp8 activations times the per-row fp8 weight. The
    activations are quantized on the CPU, whose division is correctly rounded, as the path's Triton kernel's is;
    PyTorch's CUDA division is not always (an H200 gave 83.99999 for a quotient of 84.000008, on the other side
    of the tie between e4m3's 80 and 88), so its codes differ from the definition's in a few elements."""
    xq, sa = quantize_rows(x.cpu())
    xq, sa = xq.to(x.device), sa.to(x.device)
    return (xq.float() * sa) @ (w.codes.float() * w.scales).T


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 200])
@pytest.mark.parametrize("shape", [(64, 64), (256, 128), (4096, 2048)])
def test_scaled_mm_matches_its_arithmetic_and_the_reference(rows, shape):
    g = torch.Generator(device="cuda").manual_seed(rows)
    n, k = shape
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g), torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    both = fp8_matmul(w)
    assert isinstance(both, Fp8ByRows), "both fast paths must run on this GPU"
    mm = both.large
    # the path's quantizer (one Triton kernel) gives the definition's bits
    codes, scales = mm.quantize(x)
    want_codes, want_scales = quantize_rows(x.cpu())
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)
    want = _emulated(x, w)
    for multiple in {mm.row_multiple, 16}:  # as chosen, and with the rows padded
        y = Fp8ScaledMatmul(w, multiple)(x)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), want, rtol=2 ** -7, atol=2e-3 * want.abs().max().item())
    # against the weight-only reference: the activations' e4m3 rounding (2^-4 relative per element) is the gap
    ref = Fp8ReferenceMatmul(w)(x).float()
    gap = (mm(x).float() - ref).abs()
    assert (gap <= 2 ** -4 * (x.float().abs() @ w.dequantize(torch.float32).abs().T) + 1e-2).all()
    assert gap.mean() < 0.05 * ref.abs().mean()  # (measured on an H200: 2.3% at k = 64)


def test_block_scaled_weight_runs_requantized_per_row():
    g = torch.Generator(device="cuda").manual_seed(7)
    codes = (torch.randn(256, 384, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(256, 3, device="cuda", generator=g) + 0.01
    w = Fp8Weight(codes, scales, 128, torch.bfloat16, "fp8/block128x128")
    mm = fp8_matmul(w)
    assert isinstance(mm, Fp8ByRows) and isinstance(mm.large, Fp8ScaledMatmul)
    assert mm.small.codes.data_ptr() == mm.large.codes.data_ptr()  # one requantized copy for both paths
    x = torch.randn(WEIGHT_ONLY_ROWS + 9, 384, device="cuda", generator=g).to(torch.bfloat16)
    ref = F.linear(x.float(), w.dequantize(torch.float32))
    for rows in (9, WEIGHT_ONLY_ROWS + 9):  # the weight-only kernel, then _scaled_mm
        gap = (mm(x[:rows]).float() - ref[:rows]).abs().mean()
        assert gap < 0.06 * ref[:rows].abs().mean()  # (_scaled_mm, measured on an H200: 3.8%)


def test_kernel_choice_on_cuda():
    def kernel(n, k, dtype):
        return select_linear(quantize_fp8(torch.randn(n, k), dtype).to("cuda"))

    assert isinstance(kernel(64, 64, torch.bfloat16), Fp8Kernel)
    assert kernel(64, 64, torch.bfloat16).path == "triton+scaled_mm"
    assert kernel(64, 64, torch.float32).path == "triton"  # row-wise scaled matmuls return bfloat16
    assert kernel(40, 64, torch.bfloat16).path == "triton"  # not a multiple of 16 for _scaled_mm
    lin = kernel(48, 32, torch.float32)
    x = torch.randn(3, 32, device="cuda")
    torch.testing.assert_close(lin(x), F.linear(x, lin.matmul.codes.float() * lin.matmul.scales), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("rows", [1, 7, 16, 64])
@pytest.mark.parametrize("shape", [(4096, 4096), (6144, 4096), (4096, 14336), (1000, 1000)])
def test_weight_only_kernel_at_llama_8b_shapes(rows, shape):
    """The compiled weight-only kernel at the 8B shape's o_proj, qkv and down_proj (split over the inputs on
    this GPU's SMs) and a ragged shape, bf16, against float32 arithmetic on the stored weight."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    n, k = shape
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g), torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    mm = TritonFp8Matmul(w)
    want = x.float() @ (w.codes.float() * w.scales).T
    y = mm(x)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2 ** -7, atol=2e-3 * want.abs().max().item())
    torch.testing.assert_close(mm(x, splits=1).float(), y.float(), rtol=2 ** -7, atol=2e-3 * want.abs().max().item())


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("fp8gpu")
    src = build_model("llama", root / "llama", tokenizer_dir, seed=5)
    write_fp8_checkpoint(src, root / "fp8", root / "twin", "block", (128, 128))
    return src, root / "fp8"


def _prompt_logprobs(llm, prompts) -> torch.Tensor:
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([d[t].logprob for o, p in zip(outs, prompts, strict=True)
                         for d, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)])


@pytest.mark.parametrize("mode", ["graphs", "eager"])
@pytest.mark.parametrize("which", ["quantized_at_load", "checkpoint"])
def test_engine_with_fp8_on_cuda_is_close_to_the_reference_path(which, mode, fp8_llama):
    """bfloat16 on the FP8 tensor cores against the same weights on the CPU's exact reference path in float32:
    teacher-forced prompt logprobs within the activations' rounding, and each first greedy token one the
    reference nearly picks too (the two round activations differently, so near-tied picks may differ and the
    continuations after them diverge). The CPU's own `_scaled_mm` in place of the GPU's gave a mean logprob
    gap of 1.6% and first-token gaps of at most 0.16 nats on these models."""
    src, ckpt = fp8_llama
    folder = str(src if which == "quantized_at_load" else ckpt)
    kw = dict(quantization="fp8") if which == "quantized_at_load" else {}
    llm = LLM(folder, dtype="bfloat16", device="cuda", enforce_eager=mode == "eager", num_kv_blocks=64, **kw)
    model = llm.engine.core.model
    assert model.quantization == "fp8"
    lins = [lin for lw in model.layers for lin in (lw.qkv, lw.o_proj, lw.down, lw.gate_up.linear)]
    assert all(lin.kernel.path == "triton+scaled_mm" for lin in lins)
    cpu = LLM(folder, dtype="float32", num_kv_blocks=64, **kw)
    prompts = random_prompts(4, 8, 40, seed=31)
    got, want = _prompt_logprobs(llm, prompts), _prompt_logprobs(cpu, prompts)
    assert (got - want).abs().mean() < 0.05 * want.abs().mean(), ((got - want).abs().max(), want.abs().mean())
    firsts = [t[0] for t in run(llm, prompts, GREEDY)]
    outs = cpu.generate([p + [t] for p, t in zip(prompts, firsts, strict=True)],
                        SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for o, p, t in zip(outs, prompts, firsts, strict=True):
        top = o.prompt_logprobs[len(p)]  # the reference's best and the fast path's pick, after the prompt
        assert max(v.logprob for v in top.values()) - top[t].logprob < 0.5, (p, t, top)
    assert (llm.engine.core.runner.num_graph_steps > 0) == (mode == "graphs")
