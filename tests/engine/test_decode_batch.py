"""The decode batch (engine/decode_batch.py): steady decodes kept as columns change nothing a request gets.

A differential run drives two EngineCores through the same random traffic with a deterministic stand-in
runner, one with the decode batch and one without it (every row through the general path), and compares what
each request got; a real tiny model checks the batch's inputs (positions, KV slots, block tables) against
transformers through the parity tests and here against the engine without the batch.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import random_prompts, run

from servelm import LLM, SamplingParams
from servelm.config.engine import EngineConfig
from servelm.engine.core import EngineCore
from servelm.engine.scheduler import SchedulerOutput
from servelm.engine.sequence import Request
from servelm.engine.step_outputs import RunnerOutput, SampleResult, SeqOutput

VOCAB = 50
EOS = 3


def _fake_model() -> SimpleNamespace:
    spec = SimpleNamespace(moe=None, num_layers=1, num_kv_heads=1, head_dim=8, vocab_size=VOCAB,
                           max_position_embeddings=256)
    return SimpleNamespace(spec=spec, dtype=torch.bfloat16, embed=torch.empty(0, dtype=torch.bfloat16), tp=None)


def _next_token(seq) -> int:
    """What the stand-in "samples": a function of the sample's tokens, so both engines agree whatever the
    schedule (EOS and the stop tokens come up now and then)."""
    t = seq.token_ids
    return (t[-1] * 7 + len(t) * 3 + seq.index) % VOCAB


class StandIn:
    """The runner's execute without a model. It also checks that the batch's arrays mirror its sequences."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.decode_rows = 0

    def __call__(self, out: SchedulerOutput):
        self.core.runner.apply_block_ops(out.ops)
        n = len(out.decode_seqs)
        if n:
            ids, pos, slots, lens, longest = out.batch.inputs(n)
            bs = self.core.kv.block_size
            for i, seq in enumerate(out.decode_seqs):
                p = seq.num_computed_tokens
                assert seq.batch_row == i and len(seq.token_ids) == p + 1
                assert (ids[i], pos[i], lens[i]) == (seq.token_ids[-1], p, p + 1)
                assert slots[i] == seq.block_table[p // bs] * bs + p % bs
                assert list(out.batch.tables[i, :len(seq.block_table)]) == seq.block_table
            assert longest == max(len(s.block_table) for s in out.decode_seqs)
            self.decode_rows += n
        rows = []
        for s in out.scheduled:
            for q in s.sample_seqs:
                tok = _next_token(q)
                want = q.request.params.logprobs is not None
                rows.append([SampleResult(tok, -0.5 if want else None, 1 if want else None, [] if want else None)])
        return RunnerOutput([_next_token(q) for q in out.decode_seqs], rows)


def _core(batch: bool, num_blocks: int, mode: str, caching: bool) -> tuple[EngineCore, StandIn]:
    config = EngineConfig(num_kv_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=512, block_size=4,
                          max_model_len=min(256, num_blocks * 4), preemption_mode=mode, swap_space_gb=0.001,
                          enable_prefix_caching=caching)
    core = EngineCore(config, _fake_model())
    if not batch:
        core.scheduler.batch = None
    core.runner.execute = StandIn(core)
    core.runner.prompt_logprobs = []
    return core, core.runner.execute


def _traffic(seed: int) -> list[tuple[int, Request]]:
    """(step to add it at, request): mixed lengths, EOS, stop tokens, min_tokens, n=2, logprobs, shared
    prefixes (prefix-cache hits)."""
    rng = random.Random(seed)
    out = []
    for i in range(40):
        prompt = [1, 2, 3, 4, 5, 6][: rng.randrange(0, 7)] + [rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 20))]
        max_tokens = rng.randrange(1, 40)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.choice([[], [], [11], [11, 23]]),
                                min_tokens=min(max_tokens, rng.choice([0, 0, 3])),
                                n=rng.choice([1, 1, 1, 1, 2]), logprobs=rng.choice([None, None, None, 1]))
        params._eos_token_ids = frozenset({EOS})
        out.append((rng.randrange(0, 60), Request(f"r{i}", prompt, params)))
    return out


