"""vLLM's `--hf-overrides`: fields merged over a model's config.json.

A generation model takes them as vLLM's does, e.g. YaRN to run Qwen3 past its trained context:

    --hf-overrides '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32768}}' --max-model-len 131072

For a pooling model the common use is a reranker published as a causal LM and scored by the logits of two
tokens, as Qwen3-Reranker is served in vLLM:

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

The overridden model is a folder of its own in servelm's cache (`overridden_folder`): the original's files
linked, its config.json written merged, so every reader of the folder (the embedding process, the checks made
before it starts, a generation engine's loader) sees one model. A `classifier_from_token` config makes a
classifier whose labels are those tokens' logits at the last token (encoder.load_classifier); with
`is_original_qwen3_reranker` and two tokens ("no", "yes") the one label is the difference of their logits,
whose sigmoid is P(yes) / (P(yes) + P(no)).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from servelm.model.loading.language_part import MULTIMODAL_ARCHITECTURES
from servelm.model.loading.source import cache_dir

_VERSION = 1  # bump when the folder's layout changes


def overridden_config(config: dict, overrides: dict) -> dict:
    """config.json with `overrides` merged over it; a token classifier's labels follow its tokens (one label,
    yes over no, for an original Qwen3 reranker). A multimodal checkpoint, which servelm serves by its language
    model (language_part.py), takes the fields its outer config lacks, and a `text_config` override, into its
    text config."""
    out = {**config, **overrides}
    text = config.get("text_config")
    if isinstance(text, dict) and (config.get("architectures") or [None])[0] in MULTIMODAL_ARCHITECTURES:
        inner = {k: v for k, v in overrides.items() if k not in config and k != "text_config"}
        given = overrides.get("text_config") if isinstance(overrides.get("text_config"), dict) else {}
        out["text_config"] = {**text, **inner, **given}
        for k in inner:
            del out[k]
    tokens = out.get("classifier_from_token")
    if tokens and "num_labels" not in overrides and "id2label" not in overrides:
        labels = ["score"] if out.get("is_original_qwen3_reranker") else list(tokens)
        out["id2label"] = {str(i): name for i, name in enumerate(labels)}
        out["label2id"] = {name: i for i, name in enumerate(labels)}
        out.pop("num_labels", None)
    return out


def overridden_model(model: str | None, gguf_file: str | None, hf_overrides: str | None) -> str | None:
    """What a generation engine loads for MODEL with --hf-overrides: its folder overridden (a path), or None
    without overrides. A GGUF file has no config.json to merge them over (ValueError)."""
    from servelm.config.hf_overrides import parse_hf_overrides
    from servelm.model.loading.source import resolve_model

    overrides = parse_hf_overrides(hf_overrides)
    if not overrides:
        return None
    src = resolve_model(model, gguf_file)
    if src.kind != "hf":
        raise ValueError(f"--hf-overrides merges fields over a Hugging Face folder's config.json, and {src.name} is "
                         "a GGUF file, whose settings are its header's: use the model's Hugging Face folder")
    return str(overridden_folder(src.path, overrides))


def engine_model(model_config) -> tuple[str | None, str | None]:
    """(model, gguf_file) as a generation engine loads a ModelConfig's model: the overridden folder where it
    has --hf-overrides (ValueError for a GGUF file), else its own. The checks made before an engine starts use
    it too, so that they judge the model the engine will run."""
    mc = model_config
    view = overridden_model(mc.model, mc.gguf_file, mc.hf_overrides)
    return (mc.model, mc.gguf_file) if view is None else (view, None)


def overridden_folder(folder: Path, overrides: dict) -> Path:
    """A folder in servelm's cache that is `folder` with its config.json overridden: the other files linked
    (no copy), made once for each source folder, overrides and config."""
    folder = Path(folder).resolve()
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    st = config_path.stat()
    key = json.dumps([str(folder), st.st_size, st.st_mtime_ns, overrides, _VERSION], sort_keys=True)
    view = cache_dir() / "hf-overrides" / f"{folder.name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    if (view / "config.json").is_file():
        return view
    tmp = view.with_name(view.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
        if entry.name != "config.json":
            (tmp / entry.name).symlink_to(entry.resolve())
    (tmp / "config.json").write_text(json.dumps(overridden_config(config, overrides), indent=2))
    try:
        tmp.rename(view)  # whole or not at all: two starts at once both end with one complete folder
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return view
