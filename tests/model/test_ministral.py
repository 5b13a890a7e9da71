"""Ministral (8B-2410's sliding-window layout) and Ministral 3 (YaRN, and Llama 4's query scaling past the RoPE's
original context). Tiny random-weight models match transformers' greedy outputs token for token (bfloat16: up to
rounding at near ties), alone and batched with prefix caching and chunked prefill; the mixed prompts reach past
the scaled model's original context of 16, where its queries are scaled."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from family_parity import check_parity, ministral3_config, ministral_config, save_tiny  # noqa: E402

from servelm.model.kernels import cpu as cpu_kernels  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ministral3_matches_transformers(tmp_path, tokenizer_dir, dtype):
    llm = check_parity(save_tiny(ministral3_config(), tmp_path / "m3", tokenizer_dir), dtype)
    model = llm.engine.core.model
    assert (model.spec.query_scale_beta, model.spec.query_scale_length) == (0.5, 16)
    scales = model._query_scales(torch.tensor([0, 15, 16, 47]))
    assert scales.flatten().tolist() == pytest.approx([1.0, 1.0, 1 + 0.5 * torch.log(torch.tensor(2.0)).item(),
                                                       1 + 0.5 * torch.log(torch.tensor(3.0)).item()], rel=1e-2)
    assert model._query_scales(torch.tensor([0, 15])) is None  # under L on the CPU: nothing to scale


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ministral_matches_transformers(tmp_path, tokenizer_dir, dtype):
    llm = check_parity(save_tiny(ministral_config(), tmp_path / "m", tokenizer_dir), dtype)
    model = llm.engine.core.model
    assert model.spec.sliding_windows == [24, 24, 24, None]
    kernels = cpu_kernels.load()
    if dtype == "bfloat16" and kernels is not None and kernels.avx512_linear_supported(64):
        assert model.tapes.active  # Mistral's layer: decode steps replay kernel tapes
