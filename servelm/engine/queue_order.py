"""The order of the scheduler's queues: FCFS, or priority classes with ageing.

Under "priority" a sequence's key is (effective class, arrival): its request's class improves by one for every
`aging_s` it has existed, so low priority is never starved. "fcfs" orders by arrival only. Both queues are kept in
key order between steps and re-sorted only when a key can have changed (an out-of-order append, a request ageing
into a better class before `_order_until`, a policy change), so a steady step computes no key at all.

`QueueOrder` is a part of `Scheduler` (engine/scheduler.py), which holds the state it reads: `policy`, `aging_s`,
`clock`, the `running` and `waiting` queues, `_now`, `_order_until`, `_order_params` and the sorted flags.
"""

from __future__ import annotations

import math

from servelm.engine.sequence import Sequence


class QueueOrder:
    def effective_priority(self, seq: Sequence, now: float) -> int:
        if self.policy == "fcfs":
            return 0
        p = seq.request.priority
        if self.aging_s > 0:
            p -= int((now - seq.request.arrival_time) / self.aging_s)
        return max(0, p)

    def _key(self, seq: Sequence) -> tuple:
        return (self.effective_priority(seq, self._now), *seq.arrival_key())

    def _class_change(self, seq: Sequence, t: float) -> float:
        """A time at or before the first moment after t at which seq's effective class differs from the one it
        has at t (inf: never). Early is harmless (a sort that changes nothing), late is not, so the boundary is
        moved earlier by far more than float rounding in effective_priority can shift it."""
        if self.policy == "fcfs" or self.aging_s <= 0:
            return math.inf
        req = seq.request
        age = (t - req.arrival_time) / self.aging_s
        steps = int(age)  # what effective_priority subtracts; it only grows with t (int() truncates toward 0)
        if req.priority - steps <= 0:
            return math.inf  # class 0 now, and forever
        # int(age) next changes when age reaches steps + 1, or, for a negative age below -1, passes steps
        boundary = steps + 1 if age >= 0 or steps == 0 else steps
        at = req.arrival_time + self.aging_s * boundary
        return at - 1e-9 * (abs(req.arrival_time) + abs(self.aging_s * boundary) + 1.0)

    def _note_class_change(self, seq: Sequence) -> None:
        until = self._class_change(seq, self._now)
        if until < self._order_until:
            self._order_until = until

    def _order_queues(self) -> None:
        """Put both queues in key order at the start of a step. A key changes over time only when its request
        ages into a better class: while no queued sequence can have done so since the keys were last computed
        (before self._order_until) and no append broke the order, the queues are already sorted and this costs
        nothing. Otherwise each unsorted queue is sorted, exactly as a sort at every step would leave it (sorts
        are stable and an in-order list is left as it is)."""
        now = self.clock()
        params = (self.policy, self.aging_s)
        if not self._now <= now < self._order_until or params != self._order_params:
            self._order_params = params
            self._order_until = min((self._class_change(q, now) for q in (*self.running, *self.waiting)),
                                    default=math.inf)
            self._running_sorted = self._waiting_sorted = False
        self._now = now
        if not self._running_sorted:
            self.running.sort(key=self._key)
            self._running_sorted = True
        self._sort_waiting()

    def _sort_waiting(self) -> None:
        if not self._waiting_sorted:
            self.waiting.sort(key=self._key)
            self._waiting_sorted = True
