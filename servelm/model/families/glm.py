"""GLM-4 (the 0414 models: `Glm4ForCausalLM`) and ERNIE 4.5 (`Ernie4_5ForCausalLM`): their choices over the shared
decoder, read from a transformers config.

Both rotate pairs of neighbouring dims (GPT-J's interleaved RoPE), which servelm runs as the half-split RoPE of
every other family by reordering the q/k rows as they load (model/layers/rope_layout.py). GLM-4 adds, over the
Llama layer: a norm after each sublayer as well as before it (sandwich norms, under its own names), RoPE on half
of each head (`partial_rotary_factor` 0.5), q/k/v biases, and gate and up stored as one `gate_up_proj`. ERNIE
4.5 is otherwise the Llama layer.
"""

from __future__ import annotations

GLM_ARCHITECTURES = ("Glm4ForCausalLM", "Ernie4_5ForCausalLM")
# GLM-4's names of the norm after the attention, the one before the MLP and the one after it
_GLM4_NORMS = ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


def glm_options(config, arch: str) -> dict:
    """ModelSpec fields for a GLM-4 or ERNIE 4.5 config (RoPE, partial RoPE included, is read as for Llama)."""
    if getattr(config, "use_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError(f"{arch} with MLP biases (use_bias) is not supported")
    if arch == "Glm4ForCausalLM":
        return {"interleaved_rope": True, "sandwich_norms": True, "sandwich_norm_names": _GLM4_NORMS}
    return {"interleaved_rope": True}
