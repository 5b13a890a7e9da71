"""Speculative decoding: exact greedy outputs (against plain decoding and transformers) under every scheduling
feature, no leaked KV blocks, stops inside accepted runs, and the target distribution kept when sampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import COMMON, hf_greedy

from servelm import LLM, SamplingParams
from servelm.engine.proposers import ngram_lookup
from servelm.engine.rejection import verify
from servelm.engine.sampler import Sampler
from servelm.engine.sequence import Request, Sequence

VOCAB = 64  # a small vocabulary: greedy outputs of a random model loop, so prompt lookup finds real drafts
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, tokenizer_dir) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = tmp_path_factory.mktemp("small_vocab")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "vocab_size": VOCAB}), dtype=torch.float32) \
        .save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def small_hf(small_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32).eval()


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


@pytest.mark.parametrize("setting", ["batch", "chunked_prefill", "preemption"])
def test_greedy_is_identical_to_plain_decoding_and_transformers(setting, small_dir, small_hf):
    ps = prompts(6, seed=1)
    kw = {"batch": dict(num_kv_blocks=256),
          "chunked_prefill": dict(num_kv_blocks=256, max_num_batched_tokens=8),
          "preemption": dict(num_kv_blocks=16, block_size=8)}[setting]
    llm = spec_llm(small_dir, **kw)
    ref = [hf_greedy(small_hf, p, 40) for p in ps]
    assert tokens(llm, ps) == ref
    assert tokens(LLM(str(small_dir), dtype="float32", **kw), ps) == ref  # plain decoding agrees
    st, es = llm.engine.core.spec.stats, llm.engine.get_stats()
    assert st.accepted > 0 and st.accepted < st.proposed  # drafts were verified, some kept, some not
    assert es.num_steps < 6 * 40
    assert es.num_free_blocks == es.num_kv_blocks  # nothing leaked
    if setting == "preemption":
        assert es.num_preemptions > 0


def test_prefix_cache_hits_keep_greedy_outputs(small_dir, small_hf):
    shared = prompts(1, seed=2, lo=40, hi=40)[0]
    ps = [shared + own for own in prompts(4, seed=3, lo=3, hi=9)]
    llm = spec_llm(small_dir, num_kv_blocks=256)
    out = tokens(llm, ps[:1]) + tokens(llm, ps[1:])
    assert llm.engine.get_stats().prefix_cache_hits >= 3 * 32
    assert out == [hf_greedy(small_hf, p, 40) for p in ps]


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
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(1, 41, 3)]
    cases += [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[t], ignore_eos=True) for t in set(ref)]
    cases.append(SamplingParams(temperature=0.0, max_tokens=40))  # the model's EOS (id 2) counts
    text = plain.get_tokenizer().decode(ref[12:14])
    cases.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[text], ignore_eos=True))
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
    for _ in range(4000):
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
    llm = spec_llm(small_dir, num_kv_blocks=1024, max_num_seqs=256, num_speculative_tokens=1)
    n = 1500
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
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert chisquare(obs, exp).pvalue > 1e-3
    blind = np.zeros(VOCAB)  # what accepting every draft would give: t2 = the token after t1 in the prompt
    nxt = {t: prompt[i + 1] for i, t in enumerate(prompt[:-1])} | {prompt[-1]: prompt[-1]}
    for t1, p in enumerate(p1.tolist()):
        blind[nxt[t1]] += p * n
    assert chisquare(np.append(blind[big], blind[~big].sum()), exp).pvalue < 1e-6
