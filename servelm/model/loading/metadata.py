"""A model's config, tokenizer and EOS ids: everything but the weights, without importing torch.

The API process needs only these; the engine process needs the config and EOS ids but no tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from servelm.model.loading import hf_files
from servelm.model.loading.gguf_config import config_from_dict, gguf_config_dict, read_gguf_config
from servelm.model.loading.gguf_header import read_gguf_file_header
from servelm.model.loading.language_part import language_architecture, language_config
from servelm.model.loading.source import ModelSource, cache_dir, resolve_model, set_hf_env

logger = logging.getLogger(__name__)

# Bumped whenever what is cached for a GGUF file changes: folders written by older servelm versions (whose
# config came from transformers' GGUF reader) are never read again.
_GGUF_CACHE_VERSION = 2

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM",
                           "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM",
                           "Glm4ForCausalLM", "Ernie4_5ForCausalLM", "SeedOssForCausalLM", "CohereForCausalLM",
                           "Cohere2ForCausalLM", "MinistralForCausalLM", "Ministral3ForCausalLM",
                           "Glm4MoeForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                       "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                       "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                       "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
                       "exaone4": "Exaone4ForCausalLM", "glm4": "Glm4ForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
                       "seed_oss": "SeedOssForCausalLM", "cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM",
                       "ministral": "MinistralForCausalLM", "ministral3": "Ministral3ForCausalLM",
                       "glm4_moe": "Glm4MoeForCausalLM"}


def architecture(config) -> str | None:
    """The config's architecture: its `architectures[0]`, else the one its `model_type` stands for."""
    archs = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    return archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(model_type, model_type)


