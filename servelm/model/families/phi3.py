"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share its class): its choices over the shared decoder.

Its layer is the Llama layer; what differs is how the checkpoint stores it and its RoPE:
- `self_attn.qkv_proj` holds Q, K and V in one matrix (in that order) and `mlp.gate_up_proj` the gate and
  up projections (gate first): the decoder's fused QKV and gate/up linears take them as they are.
- RoPE: default, or `longrope` with short and long factors per frequency and an attention factor
  (through transformers' initialiser, like every scaling type: `spec._rope`). The context is limited to
  `original_max_position_embeddings`, the length up to which the short factors apply (`spec._max_positions`
  says why the long ones cannot be followed).
- `partial_rotary_factor` (Phi-4-mini: 0.75) rotates only the first part of each head: handled by the
  decoder for every family (`ModelSpec.rotary_dim`), on its Python layer loop.
- A `sliding_window` (Phi-3-mini-4k: 2047) applies to every layer, as Mistral's.

With full-head RoPE a Phi-3 layer is exactly the Llama layer once loaded, so its decode steps are also
replayed from kernel tapes (model/kernels/tape.py); partial RoPE runs PyTorch ops, which keeps it on the Python loop.
"""

from __future__ import annotations

PHI3_ARCHITECTURES = ("Phi3ForCausalLM",)


def phi3_options(config) -> dict:
    """ModelSpec fields for a Phi-3 config (the rest, RoPE and windows included, is read as for Llama)."""
    return {"fused_checkpoint": True}
