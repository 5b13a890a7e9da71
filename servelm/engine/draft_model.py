"""The draft-model proposer: a small model sharing the target's tokenizer proposes its greedy continuation.

It keeps its own paged KV cache: each target sequence has a shadow sequence here whose blocks hold the draft
model's keys and values. Before proposing, a shadow is brought in line with its target: the tokens they still
agree on keep their KV (accepted drafts included), the rest is rolled back and recomputed, so rejections,
preemptions and finished requests need no hooks. Its greedy proposals are point masses (see rejection.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

from servelm.config.engine import EngineConfig
from servelm.engine.input_batch import InputBatch
from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.model_runner import ModelRunner
from servelm.engine.scheduler import SchedulerOutput
from servelm.engine.sequence import Request, Sequence
from servelm.model.decoder import DecoderLM
from servelm.model.kernels.tape import DecodeTapes
from servelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def first_layers(model: DecoderLM, n: int) -> DecoderLM:
    """The target's first n layers (then its final norm and LM head) as a self-draft: no extra weights."""
    if not 1 <= n <= model.spec.num_layers:
        raise ValueError(f"speculative_model self:{n}: the target has {model.spec.num_layers} layers")
    draft = copy.copy(model)
    draft.layers = model.layers[:n]
    draft.spec = dataclasses.replace(model.spec, num_layers=n, sliding_windows=model.spec.sliding_windows[:n])
    draft.tapes = DecodeTapes(draft, draft.fused) if model.tapes is not None else None  # its own, fewer layers
    return draft


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, max_model_len: int,
                 kv_cache_dtype: str = "auto") -> None:
        """`kv_cache_dtype`: the target's, so the draft's cache (as many blocks as the target's) grows with it."""
        self.model = model
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, num_cpu_blocks=0)
        self.runner = ModelRunner(model, num_blocks, block_size, 0, seed=0, max_model_len=max_model_len,
                                  kv_cache_dtype=kv_cache_dtype)
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> the draft's copy of it
        self._greedy = SamplingParams(temperature=0.0)

    @classmethod
    def from_config(cls, config: EngineConfig, target: DecoderLM, max_model_len: int,
                    num_blocks: int) -> DraftModelProposer:
        name = config.speculative_config.speculative_model
        if name.startswith("self:"):
            model = first_layers(target, int(name[5:]))
        else:
            from servelm.model.loading.loader import load_model

            model = load_model(name, dtype=config.model_config.dtype, device=config.device_config.device, with_tokenizer=False).model
            if model.spec.vocab_size != target.spec.vocab_size:
                raise ValueError(f"speculative_model {name} has a vocabulary of {model.spec.vocab_size} tokens, "
                                 f"the target {target.spec.vocab_size}: they must share the tokenizer")
        return cls(model, num_blocks, config.cache_config.block_size, max_model_len, config.cache_config.kv_cache_dtype)

    def _shadow(self, seq: Sequence) -> Sequence:
        """seq's shadow, its computed tokens cut back to those that still match seq's tokens."""
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            req = seq.request
            sh = Request(req.request_id, req.prompt_token_ids, self._greedy)
            sh = self.shadows[seq.seq_id] = Sequence(sh, seq.index, [])
        # at least the last token is computed again: its logits give the first draft (the shadow may hold the
        # KV of all of seq's tokens, when seq decoded without verifying and took the shadow's first draft)
        sh.num_computed_tokens = min(_common_prefix(sh.token_ids[:sh.num_computed_tokens], seq.token_ids),
                                     seq.num_tokens - 1)
        self.kv.roll_back(sh)
        sh.token_ids = list(seq.token_ids)
        return sh

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        live = {s.seq_id for s in seqs}
        for sid in [sid for sid in self.shadows if sid not in live]:  # finished, preempted or cooling down
            self.kv.free(self.shadows.pop(sid))
        shadows = [self._shadow(s) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:  # one draft token per round for every sequence that still wants one
            batch = InputBatch(self.kv.block_size)
            rows = []
            for i in active:
                sh = shadows[i]
                if self.kv.allocate(sh, sh.num_to_compute):  # else: the draft cache is full, stop here
                    batch.add(sh)
                    batch.scheduled[sh.batch_row] = sh.num_to_compute
                    rows.append(i)
            if not rows:
                break
            step = SchedulerOutput.of(batch, self.kv.take_ops())
            tokens = self.runner.execute(step).tokens
            for sh, i, tok in zip(step.seqs, rows, tokens, strict=True):
                sh.num_computed_tokens = sh.num_tokens
                sh.token_ids.append(tok)
                sh.batch_row = -1
                drafts[i].append(tok)
            active = [i for i in rows if len(drafts[i]) < ks[i]]
        return drafts
