"""Plain reads of a Hugging Face model folder, so start-up need not build transformers' model classes.

transformers 5 imports most of itself (torch._dynamo included: 2-3 s here) the first time it builds a
model config class, and AutoTokenizer builds one only to read `model_type`. Start-up needs a handful
of values, so a config.json that states them all is read as plain JSON. Whatever these readers cannot
vouch for (RoPE scaling, keys left to a class default, remote code) goes the transformers way.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

# The families whose config classes keep config.json's values as they are (no derived fields that
# ModelSpec reads), given the keys below are present.
PLAIN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_REQUIRED_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "rms_norm_eps", "max_position_embeddings")
# Where a class would otherwise derive the per-layer sliding windows itself.
_WINDOW_KEY = {"mistral": "sliding_window", "qwen2": "layer_types", "qwen3": "layer_types"}
# Tokenizer classes that AutoTokenizer turns into the generic TokenizersBackend for these model types
# (tests/model/test_metadata.py checks this against AutoTokenizer itself).
_GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama"})


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def plain_config(folder: Path) -> SimpleNamespace | None:
    """config.json as attributes, or None where transformers' config class could read it differently."""
    d = read_json(folder / "config.json")
    if d is None or d.get("model_type") not in PLAIN_MODEL_TYPES or any(k not in d for k in _REQUIRED_KEYS):
        return None
    window_key = _WINDOW_KEY.get(d["model_type"])
    if window_key is not None and window_key not in d:
        return None
    rope = d.get("rope_parameters") or {}
    if d.get("rope_scaling") or not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        return None
    theta = rope.get("rope_theta", d.get("rope_theta"))
    if theta is None or d.get("rope_theta", theta) != theta:
        return None
    return SimpleNamespace(**d)


def tokenizer_eos_id(folder: Path) -> int | None:
    """The tokenizer's EOS id from tokenizer_config.json and tokenizer.json, without building it."""
    tc = read_json(folder / "tokenizer_config.json")
    if tc is None or not (folder / "tokenizer.json").is_file():
        return None
    eos = tc.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(eos)


def tokenizer_from_folder(folder: Path):
    """The tokenizer AutoTokenizer would build, without it building the model's config class first."""
    tc = read_json(folder / "tokenizer_config.json") or {}
    cfg = read_json(folder / "config.json")
    named = tc.get("tokenizer_class")
    if cfg is None or not isinstance(named, str) or "auto_map" in tc:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    if named in _GENERIC_TOKENIZERS and cfg.get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES \
            and (folder / "tokenizer.json").is_file():
        # The generic class imports without transformers' auto machinery (and without torch).
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    # AutoTokenizer reads only these fields of the config when tokenizer_config.json names its class.
    light = SimpleNamespace(model_type=cfg.get("model_type"), tokenizer_class=cfg.get("tokenizer_class"))
    if "model_name" in cfg:
        light.model_name = cfg["model_name"]
    return AutoTokenizer.from_pretrained(folder, config=light)


# Encoder-only families: they embed, score or classify text rather than generate it.
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra"})


def is_encoder(config: dict) -> bool:
    """Whether a checkpoint's config is an encoder (the embedding process runs it), not a decoder."""
    return config.get("model_type") in ENCODER_MODEL_TYPES or "BertModel" in (config.get("architectures") or [])


def is_embedding_folder(folder: Path, config: dict) -> bool:
    """Whether a folder holds a model that embeds rather than generates, as vLLM decides it: an encoder, a
    sentence-transformers model with a Pooling module whatever its architecture (Qwen3-Embedding's config names
    Qwen3ForCausalLM), or an architecture named as a bare model (`Qwen2Model`, `*EmbeddingModel`)."""
    from servelm.model.loading.st_config import has_pooling_module

    archs = [str(a) for a in config.get("architectures") or []]
    bare = bool(archs) and all(a.endswith("Model") and not a.endswith(_GENERATIVE_MODEL_SUFFIXES) for a in archs)
    return is_encoder(config) or is_classifier(config) or has_pooling_module(folder) or bare


# architectures named ...Model that generate (vLLM's suffix table: GPT2LMHeadModel, ChatGLM's ...ChatModel)
_GENERATIVE_MODEL_SUFFIXES = ("LMHeadModel", "ChatModel")


def is_classifier(config: dict) -> bool:
    """Whether a checkpoint's config is a sequence classifier (a cross-encoder, a text classifier, a decoder
    reranker or reward model such as Qwen3ForSequenceClassification): its outputs are per-label logits of the
    whole input, not token vectors."""
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])
