"""Load a model (weights, config, tokenizer) from a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from servelm.model.attention import get_backend
from servelm.model.decoder import DecoderLM
from servelm.model.kernels.cpu_features import cpu_has_bf16
from servelm.model.layers.parallel import (
    TensorParallel,
    check_shardable,
    local_spec,
    rank_device,
    shard_tensors,
)
from servelm.model.loading.fp8_checkpoint import fp8_checkpoint, kept_as_stored, read_fp8_checkpoint
from servelm.model.loading.gguf_loader import iter_gguf_tensors
from servelm.model.loading.language_part import VISION_PREFIXES, language_tensors
from servelm.model.loading.metadata import load_config_and_eos, load_config_and_tokenizer
from servelm.model.loading.served_tensors import served_tensors
from servelm.model.loading.source import ModelSource
from servelm.model.quant.fp8 import quantize_fp8_linears
from servelm.model.quant.gguf import auto_quantization
from servelm.model.quant.weight_only import QUANTIZATIONS, is_linear_weight, quantize_linears
from servelm.model.spec import ModelSpec
from servelm.progress import progress

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str = "cpu") -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: object | None  # a transformers tokenizer (None where the caller did not need one)
    hf_config: object
    source: ModelSource
    eos_token_ids: frozenset[int]
    load_seconds: float


def _iter_safetensors(folder: Path, dtype: torch.dtype, fp8: bool = False, skip: tuple[str, ...] = ()):
    """(name, tensor in `dtype`); with `fp8`, an fp8 checkpoint's codes and scales as stored (fp8_checkpoint).
    Tensors whose names start with one of `skip` are not read."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names = list(sf.keys())
            names = [n for n in names if not n.startswith(skip)] if skip else names
            for name in progress(names, desc=f"Loading {f.name}", unit="tensor", leave=False):
                t = sf.get_tensor(name)
                # get_tensor maps the file: a kept tensor would keep the whole mapping, and with it every
                # page that loading touched, resident (the packed and fused copies made from them too).
                yield name, t.clone() if fp8 and kept_as_stored(name, t) else t.to(dtype, copy=True)


def _counted(tensors, total: list[int]):
    """The tensors, adding up their elements into total[0] as they pass."""
    for name, t in tensors:
        total[0] += t.numel()
        yield name, t


def load_engine_model(config, with_tokenizer: bool = False, tp_rank: int = 0, tp_size: int | None = None
                      ) -> LoadedModel:
    """load_model with an EngineConfig's settings, as every engine loads its model: MODEL (its folder
    overridden where --hf-overrides gives fields, model/loading/hf_overrides.py), tokenizer, dtype, device,
    window and quantization; `tp_size` (default: the config's) ranks, this one `tp_rank`."""
    from servelm.model.loading.hf_overrides import engine_model

    mc = config.model_config
    model, gguf_file = engine_model(mc)
    return load_model(model, gguf_file, mc.tokenizer, mc.dtype, config.device_config.device,
                      with_tokenizer=with_tokenizer,
                      sliding_window=mc.sliding_window, quantization=config.load_quantization(),
                      quantization_group_size=mc.quantization_group_size, tp_rank=tp_rank,
                      tp_size=config.parallel_config.tensor_parallel_size if tp_size is None else tp_size)


def checkpoint_tensors(src: ModelSource, hf_config, torch_dtype: torch.dtype, quantization: str):
    """A checkpoint's (name, tensor) pairs under Hugging Face names, read one at a time, in `torch_dtype`: a GGUF
    file's quantized linears kept as stored under quantization gguf, an fp8 checkpoint's linears as fp8 weights
    under fp8 (dequantized under any other)."""
    fp8 = fp8_checkpoint(hf_config) if src.kind != "gguf" else None
    if quantization == "gguf" and src.kind != "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's quantized types, and {src.name} is not a GGUF "
                         "file: use int8 or int4 to quantize it at load")
    # a multimodal checkpoint's language model alone (model/loading/language_part.py)
    skip = VISION_PREFIXES if getattr(hf_config, "language_of", None) else ()
    if src.kind == "gguf":
        tensors = iter_gguf_tensors(src.path, torch_dtype, keep_quantized=quantization == "gguf")
    else:  # with fp8, an fp8 checkpoint's codes and scales as stored, for read_fp8_checkpoint
        tensors = _iter_safetensors(src.path, torch_dtype, fp8=fp8 is not None, skip=skip)
    if skip:
        tensors = language_tensors(tensors)
    if fp8 is not None:  # joined before a tensor-parallel split, which takes dense tensors
        keep = is_linear_weight if quantization == "fp8" else (lambda name: False)
        tensors = read_fp8_checkpoint(tensors, fp8, torch_dtype, keep)
    return tensors


def quantized_at_load(tensors, quantization: str, quantization_group_size: int, torch_dtype: torch.dtype):
    """The linears quantized as `quantization` asks (int8, int4 in groups of `quantization_group_size`, fp8),
    the rest as they come; an fp8 checkpoint's linears are fp8 weights already and pass as they are."""
    if quantization in ("int8", "int4"):  # from a GGUF file too: its tensors dequantized, then requantized
        return quantize_linears(tensors, quantization, quantization_group_size, torch_dtype)
    if quantization == "fp8":
        return quantize_fp8_linears(tensors, torch_dtype, is_linear_weight)
    return tensors


