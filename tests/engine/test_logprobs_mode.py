"""The engine's logprobs_mode (vLLM's --logprobs-mode): what a sampled token's logprobs hold, against
transformers' logits put through each step's processing by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import random_prompts

from servelm import LLM, SamplingParams
from servelm.config.engine import ConfigError
from servelm.config.settings import load
from servelm.engine import sampler as sampler_mod
from servelm.engine.rejection import verify
from servelm.engine.sampler import Sampler
from servelm.engine.sequence import Request, Sequence
from servelm.outputs import Logprob
from servelm.server.openai.logprobs import chat_logprobs, completion_logprobs

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@pytest.fixture(scope="module")
def engines():
    """One engine per mode, started when a test first needs it."""
    return {}


def engine(engines, llama_dir, mode: str) -> LLM:
    if mode not in engines:
        engines[mode] = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, logprobs_mode=mode)
    return engines[mode]


def hf_rows(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """transformers' next-token logits at each generated position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(out)]


def top_k_scaled(row: torch.Tensor, temperature: float, k: int) -> torch.Tensor:
    """The logits a top-k, temperature-scaled draw picks from: -inf outside the k largest."""
    kept = torch.full_like(row, float("-inf"))
    idx = row.topk(k).indices
    kept[idx] = row[idx] / temperature
    return kept


def run(llm: LLM, prompt: list[int], params: SamplingParams):
    [o] = llm.generate([prompt], params, use_tqdm=False)
    return o.outputs[0]


def check_entries(out, expected_rows: torch.Tensor, k: int, tol: float = 1e-4) -> None:
    """Each position's chosen token and its k alternatives carry the expected row's values."""
    assert len(out.logprobs) == len(out.token_ids) == len(expected_rows)
    for tok, entry, row in zip(out.token_ids, out.logprobs, expected_rows, strict=True):
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=tol)
        top = sorted(((v.rank, t) for t, v in entry.items() if v.rank <= k))
        assert [float(row[t]) for _, t in top] == pytest.approx(row.topk(k).values.tolist(), abs=tol)


