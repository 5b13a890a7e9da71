"""Fused projections whose parts a GGUF file stores in different types (a Q4_K_M file's Q6_K V beside Q4_K Q and
K) stay quantized part by part (model/quant/weight_only.py RowParts, model/layers/blocks.py PartsLinear): each part runs its own
kernel into its columns of the one output, a part without a kernel is dequantized alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_prompts, run

from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.blocks import GateUpLinear, Linear, PartsLinear, fused_kernels, linear_for
from servelm.model.quant.gguf import FORMATS, GGUFBlocks, GGUFMatmul, gguf_kernels
from servelm.model.quant.weight_only import RowParts, fuse_rows

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.quant_linear_supported(FORMATS["Q4_K"], 256),
                                reason="servelm's GGUF kernels do not run here")


def _k_blocks(qtype: str, rows: int, cols: int, seed: int) -> GGUFBlocks:
    """Random Q4_K / Q6_K blocks (gguf cannot quantize the K types): random codes and sub-scales, small d."""
    rng = np.random.default_rng(seed)
    size, d_at = (144, slice(0, 4)) if qtype == "Q4_K" else (210, slice(208, 210))
    raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    raw[:, d_at] = rng.uniform(0.001, 0.01, (len(raw), (d_at.stop - d_at.start) // 2)).astype(np.float16).view(
        np.uint8)
    return GGUFBlocks(qtype, torch.from_numpy(raw.reshape(rows, -1)), cols, torch.bfloat16)


def test_mixed_qkv_runs_each_part_in_its_own_format_into_its_columns():
    """Q4_K Q and K fused into one part, Q6_K V another, and a dense part: the output is each part's own
    kernel result in its columns, bit for bit (rows 3: the int8 kernel; 40: the bf16 tile path)."""
    q, k, v = _k_blocks("Q4_K", 64, 256, 1), _k_blocks("Q4_K", 32, 256, 2), _k_blocks("Q6_K", 32, 256, 3)
    w = fuse_rows([q, k, v])
    assert isinstance(w, RowParts) and w.source == "Q4_K+Q6_K" and w.shape == (128, 256)
    bias = torch.randn(128 + 16).bfloat16()
    dense = torch.randn(16, 256).bfloat16()
    lin = linear_for(fuse_rows([q, k, v, dense]), bias)
    assert isinstance(lin, PartsLinear) and lin.formats == ["Q4_K", "Q6_K", "bfloat16"]
    assert all(isinstance(m, GGUFMatmul) for m in lin.quant) and lin.columns == [(0, 96), (96, 128), (128, 144)]
    qk = GGUFMatmul(fuse_rows([q, k]), gguf_kernels(q))
    for m in (3, 40):
        x = torch.randn(m, 256).bfloat16()
        want = torch.cat([qk(x, bias[:96]), GGUFMatmul(v, gguf_kernels(v))(x, bias[96:128]),
                          Linear(dense, bias[128:])(x)], dim=-1)
        assert torch.equal(lin(x), want), m


def test_mixed_gate_up_is_silu_of_the_gate_part_times_the_up_part():
    gate, up = _k_blocks("Q4_K", 64, 256, 4), _k_blocks("Q6_K", 64, 256, 5)
    g = GateUpLinear(gate, up)
    assert isinstance(g.linear, PartsLinear) and g.linear.formats == ["Q4_K", "Q6_K"]
    x = torch.randn(2, 256).bfloat16()
    a, b = GGUFMatmul(gate, gguf_kernels(gate))(x), GGUFMatmul(up, gguf_kernels(up))(x)
    want = (torch.nn.functional.silu(a.float()).bfloat16().float() * b.float()).bfloat16()  # the bf16 op chain
    # PyTorch's SiLU, and the fused kernel where this CPU has it (bf16 on AVX512-BF16)
    assert torch.equal(g(x, None), want) and torch.equal(g(x, fused_kernels(torch.bfloat16)), want)


def test_same_format_and_dense_fusion_are_one_weight():
    q, k = _k_blocks("Q4_K", 32, 256, 6), _k_blocks("Q4_K", 32, 256, 7)
    assert isinstance(fuse_rows([q, k]), GGUFBlocks)
    dense = fuse_rows([torch.ones(2, 4), torch.zeros(3, 4)])
    assert isinstance(dense, torch.Tensor) and dense.shape == (5, 4)


# The tiny Llama's linears (64 and 128 inputs: no K types) in a mix as a Q4_K_M-like file has it; layer 1's K
# comes dense, as a type without a kernel is loaded.
TYPES = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q4_0",
         "up_proj": "Q8_0", "down_proj": "Q4_1"}
DENSE = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def mixed_llama(llama_dir):
    """A function of (kept, env) that loads the tiny Llama with its linears as GGUF blocks of TYPES (the loader's
    safetensors reader patched), kept as blocks or (kept False) dequantized as quantization none loads them."""
    import gguf

    from servelm import LLM
    from servelm.model import memory
    from servelm.model.loading import loader
    from servelm.model.quant.weight_only import is_linear_weight

    def load(kept: bool, env: dict):
        original = loader._iter_safetensors

        def quantized(path, dtype, **kw):
            for name, t in original(path, dtype, **kw):
                if is_linear_weight(name):
                    qtype = "Q5_0" if name == DENSE else TYPES[name.split(".")[-2]]
                    raw = gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType[qtype])
                    t = GGUFBlocks(qtype, torch.from_numpy(np.ascontiguousarray(raw)), t.shape[1], dtype)
                    if not kept or name == DENSE:
                        t = t.dequantize()
                yield name, t

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader, "_iter_safetensors", quantized)
            # each weight in its own tensor (not one huge-page arena): a decode tape must vouch for every
            # part's packed weight on its own
            mp.setattr(memory, "WEIGHTS_IN_HUGE_PAGES", False)
            for key, value in env.items():
                mp.setenv(key, value)
            return LLM(str(llama_dir), dtype="bfloat16", num_kv_blocks=32)

    return load


def test_mixed_gguf_llama_keeps_every_part_quantized_and_matches_the_reference(mixed_llama):
    from servelm import SamplingParams

    llm = mixed_llama(True, {})
    model = llm.engine.core.model
    assert [lw.qkv.formats for lw in model.layers] == [["Q4_0", "Q8_0"], ["Q4_0", "bfloat16", "Q8_0"]]
    assert all(lw.gate_up.linear.formats == ["Q4_0", "Q8_0"] for lw in model.layers)
    assert all(isinstance(m, GGUFMatmul) for lw in model.layers for m in lw.qkv.quant + lw.gate_up.linear.quant)
    prompts = random_prompts(2, 5, 20, seed=7)  # prefill and decode
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = run(llm, prompts, greedy)
    if model.tapes is not None:  # decode steps replayed from kernel tapes: the parts' kernels and row copies
        assert model.tapes.active and model.tapes.replayed > 0, model.tapes.refused
    assert got == run(mixed_llama(True, {"SERVELM_QUANT_KERNEL": "reference"}), prompts, greedy)

    # against the same weights dequantized (quantization none), by prompt logprobs: the int8 kernel, which takes
    # every row count, rounds activations to int8, which moves logits by about a bf16 step
    short = random_prompts(3, 8, 14, seed=3)
    logprobs = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(llm, batched: bool) -> torch.Tensor:
        outs = llm.generate(short, logprobs, use_tqdm=False) if batched else \
            [llm.generate([p], logprobs, use_tqdm=False)[0] for p in short]
        return torch.tensor([d[t].logprob for p, o in zip(short, outs, strict=True)
                             for t, d in zip(p[1:], o.prompt_logprobs[1:], strict=True)])

    none = mixed_llama(False, {})
    mine, dense = prompt_logprobs(llm, False), prompt_logprobs(none, False)
    assert (mine - dense).abs().max() < 0.05 * dense.abs().mean()
    # and a prompt's bits do not depend on its batch: three prompts at once (more than 16 rows) as one at a time
    assert torch.equal(prompt_logprobs(llm, True), mine)
