"""Continuous-batching scheduler with no prefill/decode phases, only "tokens still to compute" per sequence.

Each step fills a token budget: running sequences first (a decode costs 1 token, a prefill chunk up to the
budget), then new or preempted ones as blocks allow. When blocks run out, the last sequence in scheduling
order (lowest priority, newest) is preempted by recompute or by swapping its blocks to CPU.

Under the "priority" policy the order is (effective class, arrival): a request's class improves by one for
every `aging_s` it has existed, so low priority is never starved; a waiting request of a strictly better
class displaces running ones of a worse class when there is no room for it. "fcfs" orders by arrival only.

Host cost per step is O(1) per scheduled sequence: both queues stay sorted between steps and are re-sorted only
when an order key can have changed (a sequence appended out of order, or a request aging into a better class;
see `_order_queues`), never wholesale each step; the decodes are found and given their slots as one vector over
the running batch (engine/input_batch.py), and a decode whose block has room allocates nothing.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from servelm.config.engine import RuntimeSettings
from servelm.engine.input_batch import InputBatch
from servelm.engine.kv_cache_manager import BlockOps, KVCacheManager
from servelm.engine.queue_order import QueueOrder
from servelm.engine.sequence import SeqStatus, Sequence
from servelm.engine.step_cost import StepCostModel
from servelm.engine.step_update import StepUpdate

MIN_PREFILL_CHUNK = 32  # prompt tokens a step computes even when decodes alone reach the latency target


class ScheduledSeq(msgspec.Struct, gc=False):
    """One row of a step, as a struct (`SchedulerOutput.scheduled`): for tools and tests that walk a step row by
    row. The engine itself reads the step as columns."""

    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int  # tokens computed this step, drafts included
    # the samples that take a token from this row's logits: [] for a partial prompt chunk, [seq] normally, and
    # [seq, *new siblings] when an n > 1 request forks after its prompt
    sample_seqs: list[Sequence] = []
    spec_token_ids: list[int] = []  # drafts verified this step (they follow the sequence's last token)


@dataclass(slots=True)
class SchedulerOutput:
    """One step as a diff against the running batch: the rows that run (ascending, so the step's tokens follow
    the batch's order), how many tokens each computes from which position, and the sparse extras: drafts to
    verify and, once EngineCore has made them, the new samples of n > 1 requests whose prompt ends here."""

    batch: InputBatch
    rows: np.ndarray  # batch rows that run this step
    seqs: list[Sequence]  # their samples
    start: np.ndarray  # each row's first position computed
    num_tokens: np.ndarray  # each row's tokens computed, drafts included
    sampled: np.ndarray  # whether each row samples: it reaches its sample's last token (then a verification
    # samples after each of its drafts too)
    ops: BlockOps
    num_preempted: int = 0
    num_admitted: int = 0  # samples that joined the running batch this step
    drafts: dict[int, list[int]] = field(default_factory=dict)  # step row -> draft tokens it verifies
    forks: dict[int, list[Sequence]] = field(default_factory=dict)  # step row -> siblings sampled with it
    prompt_rows: list[int] = field(default_factory=list)  # step rows that compute prompt positions
    num_batched_tokens: int = 0
    all_sampled: bool = True  # every row samples (no partial prompt chunk)
    # async scheduling: the rows' input tokens are those the step in flight samples (the runner takes them on
    # the device); each row's start is one past the batch's computed count
    behind: bool = False

    @classmethod
    def of(cls, batch: InputBatch, ops: BlockOps, drafts: dict[Sequence, list[int]] | None = None,
           decodes_only: bool = False, **kw) -> SchedulerOutput:
        """The step whose rows are the batch's rows with `scheduled` tokens. `decodes_only`: every row runs one
        token, its last (what a steady decode step is: then every row samples)."""
        n = len(batch)
        if decodes_only:
            rows, seqs = batch.row_ids[:n], batch.seqs[:]
            start, num_tokens, sampled, total = batch.pos[:n].copy(), batch.ones[:n], batch.all_true[:n], n
            sel = slice(0, n)
        else:
            counts = batch.scheduled[:n]
            rows = counts.nonzero()[0]
            sel = slice(0, n) if len(rows) == n else rows  # (every row: slices instead of gathers)
            seqs = batch.seqs[:] if len(rows) == n else [batch.seqs[i] for i in rows.tolist()]
            start, num_tokens = batch.pos[sel].copy(), counts[sel].copy()
            ends = start + num_tokens
            total = int(num_tokens.sum())
            if drafts:
                drafts = {r: drafts[s] for r, s in enumerate(seqs) if s in drafts}
                ends = ends - np.array([len(drafts.get(r, ())) for r in range(len(rows))], np.int64)
            sampled = ends == batch.length[sel]
        # (a decode's token is a prompt's only while its sample awaits its first token)
        prompt_rows = [] if decodes_only and not batch.num_first else np.flatnonzero(
            start < batch.prompt_len[sel]).tolist()
        return cls(batch, rows, seqs, start, num_tokens, sampled, ops, drafts=drafts or {},
                   prompt_rows=prompt_rows, num_batched_tokens=total, all_sampled=decodes_only or bool(sampled.all()),
                   **kw)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """The step row by row (for tools and tests; the engine reads the columns)."""
        sampled = self.sampled.tolist()
        return [ScheduledSeq(seq, int(a), int(n), ([seq] + self.forks.get(r, [])) if s else [],
                             self.drafts.get(r, []))
                for r, (seq, a, n, s) in enumerate(zip(self.seqs, self.start.tolist(), self.num_tokens.tolist(),
                                                        sampled, strict=True))]

    def __bool__(self) -> bool:
        return len(self.rows) > 0


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
        # the LoRA adapters of each queue's sequences, by name, with how many use each (kept as they change:
        # admission asks whether an adapter fits, and stats name them, at every step)
        self.waiting_adapters: Counter[str] = Counter()
        self.running_adapters: Counter[str] = Counter()
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
        # every running sample as a row of columns (engine/input_batch.py); EngineCore gives it the vocabulary
        self.batch = InputBatch(kv.block_size)
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
        _count_adapter(self.waiting_adapters, seq, d)

    def _append_running(self, seq: Sequence) -> None:
        """seq, already queued (its class change is noted), joins the end of the running queue."""
        if self._running_sorted and self.running and self._key(seq) < self._key(self.running[-1]):
            self._running_sorted = False
        self.running.append(seq)
        self.batch.add(seq)
        _count_adapter(self.running_adapters, seq, 1)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The step's diff against the running batch: tokens for each row that runs (decodes first, each with
        room for its token; then prompt chunks and verifications in scheduling order, preempting from the end
        when blocks run out), and the waiting samples admitted."""
        budget = self.max_num_batched_tokens
        self._order_queues()
        num_preempted = 0
        if self.policy == "priority":
            self._displace_for_priority()
        running, kv, chunked, batch = self.running, self.kv, self.enable_chunked_prefill, self.batch
        prefill = self._prefill_budget()  # prompt tokens this step may compute beside its decodes
        n = len(batch)
        scheduled = batch.scheduled
        drafts: dict[Sequence, list[int]] = {}
        # The decodes as one vector: each with room for its token, or none of them (the loop then takes them,
        # preempting if it must). A row with drafts to verify is not a plain decode.
        if batch.steady and self.spec is None:  # (known without looking: the last step ran decodes only)
            every_row = True
        else:
            decoding = batch.length[:n] - batch.pos[:n] == 1
            if self.spec is not None:
                decoding &= np.fromiter((not s.spec_token_ids for s in batch.seqs), bool, n)
            every_row = bool(decoding.all())
        sel = slice(0, n) if every_row else decoding.nonzero()[0]  # (every row: slices instead of gathers)
        k = n if every_row else len(sel)
        if k and k <= budget and batch.reserve(kv, sel):
            if every_row:
                if not batch.steady:  # (a steady batch's rows each ran one token last step: already 1)
                    scheduled[:n] = 1
            else:
                scheduled[:n] = 0
                scheduled[sel] = 1
            budget -= k
        else:
            scheduled[:n] = 0
            every_row = False
        # A for loop over a list that preemption shortens from the end: scheduled sequences sit before the current
        # one, so a victim is always after it (or is it, the last one, which ends the loop). In steady decode
        # every row is scheduled above and the loop is skipped, not walked.
        for seq in running if not every_row else ():
            if budget <= 0:
                break
            row = seq.batch_row
            if scheduled[row]:
                continue
            start = seq.num_computed_tokens
            todo = len(seq.token_ids) - start
            k = todo if todo < budget else budget
            if k > 1 and not seq.spec_token_ids and k > prefill and chunked:  # a prompt chunk over the budget
                if prefill <= 0:
                    continue
                k = prefill
            if seq.spec_token_ids:
                found = self._drafts_that_fit(seq, k, budget)
                if found:
                    batch.sync_table(seq)
                    scheduled[row] = k + len(found)
                    drafts[seq] = found
                    budget -= k + len(found)
                    continue
            if k < todo and not chunked:
                continue
            while not kv.allocate(seq, k):
                victim = running.pop()
                budget += int(scheduled[victim.batch_row])  # a decode counted above
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                batch.sync_table(seq)
                scheduled[seq.batch_row] = k
                budget -= k
                if k > 1:
                    prefill -= k

        # Admit waiting sequences, unless this step already had to preempt (the pool is under pressure).
        num_admitted = 0
        while (self.waiting and budget > 0 and prefill > 0 and len(running) < self.max_num_seqs
               and not num_preempted):
            seq = self.waiting[0]
            if seq.request.lora is not None and not self._adapter_fits(seq):  # waits, in order, for a slot
                break
            if seq.status == SeqStatus.SWAPPED:
                k = min(seq.num_to_compute, budget, max(1, prefill))
                if not kv.swap_in(seq, k):
                    break
            else:
                # prompt logprobs need every prompt position's logits: no cached prefix for those
                cached = None if seq.request.needs_prompt_logprobs else kv.find_cached_prefix(seq)
                remaining = seq.num_tokens - (cached.num_tokens if cached else 0)
                if remaining > budget and not chunked:
                    break
                k = min(remaining, budget, prefill if chunked else budget)
                if not kv.allocate(seq, k, cached):
                    break
                if seq.first_scheduled is None:
                    seq.num_cached_tokens = cached.num_tokens if cached else 0
                    kv.record_prefix_query(seq, seq.num_cached_tokens)
            self.waiting.pop(0)
            self._count_waiting(seq, -1)
            seq.status = SeqStatus.RUNNING
            self._append_running(seq)
            scheduled[seq.batch_row] = k
            num_admitted += 1
            budget -= k
            prefill -= k
        return SchedulerOutput.of(batch, kv.take_ops(), drafts, every_row and not num_admitted,
                                  num_preempted=num_preempted, num_admitted=num_admitted)

    # -- async scheduling (engine/core.py) ---------------------------------------------------------------
    def overlaps(self, out: SchedulerOutput) -> bool:
        """Whether the next step may be scheduled behind `out` before its tokens are known: `out` is a step of
        every running row's one decode, each a request whose sampling reads nothing of its tokens."""
        batch = self.batch
        return (self.spec is None and not batch.num_sync and out.all_sampled and not out.prompt_rows
                and not out.forks and out.num_batched_tokens == len(out.rows) == len(batch))

    def schedule_behind(self, inflight: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `inflight`, which runs now, before its tokens are known: every row decodes the token
        `inflight` samples for it. None where it cannot go behind it: a request waits that could be admitted (or
        displace a running one of a worse class), a row's token may reach its length limit (the next position
        might not exist), a request needs its tokens on the host, or the pool has no block for a row's next
        position (the usual schedule then preempts)."""
        batch, n = self.batch, len(self.batch)
        if not n or n > self.max_num_batched_tokens or batch.num_sync or len(inflight.seqs) != n:
            return None
        if self.waiting and not self._waiting_stays():
            return None
        if (batch.length[:n] + 1 >= batch.stop_at[:n]).any() or not batch.reserve(self.kv, slice(0, n), ahead=1):
            return None
        out = SchedulerOutput.of(batch, self.kv.take_ops(), None, True)
        out.start += 1
        out.behind = True
        return out

    def _waiting_stays(self) -> bool:
        """The usual schedule would admit no waiting request now: the running queue is full, and under the
        priority policy none waiting is of a better class than the last one running."""
        if len(self.running) >= self.max_num_seqs and self.policy == "priority":
            self._order_queues()
            now = self._now
            return self.effective_priority(self.waiting[0], now) >= self.effective_priority(self.running[-1], now)
        return len(self.running) >= self.max_num_seqs

    def rebase(self, out: SchedulerOutput) -> tuple[SchedulerOutput, np.ndarray] | None:
        """A step in flight, narrowed to the samples still running at their rows now (samples finished or
        aborted since it was scheduled leave, and the batch's last rows moved into their places), and which
        of its rows those are; None when nothing changed. While a step is in flight rows only leave."""
        batch = self.batch
        if len(out.seqs) == len(batch) and batch.seqs == out.seqs:
            return None
        alive = sorted((s.batch_row, i) for i, s in enumerate(out.seqs) if s.batch_row >= 0)
        keep = np.array([i for _, i in alive], np.int64)
        rows = np.array([r for r, _ in alive], np.int64)
        narrowed = SchedulerOutput(batch, rows, [out.seqs[i] for i in keep.tolist()], out.start[keep],
                                   out.num_tokens[keep], out.sampled[keep], BlockOps(),
                                   num_batched_tokens=len(keep), all_sampled=True, behind=out.behind)
        return narrowed, keep

    def _adapter_fits(self, seq: Sequence) -> bool:
        """seq's adapter is one the running sequences already use, or one more stays within max_loras."""
        names = self.running_adapters
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
        """seq, just taken off the running queue's end, goes back to waiting (swapped, or to recompute)."""
        self.num_preemptions += 1
        self.batch.remove(seq)
        _count_adapter(self.running_adapters, seq, -1)
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
        if seq.status == SeqStatus.RUNNING:
            self.batch.remove(seq)
            self.running.remove(seq)
            _count_adapter(self.running_adapters, seq, -1)
        else:
            self.waiting.remove(seq)
            self._count_waiting(seq, -1)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason


def _count_adapter(counts: Counter[str], seq: Sequence, d: int) -> None:
    """seq joins (d=1) or leaves (d=-1) the queue whose adapters `counts` holds; a name none uses is dropped."""
    if seq.request.lora is None:
        return
    name = seq.request.lora.lora_name
    counts[name] += d
    if not counts[name]:
        del counts[name]
