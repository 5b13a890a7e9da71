"""Beam search (servelm/beam_search.py): the offline API against transformers' beam search, and the search's own
rules (end-of-sequence, length penalty, ranking) on candidates made up for the purpose."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts

from servelm import LLM
from servelm.beam_search import BeamSearch, BeamSearchParams, beam_score
from servelm.outputs import Logprob


@pytest.fixture(scope="module")
def llm(llama_dir):
    # a 16-token step budget: the beams' requests of a step share it with each other's chunks
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16)


def hf_beams(model, prompt: list[int], width: int, steps: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search, no end-of-sequence token and no length penalty: the beams' tokens and scores."""
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                         max_new_tokens=steps, min_new_tokens=steps, length_penalty=0.0, eos_token_id=None,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return [s[len(prompt):].tolist() for s in out.sequences], out.sequences_scores.tolist()


def test_beam_search_equals_transformers(llm, hf_models):
    """Every prompt's beams and their cumulative logprobs are transformers' (prompts of different lengths
    searched together, through the prefix cache and chunked prefill)."""
    prompts = random_prompts(3, 5, 40, seed=70)
    width, steps = 4, 8
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True, length_penalty=0.0)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_scores = hf_beams(hf_models["llama"], prompt, width, steps)
        assert [s.tokens[len(prompt):] for s in out.sequences] == ref_tokens
        assert [s.tokens[:len(prompt)] for s in out.sequences] == [prompt] * width  # vLLM's: prompt included
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(ref_scores, abs=1e-4)
        for seq in out.sequences:
            assert seq.finish_reason == "length" and len(seq.logprobs) == steps
            assert seq.text == tok.decode(seq.tokens, skip_special_tokens=True)
            # each position's candidates: the top 2 x width, the chosen token among them
            assert all(len(top) == 2 * width and t in top
                       for t, top in zip(seq.tokens[len(prompt):], seq.logprobs, strict=True))
    assert not llm.engine.has_unfinished_requests()


def test_a_prompt_that_goes_on_from_a_finished_one_copies_its_partly_filled_block(llm, hf_models):
    """What makes a search step cost about one token per beam: a finished request's partly filled last block
    is cached, and a prompt that goes on from its tokens copies it and computes only the rest (here one
    token), with transformers' greedy output."""
    from tiny_models import reference

    from servelm import SamplingParams

    [prompt] = random_prompts(1, 37, 37, seed=72)  # two full blocks of 16, then 5 tokens
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    [first] = llm.generate([prompt], one, use_tqdm=False)
    longer = prompt + first.outputs[0].token_ids
    [out] = llm.generate([longer], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out.num_cached_tokens == len(prompt)  # not only the 32 of its full blocks
    assert out.outputs[0].token_ids == reference(hf_models, "llama", [longer], 6)[0]


def test_a_text_prompt_and_beam_width_one_is_greedy(llm):
    """Width 1 keeps the best token each step: greedy decoding's output, from a text prompt."""
    from servelm import SamplingParams

    greedy = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    [out] = llm.beam_search("Once upon a time", BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    [seq] = out.sequences
    prompt_len = len(llm.engine.tokenize("Once upon a time"))
    assert seq.tokens[prompt_len:] == greedy.token_ids
    assert seq.text == "Once upon a time" + greedy.text


def test_an_end_of_sequence_token_completes_a_beam(llm, hf_models, monkeypatch):
    """Made the model's end-of-sequence token, the prompt's most likely next token completes a beam at once:
    that beam holds it alone, says "stop", and its text leaves it out; no live beam ever holds it."""
    [prompt] = random_prompts(1, 9, 9, seed=71)
    with torch.no_grad():
        first = int(hf_models["llama"](torch.tensor([prompt])).logits[0, -1].argmax())
    monkeypatch.setattr(llm.engine, "eos_token_ids", frozenset({first}))
    [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.0))
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    # with no length penalty the one-token beam outranks its own (longer, less likely) continuations
    assert stopped and stopped[0].tokens == prompt + [first] and stopped[0].stop_reason == first
    assert out.sequences[0] is stopped[0]
    assert stopped[0].text == llm.get_tokenizer().decode(prompt, skip_special_tokens=True)
    for seq in out.sequences:
        if seq.finish_reason == "length":
            assert first not in seq.tokens[len(prompt):] and len(seq.tokens) == len(prompt) + 5


def test_bad_requests_are_refused_and_leave_nothing_behind(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="context length"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len))
    with pytest.raises(ValueError, match="at least one token"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def candidates(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    return {t: Logprob(lp, rank=i + 1) for i, (t, lp) in enumerate(pairs)}


EOS = 0


def test_the_search_keeps_the_best_extensions_and_completes_at_eos():
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0), frozenset({EOS}))
    search.advance([candidates((5, -0.1), (EOS, -0.2), (6, -1.0), (4, -3.0))])
    # EOS completed a beam; the two best others live on
    assert [s.tokens for s in search.beams] == [[7, 8, 5], [7, 8, 6]]
    assert [s.tokens for s in search.completed] == [[7, 8, EOS]]
    search.advance([candidates((3, -2.0), (EOS, -0.05)), candidates((3, -0.1), (2, -0.2))])
    # [7,8,5,EOS] (-0.15) completes; the live ones: [7,8,6,3] (-1.1) and [7,8,6,2] (-1.2) beat [7,8,5,3] (-2.1)
    assert [s.tokens for s in search.beams] == [[7, 8, 6, 3], [7, 8, 6, 2]]
    assert [s.cum_logprob for s in search.beams] == pytest.approx([-1.1, -1.2])
    search.advance([candidates((1, -0.5)), candidates((1, -0.5))])
    assert search.done
    best = search.result()
    # scores: [7,8,EOS] -0.2/2, [7,8,5,EOS] -0.15/3 = -0.05; live ones -1.6/5 and -1.7/5
    assert [s.tokens for s in best] == [[7, 8, 5, EOS], [7, 8, EOS]]
    assert [s.finish_reason for s in best] == ["stop", "stop"]
    assert search.text_ids(best[0]) == [5] and search.output_ids(best[0]) == [5, EOS]


def test_length_penalty_decides_between_short_and_long():
    """A short complete beam against a longer, less likely live one: length_penalty 0 ranks by cumulative
    logprob, a large one divides the longer sum by much more."""
    def finish(penalty: float) -> list[list[int]]:
        search = BeamSearch([9], BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=penalty),
                            frozenset({EOS}))
        search.advance([candidates((EOS, -1.0), (4, -1.1))])
        search.advance([candidates((4, -0.5))])
        search.advance([candidates((4, -0.5))])
        return [s.tokens for s in search.result()]

    assert finish(0.0) == [[9, EOS]]  # -1.0 against -2.1
    assert finish(2.0) == [[9, 4, 4, 4]]  # -1.0 / 1 against -2.1 / 16
    seq = BeamSearch([9], BeamSearchParams(beam_width=1, max_tokens=1), frozenset({EOS}))
    seq.advance([candidates((EOS, -1.0))])
    assert beam_score(seq.result()[0], frozenset({EOS}), 1.0) == -1.0  # the EOS token does not count


def test_ignore_eos_keeps_eos_as_a_token():
    search = BeamSearch([9], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), frozenset({EOS}))
    search.advance([candidates((EOS, -0.1), (4, -0.2))])
    assert [s.tokens for s in search.beams] == [[9, EOS], [9, 4]] and not search.completed
    assert [s.finish_reason for s in search.result()] == ["length", "length"]
