"""The runner's block copies (swap out, swap in, copy-on-write) move exactly the listed blocks, whether the pairs
form a few runs (copied as slices) or many (gathered and scattered)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from servelm.engine.kv_cache_manager import BlockOps
from servelm.engine.model_runner import ModelRunner, block_runs


def runner(num_blocks: int = 16, num_cpu_blocks: int = 16) -> ModelRunner:
    spec = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=4)
    model = SimpleNamespace(spec=spec, dtype=torch.float32, embed=torch.empty(0))
    r = ModelRunner(model, num_blocks, 4, num_cpu_blocks, seed=0)
    g = torch.Generator().manual_seed(0)
    for caches in (r.kv_caches, r.cpu_caches):
        for k, v in caches:
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
    return r


def test_block_runs():
    assert block_runs([(3, 7), (4, 8), (5, 9), (9, 0), (10, 1), (2, 2)]) == [(3, 7, 3), (9, 0, 2), (2, 2, 1)]
    assert block_runs([(5, 1), (4, 2)]) == [(5, 1, 1), (4, 2, 1)]


def _assert_moved(caches, old_dst, src, pairs) -> None:
    """Each layer of `caches` is its old contents with block d replaced by src's block s, for every (s, d)."""
    for (k, v), (ok, ov), (sk, sv) in zip(caches, old_dst, src, strict=True):
        want_k, want_v = ok.clone(), ov.clone()
        for s, d in pairs:
            want_k[d], want_v[d] = sk[s], sv[s]
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("pairs", [
    [(2, 5), (3, 6), (4, 7)],  # one run
    [(2, 5), (3, 6), (9, 0), (1, 12)],  # three runs
    [(i, 15 - i) for i in range(8)],  # eight runs of one: gathered
])
def test_swaps_and_copies_move_exactly_the_listed_blocks(pairs):
    r = runner()
    dev = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    cpu = [(k.clone(), v.clone()) for k, v in r.cpu_caches]
    r.apply_block_ops(BlockOps(swap_out=pairs))
    _assert_moved(r.cpu_caches, cpu, dev, pairs)
    cpu = [(k.clone(), v.clone()) for k, v in r.cpu_caches]
    back = [(d, s) for s, d in pairs]
    r.apply_block_ops(BlockOps(swap_in=back))
    _assert_moved(r.kv_caches, dev, cpu, back)
    before = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    r.apply_block_ops(BlockOps(copy=[(1, 10), (2, 11)]))  # copy-on-write within the device cache
    for (k, v), (bk, bv) in zip(r.kv_caches, before, strict=True):
        assert torch.equal(k[10:12], bk[1:3]) and torch.equal(k[:10], bk[:10]) and torch.equal(v[10:12], bv[1:3])
