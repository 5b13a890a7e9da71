"""AsyncLLM: the engine in a process of its own, driven from asyncio, as vLLM's `AsyncLLM` (and its older
`AsyncLLMEngine`) is: what an application builds its own server, agent loop or RL rollouts on.

    llm = AsyncLLM("./model", max_num_seqs=64)
    async with llm:                                   # starts the engine process, stops it at the end
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="a"):
            print(out.outputs[0].text)                # cumulative by default, as vLLM's

It is the server's own engine handle (`worker.client.AsyncEngine`: one engine process, continuous batching over
every request in flight, detokenized in this process) with vLLM's calling conventions on top: prompts as text,
token ids or vLLM's prompt dicts; the model's sampling defaults where no SamplingParams are given; LoRA adapters
loaded on first use; a generator closed early aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from collections.abc import AsyncIterator

from servelm.config.engine import EngineConfig
from servelm.entrypoints.llm import ENGINE_FIELDS, Prompt, _unwrap
from servelm.lora import LoRARequest
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams


class AsyncLLM:
    """An engine process serving the requests of one event loop. Construct it anywhere (it checks the model
    and loads the tokenizer); the engine process starts at `await start()`, `async with`, or the first
    `generate`, on the running loop, and stops at `await shutdown()`."""

    def __init__(self, model: str | None = None, *, start_timeout_s: float = 600.0, **kwargs) -> None:
        """`model` and any EngineConfig field by keyword, as `LLM` takes them (max_num_seqs, dtype, enable_lora,
        ...). `start_timeout_s`: how long the engine may take to load (0: no limit)."""
        unknown = set(kwargs) - set(ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"unknown AsyncLLM arguments: {', '.join(sorted(unknown))}")
        self._setup(EngineConfig(model=model, **kwargs), start_timeout_s)

    @classmethod
    def from_engine_args(cls, config: EngineConfig, start_timeout_s: float = 600.0) -> AsyncLLM:
        """vLLM's constructor; servelm's engine arguments are an EngineConfig."""
        llm = cls.__new__(cls)
        llm._setup(config, start_timeout_s)
        return llm

    from_config = from_engine_args

    def _setup(self, config: EngineConfig, start_timeout_s: float) -> None:
        from servelm.model.loading.hf_overrides import engine_model
        from servelm.model.loading.hub import fetch_models
        from servelm.model.loading.metadata import check_model, model_tokenizer

        fetch_models(config)  # a Hub model not yet in the Hugging Face cache: downloaded now
        check_model(*engine_model(config.model_config))  # a model it cannot run: one clear error, no process
        self.config, self.start_timeout_s = config, start_timeout_s
        self.tokenizer = model_tokenizer(config.model_config)
        self._engine = None
        self._starting: asyncio.Future | None = None
        self._loras: dict[str, str] = {}  # adapters loaded through a LoRARequest: name -> path

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until it is ready (once; later calls wait for that start)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        from servelm.worker.client import AsyncEngine

        engine = AsyncEngine(self.config, self.tokenizer, start_timeout=self.start_timeout_s)
        try:
            await engine.start()
        except BaseException:
            await engine.shutdown()
            raise
        self._engine = engine

    async def shutdown(self) -> None:
        """Stop the engine process; requests in flight end. Another start() starts a new one."""
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()
        engine, self._engine = self._engine, None
        self._loras.clear()
        if engine is not None:
            await engine.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        return self._engine is not None and self._engine.check_engine()

    async def check_health(self) -> None:
        """Raises EngineDeadError unless the engine is running."""
        from servelm.worker.client import EngineDeadError

        if not self.is_running:
            raise EngineDeadError("the engine is not running")

    async def get_tokenizer(self):
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output (known once started)."""
        return self._engine.max_model_len if self._engine is not None else 0

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation config, as
        `LLM.get_default_sampling_params` (known once started)."""
        info = self._engine.info if self._engine is not None else None
        return SamplingParams(**(info.sampling_defaults if info is not None else {}))

    # -- requests ----------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request: LoRARequest | None = None,
                       priority: int = 1) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs, the last with finished=True: cumulative text and tokens unless the
        params ask for OutputKind.DELTA or FINAL_ONLY, as vLLM's. `prompt`: text (tokenized with the model's
        special tokens), token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}. `priority`: 0 high,
        1 normal, 2 low (lower first, as vLLM's). Leaving the loop early aborts the request and frees its
        KV blocks: at once inside `contextlib.aclosing(llm.generate(...))`, else when the event loop collects
        the abandoned generator. A request the engine refuses (a token id outside the vocabulary, a prompt that can never
        fit) raises ValueError before any output."""
        await self.start()
        engine = self._engine
        given = _unwrap(prompt)
        if isinstance(given, str):
            text, ids = given, list(self.tokenizer(given, add_special_tokens=True).input_ids)
        else:
            text, ids = None, [int(t) for t in given]
        params = copy.copy(sampling_params or self.get_default_sampling_params())  # the caller's is left alone
        ids = params.truncate_prompt(ids, engine.max_model_len)
        if not ids:
            raise ValueError("a prompt must hold at least one token")
        if priority not in (0, 1, 2):
            raise ValueError(f"priority must be 0 (high), 1 (normal) or 2 (low), got {priority!r}")
        lora = await self._adapter(lora_request) if lora_request is not None else None
        stream = engine.generate(request_id or uuid.uuid4().hex, ids, params, prompt=text, priority=priority,
                                 lora=lora)
        async with contextlib.aclosing(stream):  # closing this generator closes the engine's: an abort now
            async for out in stream:
                yield out

    async def abort(self, request_id: str | list[str]) -> None:
        """End requests in flight (their streams end); unknown ids are ignored."""
        if self._engine is None:
            return
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            await self._engine.abort(rid)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False, changing nothing, while requests are in flight (vLLM's)."""
        await self.start()
        return await self._engine.reset_prefix_cache() is not None

    async def update_weights_from_disk(self, model_path: str) -> bool:
        """New weights from a checkpoint on disk (a folder or a GGUF file of the same architecture and settings),
        copied into the running model in place; every cached prefix is forgotten. False, changing nothing, while
        requests are in flight; ValueError, changing nothing, where the checkpoint does not fit."""
        await self.start()
        return await self._engine.update_weights_from_disk(str(model_path)) is not None

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool = False) -> None:
        """Stop generating so that weights can change between requests, as vLLM's: new requests wait until
        resume_generation. `mode`: "abort" ends the requests in flight now (finish reason "abort"), "wait" lets
        them finish first (also `wait_for_inflight_requests=True`, vLLM's older form), "keep" holds them where
        they are to go on after the resume. `clear_cache`: after abort or wait, forget every cached prefix."""
        await self.start()
        await self._engine.pause_generation("wait" if wait_for_inflight_requests else mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.start()
        await self._engine.resume_generation()

    async def is_paused(self) -> bool:
        return self._engine is not None and self._engine.paused is not None

    async def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep while it is idle, as LLM.sleep (needs `enable_sleep_mode=True`): its KV cache's
        memory, and its weights' (level 1: kept in host memory; level 2: discarded), are given back; requests
        made meanwhile wait until it is woken. RuntimeError while requests are in flight."""
        await self.start()
        if await self._engine.sleep(level) is None:
            raise RuntimeError("requests are in flight: the engine sleeps only while idle")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the parts `tags` names ("weights", "kv_cache"; default both), as LLM.wake_up."""
        await self.start()
        await self._engine.wake_up(tags)

    async def is_sleeping(self) -> bool:
        await self.start()
        return bool(await self._engine.sleeping())

    async def _adapter(self, lora: LoRARequest) -> str:
        """The name the engine holds `lora` under, loading it from its path the first time."""
        held = self._loras.get(lora.name)
        if held is not None and lora.path and held != lora.path:
            raise ValueError(f"LoRA adapter {lora.name!r} is loaded from {held}, not {lora.path}")
        if held is None and lora.path:
            done = await self._engine.lora_adapter("load", lora.name, lora.path)
            if done.error is not None:
                raise ValueError(f"LoRA adapter {lora.name!r}: {done.error}")
            self._loras[lora.name] = lora.path
        return lora.name


AsyncLLMEngine = AsyncLLM  # vLLM's older name for the same surface
