"""A model config from a GGUF header: every key that changes the computation is read or the file is refused.

transformers' GGUF support drops metadata (Llama-3 RoPE scaling, YaRN, Qwen3's head_dim), which gives a
silently different model. This builds the Hugging Face-style config itself from the header, before any
tokenizer work, and refuses with one line what servelm cannot run as the file says.
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace

from servelm.model.loading.gguf_header import GGUFHeader, read_f32_tensor, read_gguf_file_header

# GGUF architecture -> (transformers model_type, architecture class).
# A `llama` file with experts is Mixtral.
GGUF_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("mistral", "MistralForCausalLM"),
                      "qwen2": ("qwen2", "Qwen2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                      "phi3": ("phi3", "Phi3ForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
                      "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"), "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                      "smollm3": ("smollm3", "SmolLM3ForCausalLM"), "granite": ("granite", "GraniteForCausalLM"),
                      # llama.cpp writes OLMo 3 as olmo2 with its sliding window (read as OLMo 3 below)
                      "olmo2": ("olmo2", "Olmo2ForCausalLM"), "exaone4": ("exaone4", "Exaone4ForCausalLM"),
                      "seed_oss": ("seed_oss", "SeedOssForCausalLM"), "glm4": ("glm4", "Glm4ForCausalLM"),
                      "command-r": ("cohere", "CohereForCausalLM"), "cohere2": ("cohere2", "Cohere2ForCausalLM")}
# `{arch}.` keys this module reads (every other one is refused).
_ARCH_KEYS = frozenset({
    "vocab_size", "context_length", "embedding_length", "feed_forward_length", "block_count",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "rope.freq_base", "rope.freq_base_swa", "rope.dimension_count", "rope.scale_linear", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "rope.scaling.attn_factor",
    "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
    "expert_gating_func",
})
# Keys only some architectures may carry: Granite's four scalars (llama.cpp's names for its multipliers), and
# Cohere's LayerNorm epsilon and logit scale.
_COHERE_KEYS = frozenset({"logit_scale", "attention.layer_norm_epsilon"})  # LayerNorms, scaled logits
_OWN_KEYS = {"granite": frozenset({"attention.scale", "embedding_scale", "residual_scale", "logit_scale"}),
             "command-r": _COHERE_KEYS, "cohere2": _COHERE_KEYS}
_COHERE_ARCHS = ("command-r", "cohere2")
# llama.cpp's fixed window patterns where a file states none: Gemma 3's five local layers then one global, Cohere2's
# three then one
_FIXED_PATTERNS = {"gemma3": 6, "cohere2": 4}
# llama.cpp's SmolLM3 runs every fourth layer without RoPE, a rule its files do not state (no_rope_layers is
# not converted): the one HF's SmolLM3Config defaults to.
SMOLLM3_NO_ROPE_STEP = 4
_MOE_ARCHS = ("llama", "qwen2moe", "qwen3moe")  # the ones whose files may hold experts
_GATING_SOFTMAX = 1  # llama.cpp's expert_gating_func for a softmax router (its default)
_GLOBAL_TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"})
_BLOCK_TENSORS = frozenset({f"{n}.{p}" for n in ("attn_q", "attn_k", "attn_v", "attn_output") for p in ("weight", "bias")}
                           | {f"{n}.weight" for n in ("attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
_QK_NORMS = frozenset({"attn_q_norm.weight", "attn_k_norm.weight"})
# Phi-3: fused Q/K/V; its ffn_up holds gate and up.
_PHI3_TENSORS = frozenset({"attn_qkv.weight", "attn_output.weight", "attn_norm.weight", "ffn_norm.weight",
                           "ffn_up.weight", "ffn_down.weight"})
_PHI3_GLOBAL = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
_EXPERT_TENSORS = frozenset({f"{n}.weight" for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                                       "ffn_gate_up_exps")})
_SHARED_EXPERT_TENSORS = frozenset({f"{n}.weight" for n in ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp",
                                                              "ffn_down_shexp")})
_SANDWICH_NORMS = frozenset({"post_attention_norm.weight", "post_ffw_norm.weight"})  # norms after the sublayers
_POST_NORM_ARCHS = ("gemma3", "olmo2", "exaone4", "glm4")  # the ones with them
_PARTIAL_ROPE_ARCHS = ("phi3", "glm4")
_QK_NORM_ARCHS = ("qwen3", "qwen3moe", "gemma3", "olmo2", "exaone4")
# Families whose Hugging Face configs can carry a sliding window that llama.cpp's converter does not write.
_WINDOW_FAMILIES = ("mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


class GGUFUnsupported(ValueError):
    """A GGUF file whose metadata or tensors servelm cannot honour (the message is one line)."""


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    want = struct.pack("<f", x)
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == want:
            return y
    return x


class _Reader:
    def __init__(self, path: Path, head: GGUFHeader, arch: str) -> None:
        self.path, self.head, self.arch = path, head, arch

    def refuse(self, why: str):
        raise GGUFUnsupported(f"GGUF file {self.path.name}: {why}")

    def get(self, key: str, default=None, kind: type = int, required: bool = False):
        full = f"{self.arch}.{key}"
        value = self.head.fields.get(full, default)
        if full not in self.head.fields:
            if required:
                self.refuse(f"metadata key {full} is missing")
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _f32(value) if full in self.head.float32_keys else float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (str, bool, list) and isinstance(value, kind):
            return value
        self.refuse(f"metadata {full} = {_short(value)} is not a single {kind.__name__} (per-layer values are "
                    "not supported)")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_gguf_config(path: Path) -> SimpleNamespace | object:
    """The config of a GGUF model, or GGUFUnsupported naming what servelm cannot honour."""
    return config_from_dict(gguf_config_dict(path, read_gguf_file_header(path)))


def config_from_dict(d: dict) -> SimpleNamespace | object:
    """Plain attributes where the RoPE is unscaled, else transformers' class (its RoPE initialisers)."""
    params = d["rope_parameters"]
    per_type = params.values() if "rope_type" not in params else [params]  # Gemma 3: one per layer type
    if all(p["rope_type"] == "default" for p in per_type):
        return SimpleNamespace(**d)
    from transformers import AutoConfig  # its RoPE initialisers read the class's attributes

    return AutoConfig.for_model(**d)


