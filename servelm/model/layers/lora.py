"""LoRA adapters on a loaded base model: a PEFT checkpoint read into the layout of servelm's fused linears, and
the batched low-rank update that a step applies to the rows that use each adapter.

A PEFT adapter stores, per adapted linear `W` [N, K], `lora_A` [r, K] and `lora_B` [N, r]; the adapted layer
computes `x W^T + s * (x A^T) B^T` with `s = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). servelm fuses
q/k/v into one projection and gate/up into another, so an adapter's matrices are fused the same way at load:
the A's side by side ([K, r_q + r_k + r_v]) and the B's block-diagonally ([r_q + r_k + r_v, N], zero where a part
has no adapter), with `s` folded into B. One step then costs two small matmuls per adapter and fused linear,
whatever the number of parts, and the base weights are never touched: base rows and rows of several adapters
share one pass over them (the Punica / S-LoRA arrangement, in PyTorch ops that run on any device)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from servelm.model.layers.blocks import Linear
from servelm.model.layers.lora_config import LoraError, read_adapter_config
from servelm.model.layers.rope_layout import to_half_split
from servelm.model.spec import ModelSpec

# PEFT module names -> (servelm's fused target, the part's index within it)
_PARTS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "gate_up_proj": ("gate_up", None),
    "down_proj": ("down", 0),
}
TARGETS = ("qkv", "o", "gate_up", "down")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class LoraWeights:
    """One adapter, laid out for one base model, on the CPU: per layer, per fused target, (A [R, K], B [N, R])
    with the scaling folded into B. `rank` is the largest rank of any module; `nbytes` what its tensors take."""

    name: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    targets: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for layer in self.layers for a, b in layer.values())

    def on(self, device: torch.device) -> LoraLinears:
        return LoraLinears(self, device)


class LoraLinears:
    """An adapter's matrices as linear layers on one device, per layer and target: the shrink x -> x A^T
    (R wide) and the expand -> (x A^T) B^T, each on the kernel the base model's linears run on there (on the CPU
    servelm's C++ kernels, with their threads and their fixed summation order; PyTorch's matmul elsewhere)."""

    def __init__(self, w: LoraWeights, device: torch.device) -> None:
        self.name, self.rank, self.targets, self.nbytes = w.name, w.rank, w.targets, w.nbytes
        self.layers: list[dict[str, tuple[Linear, Linear]]] = [
            {t: (Linear(a.to(device)), Linear(b.to(device))) for t, (a, b) in layer.items()} for layer in w.layers]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name that ends with it (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = path / "adapter_model.bin"
    if pt.is_file():
        return torch.load(str(pt), map_location="cpu", weights_only=True)
    raise LoraError(f"{path} has no adapter_model.safetensors (or adapter_model.bin)")


def _shapes(spec: ModelSpec) -> dict[str, tuple[int, list[int]]]:
    """Per fused target: its input width and its parts' output widths, for one tensor-parallel-whole model."""
    h, hd = spec.hidden_size, spec.head_dim
    inter = spec.intermediate_size
    return {"qkv": (h, [spec.num_heads * hd, spec.num_kv_heads * hd, spec.num_kv_heads * hd]),
            "o": (spec.num_heads * hd, [h]),
            "gate_up": (h, [inter, inter]),
            "down": (inter, [h])}


