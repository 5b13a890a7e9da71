"""A checkpoint's tensors as the running model takes them, for the loader and for weight updates alike: the
layers past the model's (GLM-4.5's next-token prediction layers, which speculative decoding would use and
servelm does not) left out, and interleaved RoPE's q/k rows reordered (model/layers/rope_layout.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from servelm.model.layers.rope_layout import checkpoint_to_half_split

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def served_tensors(tensors: Iterable[tuple[str, torch.Tensor]], spec) -> Iterator[tuple[str, torch.Tensor]]:
    if spec.extra_layers:
        tensors = _without_extra_layers(tensors, spec.num_layers)
    return checkpoint_to_half_split(tensors, spec)


def _without_extra_layers(tensors, num_layers: int):
    for name, t in tensors:
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            yield name, t
