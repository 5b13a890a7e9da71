"""The running batch: every running sample as a row of columns, kept from step to step.

The scheduler's `running` queue holds the samples in scheduling order; this batch holds the same samples by row,
with what a step reads and writes of them as arrays (computed count, length, last token, prompt length, block
table, the length at which a token may end the sample). A step is a diff against it: `scheduled[row]` tokens for
the rows that run; the runner builds its inputs from the columns (engine/model_runner.py), and the update
advances them with vector operations (engine/step_update.py). A row joins when its sample starts running
(admitted, resumed or forked) and leaves when it stops (finished or preempted): the last row moves into its place.

The `Sequence` objects stay the source of truth, and the columns mirror them: code that changes a sequence
otherwise than the vector paths do (a prompt chunk, a verification, a fork, a full stop check) calls `sync`.
"""

from __future__ import annotations

import numpy as np

from servelm.engine.sequence import Request, Sequence


def plain_below(req: Request, max_model_len: float) -> int:
    """The length below which a sampled token that is not one of the request's stop ids needs no check and no
    report but the token: the request's token limit, for one-sample requests that want no logprobs and no
    grammar (0 for the rest: every token of theirs takes the full check, as do first tokens)."""
    p = req.params
    if p.n != 1 or p.logprobs is not None or p.prompt_logprobs is not None or p.structured_outputs is not None:
        return 0
    limit = len(req.prompt_token_ids) + p.max_tokens if p.max_tokens is not None else max_model_len
    return int(min(limit, max_model_len))


