"""Architecture options read from a transformers config: one decoder serves every supported family."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.model.gemma import GEMMA_ARCHITECTURES, gemma_options
from servelm.model.metadata import SUPPORTED_ARCHITECTURES, architecture


@dataclass
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: list[int | None]  # per layer
    inv_freq: torch.Tensor  # rotary inverse frequencies (float32), RoPE scaling already applied
    rope_attention_factor: float
    # per-architecture choices (servelm/model/gemma.py); the defaults are the Llama family's
    hidden_act: str = "silu"  # silu | gelu_tanh (the MLP's gate activation)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    norm_unit_offset: bool = False  # RMSNorm weights applied as (1 + w) (Gemma)
    sandwich_norms: bool = False  # a norm before and after each sublayer (Gemma 2/3)
    attn_scale: float | None = None  # attention score scale (default head_dim**-0.5)
    attn_softcap: float | None = None  # scores soft-capped as cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped likewise (Gemma 2)
    local_inv_freq: torch.Tensor | None = None  # RoPE of the sliding-window layers, if theirs differs (Gemma 3)

    @classmethod
    def from_hf_config(cls, config, sliding_window: int | None = None) -> ModelSpec:
        """`sliding_window` (the engine setting) puts that window on every layer, whatever the config says."""
        arch = architecture(config)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if arch in GEMMA_ARCHITECTURES:
            opts = gemma_options(config, arch, head_dim, _rope)
        else:
            act = getattr(config, "hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
            opts = {}
        if "inv_freq" not in opts:
            opts["inv_freq"], opts["rope_attention_factor"] = _rope(config, head_dim)
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_windows=[sliding_window] * config.num_hidden_layers if sliding_window else _sliding_windows(config),
            **opts,
        )


def _sliding_windows(config) -> list[int | None]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if layer_types is not None:  # Qwen2/Qwen3: only "sliding_attention" layers use the window
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * n  # Mistral: every layer


def _rope(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies via transformers' own RoPE initialisers, so every scaling type matches it."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        factors = getattr(config, "rope_freq_factors", None)  # a GGUF's rope_freqs (Llama-3 scaling)
        if factors is not None:  # divided as llama.cpp does: exactly the llama3 rule's frequencies
            inv = inv / torch.tensor(factors, dtype=torch.float32)
        return inv, 1.0
    if getattr(config, "rope_freq_factors", None) is not None:
        raise ValueError(f"rope_freq_factors with RoPE scaling {rope_type!r} is not supported")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling depends on sequence length and is not supported")
    # Imported only here: the module pulls in torch._dynamo and most of transformers (seconds of start-up).
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.float(), float(factor)
