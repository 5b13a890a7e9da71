"""What a sampled row draws from, held to a float64 oracle written from the definition: the torch path (what a
GPU runs) and the C++ kernel (what a CPU runs) keep the same tokens under temperature, top-k, top-p and min-p,
draw the same token for the same uniform number, and draw with the kept distribution's frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from servelm.engine import sampler as sampler_mod
from servelm.engine.sampler import draw, kept_weights
from servelm.model.kernels import cpu as cpu_kernels

kernels = cpu_kernels.load()
VOCAB = 3001  # a partial vector block and a partial 64-token draw block at the end

FILTERS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.8, 0, 0.95, 0.0),
    (0.5, 0, 0.5, 0.0),
    (1.3, 40, 1.0, 0.0),
    (1.0, 40, 0.9, 0.0),
    (0.7, 0, 1.0, 0.05),
    (1.0, 200, 0.8, 0.01),
    (2.0, 1, 1.0, 0.0),
    (1.0, 0, 0.0, 0.0),  # top_p 0: the most likely token (with its ties) only
    (1.0, VOCAB, 1.0, 0.0),  # top_k of the whole vocabulary: no cut
]


def oracle(x: torch.Tensor, t: float, k: int, p: float, min_p: float) -> tuple[torch.Tensor, bool]:
    """The kept tokens of one row by the definition, in float64, and whether a cut lies so close to a threshold
    that float32 rounding may decide it (such rows are not compared)."""
    e = torch.exp((x.double() - x.double().max()) / t)
    lo, near = 0.0, False
    vals = torch.unique(e[e > 0], sorted=True).flip(0)
    if 0 < k < len(e):
        lo = float(e.sort(descending=True).values[k - 1])
        near |= bool(((e - lo).abs() < 1e-5 * lo).sum() > (e == lo).sum())
    if p < 1:
        kept = e[e >= lo]
        target = p * float(kept.sum())
        tau = float(vals[0])
        for v in vals[vals >= lo]:
            before = float(kept[kept > v].sum())
            near |= target > 0 and abs(before - target) < 1e-5 * target
            if before >= target:
                break
            tau = float(v)
        lo = max(lo, tau)
    if min_p > 0:
        near |= bool(((e - min_p).abs() < 1e-5 * min_p).any())
        lo = max(lo, min_p)
    return (e >= lo) & (e > 0), near


def rows(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, VOCAB, generator=g) * torch.linspace(0.5, 6, 12)[:, None]  # flat to peaked
    x[3, :50] = x[3].max() + 2  # 50 tied most likely tokens
    x[4] = x[4].round()  # ties everywhere, also at the cuts
    x[5, 100:] = float("-inf")  # masked tokens (a grammar, min_tokens) are never drawn
    x[6, ::2] = float("-inf")
    return x.to(dtype)


def uniforms(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def per_row(n: int, t: float, k: int, p: float, m: float) -> tuple[torch.Tensor, ...]:
    """One filter setting as the per-row tensors the sampler takes."""
    return torch.full((n,), t), torch.full((n,), k, dtype=torch.int64), torch.full((n,), p), torch.full((n,), m)


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "t{}-k{}-p{}-min{}".format(*f))
def test_torch_path_keeps_the_tokens_the_definition_keeps(filters):
    x = rows(torch.float32)
    kept = kept_weights(x, *per_row(len(x), *filters)) > 0
    compared = 0
    for r in range(x.shape[0]):
        want, near = oracle(x[r], *filters)
        if not near:
            assert torch.equal(kept[r], want), f"row {r}"
            compared += 1
    assert compared >= 9  # the near-tie escape is for rounding, not for whole configurations


@pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "t{}-k{}-p{}-min{}".format(*f))
def test_kernel_draws_what_the_torch_path_draws(filters, dtype):
    """For each kept token, a uniform number in the middle of its share of the running sum: both paths must
    choose exactly that token. Only tokens whose share is wide beside float32's rounding of a running sum over the
    vocabulary (V * 2^-24 of the total) are asked about."""
    x = rows(dtype)
    weights = kept_weights(x, *per_row(len(x), *filters)).double()
    asked = 0
    for r in range(x.shape[0]):
        want, near = oracle(x[r], *filters)
        if near:
            continue
        w = weights[r] * want  # the oracle's kept set
        cum = w.cumsum(0)
        ids = (want & (w > 4e-4 * cum[-1])).nonzero().flatten()
        if len(ids) == 0:
            continue
        asked += 1
        pick = ids[torch.linspace(0, len(ids) - 1, min(len(ids), 25)).round().long()]
        u = ((cum[pick] - w[pick] / 2) / cum[-1]).float()
        rows_x = x[r].expand(len(pick), VOCAB).contiguous()
        got_kernel = kernels.sample_rows(rows_x, *per_row(len(pick), *filters), u)
        got_torch = draw(kept_weights(rows_x, *per_row(len(pick), *filters)), u)
        assert got_kernel.tolist() == pick.tolist(), f"row {r}"
        assert got_torch.tolist() == pick.tolist(), f"row {r}"
    assert asked >= 9


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_draws_follow_the_kept_distribution(path, monkeypatch):
    """20,000 draws of one row with top-k 8 and top-p 0.9: the frequencies match the renormalized kept
    probabilities (a chi-square test at the 0.1% level; the draws are seeded, so the outcome is fixed)."""
    if path == "kernel" and kernels is None:
        pytest.skip("CPU kernels could not be compiled here")
    if path == "torch":
        monkeypatch.setattr(sampler_mod, "_cpu_kernels", lambda x: None)
    x = torch.tensor([3.0, 2.5, 2.4, 2.0, 1.0, 0.5, 0.0, -1.0, -1.5, -3.0, 4.0, -9.0])
    n = 20000
    batch = x.expand(n, -1).contiguous()
    tokens = sampler_mod.sample_rows(batch, *per_row(n, 0.9, 8, 0.9, 0.0), uniforms(n, 3))
    want, _ = oracle(x, 0.9, 8, 0.9, 0.0)
    probs = torch.exp((x.double() - x.max()) / 0.9) * want
    probs /= probs.sum()
    counts = torch.bincount(tokens, minlength=len(x)).double()
    assert counts[~want].sum() == 0
    expected = probs[want] * n
    chi2 = float(((counts[want] - expected) ** 2 / expected).sum())
    dof = int(want.sum()) - 1
    # the 0.1% critical value of chi-square, by the Wilson-Hilferty approximation
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, (chi2, critical, counts.tolist())


@pytest.mark.skipif(kernels is None, reason="CPU kernels could not be compiled here")
def test_kernel_rejects_what_it_cannot_sample():
    x = torch.randn(2, 10)
    ones = torch.ones(2)
    with pytest.raises(RuntimeError, match="temperature > 0"):
        kernels.sample_rows(x, torch.zeros(2), torch.zeros(2, dtype=torch.int64), ones, ones * 0, ones * 0.5)
    with pytest.raises(RuntimeError, match="u in"):
        kernels.sample_rows(x, ones, torch.zeros(2, dtype=torch.int64), ones, ones * 0, ones)
