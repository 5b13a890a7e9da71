"""EngineCore: the token-level engine loop (scheduler + KV cache + model runner), with no text handling.

It is what runs in the engine process behind the server; `LLMEngine` pairs it with the output processor.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

from servelm.config.engine import ENGINE_FIELDS, EngineConfig, RuntimeSettings
from servelm.engine.cuda_graphs import capture_sizes
from servelm.engine.input_batch import InputBatch, plain_below
from servelm.engine.kv_cache_manager import KVCacheManager
from servelm.engine.kv_sizing import CudaMemory, DeviceMemory, KVPlan, check_model_len, plan_kv_blocks
from servelm.engine.lora_manager import LoraManager
from servelm.engine.mixed_graphs import mixed_graph_sizes
from servelm.engine.model_runner import (
    InFlight,
    ModelRunner,
    kv_bytes_per_block,
    profile_graphs,
    profile_largest_step,
)
from servelm.engine.proposers import NgramProposer
from servelm.engine.scheduler import Scheduler, SchedulerOutput
from servelm.engine.sequence import Request, Sequence
from servelm.engine.sleep import Sleeper
from servelm.engine.spec_decode import SpecDecoder
from servelm.engine.step_outputs import DecodeOutputs, EngineStats, RunnerOutput, SeqOutput
from servelm.engine.structured import GrammarCache, new_matcher
from servelm.model.attention.kv_quant import cache_dtype
from servelm.model.decoder import DecoderLM
from servelm.model.memory import release_freed_heap

logger = logging.getLogger(__name__)


def _tokenizer_from_config(config: EngineConfig) -> Callable[[], Any]:
    """Builds the model's tokenizer when first called: the engine process needs one only to compile grammars."""
    def load():
        from servelm.model.loading.metadata import load_tokenizer
        from servelm.model.loading.source import resolve_model

        m = config.model_config
        return load_tokenizer(resolve_model(m.model, m.gguf_file), m.tokenizer)
    return load


def plan_kv_cache(config: EngineConfig, model: DecoderLM, memory: DeviceMemory | None,
                  graph_sizes: list[int] | None = None, mixed_sizes: list[int] | None = None) -> KVPlan:
    """This rank's KV cache plan (engine/kv_sizing.py): from `memory`, its device's counters, with a profile
    run of the largest step the scheduler can form and, on a GPU that will capture CUDA graphs of
    `graph_sizes` decodes (and mixed steps of `mixed_sizes` tokens), a capture of the largest of them. Every
    tensor-parallel rank plans this way, on its own GPU (without the graphs' capture, whose all-reduces would
    have to pair across ranks: there the graphs come out of the utilization's headroom)."""
    tokens = config.scheduler_config.max_num_batched_tokens
    rows = min(config.scheduler_config.max_num_seqs, tokens)
    block_size = config.cache_config.block_size
    kv_dtype = config.cache_config.kv_cache_dtype
    graphs = None
    if graph_sizes and model.embed.device.type == "cuda":
        longest = config.model_config.max_model_len or model.spec.max_position_embeddings
        graphs = lambda: profile_graphs(model, block_size, longest, max(graph_sizes),  # noqa: E731
                                        max(mixed_sizes or [0]), config.scheduler_config.max_num_seqs, kv_dtype)
    return plan_kv_blocks(config, kv_bytes_per_block(model, block_size, kv_dtype), memory,
                          lambda: profile_largest_step(model, block_size, tokens, rows, kv_dtype),
                          str(cache_dtype(kv_dtype, model.dtype)).removeprefix("torch."), graphs)


def _free_checkpoint_copy() -> None:
    """After a weight update: the checkpoint's tensors, read into host memory, are freed now rather than when the
    collector next finds the layers built from them (reference cycles), and the heap's free pages go back to
    the OS (bench/sleep_mode.py: a level-2 wake of SmolLM2-135M otherwise kept ~170 MB more)."""
    import gc

    gc.collect()
    release_freed_heap()


