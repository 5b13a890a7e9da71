"""OLMo 2 and OLMo 3: their choices over the shared decoder, read from a transformers config.

Both norm each sublayer's output and nothing before it: the attention and the MLP read the residual stream
itself, and their outputs pass `post_attention_layernorm` and `post_feedforward_layernorm` before the
residual add (a Llama checkpoint's `input_layernorm` does not exist here). Their q/k norms normalise the
whole query and key projections, all heads together, before the split into heads (Qwen3's norm each head).
The norms scale by their weight in float32 and round once, as Gemma's do. OLMo 3 adds Gemma-style
sliding-window layers (`layer_types`), each kind of layer with its own RoPE (spec.layer_type_ropes).

These layers run PyTorch norms, so decode steps are not replayed from kernel tapes (model/kernels/tape.py),
and whole-projection q/k norms cannot be split over tensor-parallel ranks (model/layers/parallel.py).
"""

from __future__ import annotations

OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")


def olmo_options(config) -> dict:
    """ModelSpec fields for an OLMo 2 or OLMo 3 config (RoPE and windows are read as for every family)."""
    return {"post_norms_only": True, "whole_qk_norm": True, "norm_weight_in_float32": True}
