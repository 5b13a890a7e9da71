"""Speculative decoding: exact greedy outputs (against plain decoding and transformers) under every scheduling
feature, no leaked KV blocks, stops inside accepted runs, and the target distribution kept when sampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import COMMON, hf_greedy

from servelm import LLM, SamplingParams
from servelm.engine.proposers import ngram_lookup
from servelm.engine.rejection import verify
from servelm.engine.sampler import Sampler
from servelm.engine.sequence import Request, Sequence
from servelm.engine.spec_decode import SpecDecoder

VOCAB = 64  # a small vocabulary: greedy outputs of a random model loop, so prompt lookup finds real drafts
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def small_model(out: Path, tokenizer_dir: Path, seed: int, **config) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "vocab_size": VOCAB, **config}), dtype=torch.float32) \
        .save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return small_model(tmp_path_factory.mktemp("small_vocab"), tokenizer_dir, seed=0)


@pytest.fixture(scope="module")
def small_hf(small_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32).eval()


_refs: dict[tuple[int, ...], list[int]] = {}


def greedy_ref(hf, prompt: list[int], n: int = 32) -> list[int]:
    """transformers' greedy continuation (one model per module), computed once per prompt."""
    key = (*prompt, -n)
    if key not in _refs:
        _refs[key] = hf_greedy(hf, prompt, n)
    return _refs[key]


def prompts(n: int, seed: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens]


def spec_llm(path: Path, **kw) -> LLM:
    # threshold 0: speculation never switches itself off, so every decode step verifies what it can
    return LLM(str(path), dtype="float32", speculative_method="ngram", spec_fallback_threshold=0.0, **kw)


def tokens(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


def test_ngram_lookup_takes_the_latest_longest_match():
    toks = np.array([5, 1, 2, 9, 1, 2, 3, 4, 7, 1, 2])
    assert ngram_lookup(toks, 3, 4, 1) == [3, 4, 7]  # "1 2" last seen before "3 4 7"
    assert ngram_lookup(toks, 3, 4, 3) == []  # "7 1 2" never seen before
    assert ngram_lookup(np.array([4, 4, 4]), 5, 2, 1) == [4]


@pytest.mark.parametrize("setting", ["batch_prefix_cache", "chunked_prefill_preemption"])
def test_greedy_is_identical_to_plain_decoding_and_transformers(setting, small_dir, small_hf):
    shared = prompts(1, seed=2, lo=32, hi=32)[0]
    ps = prompts(2, seed=1) + [shared + own for own in prompts(3, seed=3, lo=3, hi=9)]
    kw = {"batch_prefix_cache": dict(num_kv_blocks=256),
          "chunked_prefill_preemption": dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=16)}[setting]
    llm = spec_llm(small_dir, **kw)
    ref = [greedy_ref(small_hf, p) for p in ps]
    assert tokens(llm, ps[:3]) + tokens(llm, ps[3:]) == ref  # the later prompts find the first's blocks
    es = llm.engine.get_stats()
    # transformers' tokens are plain decoding's too: test_parity.py holds it to them under every feature
    if setting == "batch_prefix_cache":
        assert es.prefix_cache_hits >= 2 * 32
    else:
        assert es.num_preemptions > 0
    st = llm.engine.core.spec.stats
    assert st.accepted > 0 and st.accepted < st.proposed  # drafts were verified, some kept, some not
    assert es.num_free_blocks == es.num_kv_blocks  # nothing leaked


