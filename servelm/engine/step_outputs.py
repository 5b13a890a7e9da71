"""What one engine step produces, as plain data: it crosses the process boundary (see
`servelm/worker/messages.py`), so this module imports nothing heavy (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec


class SampleResult(msgspec.Struct, gc=False):
    """One sampled token. A struct the garbage collector does not track (it holds no cycles): the engine makes
    one per sequence per step, and tracked objects are what trigger young collections mid-step."""

    token_id: int
    logprob: float | None = None  # of the chosen token under the raw model distribution
    rank: int | None = None  # 1 = the most likely token
    top_logprobs: list[tuple[int, float]] | None = None


class RunnerOutput(NamedTuple):
    """What a step's forward pass gives back (ModelRunner.execute), for Scheduler.update_from_output: a column
    of tokens and sparse extras, by step row (the index into `SchedulerOutput.rows`).

    tokens: one token for each row that samples (`SchedulerOutput.sampled`), in row order.
    logprobs: the SampleResult (token, logprob, rank, top logprobs) of each sampled row that asked for logprobs.
    verified: for each row verifying drafts, the accepted drafts and the token after them.
    forked: for each row whose request forks (`SchedulerOutput.forks`), one result per sample, the row's own
    first.
    prompt_logprobs: (request, first prompt position, the logprobs from there) for each prompt chunk whose logprobs
    were asked for.
    """

    tokens: list[int] = []
    logprobs: dict[int, SampleResult] = {}
    verified: dict[int, list[SampleResult]] = {}
    forked: dict[int, list[SampleResult]] = {}
    prompt_logprobs: list[tuple[Any, int, list[SampleResult]]] = ()


class SeqOutput(msgspec.Struct, gc=False):
    """What one sample gained in one step (untracked by the garbage collector, like SampleResult: one per
    sequence per step; it holds lists of ints and SampleResults, never a cycle)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[SampleResult] = []  # a fresh list per instance
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduled, on a sample's first token
    # with params.prompt_logprobs: every prompt position's (the first None), once, on sample 0's first token
    prompt_logprobs: list[SampleResult | None] | None = None


class DecodeOutputs(msgspec.Struct, gc=False):
    """One token for each of many samples in one step, as two columns: the running batch's rows that neither
    ended nor started their sample (sample index 0, nothing else to report; see engine/step_update.py)."""

    request_ids: list[str] = []
    token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_swaps: int
    num_evictions: int
    num_steps: int
    prompt_tokens: int
    generation_tokens: int
    num_priority_preemptions: int = 0
    waiting_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])  # high, normal, low
    batch_size: int = 0  # sequences in the last step
    kv_cache_dtype: str = ""  # the KV cache's element type (bfloat16, float8_e4m3fn, ...)
    # speculative decoding, cumulative (all 0 when it is off)
    spec_proposed_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0  # tokens the verifications produced (accepted + one each)
    spec_verifications: int = 0
    spec_fallbacks: int = 0  # times a request's speculation switched off for low acceptance
    spec_proposed_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)
    # LoRA adapters (all empty, max_loras 0, when they are off): the adapters of the running and the waiting
    # requests, by name, sorted (vLLM's lora_requests_info, which routers read for adapter affinity)
    max_loras: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
