"""Sampling behaviour end to end on a tiny model, plus the sampler's logit processing in isolation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts

from servelm import LLM, SamplingParams
from servelm.engine import sampler as sampler_mod
from servelm.engine.sampler import Sampler
from servelm.engine.sequence import Request, Sequence


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=256)


@pytest.fixture(params=["cpu-kernel", "torch"])
def sampler_path(request, monkeypatch):
    """The sampler's two implementations: the C++ kernel CPU logits take, and the torch code a GPU runs."""
    if request.param == "torch":
        monkeypatch.setattr(sampler_mod, "_cpu_kernels", lambda x: None)
    return request.param


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_request_is_independent_of_batch(llm, sampler_path):
    target = random_prompts(1, 12, 12, seed=10)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    alone = tokens(llm, target, seeded)[0]
    for k in (3, 7):
        batch = random_prompts(k, 4, 30, seed=20 + k)
        outs = tokens(llm, batch[:1] + target + batch[1:], [others] + [seeded] + [others] * (k - 1))
        assert outs[1] == alone
    assert tokens(llm, target, SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))[0] != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(llm, sampler_path):
    prompts = random_prompts(4, 5, 25, seed=11)
    greedy = tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert tokens(llm, prompts, SamplingParams(temperature=0.9, top_k=1, max_tokens=10, ignore_eos=True)) == greedy
    assert tokens(llm, prompts, SamplingParams(temperature=0.9, top_p=1e-6, max_tokens=10, ignore_eos=True)) == greedy


def test_unseeded_sampling_varies(llm, sampler_path):
    prompts = random_prompts(1, 10, 10, seed=12) * 4
    outs = tokens(llm, prompts, SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True))
    assert len({tuple(o) for o in outs}) > 1


def test_logit_bias_forces_a_token(llm):
    out = tokens(llm, random_prompts(1, 8, 8, seed=13), SamplingParams(temperature=0, max_tokens=5,
                                                                        logit_bias={777: 100}, ignore_eos=True))
    assert out[0] == [777] * 5


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts(1, 9, 9, seed=14)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    g = greedy[0].outputs[0]
    assert g.finish_reason == "length" and len(g.token_ids) == 8
    stop_id = g.token_ids[3]
    first = g.token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == g.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    later = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id],
                                                min_tokens=first + 2, ignore_eos=True), use_tqdm=False)
    assert len(later[0].outputs[0].token_ids) >= first + 2  # min_tokens bans the stop token until reached


def test_stop_string_across_token_boundary(llm, tokenizer):
    prompt = random_prompts(1, 7, 7, seed=15)
    g = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    ids = g[0].outputs[0].token_ids
    text = g[0].outputs[0].text
    # a stop string made of the end of token 3 and the start of token 4
    t3, t4 = tokenizer.decode(ids[:4]), tokenizer.decode(ids[:5])
    assert len(t3) >= 2 and len(t4) > len(t3)
    stop = t3[-2:] + t4[len(t3)]
    cut = text.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_abort_mid_generation_frees_blocks(llm):
    eng = llm.engine
    total = eng.get_stats().num_kv_blocks
    eng.add_request("a", random_prompts(1, 40, 40, seed=16)[0],
                    SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    eng.add_request("b", random_prompts(1, 40, 40, seed=17)[0],
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.get_stats().num_free_blocks < total
    out = eng.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_stats().num_free_blocks == total
    assert eng.get_stats().num_running == 0


def _seq(prompt, output, **params) -> Sequence:
    req = Request("x", prompt, SamplingParams(**params))
    return Sequence(req, 0, prompt + output)


def test_penalties_and_bias_follow_their_definitions():
    vocab = 8
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0, 3.0, -2.0, 1.5]])
    s = Sampler(0)
    rep = s._process(logits, [_seq([0, 1], [3], repetition_penalty=2.0)])
    assert rep[0, 0] == 1.0 and rep[0, 1] == -2.0 and rep[0, 3] == 0.5 and rep[0, 5] == 3.0
    freq = s._process(logits, [_seq([5], [3, 3, 7], frequency_penalty=0.5, presence_penalty=0.25)])
    assert freq[0, 3] == pytest.approx(1.0 - 1.0 - 0.25)
    assert freq[0, 7] == pytest.approx(1.5 - 0.5 - 0.25)
    assert freq[0, 5] == 3.0  # prompt tokens are not frequency-penalized
    bias = s._process(logits, [_seq([1], [], logit_bias={4: 5.0})])
    assert bias[0, 4] == 5.0 and torch.equal(bias[0, :4], logits[0, :4])
    seq = _seq([1], [], min_tokens=2)
    seq.request.params._eos_token_ids = frozenset({5})
    banned = s._process(logits, [seq])
    assert banned[0, 5] == float("-inf")
    assert logits.shape[1] == vocab and logits[0, 5] == 3.0  # the input is never modified


