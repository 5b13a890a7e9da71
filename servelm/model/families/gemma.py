"""Gemma 2 and Gemma 3 (text): their choices over the shared decoder, read from a transformers config.

Both wrap each sublayer in a norm before and after it ("sandwich" norms: input, post-attention,
pre-feedforward, post-feedforward), scale the embeddings by sqrt(hidden_size), use GeGLU (tanh GELU) in
the MLP, RMSNorm weights applied as (1 + w), and an attention scale of query_pre_attn_scalar**-0.5.
Gemma 2 soft-caps attention scores and final logits (cap * tanh(x / cap)) and alternates sliding-window
and global layers. Gemma 3 drops the soft-caps, adds q/k norms, and gives local (sliding-window) and
global layers their own RoPE bases.

These choices are read by the shared layer loop (`DecoderLM.run_layers`). Gemma's norms (weight applied in
float32) and GeGLU have no fused kernel and run PyTorch ops, so its decode steps are not replayed from
kernel tapes (model/kernels/tape.py).
"""

from __future__ import annotations

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def gemma_options(config, arch: str, head_dim: int) -> dict:
    """ModelSpec fields for a Gemma config."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"hidden_activation {act!r} is not supported for {arch} (only gelu_pytorch_tanh)")
    opts = dict(
        hidden_act="gelu_tanh",
        embed_scale=float(config.hidden_size) ** 0.5,
        # llama.cpp's converter stores Gemma's norm weights with the one already added
        norm_unit_offset=not getattr(config, "gguf_norms_include_one", False),
        norm_weight_in_float32=True,
        sandwich_norms=True,
        attn_scale=float(getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )
    # one RoPE per layer type (rope_parameters keyed "full_attention" and "sliding_attention") is read by
    # spec.layer_type_ropes; transformers 4 named only the local layers' base
    params = getattr(config, "rope_parameters", None) or {}
    if arch == "Gemma3ForCausalLM" and "full_attention" not in params and getattr(config, "rope_local_base_freq", None):
        base = float(config.rope_local_base_freq)
        import torch

        opts["local_inv_freq"] = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return opts
