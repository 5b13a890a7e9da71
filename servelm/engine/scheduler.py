"""Continuous-batching scheduler with no prefill/decode phases, only "tokens still to compute" per sequence.

Each step fills a token budget: running sequences first (a decode costs 1 token, a prefill chunk up to the
budget), then new or preempted ones as blocks allow. When blocks run out, the last sequence in scheduling
order (lowest priority, newest) is preempted by recompute or by swapping its blocks to CPU.

Under the "priority" policy the order is (effective class, arrival): a request's class improves by one for
every `aging_s` it has existed, so low priority is never starved; a waiting request of a strictly better
class displaces running ones of a worse class when there is no room for it. "fcfs" orders by arrival only.

Host cost per step is O(1) per scheduled sequence: both queues stay sorted between steps and are re-sorted only
when an order key can have changed (a sequence appended out of order, or a request aging into a better class;
see `_order_queues`), never wholesale each step; a decode whose block has room allocates nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from servelm.config.engine import RuntimeSettings
from servelm.engine.decode_batch import DecodeBatch
from servelm.engine.kv_cache_manager import BlockOps, KVCacheManager
from servelm.engine.queue_order import QueueOrder
from servelm.engine.sequence import SeqStatus, Sequence
from servelm.engine.step_cost import StepCostModel
from servelm.engine.step_update import StepUpdate

MIN_PREFILL_CHUNK = 32  # prompt tokens a step computes even when decodes alone reach the latency target


class ScheduledSeq(msgspec.Struct, gc=False):
    """One row of a step. A struct the garbage collector does not track (its references never lead back to it):
    a step makes one per running sequence, about 3x cheaper than a dataclass instance."""

    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int  # tokens computed this step
    # Sequences to sample a next token for from this row's logits: empty for a partial prefill chunk,
    # [seq] normally, and [seq, *new_siblings] when an n>1 request forks after its prompt.
    sample_seqs: list[Sequence] = []  # (a fresh list per instance)
    # Draft tokens verified this step (speculative decoding): they follow the sequence's last token, so
    # num_tokens counts them too, and the step samples a token after each of them.
    spec_token_ids: list[int] = []


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    ops: BlockOps
    num_preempted: int = 0
    batched_tokens: int | None = None  # the scheduler's own count (None: summed over `scheduled` when asked)
    num_admitted: int = 0  # the last rows of `scheduled` came from the waiting queue (the only ones new to a step)
    # the steady decodes, the batch's rows 0..len-1, run before the rows of `scheduled` (see decode_batch.py)
    decode_seqs: list[Sequence] = field(default_factory=list)
    batch: DecodeBatch | None = None

    @property
    def num_batched_tokens(self) -> int:
        if self.batched_tokens is not None:
            return self.batched_tokens
        return sum(s.num_tokens for s in self.scheduled) + len(self.decode_seqs)

    def __bool__(self) -> bool:
        return bool(self.scheduled or self.decode_seqs)


class Scheduler(QueueOrder, StepUpdate):
    """Which sequences run each step (`schedule`), and what a step's results change in them
    (`update_from_output`, in engine/step_update.py); the queues' order is engine/queue_order.py's."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, preemption_mode: str, policy: str = "priority",
                 aging_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 itl_target_s: float = 0.0, step_cost: StepCostModel | None = None,
                 ttft_target_s: float = 0.5) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.aging_s = aging_s
        self.clock = clock
        # Both queues are in self._key order from the start of each step on; change them only through this
        # class's methods, which note when an append breaks the order (see _order_queues).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # what the waiting queue holds, kept as it changes (stats are read every step; the queue can be long):
        # swapped sequences, and sequences by priority class (high, normal, low)
        self.num_waiting_swapped = 0
        self.waiting_by_priority = [0, 0, 0]
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        self.num_swaps = 0
        self._now = clock()
        self._waiting_sorted = self._running_sorted = True
        # Every queued sequence keeps the class it has at self._now until at least this time: before it, keys
        # computed at self._now are still the keys (-inf: sort at the next step).
        self._order_until = -math.inf
        self._order_params = (policy, aging_s)
        # Latency target for steps that carry decodes (0: off): prefill chunks are cut to what the step cost
        # model predicts fits beside them (see _prefill_budget).
        self.itl_target_s = itl_target_s
        self.ttft_target_s = ttft_target_s
        self.step_cost = step_cost if step_cost is not None else StepCostModel()
        # the steady decodes as columns (EngineCore sets one up; without it every row takes the loop below)
        self.batch: DecodeBatch | None = None
        # LoRA adapters (EngineCore sets them where enabled): a step holds at most loras.max_loras of them
        self.loras = None
        self._init_step_update()

    def apply_settings(self, settings: RuntimeSettings) -> None:
        """Take the run-time settings from the next step on; a changed policy
        or ageing re-sorts the queues then (_order_queues compares them with the last sort's)."""
        self.max_num_seqs = settings.max_num_seqs
        self.policy = settings.scheduling_policy
        self.aging_s = settings.priority_aging_s

    def add(self, seq: Sequence) -> None:
        self._note_class_change(seq)
        if self._waiting_sorted and self.waiting and self._key(seq) < self._key(self.waiting[-1]):
            self._waiting_sorted = False
        self.waiting.append(seq)
        self._count_waiting(seq, 1)

    def _count_waiting(self, seq: Sequence, d: int) -> None:
        """seq joins (d=1) or leaves (d=-1) the waiting queue (its status and priority stay while it waits)."""
        if seq.status == SeqStatus.SWAPPED:
            self.num_waiting_swapped += d
        self.waiting_by_priority[min(max(int(seq.request.priority), 0), 2)] += d

    def _append_running(self, seq: Sequence) -> None:
        """seq, already queued (its class change is noted), joins the end of the running queue."""
        if self._running_sorted and self.running and self._key(seq) < self._key(self.running[-1]):
            self._running_sorted = False
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        self._order_queues()
        num_preempted = 0
        if self.policy == "priority":
            self._displace_for_priority()
        running, kv, chunked = self.running, self.kv, self.enable_chunked_prefill
        prefill = self._prefill_budget()  # prompt tokens this step may compute beside its decodes
        batch = self.batch
        if batch is not None and batch.seqs:  # its decodes first, each with room for its token, or none of them
            if len(batch) <= budget and batch.reserve(kv):
                budget -= len(batch)
            else:
                batch.clear()  # the loop below takes them, preempting if it must
        # A for loop over a list that preemption shortens from the end: scheduled sequences sit before the current
        # one, so a victim is always after it (or is it, the last one, which ends the loop). When every running
        # sequence is in the batch (steady decode) the loop has nothing to do: skipped, not walked.
        for seq in running if batch is None or len(batch.seqs) < len(running) else ():
            if budget <= 0:
                break
            if seq.batch_row >= 0:
                continue
            start = seq.num_computed_tokens
            todo = len(seq.token_ids) - start
            n = todo if todo < budget else budget
            if n > 1 and not seq.spec_token_ids and n > prefill and chunked:  # a prompt chunk over the budget
                if prefill <= 0:
                    continue
                n = prefill
            # a row samples (sample_seqs=[seq]) when it reaches the sequence's last token
            if seq.spec_token_ids:
                drafts = self._drafts_that_fit(seq, n, budget)
                if drafts:
                    scheduled.append(ScheduledSeq(seq, start, n + len(drafts), [seq] if n == todo else [], drafts))
                    budget -= n + len(drafts)
                    continue
            if n < todo and not chunked:
                continue
            while not kv.allocate(seq, n):
                victim = running.pop()
                if victim.batch_row >= 0:
                    budget += 1  # its decode was counted above
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, start, n, [seq] if n == todo else []))
                budget -= n
                if n > 1:
                    prefill -= n

        # Admit waiting sequences, unless this step already had to preempt (the pool is under pressure).
        num_running = len(scheduled)
        while (self.waiting and budget > 0 and prefill > 0 and len(running) < self.max_num_seqs
               and not num_preempted):
            seq = self.waiting[0]
            if seq.request.lora is not None and not self._adapter_fits(seq):  # waits, in order, for a slot
                break
            if seq.status == SeqStatus.SWAPPED:
                n = min(seq.num_to_compute, budget, max(1, prefill))
                if not kv.swap_in(seq, n):
                    break
            else:
                # prompt logprobs need every prompt position's logits: no cached prefix for those
                cached = [] if seq.request.needs_prompt_logprobs else kv.find_cached_prefix(seq)
                remaining = seq.num_tokens - len(cached) * kv.block_size
                if remaining > budget and not chunked:
                    break
                n = min(remaining, budget, prefill if chunked else budget)
                if not kv.allocate(seq, n, cached):
                    break
                if seq.first_scheduled is None:
                    seq.num_cached_tokens = len(cached) * kv.block_size
                    kv.record_prefix_query(seq, seq.num_cached_tokens)
            self.waiting.pop(0)
            self._count_waiting(seq, -1)
            seq.status = SeqStatus.RUNNING
            self._append_running(seq)
            start = seq.num_computed_tokens
            scheduled.append(ScheduledSeq(seq, start, n, [seq] if start + n == seq.num_tokens else []))
            budget -= n
            prefill -= n

        decodes = batch.seqs[:] if batch is not None else []
        return SchedulerOutput(scheduled, kv.take_ops(), num_preempted, self.max_num_batched_tokens - budget,
                               len(scheduled) - num_running, decodes, batch)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """seq's adapter is one the running sequences already use, or one more stays within max_loras."""
        names = {s.request.lora.lora_name for s in self.running if s.request.lora is not None}
        return seq.request.lora.lora_name in names or len(names) < self.loras.max_loras

    def _prefill_budget(self) -> int:
        """Prompt tokens a step may compute: all of max_num_batched_tokens, unless a latency target is set and
        sequences are decoding; then what the step cost model predicts fits in the target beside the decodes
        (at least MIN_PREFILL_CHUNK, so prompts always progress, and at least the prompt backlog's share of
        ttft_target_s), or everything while it cannot predict yet."""
        if self.itl_target_s <= 0 or not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        decodes = backlog = 0
        for s in self.running:
            todo = len(s.token_ids) - s.num_computed_tokens
            if todo == 1:
                decodes += 1
            else:
                backlog += todo
        if not decodes:
            return self.max_num_batched_tokens
        fits = self.step_cost.tokens_within(self.itl_target_s)
        if fits is None:
            return self.max_num_batched_tokens
        backlog += sum(len(s.token_ids) - s.num_computed_tokens for s in self.waiting)
        # Steps of about itl_target_s each: the prompts waiting must still be done within ttft_target_s, so
        # never give them less than their share of that many steps (a cut that starved them would trade
        # smooth streams for a queue that only grows).
        share = -(-backlog * self.itl_target_s // self.ttft_target_s) if self.ttft_target_s > 0 else 0
        return max(MIN_PREFILL_CHUNK, fits - decodes, int(share))

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
            self._sort_waiting()

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        if seq.batch_row >= 0:
            self.batch.remove(seq)
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
        self._note_class_change(seq)
        self._append_running(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.batch_row >= 0:
            self.batch.remove(seq)
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self._count_waiting(seq, -1)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