def check_model(model: str | None, gguf_file: str | None = None) -> ModelSource:
    """Find the model and refuse one servelm cannot run, from its files alone (no torch, no transformers), so
    the user gets one clear error before anything is loaded. Raises FileNotFoundError or ValueError."""
    src = resolve_model(model, gguf_file)
    if src.kind == "gguf":
        with open(src.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{src.path} is not a GGUF file")
        gguf_config_dict(src.path, read_gguf_file_header(src.path))  # GGUFUnsupported: what it cannot honour
        return src
    config = hf_files.read_json(src.path / "config.json")
    if config is None:
        raise ValueError(f"{src.path / 'config.json'} is not a JSON object")
    from types import SimpleNamespace

    arch = architecture(SimpleNamespace(**config))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    served = language_architecture(arch, text.get("model_type"), _MODEL_TYPE_TO_ARCH) or arch  # a multimodal model's
    if hf_files.is_embedding_folder(src.path, config):  # (no generation architecture is an encoder)
        kind = ("an encoder" if hf_files.is_encoder(config) else
                "a sequence classifier" if hf_files.is_classifier(config) else "an embedding model")
        raise ValueError(f"model {str(src.path)!r} ({arch}) is {kind}: it embeds, scores or classifies text "
                         "rather than generating it: serve it alone with --runner pooling (or auto, the default), "
                         f"or beside a generation model with --embedding-model {src.path}")
    if served not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model {str(src.path)!r} has architecture {arch!r}, which servelm does not support; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return src


_told_embeds: set[Path] = set()  # generation models run for pooling, named once in the log


def pooling_folder(model: str | None, gguf_file: str | None = None, runner: str = "auto",
                   hf_overrides: str | None = None) -> Path | None:
    """MODEL's folder when it runs as a pooling model (vLLM's pooling runner: embeddings, scores, classes) rather
    than for generation, else None: never with runner "generate"; with "pooling" it must be one (ValueError
    where it cannot be one: a GGUF file; FileNotFoundError where it cannot be found), a generation model's
    folder then embedding as vLLM converts it; "auto" reads its files. With `hf_overrides`
    the model is read with them, and the folder is its overridden copy (model/loading/hf_overrides.py)."""
    from servelm.config.hf_overrides import parse_hf_overrides
    from servelm.model.loading.hf_overrides import overridden_config, overridden_folder

    if runner == "generate":
        return None
    try:
        src = resolve_model(model, gguf_file)
    except FileNotFoundError:
        if runner == "pooling":
            raise
        return None  # not found: the generation path's checks say so
    overrides = parse_hf_overrides(hf_overrides)
    config = hf_files.read_json(src.path / "config.json") if src.kind == "hf" else None
    if config is not None and overrides:
        config = overridden_config(config, overrides)
    if config is not None and hf_files.is_embedding_folder(src.path, config):
        return overridden_folder(src.path, overrides) if overrides else src.path
    if runner == "pooling" and config is not None:
        # a generation model run for pooling embeds, as vLLM converts it (--convert embed): the final hidden
        # state of the last token, normalized (the embedding process's defaults for a decoder without modules)
        if src.path not in _told_embeds:
            _told_embeds.add(src.path)
            logger.info("%s (%s) runs as an embedding model: the last token's final hidden state, normalized",
                        src.path, ", ".join(config.get("architectures") or []) or "no architecture named")
        return overridden_folder(src.path, overrides) if overrides else src.path
    if runner == "pooling":
        raise ValueError(f"--runner pooling: {str(src.path)!r} is a GGUF file; a pooling model is a Hugging Face "
                         "folder (an embedding model, a cross-encoder or classifier, or a generation model to embed "
                         "with)")
    return None


def converted_dir(path: Path) -> Path:
    """A cache folder holding the tokenizer that transformers derives from a GGUF file (and its config)."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:v{_GGUF_CACHE_VERSION}"
    return cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def _has_json(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()


def _config_from_folder(folder: Path):
    plain = hf_files.plain_config(folder)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def load_gguf_config_and_tokenizer(path: Path):
    """Config (from the header, servelm's own reading) and tokenizer (transformers' conversion of the GGUF
    vocabulary, cached after the first time). The config comes first: a file servelm cannot run is refused
    before the tokenizer costs anything or leaves a cache folder behind."""
    set_hf_env()
    head = read_gguf_file_header(path)
    config_json = gguf_config_dict(path, head)
    config = config_from_dict(config_json)
    out = converted_dir(path)
    if _has_json(out):
        return config, hf_files.tokenizer_from_folder(out)
    tokenizer = _gguf_tokenizer(path, head.fields.get("general.architecture"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out)
        _generic_tokenizer_class(out)
        # Beside the tokenizer for the readers that look at model_type and the EOS token; never read back as
        # the model's config (that always comes from the header).
        (out / "config.json").write_text(json.dumps(config_json, indent=2))
    except OSError:
        pass  # a read-only cache only costs speed
    return config, tokenizer


def _gguf_tokenizer(path: Path, arch: str | None):
    """transformers' tokenizer of a GGUF file's vocabulary (its tokenizer.ggml.* fields). AutoTokenizer reads the
    file's config first, only to name the tokenizer's class, and refuses architectures its GGUF reader lacks
    (granite, smollm3); for those the generic class builds the same tokenizer from the same fields."""
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch in GGUF_SUPPORTED_ARCHITECTURES:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)


def _generic_tokenizer_class(folder: Path) -> None:
    """Have later starts read the saved tokenizer.json as it is. Named after the model's family (e.g.
    Qwen2Tokenizer), transformers would rebuild that family's own pre-tokenizer over the one the GGUF file
    states (llama.cpp's `tokenizer.ggml.pre`), and split some texts differently than the first start."""
    path = folder / "tokenizer_config.json"
    tc = hf_files.read_json(path)
    if tc is not None and (folder / "tokenizer.json").is_file():
        tc["tokenizer_class"] = "TokenizersBackend"
        path.write_text(json.dumps(tc, indent=2))


def _json_folder(src: ModelSource) -> Path | None:
    """Where the model's tokenizer JSON files lie: its folder, or a GGUF's converted copy (None: not yet)."""
    if src.kind == "hf":
        return src.path
    out = converted_dir(src.path)
    return out if _has_json(out) else None


def load_config(src: ModelSource):
    """The model config: plain JSON where that reads the same as transformers' class, else the class; for a
    GGUF file, read from its header."""
    set_hf_env()
    if src.kind == "gguf":
        return read_gguf_config(src.path)
    # a multimodal checkpoint: its language model's config (model/loading/language_part.py)
    return language_config(_config_from_folder(src.path), _MODEL_TYPE_TO_ARCH)


def _tokenizer_folder(src: ModelSource, tokenizer: str | None) -> Path | None:
    """The folder `tokenizer` names, else the model's JSON folder (None: a GGUF not yet converted)."""
    return Path(tokenizer).expanduser() if tokenizer is not None else _json_folder(src)


def load_tokenizer(src: ModelSource, tokenizer: str | None = None, chat_template: str | None = None):
    """The model's tokenizer (or the one in the folder `tokenizer`), as AutoTokenizer would build it; with
    `chat_template` (a file or an inline template, as --chat-template), that template instead of its own."""
    from servelm.config.engine import read_chat_template

    set_hf_env()
    folder = _tokenizer_folder(src, tokenizer)
    tok = load_gguf_config_and_tokenizer(src.path)[1] if folder is None else hf_files.tokenizer_from_folder(folder)
    if folder is not None and not getattr(tok, "chat_template", None):
        # a multimodal checkpoint may keep its template with its processor (chat_template.json) only
        processor = hf_files.read_json(folder / "chat_template.json") or {}
        if isinstance(processor.get("chat_template"), str):
            tok.chat_template = processor["chat_template"]
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def model_tokenizer(mc) -> object:
    """The tokenizer an engine of the model settings `mc` (a ModelConfig) serves with: its --tokenizer and
    --chat-template applied."""
    return load_tokenizer(resolve_model(mc.model, mc.gguf_file), mc.tokenizer, mc.chat_template)


def eos_ids(src: ModelSource, hf_config, tokenizer_eos: int | None) -> frozenset[int]:
    """EOS ids from the generation config, the model config and the tokenizer (as transformers stops on)."""
    ids: set[int] = set()
    # A GGUF file states its own EOS ids; a generation_config.json beside it belongs to something else.
    gen = (hf_files.read_json(src.folder / "generation_config.json") or {}) if src.kind == "hf" else {}
    candidates = [getattr(hf_config, "eos_token_id", None), tokenizer_eos, gen.get("eos_token_id")]
    for c in candidates:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, list):
            ids.update(int(x) for x in c)
    return frozenset(ids)