def _grammar_state(req: Request) -> tuple[Any, tuple[int, ...]]:
    """A new sample's grammar state: a fresh matcher of the request's compiled grammar (None without one), and
    the end-of-reasoning ids it waits for before applying (SamplingParams._grammar_after)."""
    if req.grammar is None:
        return None, ()
    return new_matcher(req.grammar), tuple(req.params._grammar_after)


class EngineCore:
    def __init__(self, config: EngineConfig, model: DecoderLM,
                 tokenizer_loader: Callable[[], Any] | None = None, memory: DeviceMemory | None = None) -> None:
        """`memory`: the device's memory counters, from which the KV cache is sized when the config gives no
        size (a GPU's own by default; engine/kv_sizing.py)."""
        self.config = config
        self.model = model
        if config.device_config.batch_invariant:
            from servelm.model.layers.invariant import check_batch_invariant

            check_batch_invariant(model)
        spec = model.spec
        tp_size = model.tp.size if model.tp is not None else 1
        if tp_size != config.parallel_config.tensor_parallel_size:
            raise ValueError(f"the model was loaded for tensor_parallel_size={tp_size}, the engine is configured "
                             f"for {config.parallel_config.tensor_parallel_size}")
        workers = None
        if tp_size > 1:  # ranks 1..N-1 in their own processes (this process is rank 0), connected before the
            from servelm.engine.tp_workers import TPWorkers  # profile run: its forward pass all-reduces

            workers = TPWorkers.start(config, model)
        try:
            self._build(config, model, memory, workers)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        max_len = self.max_model_len
        self.spec = self._make_spec_decoder(config, max_len)
        block_size = config.cache_config.block_size
        self.scheduler.batch = InputBatch(block_size, spec.vocab_size, config.scheduler_config.max_num_seqs,
                                          -(-max_len // block_size))
        self.loras = self._make_lora_manager(config)
        self.runner.loras = self.scheduler.loras = self.loras
        self.requests: dict[str, Request] = {}
        # n > 1 requests whose samples have not forked yet: a step looks for forks only while there are some (the
        # scheduler's update forks them and takes them off)
        self.unforked: set[str] = self.scheduler.unforked
        sch = self.scheduler
        sch.spec, sch.max_model_len, sch.on_request_finished = self.spec, max_len, self._forget
        # structured output: requests whose grammar is still compiling wait here, outside the scheduler
        self.grammars = GrammarCache(spec.vocab_size, tokenizer_loader or _tokenizer_from_config(config),
                                     config.structured_outputs_config.structured_output_backend)
        self.compiling: dict[str, Request] = {}
        self.failed: list[tuple[str, str]] = []  # (request id, why) for requests refused after add_request
        self._order = 0
        # async scheduling: the step launched and not yet collected, and when the last one was collected
        self.async_scheduling = config.async_scheduling_on()
        self.inflight: InFlight | None = None
        self._last_collect = 0.0
        self.num_overlapped_steps = 0  # steps launched behind another
        self.num_steps = 0
        self.last_num_batched_tokens = 0
        self.last_batch_size = 0
        # sleep mode (engine/sleep.py), where enabled; and the checkpoint the weights were last read from (None:
        # the configured model), which an engine woken from level 2 without new weights reads again
        self.sleeper = Sleeper(self.runner) if config.device_config.enable_sleep_mode else None
        self.weights_path: str | None = None
        self.weights_from_tensors = False  # the last update came from tensors, which a level-2 sleep discards
        self.staged_weights: dict = {}  # a partial update's tensors, waiting for the rest of their layer
        # pause_generation's "keep": the requests stay where they are, and no step runs until released
        self.held = False

    def _build(self, config: EngineConfig, model: DecoderLM, memory: DeviceMemory | None, workers) -> None:
        """The KV cache plan, the cache manager, the scheduler and the runner. With tensor parallelism (`workers`)
        each rank plans from its own GPU's memory (the profile run's all-reduces need all of them at once) and
        every rank takes the fewest blocks any of them can hold; then every rank builds its runner at once, since
        capturing CUDA graphs runs the same all-reduces on every rank in the same order."""
        spec = model.spec
        cuda = model.embed.device.type == "cuda"
        if memory is None and cuda:
            memory = CudaMemory(model.embed.device)
        cache, sched = config.cache_config, config.scheduler_config
        graph_sizes, mixed = self._graph_sizes(config, model, workers)
        if workers is not None:
            workers.begin_plan()
        plan = plan_kv_cache(config, model, memory, graph_sizes if workers is None else None, mixed)
        if workers is not None:
            plan = workers.end_plan(plan)
        num_blocks = plan.num_blocks
        self.kv_plan = plan
        logger.info("%s", plan.describe())
        max_len = check_model_len(plan, cache.block_size, config.model_config.max_model_len,
                                  spec.max_position_embeddings)
        self.max_model_len = max_len
        cap = config.model_config.max_logprobs
        self.max_logprobs = spec.vocab_size if cap == -1 else cap  # the most logprobs a request may ask for
        swap = sched.preemption_mode == "swap"
        num_cpu_blocks = int(cache.swap_space_gb * 2**30) // plan.block_bytes if swap else 0
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, num_cpu_blocks)
        self.scheduler = Scheduler(self.kv, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   sched.enable_chunked_prefill, sched.preemption_mode, sched.scheduling_policy,
                                   sched.priority_aging_s, itl_target_s=sched.itl_target_ms / 1000,
                                   ttft_target_s=sched.ttft_target_ms / 1000)
        if workers is not None:
            workers.begin_runners(num_blocks, num_cpu_blocks, max_len, graph_sizes if cuda else None)
        self.runner = ModelRunner(model, num_blocks, cache.block_size, num_cpu_blocks, config.model_config.seed,
                                  graph_sizes, max_len, cache.kv_cache_dtype, config.model_config.logprobs_mode)
        if workers is not None:
            workers.end_runners()
            self.runner.tp_workers = workers
        if mixed:
            self.runner.enable_mixed_graphs(mixed, sched.max_num_seqs, capture=True)

    @staticmethod
    def _graph_sizes(config: EngineConfig, model: DecoderLM, workers) -> tuple[list[int] | None, list[int]]:
        """The decode batch sizes to capture in CUDA graphs (None: none; the runner captures on a GPU only) and
        the mixed steps' token counts (empty where none are captured)."""
        # MoE layers read their expert groups' sizes on the host: not capturable
        eager = config.device_config.enforce_eager or model.spec.moe is not None
        graph_sizes = None if eager else capture_sizes(config.scheduler_config.max_num_seqs)
        mixed = mixed_graph_sizes(config.device_config.cuda_graph_mixed_tokens)
        if not (mixed and graph_sizes and model.embed.device.type == "cuda"):
            return graph_sizes, []
        if workers is not None or not model.attn.mixed_graphs:
            logger.warning("cuda_graph_mixed_tokens is ignored: %s", "tensor parallelism" if workers is not None
                           else f"the {type(model.attn).__name__} backend cannot run mixed steps in graphs")
            return graph_sizes, []
        return graph_sizes, mixed

    def _make_spec_decoder(self, config: EngineConfig, max_len: int) -> SpecDecoder | None:
        sp = config.speculative_config
        if sp.speculative_method is None:
            return None
        if sp.speculative_method == "ngram":
            proposer = NgramProposer(sp.ngram_lookup_max, sp.ngram_lookup_min)
        else:
            from servelm.engine.draft_model import DraftModelProposer

            proposer = DraftModelProposer.from_config(config, self.model, max_len, self.kv.pool.num_blocks)
        return SpecDecoder(proposer, sp.num_speculative_tokens, max_len, sp.spec_fallback_threshold,
                           sp.spec_fallback_window, sp.spec_cooldown_steps)

    def _make_lora_manager(self, config: EngineConfig) -> LoraManager | None:
        lc = config.lora_config
        if not lc.enable_lora:
            return None
        from servelm.config.engine import parse_lora_module
        from servelm.lora import LoRARequest

        loras = LoraManager(self.model, lc.max_lora_rank, lc.max_loras, lc.max_cpu_loras)
        for i, module in enumerate(lc.lora_modules, 1):
            name, path, base = parse_lora_module(module)
            loras.add(LoRARequest(name, i, path, base))
        return loras

    # -- requests ----------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """Raise ValueError if a request can never be served (before it is queued)."""
        n = len(prompt_token_ids)
        vocab = self.model.spec.vocab_size
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n + (max_tokens or 1) > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request has "
                f"{n} prompt tokens and max_tokens={max_tokens or 1} (total {n + (max_tokens or 1)})")
        sched = self.config.scheduler_config
        if not sched.enable_chunked_prefill and n > sched.max_num_batched_tokens:
            raise ValueError(f"prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{sched.max_num_batched_tokens}; enable chunked prefill or raise the budget")

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if self.staged_weights:  # some layers new, some old: neither model's tokens
            waiting = sorted(self.staged_weights)
            raise ValueError(f"a partial weight update waits for the rest of its layers ({len(waiting)} tensors, "
                             f"first {waiting[0]}): load them before generating")
        self.check_request(req.prompt_token_ids, req.params.max_tokens)
        req.params.check_vocab(self.model.spec.vocab_size)
        req.params.check_logprobs(self.max_logprobs)
        if req.lora is not None:  # last check: from here the request holds its adapter until it finishes
            if self.loras is None:
                raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora or "
                                 "--lora-modules)")
            req.lora_key = self.loras.acquire(req.lora)
        req.order = self._order
        self._order += 1
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(p._eos_token_ids))
        req.plain_below = plain_below(req, self.max_model_len)
        req.overlaps = req.plain_below > 0 and not p.reads_output and p.min_tokens == 0
        seq = Sequence(req, 0, list(req.prompt_token_ids), generator=req.make_generator(0))
        req.seqs = [seq]
        self.requests[req.request_id] = req
        if req.params.n > 1:
            self.unforked.add(req.request_id)
        if req.params.structured_outputs is not None:  # compiled off the loop; scheduled once it is ready
            req.grammar = self.grammars.submit(req.params.structured_outputs, req.params._eos_token_ids)
            self.compiling[req.request_id] = req
            return
        self.scheduler.add(seq)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar has compiled; refuse those whose grammar failed."""
        for rid, req in list(self.compiling.items()):
            if not req.grammar.done():
                continue
            del self.compiling[rid]
            if req.grammar.exception() is not None:
                self._forget(req)
                self.unforked.discard(rid)
                self.failed.append((rid, str(req.grammar.exception())))
                continue
            req.grammar = req.grammar.result()
            seq = req.seqs[0]
            seq.matcher, seq.grammar_after = _grammar_state(req)
            self.scheduler.add(seq)

    def take_errors(self) -> list[tuple[str, str]]:
        """Requests refused since the last call (a grammar that did not compile), as (request id, message)."""
        failed, self.failed = self.failed, []
        return failed

    def finish_seq(self, request_id: str, index: int | None, reason: str, stop_reason=None) -> None:
        """End one sample (index) or all samples (None) of a request, freeing their blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if self.compiling.pop(request_id, None) is not None:  # never scheduled: nothing to free
            self._forget(req)
            return
        for seq in req.seqs:
            if index is None or seq.index == index:
                self.scheduler.finish(seq, reason, stop_reason)
        if req.finished:
            self._forget(req)

    def _forget(self, req: Request) -> None:
        """The request leaves the engine: what it held beside its blocks is given back."""
        del self.requests[req.request_id]
        self.unforked.discard(req.request_id)
        if req.lora is not None:
            self.loras.release(req.lora.lora_name)

    def abort_request(self, request_id: str) -> None:
        self.finish_seq(request_id, None, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> int | None:
        """Forget every cached prefix (after a weight update, or between benchmark runs): the number of blocks
        dropped, or None, changing nothing, while a request holds blocks (as vLLM's, all or nothing)."""
        if self.has_unfinished_requests():
            return None
        before = len(self.kv.pool.cached)
        self.kv.pool.reset_prefix_cache()
        return before - len(self.kv.pool.cached)

    def update_weights(self, source, partial: bool = False) -> int | None:
        """New values for the model's weights, copied into it in place (model/weight_update.py): from a
        checkpoint's path (a folder or a GGUF file), or from (name, tensor) pairs under Hugging Face names. Every
        cached prefix goes with the old values. The bytes copied, or None, changing nothing, while requests are
        in flight (their tokens would mix two models); ValueError, changing nothing, where the new weights are
        not the running model's shapes and settings. `partial` (tensors only): any subset of the model's
        tensors, each layer (and the embedding, norm and head together) copied once all of its tensors have
        arrived, over as many calls as it takes; the rest wait in `staged_weights`, and no request is taken
        meanwhile."""
        from servelm.model.weight_update import checkpoint_weights, update_in_place

        self._settle()
        if self.has_unfinished_requests() and not self.holds_requests:
            return None
        if self.runner.tp_workers is not None:
            raise ValueError("weights cannot be updated under tensor parallelism (each rank holds its own shard)")
        if self.sleeper is not None and self.sleeper.weights != "awake":
            raise ValueError("the weights are asleep: wake them first (wake_up with the tag 'weights')")
        from_path = isinstance(source, (str, bytes)) or hasattr(source, "__fspath__")
        if partial and from_path:
            raise ValueError("a checkpoint on disk is read whole: partial updates take (name, tensor) pairs")
        copied = update_in_place(self.model, checkpoint_weights(self.config, self.model, source),
                                 self.staged_weights if partial else None)
        if not partial:
            self.staged_weights.clear()  # a whole checkpoint supersedes what waited
        if copied and not self.staged_weights:  # not per tensor of a partial update: a collection costs ~0.1 s
            _free_checkpoint_copy()
        # held requests keep their blocks (computed with the old weights, as vLLM's pause "keep" leaves them),
        # but no later request may match them
        self.kv.pool.reset_prefix_cache(in_use=True)
        self.weights_path = str(source) if from_path else self.weights_path
        self.weights_from_tensors = not from_path
        if self.sleeper is not None:
            self.sleeper.needs_weights = False
        return copied

    def _settle(self) -> None:
        """Collect a step still in flight (async scheduling) whose requests have all gone (aborted since it was
        launched): the weights or the memory it reads may change next."""
        if self.inflight is not None and not self.requests:
            self.runner.collect(self.inflight)
            self.inflight = None

    # -- pausing (vLLM's pause_generation) ---------------------------------------------------------
    @property
    def holds_requests(self) -> bool:
        """Whether requests wait without a step running: the engine sleeps or is held, and no step is in flight
        (one launched before is still collected)."""
        return (self.held or self.is_sleeping) and self.inflight is None

    def abort_all(self) -> list[SeqOutput]:
        """End every request now, each of its samples with finish reason "abort" (pause_generation's "abort"):
        the outputs that tell their callers."""
        outputs = []
        for rid, req in list(self.requests.items()):
            done = {seq.index for seq in req.seqs if seq.finished}
            outputs += [SeqOutput(rid, i, [], finish_reason="abort") for i in range(req.params.n) if i not in done]
            self.finish_seq(rid, None, "abort")
        return outputs

    # -- sleep mode (engine/sleep.py) ---------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.sleeper is not None and not self.sleeper.serving

    def sleeping(self) -> list[str]:
        """The parts asleep: "weights", "kv_cache", or none."""
        return [] if self.sleeper is None else self.sleeper.asleep

    def sleep(self, level: int = 1) -> int | None:
        """Give back the KV cache's memory, and the weights' (level 1: kept in host memory; level 2: discarded),
        forgetting every cached prefix; requests added meanwhile wait until the engine is woken. The bytes given
        back, or None, changing nothing, while requests are in flight."""
        self._need_sleep_mode()
        self._settle()
        if self.has_unfinished_requests():
            return None
        released = self.sleeper.sleep(level)
        self.kv.pool.reset_prefix_cache()
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the parts named ("weights", "kv_cache"; default both). Woken whole after a level-2 sleep with no
        weights loaded meanwhile, the engine reads the checkpoint it last loaded from disk again."""
        self._need_sleep_mode()
        self.sleeper.wake_up(tags)
        if self.sleeper.needs_weights and self.sleeper.in_memory:
            # where the checkpoint has gone or is damaged, this raises and the weights stay unloaded (asleep):
            # load new ones, or wake again to read it again
            self._reload_weights()

    def _reload_weights(self) -> None:
        from servelm.model.loading.source import resolve_model
        from servelm.model.weight_update import checkpoint_weights, update_in_place

        m = self.config.model_config
        path = self.weights_path or str(resolve_model(m.model, m.gguf_file).path)
        if self.weights_from_tensors:
            logger.warning("the weights loaded from tensors were discarded by a level-2 sleep and none were loaded "
                           "since: reading %s again", path)
        update_in_place(self.model, checkpoint_weights(self.config, self.model, path))
        _free_checkpoint_copy()
        self.sleeper.needs_weights = False
        self.weights_from_tensors = False
        logger.info("weights read again from %s after a level-2 sleep", path)

    def _need_sleep_mode(self) -> None:
        if self.sleeper is None:
            raise ValueError("sleep mode is not enabled: start the engine with enable_sleep_mode "
                             "(--enable-sleep-mode)")

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they also stop when this process exits)."""
        if self.runner.tp_workers is not None:
            self.runner.tp_workers.close()

    def update_config(self, settings: RuntimeSettings) -> None:
        """Run-time changes (PATCH /admin/config): they apply from the next step."""
        for name, value in dataclasses.asdict(settings).items():
            setattr(self.config.section(ENGINE_FIELDS[name]), name, value)
        self.scheduler.apply_settings(settings)

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> tuple[list[SeqOutput], DecodeOutputs]:
        """One engine step: what each sample gained, as columns for the rows with nothing to report but their
        token, and SeqOutputs for the rest."""
        if self.compiling:
            self._admit_compiled()
        if self.inflight is not None:  # async scheduling: a step runs, the next goes behind it
            return self._step_behind()
        if self.is_sleeping or self.held:  # requests wait for the engine to be woken or released
            return [], DecodeOutputs()
        out = self.scheduler.schedule()
        if not out:
            return self._idle()
        start = self._begin(out)
        if self.async_scheduling and self.scheduler.overlaps(out):
            self.inflight = self.runner.launch(out, start)
            return self._step_behind()
        return self._update(out, self.runner.execute(out), start)

    def _update(self, out: SchedulerOutput, ran: RunnerOutput, start: float
                ) -> tuple[list[SeqOutput], DecodeOutputs]:
        """After a step's forward: its results into its requests (`start`: when it began, for its cost)."""
        self.kv.end_step()
        now = time.monotonic()
        self.scheduler.step_cost.observe(out.num_batched_tokens, now - start)
        outputs, decodes = self.scheduler.update_from_output(out, ran, now)
        if self.spec is not None:  # drafts for the next step, from the tokens as they are now
            self.spec.propose(self.scheduler.running)
        return outputs, decodes

    def _step_behind(self) -> tuple[list[SeqOutput], DecodeOutputs]:
        """Async scheduling, with a step of decodes in flight: schedule the next behind it and launch it (its input
        tokens are the in-flight step's, taken on the device), then collect the one in flight and update from
        it, while the next runs. Where no step can go behind it (a request waits, one needs more than a plain
        decode or reaches its length limit, blocks run short), the one in flight is collected alone and the next
        step() schedules as usual."""
        prev, self.inflight = self.inflight, None
        self._rebase(prev)  # samples ended since it was launched (aborts, stop strings) drop out
        nxt = None if self.held else self.scheduler.schedule_behind(prev.out)
        if nxt is not None:
            self.inflight = self.runner.launch(nxt, self._begin(nxt), after=prev)
            self.num_overlapped_steps += 1
        ran = self.runner.collect(prev)
        start, self._last_collect = max(prev.start, self._last_collect), time.monotonic()
        result = self._update(prev.out, ran, start) if prev.out else ([], DecodeOutputs())
        if self.inflight is not None:
            self._rebase(self.inflight)  # the samples the update ended drop out of the next
            if not self.inflight.out:  # every one of them ended: nothing to wait for but the copy
                self.runner.collect(self.inflight)
                self.inflight = None
        return result

    def _rebase(self, step: InFlight) -> None:
        """A step in flight keeps the rows of the samples still running, at their rows now."""
        narrowed = self.scheduler.rebase(step.out)
        if narrowed is not None:
            step.narrow(*narrowed)

    def _idle(self) -> tuple[list[SeqOutput], DecodeOutputs]:
        """A step with nothing scheduled."""
        self.kv.end_step()
        if self.compiling:  # nothing else to run: wait a little for a grammar rather than spin
            wait_futures([r.grammar for r in self.compiling.values()], 0.01, FIRST_COMPLETED)
        return [], DecodeOutputs()

    def _begin(self, out: SchedulerOutput) -> float:
        """Before the forward: the step's figures, first-scheduled times, and the new samples of n > 1 requests
        whose prompt ends this step (`out.forks`, which the update forks once the prompt has run); returns the
        step's start time."""
        self.num_steps += 1
        self.last_num_batched_tokens = out.num_batched_tokens
        self.last_batch_size = len(out.rows)
        start = time.monotonic()
        if out.num_admitted:  # only admitted rows, the step's last (they joined the batch last), run first
            for seq in out.seqs[-out.num_admitted:]:
                if seq.first_scheduled is None:
                    seq.first_scheduled = start
        if self.unforked:
            for r, (seq, sampled) in enumerate(zip(out.seqs, out.sampled.tolist(), strict=True)):
                req = seq.request
                if sampled and req.params.n > 1 and not req.forked:
                    forks = out.forks[r] = []
                    for i in range(1, req.params.n):
                        matcher, after = _grammar_state(req)
                        forks.append(Sequence(req, i, list(seq.token_ids), generator=req.make_generator(i),
                                              matcher=matcher, grammar_after=after))
        return start

    def stats(self) -> EngineStats:
        sch, kv = self.scheduler, self.kv
        swapped = sch.num_waiting_swapped  # counted as the queue changes: no pass over a long waiting queue
        by_priority = list(sch.waiting_by_priority)
        return EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting) - swapped, num_swapped=swapped,
            kv_usage=kv.usage, num_kv_blocks=kv.pool.num_blocks, num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            prefix_cache_hit_rate=kv.prefix_hit_rate, num_preemptions=sch.num_preemptions,
            num_swaps=sch.num_swaps, num_evictions=kv.pool.num_evictions, num_steps=self.num_steps,
            prompt_tokens=sch.prompt_tokens, generation_tokens=sch.generation_tokens,
            num_priority_preemptions=sch.num_priority_preemptions, waiting_by_priority=by_priority,
            batch_size=self.last_batch_size, kv_cache_dtype=self.kv_plan.dtype, **self._spec_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.loras is None:
            return {}
        sch = self.scheduler  # (the scheduler counts each queue's adapters as sequences come and go)
        return dict(max_loras=self.loras.max_loras, running_lora_adapters=sorted(sch.running_adapters),
                    waiting_lora_adapters=sorted(sch.waiting_adapters))

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        st = self.spec.stats
        return dict(spec_proposed_tokens=st.proposed, spec_accepted_tokens=st.accepted,
                    spec_emitted_tokens=st.emitted, spec_verifications=st.verifications,
                    spec_fallbacks=st.fallbacks, spec_proposed_by_position=list(st.proposed_by_position),
                    spec_accepted_by_position=list(st.accepted_by_position))
