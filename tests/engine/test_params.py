"""Invalid parameters fail early with a message naming the field and the allowed range."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from servelm import LLM, EngineConfig, SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {3: 200}}, "logit_bias"),
    ({"structured_outputs": {"json": True}}, "structured_outputs.json"),  # was a TypeError from json.loads
    ({"structured_outputs": {"json": False}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "true"}}, "structured_outputs.json"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_sampling_params_normalise():
    p = SamplingParams(stop="x", logit_bias={"5": 1})
    assert p.stop == ["x"] and p.logit_bias == {5: 1.0} and p.stop_token_ids == []


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "int8"}, "dtype"), ({"block_size": 3}, "block_size"), ({"preemption_mode": "drop"}, "preemption_mode"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"num_kv_blocks": 0}, "num_kv_blocks"),
])
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_requests_that_can_never_run_are_refused(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=100)
    with pytest.raises(ValueError, match=r"100 tokens.*90 prompt tokens and max_tokens=20"):
        llm.generate(random_prompts(1, 90, 90, seed=0), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 10**7]], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        LLM(str(llama_dir), dtype="float32", num_kv_blocks=2, max_model_len=100)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(llama_dir), dtype="float32", num_kv_blocks=512, max_model_len=5000)
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued after a refusal
    with pytest.raises(TypeError, match="unknown LLM arguments: bogus"):
        LLM(str(llama_dir), bogus=1)


def test_vllm_prompt_dicts_are_accepted(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    ids = random_prompts(1, 12, 12, seed=3)[0]
    text = llm.get_tokenizer().decode(ids[4:], skip_special_tokens=True)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = llm.generate([ids, text], sp, use_tqdm=False)
    dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt_token_ids == ids
    single = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    assert single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate({"text": "hi"}, sp)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found: pass a local Hugging Face folder.*repo id"):
        LLM(str(tmp_path / "nope"))