def build_decoder(tensors, spec: ModelSpec, torch_dtype: torch.dtype, device: str, quantization: str = "none",
                  quantization_group_size: int = 32, tp_rank: int = 0, tp_size: int = 1) -> DecoderLM:
    """The DecoderLM of a checkpoint's (name, tensor) pairs, under Hugging Face names: split for rank `tp_rank`
    of `tp_size`, quantized as `quantization` says (none, gguf: GGUF blocks as they come, int8, int4, fp8), on
    `device`."""
    check_shardable(spec, tp_size)
    tensors = served_tensors(tensors, spec)  # what the model takes, before any split or quantization
    whole = [0]  # the checkpoint's parameter count, before a tensor-parallel split
    if tp_size > 1:  # split before quantizing: each rank quantizes only its own slices
        tensors = shard_tensors(_counted(tensors, whole), spec, tp_rank, tp_size)
    tensors = quantized_at_load(tensors, quantization, quantization_group_size, torch_dtype)
    # on the CPU, .to is a no-op; on a GPU quantized weights go there as codes and scales (model/quant/triton_matmul.py,
    # model/quant/fp8.py);
    # GGUF blocks (quantization gguf) are CPU only
    weights = {name: t.to(device) for name, t in tensors}
    num_params = whole[0] or sum(math.prod(t.shape) for t in weights.values())
    tp = TensorParallel(tp_rank, tp_size, device) if tp_size > 1 else None
    lm = DecoderLM(local_spec(spec, tp_rank, tp_size), weights, torch_dtype, get_backend(device), tp)
    lm.num_params = num_params  # as the checkpoint stores them (a tied lm_head once)
    lm.quantization = f"int4/g{quantization_group_size}" if quantization == "int4" else quantization
    return lm


def load_model(model: str | None, gguf_file: str | None = None, tokenizer: str | None = None,
               dtype: str = "auto", device: str = "cpu", with_tokenizer: bool = True,
               sliding_window: int | None = None, quantization: str = "none",
               quantization_group_size: int = 32, tp_rank: int = 0, tp_size: int = 1) -> LoadedModel:
    """Weights, config, EOS ids and (unless with_tokenizer is False, as in the engine process) tokenizer.
    `sliding_window` puts that attention window on every layer (for GGUF files that lost the model's).
    `quantization` (model/quant/weight_only.py, model/quant/gguf.py, model/quant/fp8.py): none, gguf (a GGUF file's
    block-quantized linears kept as they are), int8 or int4 (the linears quantized at load; int4 in groups of
    `quantization_group_size`), fp8 (an fp8 checkpoint's linears kept, any other's quantized at load), or auto:
    fp8 for an fp8 checkpoint (model/loading/fp8_checkpoint.py), gguf for a GGUF file in bfloat16 where servelm's
    GGUF kernels run (prefill path included), else none. An fp8 checkpoint under any other quantization is
    dequantized (then requantized for int8/int4).
    With `tp_size` > 1 only rank `tp_rank`'s shard of the weights is kept (model/layers/parallel.py); its group is
    connected later."""
    if tp_size > 1:  # one GPU per rank (the CPU for all of them)
        device = rank_device(device, tp_rank)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "gguf" and not device.startswith("cpu"):
        raise ValueError("quantization 'gguf' runs on the CPU only; on a GPU use int8 or int4 (Triton kernels)")
    t0 = time.perf_counter()
    if with_tokenizer:
        src, hf_config, tok, eos = load_config_and_tokenizer(model, gguf_file, tokenizer)
    else:
        (src, hf_config, eos), tok = load_config_and_eos(model, gguf_file, tokenizer), None
    torch_dtype = resolve_dtype(dtype, device)
    fp8 = fp8_checkpoint(hf_config) if src.kind != "gguf" else None
    if quantization == "auto":
        if tp_size > 1:
            quantization = "none"
        else:
            quantization = "fp8" if fp8 is not None else auto_quantization(src.kind, device, torch_dtype)
    if quantization == "fp8" and tp_size > 1:
        raise ValueError("quantization 'fp8' does not run with tensor parallelism (fp8 weights are not split); "
                         "use none, int8 or int4")
    if quantization not in ("none", "fp8") and torch_dtype != torch.bfloat16 and device.startswith("cpu"):
        logger.warning("quantization %s with %s: servelm's GGUF kernels take bfloat16 only and PyTorch's int8/int4 "
                       "CPU kernels are vectorized for bfloat16 only, so the quantized linears run a scalar loop "
                       "(slow); use dtype bfloat16", quantization,
                       torch_dtype)
    tensors = checkpoint_tensors(src, hf_config, torch_dtype, quantization)
    spec = ModelSpec.from_hf_config(hf_config, sliding_window)
    if getattr(hf_config, "gguf_sliding_window_unstated", False) and sliding_window is None:
        logger.warning("%s states no sliding window (llama.cpp's converter does not write Mistral's or Qwen's), "
                       "so every layer runs full attention; if the original model's config.json sets "
                       "sliding_window, pass it: LLM(..., sliding_window=N) or servelm serve --sliding-window N",
                       src.path.name)
    lm = build_decoder(tensors, spec, torch_dtype, device, quantization, quantization_group_size, tp_rank, tp_size)
    seconds = time.perf_counter() - t0
    logger.info("loaded %s (%s, %s%s) in %.1fs", src.name, spec.architecture, torch_dtype,
                "" if quantization == "none" else f", quantization {quantization}", seconds)
    return LoadedModel(lm, tok, hf_config, src, eos, seconds)
