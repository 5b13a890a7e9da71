"""Validation before anything is served: the artifact's hash still matches, it loads in a real worker, and its
golden prompts (or a default smoke set) run greedily; the outputs are recorded. Any failure leaves the version
FAILED with the reason.

Generation versions run in one engine-core worker (`AsyncEngine`), as a deployment would run them. A LoRA
adapter version runs in one worker of its base version with the adapter loaded (as an adapter deployment runs it
on its base's workers): its golden prompts are answered by the adapter, and the base's artifact is checked too.
Embedding versions run in an embedding worker made by `embedder_factory` (by default the server's `Embedder`,
its own process); a sequence classifier (a cross-encoder) classifies the prompts instead of embedding them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from servelm.config.engine import EngineConfig
from servelm.control.errors import ControlError
from servelm.control.types import Kind, ModelVersion, State

logger = logging.getLogger("servelm.control")

DEFAULT_PROMPTS = ("The capital of France is", "Once upon a time,", "def fibonacci(n):")
MAX_TOKENS = 16
EMBED_HEAD = 8  # leading dimensions of each embedding kept in the record


class EmbedWorker(Protocol):
    """What validation needs of an embedding worker (the server's `Embedder` has this shape)."""

    async def wait_ready(self) -> None: ...
    async def embed(self, texts: list[str]) -> tuple[Sequence[Sequence[float]], int]: ...
    def close(self) -> None: ...


async def validate(registry, name: str, version: int, base: EngineConfig, actor: str, *,
                   embedder_factory: Callable[[Path], EmbedWorker] | None = None, max_tokens: int = MAX_TOKENS,
                   start_timeout: float = 600.0) -> ModelVersion:
    """REGISTERED -> VALIDATING -> VALIDATED (outputs recorded) or FAILED (reason recorded); returns the
    version as it ends. The worker is shut down either way. A cancelled validation is recorded as FAILED."""
    mv = await asyncio.to_thread(registry.transition, name, version, State.VALIDATING, actor)
    prompts = list(mv.golden_prompts) or list(DEFAULT_PROMPTS)
    try:
        await asyncio.to_thread(registry.store.check, Path(mv.artifact), mv.sha256)
        if mv.kind == Kind.PREDICT:  # a non-LLM model has no golden prompts: it must load and describe itself
            from servelm.runtimes.predictors import load_predictor

            await asyncio.to_thread(load_predictor, mv.artifact)
            outputs = []
        elif mv.kind == Kind.EMBED:
            outputs = await _run_embed(mv, prompts, embedder_factory or _default_embedder)
        elif mv.kind == Kind.LORA:
            base_mv = await asyncio.to_thread(registry.get, *mv.base_ref)
            await asyncio.to_thread(registry.store.check, Path(base_mv.artifact), base_mv.sha256)
            outputs = await _run_generate(base_mv, base, prompts, max_tokens, start_timeout, adapter=mv)
        else:
            outputs = await _run_generate(mv, base, prompts, max_tokens, start_timeout)
    except asyncio.CancelledError:
        await asyncio.to_thread(registry.transition, name, version, State.FAILED, actor, "validation was cancelled")
        raise
    except Exception as e:  # noqa: BLE001 (whatever went wrong is the version's failure, reported as such)
        reason = e.message if isinstance(e, ControlError) else f"{type(e).__name__}: {e}"
        logger.warning("validation of %s failed: %s", mv.ref, reason)
        return await asyncio.to_thread(registry.transition, name, version, State.FAILED, actor, reason)
    logger.info("validated %s: %d golden prompts", mv.ref, len(outputs))
    return await asyncio.to_thread(registry.transition, name, version, State.VALIDATED, actor, None,
                                   outputs=outputs)


async def _run_generate(mv: ModelVersion, base: EngineConfig, prompts: list[str], max_tokens: int,
                        start_timeout: float, adapter: ModelVersion | None = None) -> list[str]:
    """Start one engine worker on the version's artifact and settings, run each prompt greedily, shut it down.
    With `adapter` (a LoRA version of `mv`), the worker loads it at start and every prompt runs with it."""
    from servelm.control.deployment import load_tokenizer, with_adapter
    from servelm.sampling_params import SamplingParams
    from servelm.worker.client import AsyncEngine

    config = mv.engine_config(base)
    lora = {}
    if adapter is not None:  # named as its deployments name it in their workers
        config = with_adapter(config, adapter.ref, adapter.artifact)
        lora = {"lora": adapter.ref}
    engine = AsyncEngine(config, start_timeout=start_timeout)
    engine.launch()  # the worker loads the weights while this process loads the tokenizer
    try:
        # the deployments' loader: one tokenizer load at a time in this process (transformers' lazy imports are
        # not thread-safe, and a deployment may be loading one now)
        tokenizer = await asyncio.to_thread(load_tokenizer, mv, config)
        engine.set_tokenizer(tokenizer)
        await engine.wait_ready()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outputs = []
        for i, prompt in enumerate(prompts):
            ids = tokenizer(prompt).input_ids
            final = None
            rid = f"validate-{(adapter or mv).ref}-{i}-{uuid.uuid4().hex[:8]}"
            async for out in engine.generate(rid, ids, params, prompt, **lora):
                final = out
            if final is None or not final.finished:
                raise RuntimeError(f"golden prompt {i} produced no finished output")
            outputs.append(final.outputs[0].text)
        return outputs
    finally:
        await engine.shutdown()


def _default_embedder(path: Path):
    from servelm.runtimes.embedder import Embedder

    return Embedder(path)


async def _run_embed(mv: ModelVersion, prompts: list[str], factory: Callable[[Path], EmbedWorker]) -> list[str]:
    """Embed the prompts in an embedding worker; record each vector's size and leading values (a classifier's:
    its number of labels and its logits)."""
    worker = factory(Path(mv.artifact))
    try:
        await worker.wait_ready()
        if getattr(worker, "task", "embed") == "classify":
            rows, _ = await worker.classify(prompts)
            key = "labels"
        else:
            rows, _ = await worker.embed(prompts)
            key = "dim"
    finally:
        await asyncio.to_thread(worker.close)  # may wait for its process to exit: not on the event loop
    if len(rows) != len(prompts):
        raise RuntimeError(f"the embedder returned {len(rows)} rows for {len(prompts)} texts")
    return [json.dumps({key: len(v), "head": [round(float(x), 4) for x in list(v)[:EMBED_HEAD]]}) for v in rows]
