"""Ministral (`MinistralForCausalLM`, Ministral-8B-2410) and Ministral 3 (`Ministral3ForCausalLM`, also the language
model of the Ministral 3 checkpoints, `Mistral3ForConditionalGeneration`): their choices over the shared decoder.

Ministral is Mistral's layer with its sliding window on the layers `layer_types` marks: read as for every family.
Ministral 3 is Mistral's layer with YaRN (through transformers' initialiser) and Llama 4's attention temperature:
past the RoPE's original context L, queries are multiplied after RoPE by 1 + beta * log(1 + floor(position / L))
(`llama_4_scaling_beta`), which the decoder applies where it is not 1 (DecoderLM._query_scales).
"""

from __future__ import annotations


def ministral3_options(config) -> dict:
    """ModelSpec fields for a Ministral 3 config."""
    params = getattr(config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return {}
    length = params.get("original_max_position_embeddings")
    if not length:
        raise ValueError("Ministral3ForCausalLM: llama_4_scaling_beta needs the RoPE's original_max_position_embeddings")
    return {"query_scale_beta": float(beta), "query_scale_length": int(length)}