def _drive(core: EngineCore, traffic: list[tuple[int, Request]]) -> dict:
    got: dict = {}
    step = 0
    pending = sorted(traffic, key=lambda x: x[0])
    while pending or core.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, req = pending.pop(0)
            p = req.params
            core.add_request(Request(req.request_id, list(req.prompt_token_ids), p))
        outputs, decodes = core.step()
        columns = [SeqOutput(rid, 0, [t]) for rid, t in zip(decodes.request_ids, decodes.token_ids, strict=True)]
        for o in [*outputs, *columns]:
            entry = got.setdefault((o.request_id, o.index), [[], None, 0])
            entry[0] += o.new_token_ids
            entry[1] = o.finish_reason or entry[1]
            entry[2] += len(o.new_logprobs)
        step += 1
        assert step < 5000
    return got


@pytest.mark.parametrize("mode,num_blocks,caching,seed", [
    ("recompute", 256, True, 0), ("recompute", 24, True, 1), ("swap", 24, False, 2), ("swap", 20, True, 3),
])
def test_decode_batch_changes_no_output(mode, num_blocks, caching, seed):
    traffic = _traffic(seed)
    with_batch, fwd = _core(True, num_blocks, mode, caching)
    without, _ = _core(False, num_blocks, mode, caching)
    got = _drive(with_batch, traffic)
    assert got == _drive(without, traffic)
    assert fwd.decode_rows > 0  # the batch really carried decodes
    # every request is done and nothing leaks: no member left, every block back in the pool
    for core in (with_batch, without):
        assert not core.requests and not core.scheduler.running
        assert core.kv.num_free_blocks == core.kv.pool.num_blocks
    assert len(with_batch.scheduler.batch) == 0
    assert not with_batch.scheduler.batch.stop_count.any()
    if num_blocks == 256:  # no pressure: the same blocks entered the prefix cache (generated ones included)
        assert set(with_batch.kv.pool.cached) == set(without.kv.pool.cached)
        assert with_batch.stats().generation_tokens == without.stats().generation_tokens
    if mode == "recompute" and num_blocks < 64:
        assert with_batch.scheduler.num_preemptions > 0  # the small pool forced preemptions


def test_aborting_members_frees_their_rows_and_blocks():
    core, _ = _core(True, 256, "recompute", True)
    for i in range(6):
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        core.add_request(Request(f"a{i}", [5, 6, 7, 8 + i], params))
    for _ in range(4):
        core.step()
    batch = core.scheduler.batch
    assert len(batch) == 6 and sorted(batch.request_ids) == [f"a{i}" for i in range(6)]
    core.abort_request("a1")
    core.abort_request("a4")
    assert sorted(batch.request_ids) == ["a0", "a2", "a3", "a5"]
    assert [s.batch_row for s in batch.seqs] == [0, 1, 2, 3]
    outputs, decodes = core.step()
    assert sorted(decodes.request_ids) == ["a0", "a2", "a3", "a5"] and not outputs
    for rid in ("a0", "a2", "a3", "a5"):
        core.abort_request(rid)
    assert len(batch) == 0 and core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_real_model_same_tokens_with_and_without_the_batch(model_dirs):
    prompts = random_prompts(6, 5, 40, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=64, block_size=4)
    core = llm.engine.core
    seen = []
    schedule = core.scheduler.schedule

    def recording():
        out = schedule()
        seen.append(len(out.decode_seqs))
        return out

    core.scheduler.schedule = recording
    with_batch = run(llm, prompts, params)
    assert max(seen) == len(prompts)  # all six decoded as columns
    core.scheduler.batch = None
    assert run(llm, prompts, params) == with_batch
