"""Architecture options read from a transformers config: one decoder serves every supported family."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from servelm.model.families.cohere import COHERE_ARCHITECTURES, cohere_options
from servelm.model.families.gemma import GEMMA_ARCHITECTURES, gemma_options
from servelm.model.families.glm import GLM_ARCHITECTURES, glm_options
from servelm.model.families.ministral import ministral3_options
from servelm.model.families.moe import MOE_ARCHITECTURES, MoeOptions, moe_options
from servelm.model.families.olmo import OLMO_ARCHITECTURES, exaone4_options, olmo_options
from servelm.model.families.phi3 import PHI3_ARCHITECTURES, phi3_options
from servelm.model.loading.metadata import SUPPORTED_ARCHITECTURES, architecture

logger = logging.getLogger(__name__)


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
    # per-architecture choices (servelm/model/families/gemma.py, phi3.py, moe.py); the defaults are the Llama family's
    hidden_act: str = "silu"  # silu | gelu_tanh (the MLP's gate activation)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    norm_unit_offset: bool = False  # RMSNorm weights applied as (1 + w) (Gemma)
    norm_weight_in_float32: bool = False  # RMSNorm scales by its weight before rounding (Gemma), not after
    sandwich_norms: bool = False  # a norm before and after each sublayer (Gemma 2/3, GLM-4)
    # with sandwich norms, the checkpoint's names of the norms after the attention, before the MLP and after it
    sandwich_norm_names: tuple[str, str, str] = ("post_attention_layernorm", "pre_feedforward_layernorm",
                                                 "post_feedforward_layernorm")
    post_norms_only: bool = False  # a norm after each sublayer, none before it (OLMo 2/3, EXAONE 4)
    whole_qk_norm: bool = False  # q/k norms over the whole projections, before the split into heads (OLMo 2/3)
    attn_scale: float | None = None  # attention score scale (default head_dim**-0.5)
    attn_softcap: float | None = None  # scores soft-capped as cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped likewise (Gemma 2)
    local_inv_freq: torch.Tensor | None = None  # RoPE of the sliding-window layers, if theirs differs (Gemma 3, OLMo 3)
    local_rope_attention_factor: float = 1.0
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head only (partial_rotary_factor < 1)
    # the checkpoint rotates pairs of neighbouring dims (GLM-4, ERNIE 4.5): its q/k rows are reordered at load so
    # that the usual half-split RoPE computes the same (model/layers/rope_layout.py)
    interleaved_rope: bool = False
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj already joined (Phi-3)
    moe: MoeOptions | None = None  # mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE)
    rope_layers: list[bool] | None = None  # per layer, whether it applies RoPE (SmolLM3's NoPE layers); None: all
    residual_scale: float | None = None  # each sublayer's output times this before its residual add (Granite)
    logits_divisor: float | None = None  # the logits divided by this (Granite's logits_scaling)
    logits_scale: float | None = None  # the logits multiplied by this (Cohere's logit_scale)
    # queries times 1 + beta * log(1 + floor(position / length)) after RoPE (Ministral 3: Llama 4's temperature)
    query_scale_beta: float | None = None
    query_scale_length: int = 0
    extra_layers: int = 0  # layers the checkpoint has past num_layers, left unread (GLM-4.5's next-token prediction)
    layer_norm: bool = False  # norms are LayerNorms without bias (Cohere), not RMSNorms; rms_norm_eps is theirs
    parallel_residual: bool = False  # attention and MLP read the same normed input, both add to h (Cohere)

    @classmethod
    def from_hf_config(cls, config, sliding_window: int | None = None) -> ModelSpec:
        """`sliding_window` (the engine setting) puts that window on every layer, whatever the config says."""
        arch = architecture(config)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if arch in GEMMA_ARCHITECTURES:
            opts = gemma_options(config, arch, head_dim)
        else:
            opts = phi3_options(config) if arch in PHI3_ARCHITECTURES else {}
            if arch in OLMO_ARCHITECTURES:
                opts.update(olmo_options(config))
            if arch in GLM_ARCHITECTURES:
                opts.update(glm_options(config, arch))
            if arch == "Exaone4ForCausalLM":  # OLMo's norms after the sublayers, per-head q/k norms, NoPE global layers
                opts.update(exaone4_options(config))
            if arch in COHERE_ARCHITECTURES:
                opts.update(cohere_options(config))
            if arch == "Ministral3ForCausalLM":
                opts.update(ministral3_options(config))
            if arch == "SeedOssForCausalLM" and getattr(config, "mlp_bias", False):
                raise ValueError("SeedOssForCausalLM with mlp_bias is not supported")
            if arch in MOE_ARCHITECTURES:
                opts["moe"] = moe_options(config, arch)
            if arch == "Glm4MoeForCausalLM":  # its checkpoints hold next-token prediction layers past the model's
                opts["extra_layers"] = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
            act = getattr(config, "hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        if arch == "SmolLM3ForCausalLM":  # every n-th layer attends without positions (NoPE)
            opts["rope_layers"] = [bool(x) for x in config.no_rope_layers]
        if arch == "GraniteForCausalLM":  # Llama's layer with four scalars (muP)
            opts.update(embed_scale=float(config.embedding_multiplier), attn_scale=float(config.attention_multiplier),
                        residual_scale=float(config.residual_multiplier), logits_divisor=float(config.logits_scaling))
        opts.update(layer_type_ropes(config, head_dim))
        if "inv_freq" not in opts:
            opts["inv_freq"], opts["rope_attention_factor"] = _rope(config, head_dim)
            if 2 * len(opts["inv_freq"]) != head_dim:  # partial_rotary_factor: the rest of each head passes
                opts["rotary_dim"] = 2 * len(opts["inv_freq"])
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.layer_norm_eps if opts.get("layer_norm") else config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=_max_positions(config),
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


def _max_positions(config) -> int:
    """The longest sequence servelm runs as transformers does. LongRoPE (Phi-3) switches every position's
    frequencies from its short to its long factors once a sequence passes original_max_position_embeddings
    (transformers recomputes them per forward call, vLLM per batch): a paged KV cache of keys rotated once
    cannot follow that switch, so servelm runs the short factors up to the original length and no further."""
    n = config.max_position_embeddings
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None) or n
        if original < n:
            logger.warning("longrope RoPE scaling: context limited to original_max_position_embeddings=%d (of "
                           "max_position_embeddings=%d); its long factors (past that length) are not supported",
                           original, n)
        return min(n, original)
    return n


def _rope(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies via transformers' own RoPE initialisers, so every scaling type matches it. With a
    partial_rotary_factor below 1 they cover only that fraction of each head (as transformers'). `layer_type`:
    the RoPE of one kind of layer, for configs that give each its own (`rope_parameters["sliding_attention"]`)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        dim = int(head_dim * factor)
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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

    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv, factor = init(config, "cpu") if layer_type is None else init(config, "cpu", layer_type=layer_type)
    return inv.float(), float(factor)


def layer_type_ropes(config, head_dim: int) -> dict:
    """ModelSpec's RoPE fields for a config whose global and sliding-window layers each have their own RoPE
    (`rope_parameters` keyed by layer type: Gemma 3, OLMo 3); {} for one RoPE over every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" not in params:
        return {}
    opts = {}
    opts["inv_freq"], opts["rope_attention_factor"] = _rope(config, head_dim, "full_attention")
    if params.get("sliding_attention") is not None:
        opts["local_inv_freq"], opts["local_rope_attention_factor"] = _rope(config, head_dim, "sliding_attention")
    return opts
