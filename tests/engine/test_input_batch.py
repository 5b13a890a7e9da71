"""The running batch (engine/input_batch.py): every running sample as a row of columns changes nothing a
request gets.

Random traffic runs through an EngineCore with a deterministic stand-in runner whose token is a function of the
sample's own tokens, so what each sample gets is known without the engine (`_expected`); the stand-in also
checks each step that the columns mirror the sequences. A real tiny model checks the inputs the runner builds
from the columns (positions, KV slots, block tables, prompt chunks beside decodes) against transformers.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy, random_prompts

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
    """The runner's execute without a model. Before each step it checks that the running batch's columns mirror
    its sequences: every running sample has a row, and the row holds the sample's computed count, length, last
    token, prompt length and block table."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.decode_rows = 0
        self.mixed_steps = 0
        self.steady_steps = 0

    def __call__(self, out: SchedulerOutput) -> RunnerOutput:
        self.core.runner.apply_block_ops(out.ops)
        batch = out.batch
        assert sorted(s.seq_id for s in batch.seqs) == sorted(s.seq_id for s in self.core.scheduler.running)
        for i, seq in enumerate(batch.seqs):
            assert seq.batch_row == i
            k = len(seq.block_table)
            assert (batch.length[i], batch.last[i], batch.prompt_len[i], batch.num_blocks[i]) == \
                (len(seq.token_ids), seq.token_ids[-1], seq.num_prompt_tokens, k)
            assert list(batch.tables[i, :k]) == seq.block_table
            assert batch.first[i] == (seq.num_output_tokens == 0)
        assert batch.num_first == int(batch.first[:len(batch)].sum())
        if batch.steady:  # what the scheduler takes without looking: every row has its last token to compute
            assert all(s.num_to_compute == 1 for s in batch.seqs)
            self.steady_steps += 1
        assert batch.num_shared == int(batch.shared[:len(batch)].sum())
        for r, (seq, a) in enumerate(zip(out.seqs, out.start.tolist(), strict=True)):
            assert a == seq.num_computed_tokens and out.rows[r] == seq.batch_row
        decodes = int(((out.num_tokens == 1) & out.sampled).sum())
        self.decode_rows += decodes
        self.mixed_steps += 0 < decodes < len(out.rows)
        tokens, logprobs, forked = [], {}, {}
        for r in np.flatnonzero(out.sampled).tolist():
            samples = [out.seqs[r], *out.forks.get(r, ())]
            results = []
            for q in samples:
                want = q.request.params.logprobs is not None
                results.append(SampleResult(_next_token(q), -0.5 if want else None, 1 if want else None,
                                            [] if want else None))
            tokens.append(results[0].token_id)
            if r in out.forks:
                forked[r] = results
            elif results[0].logprob is not None:
                logprobs[r] = results[0]
        return RunnerOutput(tokens, logprobs, forked=forked)


def _core(num_blocks: int, mode: str, caching: bool) -> tuple[EngineCore, StandIn]:
    config = EngineConfig(num_kv_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=512, block_size=4,
                          max_model_len=min(256, num_blocks * 4), preemption_mode=mode, swap_space_gb=0.001,
                          enable_prefix_caching=caching)
    core = EngineCore(config, _fake_model())
    core.runner.execute = StandIn(core)
    return core, core.runner.execute


def _expected(req: Request, index: int, max_model_len: int) -> tuple[list[int], str]:
    """What sample `index` of `req` gets, computed alone: the stand-in's chain of tokens up to the first that
    ends it (EOS or a stop id once min_tokens are out, max_tokens, or the context length)."""
    p = req.params
    tokens = list(req.prompt_token_ids)
    out = []
    while True:
        tok = (tokens[-1] * 7 + len(tokens) * 3 + index) % VOCAB
        tokens.append(tok)
        out.append(tok)
        if len(out) >= p.min_tokens and ((not p.ignore_eos and tok == EOS) or tok in p.stop_token_ids):
            return out, "stop"
        if len(out) >= p.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


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
            if (o.request_id, o.index) not in got:  # a sample's first token reports its time in the queue
                assert o.queue_time is not None and o.queue_time >= 0
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
def test_every_request_gets_what_it_would_get_alone(mode, num_blocks, caching, seed):
    """Random traffic (EOS, stop ids, min_tokens, n = 2, logprobs, shared prefixes) through the running batch,
    with preemption by recompute or swap where the pool is small: each sample gets exactly the tokens and finish
    reason it gets alone, logprobs where asked, and nothing leaks."""
    traffic = _traffic(seed)
    core, fwd = _core(num_blocks, mode, caching)
    got = _drive(core, traffic)
    want = {}
    for _, req in traffic:
        for i in range(req.params.n):
            tokens, reason = _expected(req, i, core.max_model_len)
            want[(req.request_id, i)] = [tokens, reason, len(tokens) if req.params.logprobs is not None else 0]
    assert got == want
    assert fwd.decode_rows > 0 and fwd.mixed_steps > 0  # decodes ran as columns, also beside prompt chunks
    assert fwd.steady_steps > 0
    assert not core.requests and not core.scheduler.running
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks
    assert len(core.scheduler.batch) == 0 and not core.scheduler.batch.stop_count.any()
    if mode == "recompute" and num_blocks < 64:
        assert core.scheduler.num_preemptions > 0  # the small pool forced preemptions


def test_aborting_members_frees_their_rows_and_blocks():
    core, _ = _core(256, "recompute", True)
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


def test_real_model_rows_in_any_order_match_transformers(model_dirs, hf_models):
    """Rows finish at different lengths (the last row moves into each hole) while later prompts are admitted in
    small chunks beside the decodes: every output still equals transformers' greedy continuation."""
    prompts = random_prompts(8, 5, 40, seed=11)
    lengths = [3, 24, 7, 24, 1, 16, 24, 5]
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=16)
    core = llm.engine.core
    seen = []
    schedule = core.scheduler.schedule

    def recording():
        out = schedule()
        seen.append((int(((out.num_tokens == 1) & out.sampled).sum()), len(out.rows)))
        return out

    core.scheduler.schedule = recording
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(hf_models["llama"], p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert any(0 < d < n for d, n in seen)  # steps that mixed decodes and prompt chunks