def test_raw_logits_are_the_models_logits(engines, llama_dir, hf_models):
    prompt = random_prompts(1, 9, 9, seed=30)[0]
    out = run(engine(engines, llama_dir, "raw_logits"), prompt,
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    check_entries(out, hf_rows(hf_models["llama"], prompt, out.token_ids), 3)


@pytest.mark.parametrize("path", ["cpu-kernel", "torch"])
def test_processed_logprobs_are_the_distribution_drawn_from(engines, llama_dir, hf_models, path, monkeypatch):
    """Temperature 0.7 and top-k 4: each position's logprobs are the log-softmax of the 4 kept logits over 0.7,
    the other tokens -inf; the draw itself is the raw mode's (the same seed gives the same tokens)."""
    if path == "torch":
        monkeypatch.setattr(sampler_mod, "_cpu_kernels", lambda x: None)
    prompt = random_prompts(1, 11, 11, seed=31)[0]
    params = SamplingParams(temperature=0.7, top_k=4, seed=5, max_tokens=8, ignore_eos=True, logprobs=6)
    out = run(engine(engines, llama_dir, "processed_logprobs"), prompt, params)
    rows = hf_rows(hf_models["llama"], prompt, out.token_ids)
    expected = torch.log_softmax(torch.stack([top_k_scaled(r, 0.7, 4) for r in rows]), dim=-1)
    for tok, entry, row in zip(out.token_ids, out.logprobs, expected, strict=True):
        assert math.isfinite(entry[tok].logprob) and entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        kept = [v.logprob for v in entry.values() if math.isfinite(v.logprob)]
        assert sum(math.exp(v) for v in kept) == pytest.approx(1.0, abs=1e-4)  # the four kept tokens
        dropped = [v for v in entry.values() if not math.isfinite(v.logprob)]
        assert len(kept) == 4 and len(dropped) >= 2  # logprobs=6 asks for two the sampling dropped
    raw = run(engine(engines, llama_dir, "raw_logprobs"), prompt, params)
    assert raw.token_ids == out.token_ids
    raw_expected = torch.log_softmax(rows, dim=-1)
    check_entries(raw, raw_expected, 6)


def test_processed_logits_carry_bias_and_penalties_on_greedy_rows(engines, llama_dir, hf_models):
    """A greedy row's processed logits: logit_bias and the repetition penalty applied, no temperature."""
    prompt = random_prompts(1, 8, 8, seed=32)[0]
    bias = {prompt[0]: 3.0, 500: -2.0}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=4, logit_bias=bias,
                            repetition_penalty=1.3)
    out = run(engine(engines, llama_dir, "processed_logits"), prompt, params)
    rows = hf_rows(hf_models["llama"], prompt, out.token_ids)
    expected = []
    for j, row in enumerate(rows):
        row = row.clone()
        for t, b in bias.items():
            row[t] += b
        seen = torch.tensor(sorted(set(prompt + out.token_ids[:j])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.3, row[seen] * 1.3)
        expected.append(row)
    check_entries(out, torch.stack(expected), 4)
    assert out.token_ids == [int(r.argmax()) for r in expected]


def test_processed_logprobs_over_allowed_tokens_read_a_label_distribution(engines, llama_dir, hf_models):
    """The classification read processed_logprobs is for: one greedy token out of a few allowed ones, whose
    logprobs are a distribution over those alone (raw logprobs would be the whole vocabulary's)."""
    prompt = random_prompts(1, 10, 10, seed=33)[0]
    labels = [11, 222, 3333]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3, allowed_token_ids=labels)
    out = run(engine(engines, llama_dir, "processed_logprobs"), prompt, params)
    row = hf_rows(hf_models["llama"], prompt, out.token_ids)[0]
    expected = torch.log_softmax(row[labels], dim=-1)
    got = {t: v.logprob for t, v in out.logprobs[0].items()}
    assert set(got) == set(labels)
    assert [got[t] for t in labels] == pytest.approx(expected.tolist(), abs=1e-4)
    raw = run(engine(engines, llama_dir, "raw_logprobs"), prompt, params)
    assert sum(math.exp(v.logprob) for v in raw.logprobs[0].values()) < 0.99


def test_verified_tokens_report_the_mode_too():
    """Speculative decoding's verification of a sampled row reports the same processed values as a plain
    step would: the log-softmax of the kept, temperature-scaled logits."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 16, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_k=3, logprobs=3, seed=9)
    seq = Sequence(Request("r", [1, 2, 3], params), 0, [1, 2, 3])
    seq.generator = torch.Generator().manual_seed(9)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]
    results = verify(Sampler(0, "processed_logprobs"), logits, seq, drafts)
    for j, res in enumerate(results):
        expected = torch.log_softmax(top_k_scaled(logits[j], 0.8, 3), dim=-1)
        assert res.logprob == pytest.approx(float(expected[res.token_id]), abs=1e-5)
        assert [v for _, v in res.top_logprobs] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)


def test_dropped_tokens_serialize_as_vllm_writes_them():
    """-inf (a token the sampling dropped) reaches JSON as -9999.0, in chat's and completions' shapes."""
    entry = {7: Logprob(-0.1, 1, "a"), 8: Logprob(float("-inf"), 5, "b")}
    chat = json.dumps(chat_logprobs([7, 8], [entry, entry], 2), allow_nan=False)
    assert json.loads(chat)["content"][1]["logprob"] == -9999.0
    comp = json.loads(json.dumps(completion_logprobs([8], [entry], 0), allow_nan=False))
    assert comp["token_logprobs"] == [-9999.0] and comp["top_logprobs"][0]["b"] == -9999.0


def test_logprobs_mode_is_a_validated_setting():
    """From the command line and the environment (as vLLM's --logprobs-mode), one of the four names."""
    for mode in MODES:
        assert load({"logprobs_mode": mode}, env={}).engine.model_config.logprobs_mode == mode
    assert load({}, env={"SERVELM_LOGPROBS_MODE": "raw_logits"}).engine.model_config.logprobs_mode == "raw_logits"
    with pytest.raises(ConfigError, match="logprobs_mode"):
        load({"logprobs_mode": "softmax"}, env={})
