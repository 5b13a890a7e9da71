"""The shared benchmark workloads (see shared/workloads.md): prompts are token ids, drawn reproducibly.

Every prompt is `[BOS] + uniform random ids in [4, vocab)` from numpy's PCG64(seed), request by request.
W4 draws, per request, its prompt length, then its output length, then its ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def _ids(rng, n: int, vocab: int) -> list[int]:
    return [int(i) for i in rng.integers(4, vocab, size=n)]


def make_workload(name: str, vocab: int, bos: int = 1, scale: float = 1.0) -> Workload:
    """`scale` < 1 shrinks the request count (for quick runs); lengths stay as specified."""
    def count(n: int) -> int:
        return max(1, int(round(n * scale)))

    name = name.upper()
    if name == "W1":
        rng = np.random.Generator(np.random.PCG64(0))
        prompts = [[bos] + _ids(rng, 127, vocab) for _ in range(count(64))]
        return Workload("W1", prompts, [128] * len(prompts))
    if name == "W2":
        rng = np.random.Generator(np.random.PCG64(1))
        return Workload("W2", [[bos] + _ids(rng, 511, vocab)], [128])
    if name == "W3":
        rng = np.random.Generator(np.random.PCG64(2))
        shared = [bos] + _ids(rng, 447, vocab)
        prompts = [shared + _ids(rng, 64, vocab) for _ in range(count(64))]
        return Workload("W3", prompts, [64] * len(prompts))
    if name == "W4":
        rng = np.random.Generator(np.random.PCG64(3))
        prompts, outs = [], []
        for _ in range(count(128)):
            plen, olen = int(rng.integers(32, 1025)), int(rng.integers(16, 257))
            prompts.append([bos] + _ids(rng, plen - 1, vocab))
            outs.append(olen)
        return Workload("W4", prompts, outs)
    raise ValueError(f"unknown workload {name!r}: choose W1, W2, W3 or W4")


def make_serving_workload(vocab: int, num_requests: int = 200, seed: int = 4, bos: int = 1) -> Workload:
    """S1: prompts of uniform 64..512 tokens, outputs of uniform 32..256 (arrival times are drawn by the
    load generator from the request rate)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    prompts, outs = [], []
    for _ in range(num_requests):
        plen, olen = int(rng.integers(64, 513)), int(rng.integers(32, 257))
        prompts.append([bos] + _ids(rng, plen - 1, vocab))
        outs.append(olen)
    return Workload("S1", prompts, outs)