def sampling_defaults(src: ModelSource, generation_config: str = "auto",
                      overrides: str | dict | None = None) -> dict[str, float | int]:
    """The defaults of a request's unset sampling fields (see servelm.config.generation): from the model's
    generation_config.json under `auto` (a GGUF file keeps none), logged when there are any, as vLLM warns."""
    from servelm.config import generation

    out = generation.sampling_defaults(generation_config, src.path if src.kind == "hf" else None, overrides)
    if out and generation_config != "vllm":
        logger.warning("default sampling parameters of unset request fields from %s: %s (start with "
                       "--generation-config vllm for OpenAI's neutral defaults)",
                       "the model's generation_config.json" if generation_config == "auto" else generation_config,
                       out)
    return out


def load_config_and_tokenizer(model: str | None, gguf_file: str | None = None, tokenizer: str | None = None):
    """(source, hf_config, tokenizer, eos ids)."""
    src = resolve_model(model, gguf_file)
    hf_config = load_config(src)
    tok = load_tokenizer(src, tokenizer)
    return src, hf_config, tok, eos_ids(src, hf_config, getattr(tok, "eos_token_id", None))


def load_config_and_eos(model: str | None, gguf_file: str | None = None, tokenizer: str | None = None):
    """(source, hf_config, eos ids), building the tokenizer only where its files do not state the EOS token."""
    src = resolve_model(model, gguf_file)
    hf_config = load_config(src)
    folder = _tokenizer_folder(src, tokenizer)
    eos = hf_files.tokenizer_eos_id(folder) if folder is not None else None
    if eos is None:
        eos = getattr(load_tokenizer(src, tokenizer), "eos_token_id", None)
    return src, hf_config, eos_ids(src, hf_config, eos)