def test_rejected_drafts_give_their_blocks_back_every_step(small_dir):
    llm = spec_llm(small_dir, num_kv_blocks=128, block_size=4, num_speculative_tokens=8)
    eng = llm.engine
    for i, p in enumerate(prompts(4, seed=4)):
        eng.add_request(str(i), p, GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
        running = eng.core.scheduler.running
        held = set()
        for seq in running:  # exactly the blocks of the computed tokens: no slot of a rejected draft kept
            assert len(seq.block_table) == -(-seq.num_computed_tokens // 4)
            held.update(seq.block_table)
        assert eng.core.kv.num_free_blocks == 128 - len(held)
    assert eng.core.spec.stats.proposed > eng.core.spec.stats.accepted > 0


def test_stops_inside_an_accepted_run_truncate_like_plain_decoding(small_dir):
    p = prompts(1, seed=1)[0]
    plain = LLM(str(small_dir), dtype="float32", num_kv_blocks=512)
    llm = spec_llm(small_dir, num_kv_blocks=512)
    ref = tokens(plain, [p])[0]
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(1, 33, 5)]
    cases += [SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[t], ignore_eos=True)
              for t in dict.fromkeys(ref[1:])]
    cases.append(SamplingParams(temperature=0.0, max_tokens=32))  # the model's EOS (id 2) counts
    text = plain.get_tokenizer().decode(ref[12:14])
    cases.append(SamplingParams(temperature=0.0, max_tokens=32, stop=[text], ignore_eos=True))
    want = plain.generate([p] * len(cases), cases, use_tqdm=False)
    got = llm.generate([p] * len(cases), cases, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        a, b = w.outputs[0], g.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
               (a.token_ids, a.text, a.finish_reason, a.stop_reason)
    assert llm.engine.core.spec.stats.accepted > 0
    assert llm.engine.get_stats().num_free_blocks == 512


def _seq(params: SamplingParams) -> Sequence:
    return Sequence(Request("r", [1, 2, 3], params), 0, [1, 2, 3])


def test_rejection_sampling_keeps_the_target_distribution():
    """Many verifications of the same two drafts against fixed target logits: the first emitted token follows
    row 0's distribution, and the second (after an accepted first draft) row 1's."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=g) * 1.5
    drafts = [int(logits[0].argmax()), 5]  # a likely first draft, so that the second row gets verified too
    sampler = Sampler(seed=0)
    seq = _seq(SamplingParams(temperature=1.0))
    first, second = np.zeros(8), np.zeros(8)
    for _ in range(800):
        out = [r.token_id for r in verify(sampler, logits, seq, drafts)]
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    for counts, row in ((first, logits[0]), (second, logits[1])):
        expected = torch.softmax(row, -1).double().numpy()
        expected *= counts.sum() / expected.sum()
        assert chisquare(counts, expected).pvalue > 1e-3
    # accepting the drafts blindly would have made every first token the draft
    assert first[drafts[0]] < first.sum()


def test_sampled_tokens_after_a_verification_follow_the_model(small_dir, small_hf):
    """End to end on the tiny model: the second token of many sampled requests is always verified against an
    n-gram draft (the prompt holds every token, so the lookup always finds one); its frequencies match the
    model's exact marginal sum_t1 p(t1) p(t2 | t1)."""
    from scipy.stats import chisquare

    prompt = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=1.5, max_tokens=3, ignore_eos=True)
    n = 300
    llm = spec_llm(small_dir, num_kv_blocks=4096, max_num_seqs=n, max_num_batched_tokens=8192,
                   num_speculative_tokens=1)
    counts = np.zeros(VOCAB)
    for o in llm.generate([prompt] * n, params, use_tqdm=False):
        counts[o.outputs[0].token_ids[1]] += 1
    st = llm.engine.core.spec.stats
    assert st.proposed >= n and 0 < st.accepted < st.proposed
    with torch.no_grad():
        p1 = torch.softmax(small_hf(torch.tensor([prompt])).logits[0, -1].double() / 1.5, -1)
        both = torch.tensor([prompt + [t] for t in range(VOCAB)])
        p2 = torch.softmax(small_hf(both).logits[:, -1].double() / 1.5, -1)
    expected = (p1[:, None] * p2).sum(0).numpy()
    expected *= n / expected.sum()
    big = expected >= 5  # pool the rare tokens into one cell

    def cells(x: np.ndarray) -> np.ndarray:
        return np.append(x[big], x[~big].sum()) if (~big).any() else x

    assert chisquare(cells(counts), cells(expected)).pvalue > 1e-3
    blind = np.zeros(VOCAB)  # what accepting every draft would give: t2 = the token after t1 in the prompt
    nxt = {t: prompt[i + 1] for i, t in enumerate(prompt[:-1])} | {prompt[-1]: prompt[-1]}
    for t1, p in enumerate(p1.tolist()):
        blind[nxt[t1]] += p * n
    assert chisquare(cells(blind), cells(expected)).pvalue < 1e-6


@pytest.mark.parametrize("draft", ["self:2", "other"])
def test_draft_model_greedy_is_exact(draft, small_dir, small_hf, tmp_path, tokenizer_dir):
    """The target's own layers as the draft (all of them: every draft is right), and a separate one-layer
    model (some are wrong); preemption included (a small pool), and the draft cache given back at the end."""
    name = str(small_model(tmp_path, tokenizer_dir, seed=1, num_hidden_layers=1)) if draft == "other" else draft
    ps = prompts(3, seed=7)
    llm = LLM(str(small_dir), dtype="float32", num_kv_blocks=14, block_size=8, speculative_model=name,
              num_speculative_tokens=3, spec_fallback_threshold=0.0)
    assert tokens(llm, ps) == [greedy_ref(small_hf, p) for p in ps]
    core = llm.engine.core
    st = core.spec.stats
    if draft == "self:2":
        assert st.accepted == st.proposed > 0
    else:
        assert st.proposed > st.accepted
    assert core.kv.num_free_blocks == 14 and core.spec.proposer.kv.num_free_blocks == 14


