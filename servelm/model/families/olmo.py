"""OLMo 2, OLMo 3 and EXAONE 4: their choices over the shared decoder, read from a transformers config.

OLMo 2 and 3 norm each sublayer's output and nothing before it: the attention and the MLP read the residual stream
itself, and their outputs pass `post_attention_layernorm` and `post_feedforward_layernorm` before the
residual add (a Llama checkpoint's `input_layernorm` does not exist here). Their q/k norms normalise the
whole query and key projections, all heads together, before the split into heads (Qwen3's norm each head).
The norms scale by their weight in float32 and round once, as Gemma's do. OLMo 3 adds Gemma-style
sliding-window layers (`layer_types`), each kind of layer with its own RoPE (spec.layer_type_ropes).

EXAONE 4 (`Exaone4ForCausalLM`) has the same norms after the sublayers, none before them, with Qwen3's per-head
q/k norms (weights applied as Llama's) and, where it sets a sliding window, local layers with RoPE and global
layers without (`layer_types`).

These layers add to the residual stream in PyTorch ops, so decode steps are not replayed from kernel tapes
(model/kernels/tape.py), and whole-projection q/k norms cannot be split over tensor-parallel ranks
(model/layers/parallel.py).
"""

from __future__ import annotations

OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")


def olmo_options(config) -> dict:
    """ModelSpec fields for an OLMo 2 or OLMo 3 config (RoPE and windows are read as for every family)."""
    return {"post_norms_only": True, "whole_qk_norm": True, "norm_weight_in_float32": True}


def exaone4_options(config) -> dict:
    """ModelSpec fields for an EXAONE 4 config: its global layers attend without RoPE once it has local ones."""
    opts: dict = {"post_norms_only": True}
    types = getattr(config, "layer_types", None)
    if getattr(config, "sliding_window", None) and types is not None:
        opts["rope_layers"] = [t == "sliding_attention" for t in types]
    return opts
