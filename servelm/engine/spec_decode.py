"""Speculative decoding: which sequences get draft tokens, how many, the per-request fall-back, and metrics.

After each step the engine asks `SpecDecoder.propose` for the running sequences' drafts (an n-gram lookup or
a draft model, see proposers.py); the scheduler then gives a decoding sequence 1 + k tokens, the runner
verifies them in one forward (rejection.py), and `record` notes how many were accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from servelm.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow seqs[i]'s tokens (fewer, or none, where it has no guess)."""
        ...


@dataclass
class SpecStats:
    """Cumulative counters (they cross to the server in EngineStats)."""

    num_spec_tokens: int
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # tokens the verifications produced (accepted + one each)
    verifications: int = 0
    fallbacks: int = 0  # times a request's speculation was switched off for low acceptance
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.proposed_by_position = [0] * self.num_spec_tokens
        self.accepted_by_position = [0] * self.num_spec_tokens


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_spec_tokens: int, max_model_len: int, threshold: float,
                 window: int, cooldown_steps: int) -> None:
        self.proposer = proposer
        self.k = num_spec_tokens
        self.max_model_len = max_model_len
        self.threshold = threshold
        self.window = window
        self.cooldown_steps = cooldown_steps
        self.stats = SpecStats(num_spec_tokens)

    def num_drafts(self, seq: Sequence) -> int:
        """How many drafts seq may verify next step: 0 where its logits processing depends on the tokens
        generated so far (penalties, bad words, min_tokens still masking stops, a grammar: every verification row
        would need its own state), while it is cooling down, or near its end (no drafts past max_tokens or the
        context)."""
        p = seq.request.params
        if seq.num_to_compute != 1 or p.reads_output or seq.num_output_tokens < p.min_tokens \
                or seq.spec.cooldown > 0 or seq.matcher is not None:
            return 0
        k = min(self.k, self.max_model_len - seq.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def propose(self, running: list[Sequence]) -> None:
        """Set every running sequence's drafts for the next step (none for those that may not speculate)."""
        asked, ks = [], []
        for seq in running:
            seq.spec_token_ids = []
            if seq.spec.cooldown > 0 and seq.num_to_compute == 1:
                seq.spec.cooldown -= 1  # one decode step without drafts
                continue
            k = self.num_drafts(seq)
            if k:
                asked.append(seq)
                ks.append(k)
        # asked even with none to ask: a draft model frees the cache of sequences that are no longer asked
        for seq, drafts in zip(asked, self.proposer.propose(asked, ks), strict=True):
            seq.spec_token_ids = drafts

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: counters, and seq's rolling acceptance (fall back when it is too low)."""
        st = self.stats
        st.verifications += 1
        st.proposed += num_drafts
        st.accepted += num_accepted
        st.emitted += num_accepted + 1
        for j in range(num_drafts):
            st.proposed_by_position[j] += 1
            st.accepted_by_position[j] += j < num_accepted
        w = seq.spec.window
        w += [1] * num_accepted + [0] * (num_drafts - num_accepted)
        del w[:-self.window]
        if len(w) >= self.window and sum(w) < self.threshold * len(w):
            seq.spec.window = []
            seq.spec.cooldown = self.cooldown_steps
            st.fallbacks += 1