def load_lora(name: str, path: str | Path, spec: ModelSpec, dtype: torch.dtype, max_rank: int) -> LoraWeights:
    """Reads the PEFT adapter at `path` for a base model of `spec`, in `dtype`, on the CPU. Raises LoraError
    naming what does not fit (a module servelm cannot adapt, a rank over `max_rank`, shapes of another base)."""
    path = Path(path)
    cfg = read_adapter_config(path)
    tensors = _read_tensors(path)
    r0, alpha0 = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rs = bool(cfg.get("use_rslora", False))
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"{name}: tensor {key!r} is not a LoRA matrix of a decoder layer's linear "
                            f"(servelm adapts q/k/v/o and gate/up/down projections only)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in _PARTS:
            raise LoraError(f"{name}: module {module!r} cannot take an adapter here "
                            f"(supported: {', '.join(sorted(_PARTS))})")
        found.setdefault((layer, module), {})[ab] = t
    shapes = _shapes(spec)
    sparse = spec.moe.sparse_layers if spec.moe is not None else [False] * spec.num_layers
    parts: list[dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]]] = [{} for _ in range(spec.num_layers)]
    max_seen = 0
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{name}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        if layer >= spec.num_layers:
            raise LoraError(f"{name}: layer {layer} does not exist in a {spec.num_layers}-layer base model")
        target, part = _PARTS[module]
        if target in ("gate_up", "down") and sparse[layer]:
            raise LoraError(f"{name}: layer {layer} is a mixture-of-experts layer; its experts cannot take adapters")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        full = f"model.layers.{layer}.{'self_attn' if target in ('qkv', 'o') else 'mlp'}.{module}"
        if r != _pattern_value(cfg.get("rank_pattern"), full, r0):
            raise LoraError(f"{name}: {full} has rank {r}, its config says "
                            f"{_pattern_value(cfg.get('rank_pattern'), full, r0)}")
        if r > max_rank:
            raise LoraError(f"{name}: rank {r} is over max_lora_rank={max_rank} (raise --max-lora-rank)")
        k_in, outs = shapes[target]
        n_out = sum(outs) if part is None else outs[part]
        if a.shape != (r, k_in) or b.shape != (n_out, r):
            raise LoraError(f"{name}: {full} has A {tuple(a.shape)} and B {tuple(b.shape)}; this base model "
                            f"needs A ({r}, {k_in}) and B ({n_out}, {r}): an adapter of another base model?")
        if spec.interleaved_rope and module in ("q_proj", "k_proj"):  # B's rows as the base's q/k rows are laid out
            b = to_half_split(b, spec.head_dim, spec.rotary_dim or spec.head_dim)
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), full, alpha0))
        scale = alpha / (math.sqrt(r) if rs else r)
        parts[layer].setdefault(target, {})[part] = (a, b * scale)
        max_seen = max(max_seen, r)
    if max_seen == 0:
        raise LoraError(f"{name}: the adapter holds no LoRA matrices")
    layers = []
    for layer_parts in parts:
        fused = {}
        for target, by_part in layer_parts.items():
            k_in, outs = shapes[target]
            if None in by_part:  # Phi-3's fused projections: one A and B already
                a, b = by_part[None]
            else:  # A's side by side, B's block-diagonal
                a = torch.cat([by_part[i][0] for i in sorted(by_part)])
                b = torch.zeros(sum(outs), a.shape[0])
                col, row = 0, 0
                for i, n in enumerate(outs):
                    if i in by_part:
                        bi = by_part[i][1]
                        b[col:col + n, row:row + bi.shape[1]] = bi
                        row += bi.shape[1]
                    col += n
            fused[target] = (a.contiguous().to(dtype), b.contiguous().to(dtype))
        layers.append(fused)
    targets = tuple(t for t in TARGETS if any(t in layer for layer in layers))
    return LoraWeights(name, max_seen, layers, targets)


@dataclass
class LoraBatch:
    """A step's adapters: for each adapter in it, its weights (on the model's device) and the rows that use it
    (None: every row of the step)."""

    groups: list[tuple[LoraLinears, torch.Tensor | None]]

    def targets(self, layer: int, target: str):
        """(shrink, expand, rows) of each adapter of this step with matrices for `target` in `layer`."""
        for w, rows in self.groups:
            pair = w.layers[layer].get(target)
            if pair is not None:
                yield pair[0], pair[1], rows

    def any(self, layer: int, target: str) -> bool:
        return any(target in w.layers[layer] for w, _ in self.groups)


def add_lora(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch | None, layer: int, target: str) -> torch.Tensor:
    """y += s (x A^T) B^T for the rows of each adapter of the step (in place; y returned)."""
    if batch is None:
        return y
    for shrink, expand, rows in batch.targets(layer, target):
        if rows is None:
            y.add_(expand(shrink(x)))
        else:
            y.index_add_(0, rows, expand(shrink(x.index_select(0, rows))))
    return y
