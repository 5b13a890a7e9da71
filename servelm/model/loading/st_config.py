"""How a sentence-transformers folder says its embeddings are made, read as sentence-transformers reads it.

An embedding model published for sentence-transformers lists its modules in `modules.json`: the transformer,
then a Pooling module (its `config.json` names the pooling: the first token, the mean, the last token...), often
a Normalize module; `sentence_bert_config.json` (or `sentence_<family>_config.json`) caps the input at
`max_seq_length` tokens and may lower-case it. vLLM reads the same files for its pooling models, and so does
servelm, so that an embedding equals `SentenceTransformer(folder).encode(text)`: bge's and mxbai's come from
the first token, all-MiniLM's and e5's from the mean, Qwen3-Embedding's and gte-Qwen2's from the last token.

A folder without `modules.json` gets vLLM's defaults: the first token of an encoder (BERT's [CLS]), the last token
of a decoder, normalized, up to the model's own length limit. Modules other than the transformer, pooling and
normalization (a Dense projection, say) are refused by name rather than skipped, which would give vectors of
another space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' pooling modes (the older configs' booleans concatenate in this order; a
# `pooling_mode` list, in its own)
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# the older configs' booleans, one per mode
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                 "sentence_camembert_config.json", "sentence_albert_config.json",
                 "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")
_RUN = frozenset({"Transformer", "Pooling", "Normalize"})  # the modules servelm runs


@dataclass(frozen=True)
class EmbeddingRecipe:
    """pooling: the modes, concatenated in this order; normalize: L2 normalization of the result;
    max_seq_length: the most tokens an input keeps (None: the model's own limit); lower_case: the text is
    lower-cased before tokenization; source: where these came from, for logs and errors."""

    pooling: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None
    lower_case: bool
    source: str


def modules(folder: Path) -> list[dict] | None:
    """modules.json's entries, or None where the folder has none (or it is not a list of modules)."""
    try:
        data = json.loads((Path(folder) / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, list) and all(isinstance(m, dict) for m in data) else None


def _kind(module: dict) -> str:
    """A module's class name: sentence_transformers.models.Pooling (or the newer module path) -> Pooling."""
    return str(module.get("type", "")).rpartition(".")[2]


def has_pooling_module(folder: Path) -> bool:
    """Whether the folder is a sentence-transformers model that pools (an embedding model, whatever its
    architecture: Qwen3-Embedding's config names Qwen3ForCausalLM)."""
    return any(_kind(m) == "Pooling" for m in modules(folder) or [])


def _pooling_modes(config: dict) -> tuple[str, ...]:
    """A Pooling module's modes: `pooling_mode` (a name or a list), else the older booleans, else the mean."""
    mode = config.get("pooling_mode")
    if mode is not None:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(m for key, m in _LEGACY_KEYS.items() if config.get(key) is True) or ("mean",)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise ValueError(f"pooling mode {unknown or modes!r} is not one of sentence-transformers' {POOLING_MODES}")
    return modes


def _tokenizer_settings(folder: Path) -> tuple[int | None, bool]:
    for name in _CONFIG_FILES:
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            length = data.get("max_seq_length")
            return (int(length) if isinstance(length, int) and length > 0 else None), bool(data.get("do_lower_case"))
    return None, False


def read_recipe(folder: Path, decoder: bool) -> EmbeddingRecipe:
    """The folder's embedding recipe (`decoder`: the model is causal, whose default pooling is the last
    token). Raises ValueError for modules servelm does not run or a pooling mode it does not know."""
    folder = Path(folder)
    listed = modules(folder)
    max_len, lower = _tokenizer_settings(folder)
    if listed is None:
        return EmbeddingRecipe(("lasttoken",) if decoder else ("cls",), True, max_len, lower,
                               "the defaults for a folder without sentence-transformers modules")
    other = [f"{_kind(m)} ({m.get('path') or m.get('name')})" for m in listed if _kind(m) not in _RUN]
    if other:
        raise ValueError(f"{folder}: its sentence-transformers modules include {', '.join(other)}, which servelm "
                         f"does not run (it runs {', '.join(sorted(_RUN))})")
    pooling = next((m for m in listed if _kind(m) == "Pooling"), None)
    if pooling is None:
        raise ValueError(f"{folder}: its modules.json lists no Pooling module")
    path = folder / str(pooling.get("path") or "") / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: the Pooling module's config cannot be read ({e})") from None
    try:
        modes = _pooling_modes(config if isinstance(config, dict) else {})
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return EmbeddingRecipe(modes, any(_kind(m) == "Normalize" for m in listed), max_len, lower,
                           "its sentence-transformers modules")
