"""What the registry records about a checkpoint, read from its files alone (headers, never the weights):
what its workers do, architecture, dtype and parameter count."""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from math import prod
from pathlib import Path

from servelm.control.errors import InvalidRequest
from servelm.control.types import Kind
from servelm.model.loading import hf_files, metadata
from servelm.model.loading.gguf_header import read_gguf_file_header

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64"}


@dataclass
class CheckpointInfo:
    kind: Kind
    architecture: str | None
    dtype: str | None
    num_params: int | None


def describe(path: Path) -> CheckpointInfo:
    """Inspect a model folder or .gguf file; InvalidRequest for one servelm cannot serve."""
    path = Path(path)
    from servelm.runtimes.predictors import describe as describe_predictor

    if (pred := describe_predictor(path)) is not None:  # a non-LLM model: its runtime, from the file name
        return CheckpointInfo(Kind.PREDICT, pred["runtime"], None, None)
    config = hf_files.read_json(path / "config.json") if path.is_dir() else None
    if config is not None and hf_files.is_embedding_folder(path, config):  # it embeds, scores or classifies text
        return _describe_folder(path, config, Kind.EMBED)
    try:
        src = metadata.check_model(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise InvalidRequest(f"cannot register {str(path)!r}: {e}", code="invalid_model", param="path") from e
    if src.kind == "gguf":
        return _describe_gguf(src.path)
    return _describe_folder(src.path, config or {}, Kind.GENERATE)


def describe_adapter(path: Path) -> CheckpointInfo:
    """Inspect a PEFT LoRA adapter folder (adapter_config.json, its weights); InvalidRequest for one the
    engine cannot serve. Its architecture reads "LoRA r=R" (the base's is the base version's)."""
    from servelm.model.layers.lora_config import LoraError, read_adapter_config

    path = Path(path)
    try:
        if not path.is_dir():
            raise LoraError(f"{path} is not a PEFT LoRA adapter folder")
        cfg = read_adapter_config(path)
        if not any((path / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
            raise LoraError(f"{path} has no adapter_model.safetensors (or adapter_model.bin)")
    except LoraError as e:
        raise InvalidRequest(f"cannot register {str(path)!r} as a LoRA adapter: {e}", code="invalid_adapter",
                             param="path") from e
    info = _describe_folder(path, {}, Kind.LORA)
    info.architecture = f"LoRA r={cfg.get('r', 8)}"
    return info


def _describe_folder(folder: Path, config: dict, kind: Kind) -> CheckpointInfo:
    dtypes: Counter[str] = Counter()
    params = 0
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        for name, t in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = prod(t["shape"])
            params += n
            dtypes[t["dtype"]] += n
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is None and dtypes:
        raw = dtypes.most_common(1)[0][0]
        dtype = _SAFETENSORS_DTYPES.get(raw, raw)
    from types import SimpleNamespace

    arch = metadata.architecture(SimpleNamespace(**config)) if config else None
    return CheckpointInfo(kind, arch, dtype, params if files else None)


def _safetensors_header(path: Path) -> dict:
    """A .safetensors file's JSON header: tensor name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidRequest(f"{path} is not a safetensors file", code="invalid_model", param="path")
        (n,) = struct.unpack("<Q", raw)
        try:
            return json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"{path} has no valid safetensors header", code="invalid_model",
                                 param="path") from e


def _describe_gguf(path: Path) -> CheckpointInfo:
    head = read_gguf_file_header(path)
    arch = metadata.architecture(metadata.load_config(metadata.resolve_model(str(path))))
    counts: Counter[str] = Counter()
    params = 0
    for _name, shape, ggml_type, _offset in head.tensors:
        n = prod(shape)
        params += n
        counts[_ggml_type_name(ggml_type)] += n
    return CheckpointInfo(Kind.GENERATE, arch, counts.most_common(1)[0][0] if counts else None, params)


def _ggml_type_name(t: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(t).name
    except (ImportError, ValueError):
        return f"ggml_type_{t}"
