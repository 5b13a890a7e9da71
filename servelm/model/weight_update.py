"""Weights changed in place: a running model takes another checkpoint's values of the same shapes (a fine-tuning
or reinforcement-learning step's), tensor by tensor into the memory it already holds.

The new checkpoint's names and shapes are checked against the running model's first, so one that does not fit
changes nothing. Then its tensors are built a layer at a time by the model's own constructor code, so that they
take exactly the layouts, fusions and quantization of the running model's, and copied into the running model's
tensors at the same places: the device holds one layer's new copy at a time beside the model. Nothing the
running model handed out moves: kernel tapes and CUDA graphs, which hold the weights' addresses, replay the new
values, and a draft model sharing layers sees them too.
"""

from __future__ import annotations

from typing import Any

import torch

# DecoderLM attributes that hold no weights: what is derived from them or from the spec (kernel tapes, the
# attention backend, the fused-kernel library, the tensor-parallel group)
_NOT_WEIGHTS = frozenset({"tapes", "attn", "fused", "tp", "spec"})


def weight_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every tensor a model holds, by where it lies (`layers[3].qkv.kernel.tiled`), in a fixed order: the same
    places for two models built alike."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            out.setdefault(path, obj)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                walk(x, f"{path}[{i}]")
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{path}[{k!r}]")
        elif type(obj).__module__.startswith("servelm."):
            names = list(getattr(obj, "__dict__", {})) or [s for c in type(obj).__mro__
                                                          for s in getattr(c, "__slots__", ())]
            for name in names:
                if path == "" and name in _NOT_WEIGHTS:
                    continue
                if hasattr(obj, name):
                    walk(getattr(obj, name), f"{path}.{name}" if path else name)

    walk(model, "")
    return out


def copy_weights(into: Any, source: Any) -> int:
    """`source`'s tensors copied into `into`'s in place (two objects built alike: models, layers, linears); the
    bytes copied. ValueError naming the first tensor that does not fit, before any copy."""
    return _copy(_pairs(into, source))


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    copied = 0
    with torch.no_grad():
        for d, s in pairs:
            if s.data_ptr() != d.data_ptr():
                d.copy_(s)
                copied += d.numel() * d.element_size()
    return copied


