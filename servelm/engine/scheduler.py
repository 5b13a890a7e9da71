"""Continuous-batching scheduler with no prefill/decode phases, only "tokens still to compute" per sequence.

Each step fills a token budget: running sequences first (a decode costs 1 token, a prefill chunk up to the
budget), then new or preempted ones as blocks allow. When blocks run out, the last sequence in scheduling
order (lowest priority, newest) is preempted by recompute or by swapping its blocks to CPU.

Under the "priority" policy the order is (effective class, arrival): a request's class improves by one for
every `aging_s` it has existed, so low priority is never starved; a waiting request of a strictly better
class displaces running ones of a worse class when there is no room for it. "fcfs" orders by arrival only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from servelm.engine.kv_cache_manager import BlockOps, KVCacheManager
from servelm.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int  # tokens computed this step
    # Sequences to sample a next token for from this row's logits: empty for a partial prefill chunk,
    # [seq] normally, and [seq, *new_siblings] when an n>1 request forks after its prompt.
    sample_seqs: list[Sequence] = field(default_factory=list)
    # Draft tokens verified this step (speculative decoding): they follow the sequence's last token, so
    # num_tokens counts them too, and the step samples a token after each of them.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    ops: BlockOps
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, preemption_mode: str, policy: str = "priority",
                 aging_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.aging_s = aging_s
        self.clock = clock
        self.waiting: list[Sequence] = []  # sorted by self._key at the start of each step
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        self.num_swaps = 0
        self._now = clock()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def effective_priority(self, seq: Sequence, now: float) -> int:
        if self.policy == "fcfs":
            return 0
        p = seq.request.priority
        if self.aging_s > 0:
            p -= int((now - seq.request.arrival_time) / self.aging_s)
        return max(0, p)

    def _key(self, seq: Sequence) -> tuple:
        return (self.effective_priority(seq, self._now), *seq.arrival_key())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        self._now = self.clock()
        self.running.sort(key=self._key)
        self.waiting.sort(key=self._key)
        num_preempted = 0
        if self.policy == "priority":
            self._displace_for_priority()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_to_compute, budget)
            drafts = self._drafts_that_fit(seq, n, budget)
            if drafts:
                scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n + len(drafts), spec_token_ids=drafts))
                budget -= n + len(drafts)
                i += 1
                continue
            if n < seq.num_to_compute and not self.enable_chunked_prefill:
                i += 1
                continue
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()  # scheduled sequences sit before i, so never a victim
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                budget -= n
                i += 1

        # Admit waiting sequences, unless this step already had to preempt (the pool is under pressure).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not num_preempted:
            seq = self.waiting[0]
            if seq.status == SeqStatus.SWAPPED:
                n = min(seq.num_to_compute, budget)
                if not self.kv.swap_in(seq, n):
                    break
            else:
                # prompt logprobs need every prompt position's logits: no cached prefix for those
                cached = [] if seq.request.needs_prompt_logprobs else self.kv.find_cached_prefix(seq)
                remaining = seq.num_tokens - len(cached) * self.kv.block_size
                if remaining > budget and not self.enable_chunked_prefill:
                    break
                n = min(remaining, budget)
                if not self.kv.allocate(seq, n, cached):
                    break
                if seq.first_scheduled is None:
                    seq.num_cached_tokens = len(cached) * self.kv.block_size
                    self.kv.record_prefix_query(seq, seq.num_cached_tokens)
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n

        for s in scheduled:
            if s.start + s.num_tokens - len(s.spec_token_ids) == s.seq.num_tokens:
                s.sample_seqs = [s.seq]
        return SchedulerOutput(scheduled, self.kv.take_ops(), num_preempted)

    def _drafts_that_fit(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """The draft tokens to verify with a decode of seq, as many as the budget allows, with their KV slots
        allocated; none when seq is not decoding or blocks are short (drafts never preempt anyone)."""
        if not seq.spec_token_ids or n != 1 or seq.num_to_compute != 1:
            return []
        drafts = seq.spec_token_ids[:budget - 1]
        if drafts and self.kv.allocate(seq, 1 + len(drafts)):
            return drafts
        return []

    def _displace_for_priority(self) -> None:
        """Preempt running sequences of a worse class than the best waiting one while it does not fit.

        Done before anything is scheduled this step, so no scheduled work has to be undone.
        """
        while self.waiting and self.running:
            best, worst = self.waiting[0], self.running[-1]
            if self.effective_priority(best, self._now) >= self.effective_priority(worst, self._now):
                return
            need = -(-min(best.num_to_compute, self.max_num_batched_tokens) // self.kv.block_size)
            if len(self.running) < self.max_num_seqs and self.kv.num_free_blocks >= need:
                return
            self.running.pop()
            self._preempt(worst)
            self.num_priority_preemptions += 1
            self.waiting.sort(key=self._key)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        if self.preemption_mode == "swap" and self.kv.can_swap_out(seq):
            self.kv.swap_out(seq)
            seq.status = SeqStatus.SWAPPED
            self.num_swaps += 1
        else:
            self.kv.reset_for_recompute(seq)
            seq.status = SeqStatus.WAITING
        self.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sibling forked from a running sequence joins the batch directly."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
