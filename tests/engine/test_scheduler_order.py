"""The scheduler sorts its queues only when an order key can have changed (an out-of-order append, a request
aging into a better class, a policy change); every step must still schedule exactly what sorting both queues
at every step schedules. Checked step by step against such a reference on random traffic with priorities,
aging boundaries crossed at and between steps, arrival times ahead of the scheduler's clock, preemption by
recompute and by swap, forks (n > 1) and run-time policy changes. No model: a step "computes" what was
scheduled and samples a dummy token, reported through the scheduler's update, on a fake clock.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import Request, Sequence
from servelm.engine.step_outputs import RunnerOutput, SampleResult
from servelm.sampling_params import SamplingParams


class SortEveryStep(Scheduler):
    """The reference: both queues sorted by their keys at the start of every step (and waiting again after
    each priority displacement), whatever changed."""

    def _order_queues(self) -> None:
        self._now = self.clock()
        self.running.sort(key=self._key)
        self.waiting.sort(key=self._key)

    def _sort_waiting(self) -> None:
        self.waiting.sort(key=self._key)


class Sim:
    def __init__(self, cls: type[Scheduler], policy: str, aging_s: float, mode: str) -> None:
        self.now = 0.0
        self.kv = KVCacheManager(40, 4, enable_prefix_caching=True, num_cpu_blocks=24 if mode == "swap" else 0)
        self.sch = cls(self.kv, 6, 24, True, mode, policy, aging_s, lambda: self.now)
        self.order = 0
        self.finished = 0

    def add(self, rid: str, prompt: list[int], out_tokens: int, priority: int, arrival: float, n: int,
            lora=None) -> None:
        req = Request(rid, prompt, SamplingParams(max_tokens=out_tokens, n=n), arrival_time=arrival,
                      priority=priority, order=self.order, lora=lora)
        self.order += 1
        req.seqs = [Sequence(req, 0, list(prompt))]
        self.sch.add(req.seqs[0])

    def step(self) -> list[tuple]:
        out = self.sch.schedule()
        for r, seq in enumerate(out.seqs):  # n > 1: siblings sample from the prompt's last row, as in EngineCore
            req = seq.request
            if out.sampled[r] and req.params.n > 1 and not req.forked:
                out.forks[r] = [Sequence(req, i, list(seq.token_ids)) for i in range(1, req.params.n)]
        tokens, forked = [], {}
        for r in np.flatnonzero(out.sampled).tolist():  # each sample's token: 5 + its index
            tokens.append(5 + out.seqs[r].index)
            if r in out.forks:
                forked[r] = [SampleResult(5 + q.index) for q in [out.seqs[r], *out.forks[r]]]
        outputs, _ = self.sch.update_from_output(out, RunnerOutput(tokens, forked=forked))
        self.finished += sum(o.finish_reason is not None for o in outputs)
        self.kv.end_step()
        return [(s.seq.request.request_id, s.seq.index, s.start, s.num_tokens, len(s.sample_seqs))
                for s in out.scheduled]

    def queues(self) -> tuple[list, list]:
        return ([(q.request.request_id, q.index) for q in self.sch.running],
                [(q.request.request_id, q.index) for q in self.sch.waiting])


@pytest.mark.parametrize("policy,aging_s,mode,seed", [
    ("priority", 3.0, "recompute", 0), ("priority", 3.0, "swap", 1), ("priority", 0.7, "recompute", 2),
    ("priority", 0.0, "recompute", 3), ("fcfs", 3.0, "swap", 4), ("priority", 2.0, "recompute", 5),
])
def test_schedules_exactly_as_sorting_every_step(policy, aging_s, mode, seed):
    rng = random.Random(seed)
    new, ref = Sim(Scheduler, policy, aging_s, mode), Sim(SortEveryStep, policy, aging_s, mode)
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]  # shared prefixes: prefix-cache hits
    for step in range(400):
        for _ in range(rng.choice([0, 0, 0, 0, 0, 1, 1, 3])):
            rid = f"r{new.order}"
            prompt = list(rng.choice(prompts)) + [rng.randrange(10, 99) for _ in range(rng.randrange(0, 30))]
            # arrival on the clock, a little ahead of it, or a whole aging period and more ahead
            arrival = new.now + rng.choice([0.0, 0.0, 0.0, 0.4, 0.5 * aging_s, 1.5 * aging_s + 1.0])
            args = (rid, prompt, rng.randrange(1, 12), rng.choice([0, 1, 1, 2, 5]), arrival,
                    rng.choice([1, 1, 1, 2]))
            new.add(*args)
            ref.add(*args)
        if step == 250:  # run-time changes (PATCH /admin/config) apply from the next step
            for sim in (new, ref):
                sim.sch.policy, sim.sch.aging_s = ("fcfs" if policy == "priority" else "priority"), 1.0
        assert new.step() == ref.step(), f"step {step}"
        assert new.queues() == ref.queues(), f"step {step}"
        # the waiting queue's counts (engine stats, read every step) are kept as it changes: they are a recount
        waiting = new.sch.waiting
        assert new.sch.num_waiting_swapped == sum(1 for q in waiting if q.cpu_block_table), f"step {step}"
        assert new.sch.waiting_by_priority == [sum(1 for q in waiting if min(q.request.priority, 2) == c)
                                               for c in range(3)], f"step {step}"
        # steps land on aging boundaries exactly (whole seconds) and between them
        dt = rng.choice([1.0, 1.0, 0.5, 0.25, 0.3])
        new.now += dt
        ref.now += dt
    assert new.sch.num_preemptions == ref.sch.num_preemptions > 0
    assert new.finished == ref.finished > 100


def test_steady_decode_does_not_recompute_keys():
    """The point of it all: with nothing appended and no aging due, a step computes no order key."""
    sim = Sim(Scheduler, "priority", 10.0, "recompute")
    for i in range(10):
        sim.add(f"r{i}", [1, 2, 3, i], 50, 1, 0.0, 1)
    for _ in range(3):
        sim.step()
    calls = []
    key = sim.sch._key
    sim.sch._key = lambda seq: calls.append(seq) or key(seq)
    for _ in range(5):
        sim.now += 1.0
        sim.step()
    assert calls == []
    sim.now += 5.0  # every request is now 10 s old: class 1 -> 0, so the queues are sorted again
    sim.step()
    assert len(calls) >= 10


@pytest.mark.parametrize("mode,seed", [("recompute", 0), ("swap", 1)])
def test_adapter_counts_follow_the_queues_and_cap_the_running_adapters(mode, seed):
    """Each queue's LoRA adapters (named by the engine's stats, asked by admission at every step) are counted as
    sequences come and go: after every step, and after aborts from either queue, they are a recount of the
    queues, and the running sequences never use more than max_loras adapters."""
    from types import SimpleNamespace

    from servelm.lora import LoRARequest

    rng = random.Random(seed)
    sim = Sim(Scheduler, "priority", 2.0, mode)
    sim.sch.loras = SimpleNamespace(max_loras=2)
    adapters = [None, *(LoRARequest(f"a{i}", i + 1) for i in range(4))]
    seen_waiting_for_a_slot = False

    def recount(seqs):
        names: dict[str, int] = {}
        for q in seqs:
            if q.request.lora is not None:
                names[q.request.lora.lora_name] = names.get(q.request.lora.lora_name, 0) + 1
        return names

    for step in range(300):
        for _ in range(rng.choice([0, 0, 1, 1, 3])):
            sim.add(f"r{sim.order}", [1, 2, 3] + [rng.randrange(10, 99) for _ in range(rng.randrange(0, 30))],
                    rng.randrange(1, 24), rng.choice([0, 1, 2]), sim.now, rng.choice([1, 1, 2]), rng.choice(adapters))
        if rng.random() < 0.1:  # an abort, of a waiting or a running sequence
            queue = rng.choice([sim.sch.waiting, sim.sch.running])
            if queue:
                sim.sch.finish(rng.choice(queue), "abort")
        sim.step()
        running = recount(sim.sch.running)
        assert dict(sim.sch.running_adapters) == running, f"step {step}"
        assert dict(sim.sch.waiting_adapters) == recount(sim.sch.waiting), f"step {step}"
        assert len(running) <= 2, f"step {step}"
        waiting = sim.sch.waiting
        if waiting and waiting[0].request.lora is not None and len(running) == 2 \
                and waiting[0].request.lora.lora_name not in running:
            seen_waiting_for_a_slot = True
        sim.now += 0.5
    assert sim.sch.num_preemptions > 0 and sim.finished > 50
    assert seen_waiting_for_a_slot  # the cap was reached and held a request back
