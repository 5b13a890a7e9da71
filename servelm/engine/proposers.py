"""Draft-token proposers for speculative decoding (see spec_decode.py)."""

from __future__ import annotations

import numpy as np

from servelm.engine.sequence import Sequence


def ngram_lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n first, from
    n_max down to n_min) and propose the up to k tokens that followed it."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        # candidate starts i in [0, size - n - 1]: the match ends before the suffix itself begins to end
        m = size - n
        hit = tokens[:m] == suffix[0]
        for j in range(1, n):
            hit &= tokens[j:m + j] == suffix[j]
        found = np.flatnonzero(hit)
        if found.size:
            start = int(found[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Drafts copied from the sequence's own earlier tokens (prompt and output): free, and right whenever the
    output repeats or quotes its context (code edits, summaries, loops)."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [ngram_lookup(np.asarray(s.token_ids, dtype=np.int64), k, self.n_max, self.n_min)
                for s, k in zip(seqs, ks, strict=True)]