class InputBatch:
    _COLUMNS = ("pos", "length", "last", "prompt_len", "stop_at", "num_blocks", "scheduled", "shared", "first")

    def __init__(self, block_size: int, vocab_size: int = 1, capacity: int = 64, max_blocks: int = 16) -> None:
        self.block_size = block_size
        self.seqs: list[Sequence] = []
        self.request_ids: list[str] = []
        self.pos = np.zeros(capacity, np.int64)  # tokens with KV computed: the position of the next to compute
        self.length = np.zeros(capacity, np.int64)  # tokens the sample holds
        self.last = np.zeros(capacity, np.int64)  # its last token (what a decode computes)
        self.prompt_len = np.zeros(capacity, np.int64)
        self.stop_at = np.zeros(capacity, np.int64)  # a token that makes the sample this long takes the full check
        self.num_blocks = np.zeros(capacity, np.int64)
        self.scheduled = np.zeros(capacity, np.int64)  # tokens this step computes (0: the row does not run)
        self.shared = np.zeros(capacity, bool)  # a sample of n > 1: its last block may be shared (copy-on-write)
        self.num_shared = 0
        self.first = np.zeros(capacity, bool)  # the sample's first token is still to come (its last is a prompt's)
        self.num_first = 0
        self.num_sync = 0  # rows whose requests need each step's tokens on the host before the next is scheduled
        # every row has exactly one token to compute, its last: true after a step of decodes only, until a row
        # joins or is re-synced (the scheduler then looks at the columns)
        self.steady = False
        # what a steady decode step says of its rows (views of these, never written): 0..n-1, one token each,
        # each sampled
        self.row_ids = np.arange(capacity)
        self.ones = np.ones(capacity, np.int64)
        self.all_true = np.ones(capacity, bool)
        self.tables = np.zeros((capacity, max_blocks), np.int64)
        # how many members stop on each token id: a sampled token with a count takes the full check
        self.stop_count = np.zeros(max(vocab_size, 1), np.int32)
        self.vocab_known = vocab_size > 1  # every sampled token is then an index of stop_count

    def __len__(self) -> int:
        return len(self.seqs)

    # -- membership ----------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        i = len(self.seqs)
        if i == len(self.pos):
            self._grow_rows()
        seq.batch_row = i
        self.seqs.append(seq)
        self.request_ids.append(seq.request.request_id)
        self.prompt_len[i] = seq.request.num_prompt_tokens
        # a sample's first token takes the full check (it reports its queue time): until then, stop at once
        first = seq.num_output_tokens == 0
        self.stop_at[i] = 0 if first else seq.request.plain_below
        self.first[i] = first
        self.num_first += first
        self.shared[i] = shared = seq.request.params.n > 1
        self.num_shared += shared
        self.num_sync += not seq.request.overlaps
        self.scheduled[i] = 0
        self.sync(seq)
        self._count_stops(seq, 1)

    def remove(self, seq: Sequence) -> None:
        """Take seq out: the last row moves into its place."""
        i, j = seq.batch_row, len(self.seqs) - 1
        seq.batch_row = -1
        self._count_stops(seq, -1)
        self.num_shared -= bool(self.shared[i])
        self.num_sync -= not seq.request.overlaps
        self.num_first -= bool(self.first[i])
        moved = self.seqs.pop()
        rid = self.request_ids.pop()
        if i != j:
            self.seqs[i], self.request_ids[i] = moved, rid
            moved.batch_row = i
            for name in self._COLUMNS:
                a = getattr(self, name)
                a[i] = a[j]
            self.tables[i] = self.tables[j]

    def sync(self, seq: Sequence) -> None:
        """Mirror seq's computed count, tokens and block table in its row."""
        self.steady = False
        i = seq.batch_row
        self.pos[i] = seq.num_computed_tokens
        tokens = seq.token_ids
        self.length[i] = len(tokens)
        self.last[i] = tokens[-1] if tokens else 0
        self.sync_table(seq)

    def sync_table(self, seq: Sequence) -> None:
        i, table = seq.batch_row, seq.block_table
        n = len(table)
        if n > self.tables.shape[1]:
            self._grow_blocks(n)
        self.tables[i, :n] = table
        self.num_blocks[i] = n

    def _grow_rows(self) -> None:
        for name in self._COLUMNS:
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
        self.row_ids = np.arange(len(self.pos))
        self.ones = np.ones(len(self.pos), np.int64)
        self.all_true = np.ones(len(self.pos), bool)
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])

    def _grow_blocks(self, n: int) -> None:
        wider = np.zeros((len(self.tables), max(n, 2 * self.tables.shape[1])), np.int64)
        wider[:, :self.tables.shape[1]] = self.tables
        self.tables = wider

    def _count_stops(self, seq: Sequence, d: int) -> None:
        ids = [t for t in seq.request.stop_ids if t >= 0]
        if not ids:
            return
        if max(ids) >= len(self.stop_count):
            grown = np.zeros(max(ids) + 1, np.int32)
            grown[:len(self.stop_count)] = self.stop_count
            self.stop_count = grown
        self.stop_count[ids] += d

    # -- a step ---------------------------------------------------------------------------------------------
    def reserve(self, kv, rows: np.ndarray | slice, ahead: int = 0) -> bool:
        """Room for one more token in each of `rows` (each has exactly one to compute; a slice when they are all
        the batch's): a block for those whose token starts one, and copy-on-write for samples that may share
        their last block. False when the pool runs short (blocks given to the rows before then stay theirs:
        allocating is idempotent). `ahead`: tokens computed by a step in flight, not yet in `pos` (async
        scheduling)."""
        pos = self.pos[rows] + ahead if ahead else self.pos[rows]
        starts = pos // self.block_size >= self.num_blocks[rows]  # the token starts a block
        starts = starts.nonzero()[0] if isinstance(rows, slice) else rows[starts]
        if len(starts) > kv.num_free_blocks:
            return False
        seqs, num_blocks = self.seqs, self.num_blocks
        if len(starts):  # one allocation for them all: a row's next block goes at its table's end
            blocks = kv.append_blocks([seqs[i] for i in starts.tolist()])
            k = num_blocks[starts]
            widest = max(k.tolist())  # (a few rows: faster than the array's max)
            if widest >= self.tables.shape[1]:
                self._grow_blocks(widest + 1)
            self.tables[starts, k] = blocks
            num_blocks[starts] = k + 1
        if self.num_shared:
            shared = self.shared[rows]
            # (a block just appended is its own: allocate finds nothing more to do for it)
            for i in (shared.nonzero()[0] if isinstance(rows, slice) else rows[shared]).tolist():
                if not kv.allocate(seqs[i], 1):
                    return False
                self.sync_table(seqs[i])
        return True

    def advance(self, rows: np.ndarray | slice, tokens: np.ndarray, one_each: bool = False) -> np.ndarray:
        """Record for each of `rows` its scheduled tokens as computed and `tokens` (one each) as its new last
        token (the arrays only; `one_each`: every row computed one token). Returns which of them must take the
        full check: a token that may end the sample (its length, a stop id), a sample's first token, and every
        token of a request that asks for more than its tokens (stop_at 0 for both)."""
        step = 1 if one_each else self.scheduled[rows]
        length = self.length[rows]
        length += 1
        if isinstance(rows, slice):  # (a slice's views are the columns: added to in place)
            pos = self.pos[rows]
            pos += step
        else:
            self.pos[rows] += step
            self.length[rows] = length
        self.last[rows] = tokens
        stop_count = self.stop_count
        if not self.vocab_known and tokens.max(initial=0) >= len(stop_count):
            tokens = np.minimum(tokens, len(stop_count) - 1)
        return (length >= self.stop_at[rows]) | (stop_count[tokens] > 0)

    def first_token_done(self, seq: Sequence) -> None:
        """seq's first token is out: from now on its tokens may skip the full check (see add)."""
        i = seq.batch_row
        self.stop_at[i] = seq.request.plain_below
        if self.first[i]:
            self.first[i] = False
            self.num_first -= 1