def gguf_config_dict(path: Path, head: GGUFHeader) -> dict:
    """The config.json a Hugging Face folder of this model would have (plus `rope_freq_factors` where the
    file has a rope_freqs tensor, and `gguf_sliding_window_unstated` where it may have lost a window)."""
    f = head.fields
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFUnsupported(f"GGUF file {path.name}: architecture {arch!r} is not supported (supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)})")
    r = _Reader(path, head, arch)
    if f.get("general.type", "model") != "model":
        r.refuse(f"general.type is {f['general.type']!r}; only whole models (not adapters) load")
    if (f.get("split.count") or 1) > 1 and not head.shards:  # a split model's file, renamed: its others unknown
        r.refuse(f"it is file {f.get('split.no', 0) + 1} of {f['split.count']} of a split GGUF model, named other "
                 "than NAME-00001-of-0000N.gguf, so its other files cannot be found; restore llama.cpp's names")
    known = _ARCH_KEYS | _OWN_KEYS.get(arch, frozenset())
    unknown = sorted(k for k in f if k.startswith(arch + ".") and k[len(arch) + 1:] not in known)
    if unknown:
        r.refuse(f"metadata {', '.join(unknown)} changes the model in a way servelm does not implement")
    n_layers = r.get("block_count", required=True)
    _check_tensors(r, n_layers)
    hidden = r.get("embedding_length", required=True)
    n_head = r.get("attention.head_count", required=True)
    head_dim = r.get("attention.key_length", hidden // n_head)
    if r.get("attention.value_length", head_dim) != head_dim:
        r.refuse(f"{arch}.attention.value_length {f[arch + '.attention.value_length']} differs from the key length "
                 f"{head_dim} (value heads of another size are not supported)")
    rope_dims = r.get("rope.dimension_count", head_dim)
    if rope_dims != head_dim and (arch not in _PARTIAL_ROPE_ARCHS or not 0 < rope_dims < head_dim or rope_dims % 2):
        r.refuse(f"{arch}.rope.dimension_count {rope_dims} is not the head size {head_dim} "
                 f"(partial rotary embeddings are supported for {' and '.join(_PARTIAL_ROPE_ARCHS)} only)")
    model_type, cls = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and r.get("expert_count") is not None:
        model_type, cls = "mixtral", "MixtralForCausalLM"
    if arch == "olmo2" and r.get("attention.sliding_window", None):
        model_type, cls = "olmo3", "Olmo3ForCausalLM"
    tensors = {name: shape for name, shape, _, _ in head.tensors}
    if "token_embd.weight" not in tensors:
        r.refuse("the token_embd.weight tensor is missing")
    d = {
        "architectures": [cls], "model_type": model_type, "hidden_act": "silu",
        **(_gemma3(r, head_dim) if arch == "gemma3" else {}),
        "vocab_size": r.get("vocab_size", tensors["token_embd.weight"][1]),
        "hidden_size": hidden, "intermediate_size": r.get("feed_forward_length", required=True),
        "num_hidden_layers": n_layers, "num_attention_heads": n_head,
        "num_key_value_heads": r.get("attention.head_count_kv", n_head), "head_dim": head_dim,
        **({"layer_norm_eps": r.get("attention.layer_norm_epsilon", kind=float, required=True),
            "logit_scale": r.get("logit_scale", 1.0, kind=float),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors} if arch in _COHERE_ARCHS else
           {"rms_norm_eps": r.get("attention.layer_norm_rms_epsilon", kind=float, required=True)}),
        "max_position_embeddings": r.get("context_length", required=True),
        "tie_word_embeddings": "output.weight" not in tensors,
        **_token_ids(f),
    }
    d["rope_parameters"] = _phi3_rope(r, d, tensors) if arch == "phi3" else _rope_parameters(r)
    if rope_dims != head_dim:  # Phi-4-mini: only the first rope_dims of each head rotate
        d["rope_parameters"]["partial_rotary_factor"] = rope_dims / head_dim
    d.update(_experts(r, n_layers, tensors))
    if arch == "granite":
        d.update(_granite(r, head_dim))
    if arch == "smollm3":
        d["no_rope_layers"] = [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(n_layers)]
        d["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_STEP
    factors = read_f32_tensor(path, head, "rope_freqs.weight")
    if factors is not None:  # llama.cpp's form of Llama-3 scaling: per-dimension frequency divisors
        if d["rope_parameters"]["rope_type"] != "default":
            r.refuse("a rope_freqs tensor together with RoPE scaling type "
                     f"{d['rope_parameters']['rope_type']!r} is not supported")
        if len(factors) != head_dim // 2:
            r.refuse(f"rope_freqs has {len(factors)} values, expected {head_dim // 2}")
        d["rope_freq_factors"] = factors
    d.update(_windows(r, n_layers))
    swa_base = r.get("rope.freq_base_swa", None, kind=float)
    if arch == "gemma3":  # the local layers' base: the file's, else llama.cpp's fixed 10000 (older files)
        d["rope_parameters"] = {"full_attention": d["rope_parameters"],
                                "sliding_attention": {"rope_type": "default", "rope_theta": swa_base or 10000.0}}
    elif swa_base is not None and swa_base != d["rope_parameters"].get("rope_theta"):
        r.refuse(f"{arch}.rope.freq_base_swa (a RoPE base of its own for sliding-window layers) is not supported")
    return d


def _gemma3(r: _Reader, head_dim: int) -> dict:
    """Gemma 3 as llama.cpp runs it: GeGLU, query scale head_dim**-0.5 (all but the 27B, whose file this
    cannot tell apart: refused), norm weights already stored as (1 + w) by llama.cpp's converter."""
    if r.get("embedding_length") == 5376:
        r.refuse("Gemma 3 27B scales queries by hidden_size / num_heads, which the file does not state")
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": head_dim, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "gguf_norms_include_one": True}


def _granite(r: _Reader, head_dim: int) -> dict:
    """Granite's multipliers, as GraniteConfig names them. A file without attention.scale attends with
    1/sqrt(head_dim), as llama.cpp does then; the others default to 1."""
    return {"embedding_multiplier": r.get("embedding_scale", 1.0, kind=float),
            "attention_multiplier": r.get("attention.scale", head_dim ** -0.5, kind=float),
            "residual_multiplier": r.get("residual_scale", 1.0, kind=float),
            "logits_scaling": r.get("logit_scale", 1.0, kind=float)}


def _check_tensors(r: _Reader, n_layers: int) -> None:
    """Every tensor must be one the decoder uses: an unknown one would be skipped, a different model."""
    allowed = _PHI3_TENSORS if r.arch == "phi3" else _BLOCK_TENSORS
    if r.arch in ("olmo2", "exaone4"):  # norms after the sublayers only
        allowed = allowed - {"attn_norm.weight", "ffn_norm.weight"}
    if r.arch == "seed_oss":  # the norm in front of the MLP under another name
        allowed = allowed - {"ffn_norm.weight"} | {"post_attention_norm.weight"}
    if r.arch == "glm4":  # gate and up in ffn_up
        allowed = allowed - {"ffn_gate.weight"}
    if r.arch in _COHERE_ARCHS:  # one norm per layer (a parallel block); Command R+'s q/k norms
        allowed = allowed - {"ffn_norm.weight"} | _QK_NORMS
    allowed = allowed | (_QK_NORMS if r.arch in _QK_NORM_ARCHS else frozenset()) \
        | (_SANDWICH_NORMS if r.arch in _POST_NORM_ARCHS else frozenset())
    if r.arch in _MOE_ARCHS and r.get("expert_count") is not None:
        allowed = allowed | _EXPERT_TENSORS | (_SHARED_EXPERT_TENSORS if r.arch == "qwen2moe" else frozenset())
    bad, norms = [], set()
    for name, *_ in r.head.tensors:
        if name in _GLOBAL_TENSORS or (r.arch == "phi3" and name in _PHI3_GLOBAL):
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers \
                and parts[2] in allowed:
            if parts[2] in _QK_NORMS:
                norms.add(name)
            continue
        bad.append(name)
    if bad:
        r.refuse(f"tensor {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} is not part of a {r.arch} model "
                 "that servelm implements")
    if r.arch in _QK_NORM_ARCHS and len(norms) != 2 * n_layers:
        r.refuse(f"a {r.arch} model needs attn_q_norm and attn_k_norm in every block")
    if r.arch in _POST_NORM_ARCHS:
        names = {name for name, *_ in r.head.tensors}
        if any(f"blk.{i}.{n}" not in names for i in range(n_layers) for n in _SANDWICH_NORMS):
            r.refuse(f"a {r.arch} model needs post_attention_norm and post_ffw_norm in every block")


def _experts(r: _Reader, n_layers: int, tensors: dict) -> dict:
    """The config's MoE keys. llama.cpp states no norm_topk_prob: it renormalises Qwen3-MoE's top-k weights
    (and Mixtral's), not Qwen2-MoE's, and so does servelm. A block without a router is a dense layer."""
    n = r.get("expert_count", None)
    if n is None:
        if r.arch in ("qwen2moe", "qwen3moe"):
            r.refuse(f"metadata key {r.arch}.expert_count is missing")
        return {}
    if r.arch not in _MOE_ARCHS:
        r.refuse(f"{r.arch}.expert_count: experts are not supported for {r.arch}")
    if r.get("expert_gating_func", _GATING_SOFTMAX) != _GATING_SOFTMAX:
        r.refuse(f"{r.arch}.expert_gating_func {r.get('expert_gating_func')} is not supported (only softmax)")
    dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if r.arch == "llama" and dense:
        r.refuse(f"llama.expert_count {n}, but block {dense[0]} has no ffn_gate_inp (router): a Mixtral model has "
                 "experts in every block")
    k = r.get("expert_used_count", required=True)
    if r.arch == "llama":
        return {"num_local_experts": n, "num_experts_per_tok": k}
    out = {"num_experts": n, "num_experts_per_tok": k, "norm_topk_prob": r.arch == "qwen3moe",
           "moe_intermediate_size": r.get("expert_feed_forward_length", required=True),
           "mlp_only_layers": dense, "decoder_sparse_step": 1}
    if r.arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = r.get("expert_shared_feed_forward_length", required=True)
    return out


def _phi3_rope(r: _Reader, d: dict, tensors: dict) -> dict:
    """Phi-3's RoPE: default, or LongRoPE, which llama.cpp stores as rope_factors_long/short tensors, the
    original context and the attention factor (transformers' Phi3Config reads the original context at the top
    level, so it goes there too)."""
    long, short = (read_f32_tensor(r.path, r.head, f"rope_factors_{n}.weight") for n in ("long", "short"))
    kind = r.get("rope.scaling.type", None, kind=str)
    if long is None and short is None:
        if kind not in (None, "none"):
            r.refuse(f"phi3.rope.scaling.type {kind!r} is not supported (only LongRoPE's factor tensors)")
        if r.get("rope.scaling.attn_factor", 1.0, kind=float) != 1.0:
            r.refuse(f"phi3.rope.scaling.attn_factor {r.get('rope.scaling.attn_factor', kind=float)} is given "
                     "without LongRoPE factors")
        return {"rope_type": "default", "rope_theta": r.get("rope.freq_base", 10000.0, kind=float)}
    if long is None or short is None or len(long) != len(short):
        r.refuse("LongRoPE needs rope_factors_long and rope_factors_short tensors of one length")
    original = r.get("rope.scaling.original_context_length", required=True)
    d["original_max_position_embeddings"] = original
    params = {"rope_type": "longrope", "rope_theta": r.get("rope.freq_base", 10000.0, kind=float),
              "long_factor": list(long), "short_factor": list(short), "original_max_position_embeddings": original}
    attn = r.get("rope.scaling.attn_factor", None, kind=float)
    if attn is not None:
        params["attention_factor"] = attn
    return params


def _token_ids(f: dict) -> dict:
    """BOS/EOS/pad ids; llama.cpp also ends generation at end-of-turn and end-of-message tokens."""
    out = {}
    for gguf_key, hf in (("bos", "bos"), ("padding", "pad")):
        if isinstance(f.get(f"tokenizer.ggml.{gguf_key}_token_id"), int):
            out[f"{hf}_token_id"] = f[f"tokenizer.ggml.{gguf_key}_token_id"]
    eos = [f[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if isinstance(f.get(k), int)]
    eos = list(dict.fromkeys(eos))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def _rope_parameters(r: _Reader) -> dict:
    theta = r.get("rope.freq_base", 10000.0, kind=float)
    kind = r.get("rope.scaling.type", None, kind=str)
    factor = r.get("rope.scaling.factor", None, kind=float)
    linear = r.get("rope.scale_linear", None, kind=float)  # the older key for linear scaling
    if kind in (None, "none") and linear not in (None, 1.0):
        kind, factor = "linear", linear
    if r.get("rope.scaling.attn_factor", 1.0, kind=float) != 1.0:
        r.refuse(f"{r.arch}.rope.scaling.attn_factor {r.get('rope.scaling.attn_factor', kind=float)} is not supported")
    if kind in (None, "none"):
        if factor not in (None, 0.0, 1.0):
            r.refuse(f"{r.arch}.rope.scaling.factor {factor} is given without a scaling type")
        return {"rope_type": "default", "rope_theta": theta}
    if not factor or factor <= 0:
        r.refuse(f"{r.arch}.rope.scaling.type {kind!r} needs a positive {r.arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if kind != "yarn":
        r.refuse(f"{r.arch}.rope.scaling.type {kind!r} is not supported (supported: none, linear, yarn)")
    ext = r.get("rope.scaling.yarn_ext_factor", -1.0, kind=float)
    if ext >= 0 and ext != 1.0:  # negative: llama.cpp's "unset", which is 1 for YaRN
        r.refuse(f"{r.arch}.rope.scaling.yarn_ext_factor {ext} is not supported (only 1)")
    params = {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
              "original_max_position_embeddings": r.get("rope.scaling.original_context_length", required=True)}
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                    ("yarn_attn_factor", "attention_factor")):
        value = r.get(f"rope.scaling.{key}", None, kind=float)
        if value is not None:
            params[hf] = value
    return params


def _windows(r: _Reader, n_layers: int) -> dict:
    """sliding_window and per-layer layer_types, as llama.cpp reads the window and its layer pattern."""
    window = r.get("attention.sliding_window", None)
    if window is None:
        name = " ".join(str(r.head.fields.get(k, "")) for k in ("general.name", "general.basename")).lower()
        unstated = r.arch in _WINDOW_FAMILIES or "mistral" in name
        return {"sliding_window": None, "gguf_sliding_window_unstated": unstated}
    if window == 0:
        return {"sliding_window": None}
    pattern = r.head.fields.get(f"{r.arch}.attention.sliding_window_pattern")
    if pattern is None and r.arch in _FIXED_PATTERNS:
        pattern = _FIXED_PATTERNS[r.arch]
    if pattern is None:
        sliding = [True] * n_layers
    elif isinstance(pattern, list) and len(pattern) == n_layers:
        sliding = [bool(x) for x in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool):  # every n-th layer full (0: none)
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    else:
        r.refuse(f"{r.arch}.attention.sliding_window_pattern {_short(pattern)} does not give one value per layer")
    return {"sliding_window": window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
