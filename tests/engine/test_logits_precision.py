"""A bf16 model's logits reach the sampler in float32 on the CPU kernels: two tokens whose logits differ by less
than one bf16 step are told apart by greedy decoding and by their logprobs, through the whole engine.

The lm_head is rebuilt around the hidden state the engine computes for a prompt: token B's logit is that state's
largest positive element h_j, token A's h_j plus 2^-12 h_j (an extra input that only A's row reads). Rounded to
bf16 the two are one value and the tie goes to B, the lower id; in float32 A leads."""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.model.kernels import cpu as cpu_kernels
from servelm.model.layers.blocks import Linear

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels could not be compiled here")
PROMPT = [1, 17, 42, 99, 7]
B, A = 5, 9  # B < A: a tie goes to B


def _near_tie_lm_head(hidden: torch.Tensor, vocab: int) -> torch.Tensor:
    h = hidden.float()
    j = int(h.argmax())
    assert h[j] > 0
    others = h.abs().clone()
    others[j] = 0
    i = int(others.argmax())
    w = torch.zeros(vocab, h.numel())
    w[B, j] = w[A, j] = 1.0
    w[A, i] = torch.sign(h[i]) * 2.0 ** -12 * h[j] / h[i].abs()
    return w.bfloat16()


def test_greedy_and_logprobs_tell_apart_logits_closer_than_a_bf16_step(llama_dir):
    llm = LLM(str(llama_dir), dtype="bfloat16", num_kv_blocks=16, enable_prefix_caching=False)
    model = llm.engine.core.model
    seen: list[torch.Tensor] = []
    logits = model.logits
    model.logits = lambda hidden: seen.append(hidden.clone()) or logits(hidden)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    hidden = seen[-1][-1]  # the prompt's last position
    model.lm_head = Linear(_near_tie_lm_head(hidden, model.spec.vocab_size))
    row = logits(hidden[None])[0]
    assert row.dtype == torch.float32 and row[A] > row[B]
    assert row[A].bfloat16() == row[B].bfloat16()  # a tie in bf16: the test can tell the two apart

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [A]
    assert out.logprobs[0][A].logprob > out.logprobs[0][B].logprob
