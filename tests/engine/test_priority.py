"""Priority scheduling: admission and preemption by class, FCFS within a class, aging so low is never starved.

The scheduler runs here without a model: each step "computes" what was scheduled and samples a dummy token,
and time is a fake clock advanced by one second per step.
"""

from __future__ import annotations

from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import Priority, Request, Sequence
from servelm.engine.step_outputs import RunnerOutput
from servelm.sampling_params import SamplingParams


class Sim:
    def __init__(self, max_num_seqs: int = 1, num_blocks: int = 64, policy: str = "priority",
                 aging_s: float = 10.0) -> None:
        self.now = 0.0
        self.kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False, num_cpu_blocks=0)
        self.sch = Scheduler(self.kv, max_num_seqs, 64, True, "recompute", policy, aging_s, lambda: self.now)
        self.finished: list[str] = []
        self.max_out: dict[str, int] = {}
        self._order = 0

    def add(self, rid: str, priority: Priority, out_tokens: int, prompt_len: int = 4) -> Sequence:
        req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=out_tokens),
                      arrival_time=self.now, priority=priority, order=self._order)
        self._order += 1
        seq = Sequence(req, 0, list(req.prompt_token_ids))
        req.seqs = [seq]
        self.max_out[rid] = out_tokens
        self.sch.add(seq)
        return seq

    def step(self) -> list[str]:
        out = self.sch.schedule()
        outputs, _ = self.sch.update_from_output(out, RunnerOutput([7] * int(out.sampled.sum())))
        self.finished += [o.request_id for o in outputs if o.finish_reason is not None]
        self.now += 1.0
        return [s.request.request_id for s in out.seqs]


def test_high_priority_is_admitted_before_earlier_low_and_fcfs_within_a_class():
    sim = Sim(max_num_seqs=1)
    sim.add("low", Priority.LOW, 2)
    sim.add("normal-1", Priority.NORMAL, 2)
    sim.add("high", Priority.HIGH, 2)
    sim.add("normal-2", Priority.NORMAL, 2)
    while sim.sch.has_unfinished():
        sim.step()
    assert sim.finished == ["high", "normal-1", "normal-2", "low"]


def test_high_priority_preempts_running_low_which_still_finishes():
    sim = Sim(max_num_seqs=1)
    low = sim.add("low", Priority.LOW, 20)
    for _ in range(3):
        sim.step()
    assert sim.sch.running == [low]
    sim.add("high", Priority.HIGH, 3)
    assert sim.step() == ["high"]  # the low request was displaced at once
    assert sim.sch.num_priority_preemptions == 1 and low in sim.sch.waiting
    while sim.sch.has_unfinished():
        sim.step()
    assert sim.finished == ["high", "low"]
    assert low.num_output_tokens == 20  # recomputed, then completed in full


def test_equal_classes_never_preempt_each_other():
    sim = Sim(max_num_seqs=1)
    first = sim.add("a", Priority.NORMAL, 5)
    sim.step()
    sim.add("b", Priority.NORMAL, 5)
    sim.step()
    assert sim.sch.running == [first] and sim.sch.num_priority_preemptions == 0


def test_aging_lets_low_priority_through_a_constant_stream_of_high():
    sim = Sim(max_num_seqs=1, aging_s=10.0)
    sim.add("low", Priority.LOW, 2)
    for i in range(200):  # a new high request every step, each needing two steps: the queue never empties
        sim.add(f"high-{i}", Priority.HIGH, 2)
        sim.step()
        if "low" in sim.finished:
            break
    assert "low" in sim.finished
    # it waited while its class was worse, and got through once aging lifted it to high (after 2 x 10 s)
    assert sim.finished.index("low") >= 5
    assert sim.now <= 2 * 10 + 10


def test_without_aging_low_waits_for_all_high_work():
    sim = Sim(max_num_seqs=1, aging_s=0.0)
    sim.add("low", Priority.LOW, 2)
    for i in range(30):
        sim.add(f"high-{i}", Priority.HIGH, 2)
        sim.step()
    assert "low" not in sim.finished  # starved while high work keeps coming ...
    while sim.sch.has_unfinished():
        sim.step()
    assert sim.finished[-1] == "low"  # ... and served once it stops


def test_fcfs_policy_ignores_priority():
    sim = Sim(max_num_seqs=1, policy="fcfs")
    sim.add("low", Priority.LOW, 2)
    sim.add("high", Priority.HIGH, 2)
    while sim.sch.has_unfinished():
        sim.step()
    assert sim.finished == ["low", "high"] and sim.sch.num_priority_preemptions == 0


def test_block_pressure_preempts_lowest_class_first():
    sim = Sim(max_num_seqs=4, num_blocks=6)  # 24 token slots
    high = sim.add("high", Priority.HIGH, 12)
    low = sim.add("low", Priority.LOW, 12)
    while sim.sch.num_preemptions == 0 and sim.sch.has_unfinished():
        sim.step()
    assert low in sim.sch.waiting and high in sim.sch.running
    while sim.sch.has_unfinished():
        sim.step()
    assert sim.finished == ["high", "low"]