def test_allowed_tokens_and_bad_words_mask_their_rows_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0, 3.0, -2.0, 1.5]] * 3)
    s = Sampler(0)
    allowed = _seq([1], [], allowed_token_ids=[2, 6])
    bad = _seq([1], [4, 2], bad_words=["x"])
    bad.request.params._bad_words_token_ids = [[7], [2, 3], [4, 5], [0, 2, 1]]  # as tokenize_bad_words leaves them
    out = s._process(logits, [allowed, _seq([1], []), bad])
    inf = float("-inf")
    assert out[0].tolist() == [inf, inf, 0.5, inf, inf, inf, -2.0, inf]  # only the allowed ids stay
    assert torch.equal(out[1], logits[1])  # a row beside them is untouched
    # [7] always; [2, 3] ends in 3 after the output's last token 2; [4, 5] and [0, 2, 1] do not match its end
    assert out[2].tolist() == [2.0, -1.0, 0.5, inf, 0.0, 3.0, -2.0, inf]
    later = _seq([1], [4, 2, 4], bad_words=["x"])  # the output ends with 4: [4, 5] bans 5, [2, 3] no longer
    later.request.params._bad_words_token_ids = bad.request.params._bad_words_token_ids
    assert s._process(logits[:1], [later])[0].tolist() == [2.0, -1.0, 0.5, 1.0, 0.0, inf, -2.0, inf]


def test_bad_words_are_tokenized_as_written_and_after_a_space(tokenizer):
    p = SamplingParams(bad_words=["  hello world", "cat"])
    p.tokenize_bad_words(lambda t: tokenizer(t, add_special_tokens=False).input_ids)
    want = []
    for text in ("hello world", " hello world", "cat", " cat"):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if ids not in want:
            want.append(ids)
    assert p._bad_words_token_ids == want and len(want) >= 3
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
    with pytest.raises(ValueError, match="allowed_token_ids holds token id 99"):
        SamplingParams(allowed_token_ids=[1, 99]).check_vocab(50)


def test_allowed_token_ids_and_bad_words_end_to_end(llm, hf_models, sampler_path):
    """Greedy with allowed_token_ids is transformers' argmax over those ids; sampled, every token is one of
    them. A bad word's last token never follows its first: the output differs from plain greedy exactly there."""
    prompt = random_prompts(1, 10, 10, seed=21)[0]
    allowed = [5, 17, 300, 777, 901]
    got = tokens(llm, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               allowed_token_ids=allowed))[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            row = hf_models["llama"](torch.tensor([ids])).logits[0, -1]
            ids.append(allowed[int(row[allowed].argmax())])
    assert got == ids[len(prompt):]
    drawn = tokens(llm, [prompt], SamplingParams(temperature=1.5, max_tokens=20, ignore_eos=True, seed=3,
                                                 allowed_token_ids=allowed))[0]
    assert set(drawn) <= set(allowed) and len(set(drawn)) > 1
    greedy = tokens(llm, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    word = llm.get_tokenizer().decode(greedy[2:4])  # a two-token piece of the greedy output
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    out = tokens(llm, [prompt], params)[0]
    assert out[:3] == greedy[:3] and out[3] != greedy[3]


def test_truncate_prompt_tokens_runs_the_prompts_end(llm):
    """vLLM's left truncation in the offline API: the request runs on its prompt's last k tokens."""
    [prompt] = random_prompts(1, 20, 20, seed=22)
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    [cut] = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=7), use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs[0].token_ids == tokens(llm, [prompt[-7:]], SamplingParams(**greedy))[0]
    [whole] = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole.prompt_token_ids == prompt
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_plain_greedy_marks_the_batches_that_may_take_their_argmax_on_the_device():
    """On a GPU a plain greedy batch skips the host sampler; any row that needs processing, a draw or
    logprobs keeps the whole batch on the host path."""
    greedy = _seq([1, 2], [3], temperature=0.0)
    assert Sampler.plain_greedy([greedy, _seq([1], [], temperature=0.0, min_tokens=0)])
    for other in (_seq([1], [], temperature=0.7), _seq([1], [], temperature=0.0, logprobs=2),
                  _seq([1], [], temperature=0.0, logit_bias={4: 1.0}),
                  _seq([1], [], temperature=0.0, repetition_penalty=1.2),
                  _seq([1], [], temperature=0.0, allowed_token_ids=[3]),
                  _seq([1], [], temperature=0.0, min_tokens=2)):
        assert not Sampler.plain_greedy([greedy, other])
    assert Sampler.plain_greedy([_seq([1], [3, 4], temperature=0.0, min_tokens=2)])  # min_tokens reached


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    """vLLM's detokenize=False: the token ids (and logprobs) as with text, never decoded; stop strings, which
    are looked for in the text, are refused with it."""
    prompt = random_prompts(1, 9, 9, seed=24)
    params = dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    on = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    off = llm.generate(prompt, SamplingParams(**params, detokenize=False), use_tqdm=False)[0]
    a, b = on.outputs[0], off.outputs[0]
    assert b.token_ids == a.token_ids and b.text == "" and a.text
    assert [{t: v.logprob for t, v in e.items()} for e in b.logprobs] == \
        [{t: v.logprob for t, v in e.items()} for e in a.logprobs]
    assert all(v.decoded_token is None for e in b.logprobs for v in e.values())
    assert all(v.decoded_token is None for e in off.prompt_logprobs[1:] for v in e.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["the"], detokenize=False)
