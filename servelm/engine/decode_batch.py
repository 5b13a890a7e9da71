"""The steady decode rows of the running batch, kept as columns from step to step.

A sample in steady decode (one token to compute, one to sample, nothing to report but that token) costs the
same host work every step. Kept here as arrays indexed by batch row (position, last token, block table, the
length at which it may end), a step schedules, feeds the runner and updates all of them with a few vector
operations and one short Python loop (the token appended to each sequence), not a struct per row per stage.

The `Sequence` objects stay the source of truth (their tokens, computed count and block table are updated as
before): the arrays mirror them while they are members, so dropping a member, or all of them, is always safe.
A sample joins after a step leaves it decoding (`Scheduler.update_from_output`, engine/step_update.py) and leaves when it finishes,
is preempted, or needs anything the general path does (a token that may end it, `Scheduler.schedule`).
"""

from __future__ import annotations

import numpy as np

from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.sequence import Request, SeqStatus, Sequence


def batchable(req: Request) -> bool:
    """Requests whose decodes can be columns: one sample, no logprobs, no grammar, no prompt logprobs
    (those set plain_below to 0), so that a token that neither stops nor starts it is all a step reports."""
    p = req.params
    return p.n == 1 and req.plain_below > 0 and p.logprobs is None and p.structured_outputs is None


class DecodeBatch:
    def __init__(self, capacity: int, max_blocks: int, block_size: int, vocab_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.seqs: list[Sequence] = []
        self.request_ids: list[str] = []
        self.pos = np.zeros(capacity, np.int64)  # tokens with KV computed: the position of the token to compute
        self.last = np.zeros(capacity, np.int64)  # the token to compute (the sequence's last)
        self.stop_at = np.zeros(capacity, np.int64)  # a sample this long goes through the full check
        self.num_blocks = np.zeros(capacity, np.int64)
        self.tables = np.zeros((capacity, max_blocks), np.int64)
        # how many members stop on each token id: a sampled token with a count goes through the full check
        self.stop_count = np.zeros(vocab_size, np.int32)
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.seqs)

    def can_join(self, seq: Sequence) -> bool:
        return (seq.batch_row < 0 and seq.status == SeqStatus.RUNNING and len(self.seqs) < self.capacity
                and len(seq.token_ids) - seq.num_computed_tokens == 1 and seq.first_token_time is not None
                and len(seq.block_table) <= self.tables.shape[1])

    def add(self, seq: Sequence) -> None:
        i = len(self.seqs)
        seq.batch_row = i
        self.seqs.append(seq)
        self.request_ids.append(seq.request.request_id)
        self.pos[i] = seq.num_computed_tokens
        self.last[i] = seq.token_ids[-1]
        self.stop_at[i] = seq.request.plain_below
        table = seq.block_table
        self.num_blocks[i] = len(table)
        self.tables[i, :len(table)] = table
        self._count_stops(seq, 1)

    def remove(self, seq: Sequence) -> None:
        """Take seq out (the last row moves into its place)."""
        i, j = seq.batch_row, len(self.seqs) - 1
        seq.batch_row = -1
        self._count_stops(seq, -1)
        moved = self.seqs.pop()
        rid = self.request_ids.pop()
        if i != j:
            self.seqs[i], self.request_ids[i] = moved, rid
            moved.batch_row = i
            for a in (self.pos, self.last, self.stop_at, self.num_blocks, self.tables):
                a[i] = a[j]

    def clear(self) -> None:
        for seq in self.seqs:
            seq.batch_row = -1
        self.seqs, self.request_ids = [], []
        self.stop_count[:] = 0

    def _count_stops(self, seq: Sequence, d: int) -> None:
        ids = [t for t in seq.request.stop_ids if 0 <= t < self.vocab_size]
        if ids:
            self.stop_count[ids] += d

    def reserve(self, kv: KVCacheManager) -> bool:
        """Give every member whose next token starts a block that block. False (nothing allocated) when the
        pool has too few free blocks: the caller then drops the batch and the general path preempts."""
        n = len(self.seqs)
        rows = np.flatnonzero(self.pos[:n] // self.block_size >= self.num_blocks[:n])
        if len(rows) > kv.num_free_blocks:
            return False
        for i in rows.tolist():  # (max_model_len bounds a sequence's blocks by the tables' width)
            k = int(self.num_blocks[i])
            self.tables[i, k] = kv.append_block(self.seqs[i])
            self.num_blocks[i] = k + 1
        return True

    def inputs(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """The first n rows' token ids, positions, KV slots and lengths, and their longest block table."""
        pos = self.pos[:n]
        bs = self.block_size
        blocks = self.tables[np.arange(n), pos // bs]
        return self.last[:n].copy(), pos.copy(), blocks * bs + pos % bs, pos + 1, int(self.num_blocks[:n].max())

    def advance(self, n: int, tokens: list[int]) -> np.ndarray:
        """Record one computed and one new token for each of the first n rows (the arrays only). Returns the
        rows whose token may end their sample (length or a stop token: the full check decides). A block that
        fills holds generated tokens: it is registered only if the sample is preempted (commit_computed)."""
        tok = np.asarray(tokens, dtype=np.int64)
        pos = self.pos[:n]
        pos += 1
        self.last[:n] = tok
        return np.flatnonzero((pos + 1 >= self.stop_at[:n]) | (self.stop_count[tok] > 0))
