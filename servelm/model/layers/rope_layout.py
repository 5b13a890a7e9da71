"""Interleaved RoPE (GPT-J's pairs, as GLM-4 and ERNIE 4.5 rotate) run as the half-split RoPE every kernel
implements.

Rotating the pairs (2i, 2i+1) of a head's first R dims by frequency i is rotating the pairs (i, i + R/2) once
those dims are reordered evens first: [0, 2, ..., R-2, 1, 3, ..., R-1]. An attention score is the dot product
of a query and a key, unchanged when both have their dims reordered alike, so reordering the rows of the q and
k projections (their weights and biases, and per-head q/k norm weights) as they load makes the model exact
under half-split RoPE. The fused CPU rotary kernel, kernel tapes and the GPU's RoPE fused with the KV-cache
write then serve these models too. V and O are untouched, and so is every output.

Every path that brings q/k projections goes through here: the loader, weight updates, LoRA adapters' B matrices.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

_ROTATED = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias")
_HEAD_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def half_split_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's dims in half-split order: the rotated part's even dims, its odd dims, then the rest."""
    return torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)])


def to_half_split(t: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Rows (dim 0) of whole heads, each head's reordered by `half_split_order`."""
    if t.shape[0] % head_dim:
        raise ValueError(f"{t.shape[0]} rows are not whole heads of {head_dim}")
    order = half_split_order(head_dim, rotary_dim).to(t.device)
    heads = t.shape[0] // head_dim
    return t.reshape(heads, head_dim, *t.shape[1:])[:, order].reshape(t.shape).contiguous()


def checkpoint_to_half_split(tensors: Iterable[tuple[str, torch.Tensor]], spec) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs with the q/k projections reordered, for a model with interleaved RoPE
    (`spec.interleaved_rope`); the pairs as they are otherwise."""
    if not spec.interleaved_rope:
        yield from tensors
        return
    rot = spec.rotary_dim or spec.head_dim
    for name, t in tensors:
        if name.endswith(_ROTATED) or (name.endswith(_HEAD_NORMS) and t.shape[0] == spec.head_dim):
            if not isinstance(t, torch.Tensor) or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(f"{name}: a model with interleaved RoPE ({spec.architecture}) loads from unquantized "
                                 "weights only (its q/k rows are reordered as they load)")
            t = to_half_split(t, spec.head_dim, rot)
        yield name, t