class _FixedProposer:
    def propose(self, seqs, ks):
        return [[9] * k for k in ks]


def test_fallback_switches_a_request_off_below_the_threshold_and_back_on_after_the_cooldown():
    dec = SpecDecoder(_FixedProposer(), num_spec_tokens=2, max_model_len=100, threshold=0.5, window=4,
                      cooldown_steps=3)
    bad, good = _seq(SamplingParams(temperature=0.0)), _seq(SamplingParams(temperature=0.0))
    for s in (bad, good):
        s.token_ids.append(7)  # one generated token, its KV not yet computed: decoding
        s.num_computed_tokens = s.num_tokens - 1

    def step(accepted_bad: int) -> None:
        dec.propose([bad, good])
        if bad.spec_token_ids:
            dec.record(bad, 2, accepted_bad)
        dec.record(good, 2, 2)

    step(1)
    step(0)  # 1 of 4 accepted: below 0.5
    assert dec.stats.fallbacks == 1
    for _ in range(3):  # the cool-down: no drafts for the bad request, the good one keeps its own
        dec.propose([bad, good])
        assert bad.spec_token_ids == [] and good.spec_token_ids == [9, 9]
    dec.propose([bad, good])
    assert bad.spec_token_ids == [9, 9]
    assert dec.stats.fallbacks == 1


def test_spec_decode_counters_reach_metrics_and_stats():
    from prometheus_client import generate_latest

    from servelm.engine.step_outputs import EngineStats
    from servelm.server.observability.metrics import Metrics, spec_decode_summary

    def stats(**kw) -> EngineStats:
        return EngineStats(0, 0, 0, 0.0, 8, 8, 0, 0, 0.0, 0, 0, 0, 1, 0, 0, **kw)

    m = Metrics("m")
    m.on_ready(stats(), restarted=False)
    st = stats(spec_proposed_tokens=8, spec_accepted_tokens=5, spec_emitted_tokens=9, spec_verifications=4,
               spec_proposed_by_position=[4, 4], spec_accepted_by_position=[3, 2])
    m.on_step(st, 12, ran=True)
    text = generate_latest(m.registry).decode()
    assert 'servelm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'servelm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    summary = spec_decode_summary(st)
    assert summary["acceptance_rate"] == 5 / 8 and summary["acceptance_rate_by_position"] == [0.75, 0.5]
    assert summary["mean_accepted_length"] == 5 / 4 and summary["tokens_per_verification"] == 9 / 4
    assert spec_decode_summary(stats()) is None


def test_speculative_settings_are_typed_and_validated():
    from servelm.config.engine import ConfigError, EngineConfig
    from servelm.config.settings import load

    c = load({"speculative_model": "self:4"}, {"SERVELM_NUM_SPECULATIVE_TOKENS": "3"})
    assert (c.engine.speculative_config.speculative_method, c.engine.speculative_config.num_speculative_tokens) == ("draft", 3)
    assert EngineConfig().speculative_config.speculative_method is None  # off by default
    for bad in (dict(speculative_method="eagle"), dict(speculative_method="draft"),
                dict(speculative_method="ngram", num_speculative_tokens=0),
                dict(speculative_method="ngram", ngram_lookup_min=5), dict(spec_fallback_threshold=1.5)):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)


def test_bf16_cpu_kernels_verify_on_decode_tapes(small_dir):
    """In bf16 pure-decode steps replay kernel tapes, verifications included: outputs and logprobs are bit
    for bit those of plain decoding (Scheduling invariance)."""
    plain = LLM(str(small_dir), dtype="bfloat16", num_kv_blocks=256)
    if plain.engine.core.model.tapes is None:
        pytest.skip("decode tapes do not run here (no AVX512-BF16 or kernels not built)")
    ps = prompts(3, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    llm = LLM(str(small_dir), dtype="bfloat16", num_kv_blocks=256, speculative_method="ngram",
              spec_fallback_threshold=0.0)
    want = [o.outputs[0] for o in plain.generate(ps, params, use_tqdm=False)]
    got = [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [[lp[t].logprob for t, lp in zip(g.token_ids, g.logprobs, strict=True)] for g in got] == \
           [[lp[t].logprob for t, lp in zip(w.token_ids, w.logprobs, strict=True)] for w in want]
    assert llm.engine.core.spec.stats.accepted > 0
    assert llm.engine.core.model.tapes.replayed > 0
