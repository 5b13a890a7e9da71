"""Cohere's Command R (`CohereForCausalLM`) and Command R7B / Command A (`Cohere2ForCausalLM`): their choices over the
shared decoder, read from a transformers config.

Their layer is a parallel block: one norm, then the attention and the MLP both read its output and both outputs
join the residual stream at once. The norms are LayerNorms without bias (the mean taken out, the weight applied in
float32 before one rounding); Command R+'s optional q/k norms are LayerNorms with a weight of their own per head.
RoPE rotates neighbouring pairs (interleaved, run as half-split over q/k rows reordered at load:
model/layers/rope_layout.py); the logits are multiplied by `logit_scale`. Command R7B and Command A add
sliding-window layers (`layer_types`) that apply RoPE beside global layers that attend without positions.

The LayerNorms and the parallel sum run PyTorch ops, so decode steps are not replayed from kernel tapes.
"""

from __future__ import annotations

COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")


def cohere_options(config) -> dict:
    """ModelSpec fields for a Cohere config (its norm epsilon is read from layer_norm_eps)."""
    opts: dict = {"layer_norm": True, "parallel_residual": True, "interleaved_rope": True,
                  "norm_weight_in_float32": True, "logits_scale": float(getattr(config, "logit_scale", 1.0))}
    types = getattr(config, "layer_types", None)
    if getattr(config, "sliding_window", None) and types is not None:  # Cohere2: RoPE on the local layers only
        opts["rope_layers"] = [t == "sliding_attention" for t in types]
    return opts