def _pairs(into: Any, source: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(running tensor, new tensor) at each place, checked to fit: ValueError naming the first that does not."""
    dst, src = weight_tensors(into), weight_tensors(source)
    missing = sorted(set(dst) ^ set(src))
    if missing:
        raise ValueError(f"the new weights are laid out otherwise than the running model's (at {missing[0]}): "
                         "give a checkpoint of the same architecture, sizes and quantization")
    for path, d in dst.items():
        s = src[path]
        if d.layout != torch.strided or d.is_mkldnn:
            raise ValueError(f"{path} is held in an opaque layout (oneDNN's), which cannot be updated in place; "
                             "run servelm's CPU kernels (SERVELM_CPU_KERNELS unset) to update weights")
        if s.shape != d.shape or s.dtype != d.dtype:
            raise ValueError(f"the new weights do not fit the running model: {path} is {tuple(s.shape)} "
                             f"{s.dtype}, the model's {tuple(d.shape)} {d.dtype}")
    return [(d, src[path]) for path, d in dst.items()]


GLOBALS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def update_in_place(model: Any, tensors, staged: dict | None = None) -> int:
    """A checkpoint's (name, tensor) pairs, under Hugging Face names and in the form the loader gives them (the
    model's dtype, quantized as the model is), copied into `model` (a DecoderLM) in place; the bytes copied.
    ValueError, changing nothing, where the names or shapes are not the running model's.

    `staged` (a partial update, as vLLM's load_weights takes any subset): the pairs may be any of the model's
    tensors. A unit (the embedding, norm and head together, or one layer) is copied once all of its tensors are
    there, with those `staged` holds from earlier calls; the tensors of units still incomplete are left in
    `staged` (copies: the caller may change its own)."""
    want = model.checkpoint_shapes
    new = {name: t for name, t in tensors if not name.endswith("rotary_emb.inv_freq")}
    if model.spec.tie_word_embeddings and "lm_head.weight" not in want:
        new.pop("lm_head.weight", None)  # a tied head saved anyway: the model reads the embedding
    missing = [] if staged is not None else sorted(set(want) - set(new))
    extra = sorted(set(new) - set(want))
    if missing or extra:
        what = f"lacks {', '.join(missing[:3])}" if missing else f"has {', '.join(extra[:3])}, which it does not"
        raise ValueError(f"the new weights do not fit the running model: the checkpoint {what}"
                         f"{' ...' if len(missing or extra) > 3 else ''}")
    bad = next((n for n in new if tuple(new[n].shape) != want[n]), None)
    if bad is not None:
        raise ValueError(f"the new weights do not fit the running model: {bad} is {tuple(new[bad].shape)}, the "
                         f"model's {want[bad]}")
    fresh = set(new)
    if staged is not None:
        new = {**staged, **new}
    units: list[list[str]] = [[n for n in GLOBALS if n in want]] + [[] for _ in model.layers]
    for n in want:  # one pass: a partial update calls this once per tensor
        if n.startswith("model.layers."):
            units[int(n.split(".", 3)[2]) + 1].append(n)
    ready = [k for k, names in enumerate(units) if all(n in new for n in names)]  # 0: the globals, k: layer k-1
    for i in (k - 1 for k in ready if k > 0):  # read off the checkpoint's values, like the constructor does
        scales = model._kv_scales(lambda name, required=True, p=f"model.layers.{i}.": new.get(p + name))
        if scales != model.layers[i].kv_scales:
            raise ValueError(f"layer {i}'s fp8 KV cache scales differ from the running model's; restart the "
                             "engine with the new checkpoint to change them")
    device = model.embed.device

    def unit(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # built from its tensors, moved to the device
        own = {n: new.pop(n).to(device) for n in units[k] if n in new}
        if k == 0:
            return _pairs([model.embed, model.norm, model.lm_head], list(model._take_globals(own)))
        return _pairs(model.layers[k - 1], model._take_layer(own, k - 1))

    # The first unit or two (the globals, the first layer) are built and checked before anything is copied:
    # every other layer is built by the same code from tensors of the shapes checked above, so it fits if the
    # first one does.
    first = [pair for k in ready[:2] for pair in unit(k)]
    copied = _copy(first)
    del first
    for k in ready[2:]:
        copied += _copy(unit(k))
    if staged is not None:
        staged.clear()
        staged.update({n: t.clone() if n in fresh and isinstance(t, torch.Tensor) else t for n, t in new.items()})
    return copied


def differing_setting(running: Any, new: Any) -> str | None:
    """The first field in which two ModelSpecs differ (None: alike): a checkpoint of the same shapes may still be
    another model (its RoPE base, norm epsilon, window...), which a weight update cannot change."""
    import dataclasses

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
                and torch.equal(a, b)
        if dataclasses.is_dataclass(a) and type(a) is type(b):  # MoE options, which hold tuples and tensors
            return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    return next((f.name for f in dataclasses.fields(running)
                 if not same(getattr(running, f.name), getattr(new, f.name))), None)


def checkpoint_weights(config: Any, model: Any, source: Any):
    """The (name, tensor) pairs `update_in_place` takes, from `source`: a checkpoint's path (a Hugging Face
    folder or a GGUF file), read as the engine of `config` reads its model; or (name, tensor) pairs (or a
    mapping) under Hugging Face names, in any float dtype. Either way quantized as the running model is.
    ValueError for a checkpoint of another architecture or settings."""
    from servelm.model.loading.language_part import language_tensors
    from servelm.model.loading.loader import checkpoint_tensors, quantized_at_load
    from servelm.model.loading.served_tensors import served_tensors
    from servelm.model.spec import ModelSpec

    kind, _, group = getattr(model, "quantization", "none").partition("/g")
    group_size = int(group) if group else config.model_config.quantization_group_size
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        from servelm.model.loading.metadata import load_config
        from servelm.model.loading.source import resolve_model

        # the weights and the config only: a trainer's checkpoint need not hold tokenizer files
        src = resolve_model(str(source), None)
        hf_config = load_config(src)
        other = differing_setting(model.spec, ModelSpec.from_hf_config(hf_config, config.model_config.sliding_window))
        if other is not None:
            raise ValueError(f"{source} is another model than the running one (its {other} differs): a weight "
                             "update takes a checkpoint of the same architecture and settings")
        tensors = checkpoint_tensors(src, hf_config, model.dtype, kind)
    else:
        if kind == "gguf":
            raise ValueError("this model's linears are kept in a GGUF file's quantized types: update it from a "
                             "GGUF file's path")
        pairs = source.items() if hasattr(source, "items") else source
        # a multimodal model's state dict: its language model's tensors, under a causal LM's names
        tensors = ((name, t.detach().to(dtype=model.dtype)) for name, t in language_tensors(pairs))
    # as the loader lays them out (build_decoder): the model's own tensors, laid out for it, then quantized
    return quantized_at_load(served_tensors(tensors, model.spec), kind, group_size, model.dtype)
