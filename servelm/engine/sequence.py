"""Requests and their sequences: the engine's per-request state."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a seeded sample needs a generator (keeps the API process light)
    import torch

from servelm.engine.step_outputs import SampleResult
from servelm.lora import LoRARequest
from servelm.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted by recompute
    SWAPPED = "swapped"  # preempted, its KV blocks held in the CPU swap pool
    RUNNING = "running"
    FINISHED = "finished"


class Priority(enum.IntEnum):
    """Lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


_seq_ids = itertools.count()


@dataclass
class SpecState:
    """Per-sample speculation state: recent draft outcomes (1 accepted, 0 rejected) and, after a fall-back,
    how many more decode steps run without drafts."""

    window: list[int] = field(default_factory=list)
    cooldown: int = 0


@dataclass(eq=False)
class Sequence:
    """One sample of a request: its tokens, how many have KV computed, and its blocks."""

    request: Request
    index: int  # sample index within the request (0..n-1)
    token_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    cpu_block_table: list[int] = field(default_factory=list)  # while SWAPPED
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash chain of its full blocks
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None  # per-sample RNG when the request has a seed
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_scheduled: float | None = None
    first_token_time: float | None = None
    # speculative decoding: draft tokens to verify next step, and the fall-back state
    spec_token_ids: list[int] = field(default_factory=list)
    spec: SpecState = field(default_factory=lambda: SpecState())
    # structured output: the grammar's state after this sample's tokens (structured.new_matcher's); it stays
    # with the sequence through preemption, so a resumed sample goes on where it was
    matcher: Any = None
    # the end-of-reasoning ids the output must end with before the grammar applies (params._grammar_after);
    # () once it does
    grammar_after: tuple[int, ...] = ()
    batch_row: int = -1  # its row in the scheduler's running batch (engine/input_batch.py) while running, else -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def arrival_key(self) -> tuple:
        """FCFS order; the scheduler puts the (aged) priority class in front of it."""
        return (self.request.arrival_time, self.request.order, self.index)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = Priority.NORMAL
    order: int = 0  # arrival counter, a tie-breaker for equal arrival times
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # True once the n samples exist (after the prompt's first token)
    cache_salt: str | None = None  # prefix-cache namespace: requests share cached blocks only within one salt
    lora: LoRARequest | None = None  # the LoRA adapter its rows run with (None: the base model)
    lora_key: str | None = None  # the adapter's digest, set by EngineCore.add_request: its prefix-cache namespace
    # params.prompt_logprobs: one entry per prompt position (the first is None), filled as chunks run
    prompt_logprobs: list[SampleResult | None] | None = None
    prompt_logprobs_done: bool = False  # all computed and reported: a recompute need not redo them
    grammar: Any = None  # params.structured_outputs compiled (a Future until the engine has it)
    # Set by EngineCore.add_request (engine/input_batch.plain_below): a sample whose next token is not in
    # stop_ids and leaves it shorter than plain_below tokens goes on with nothing to report but that token (0:
    # every token takes the full check, as for logprobs, n > 1 and grammars).
    plain_below: int = 0
    stop_ids: frozenset[int] = frozenset()
    # Set by EngineCore.add_request: its decode steps may be scheduled behind one another (async scheduling,
    # engine/core.py): it has plain_below, and its sampling reads nothing of its tokens (no penalties, no
    # min_tokens), so a step may sample it before the last step's token is on the host.
    overlaps: bool = False

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions must produce logprobs: such a request computes its whole prompt (no prefix-cache
        hits), so that every position's logits exist."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_done

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def make_generator(self, index: int) -> torch.Generator | None:
        if self.params.seed is None:
            return None
        import torch

        g = torch.Generator()
        # Each sample gets its own stream so its draws never depend on its siblings' progress.
        g.manual_seed((self.params.seed * 1_000_003 + index) % (2**63))
        return g
