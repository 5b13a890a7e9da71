"""What every generation route shares: tokenizing off the event loop, sampling params and admission for a
request, and running engine requests (streamed or collected) with metrics, logs and client-disconnect aborts.

`Api` holds the server state; each helper takes the model that serves the request (`m`: the engine surface of
an AsyncEngine plus its `tokenizer`), so one app can serve several models.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from servelm.beam_search import generate_outputs
from servelm.control.types import Kind
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams
from servelm.server.middleware.admission import check_model
from servelm.server.observability.telemetry import OUTPUT_HEAD, RequestRecord
from servelm.server.openai import protocol as p
from servelm.server.openai.protocol import APIError
from servelm.server.openai.tools import template_messages
from servelm.worker.client import EngineDeadError, QueueTimeout, RequestRejected

Job = tuple  # (request id, prompt token ids, SamplingParams, prompt text | None, priority, cache salt | None)


def sse(obj: dict | str) -> bytes:
    """One server-sent event carrying `obj` (JSON) or a bare string such as [DONE]."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: the prompt tokens the prefix cache served (OpenAI's and vLLM's
    prompt_tokens_details)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def record(request: Request) -> RequestRecord:
    """The gateway's record of this request (telemetry, admission)."""
    return request.state.record


def b64(vec) -> str:
    """A vector as base64 of little-endian float32 (OpenAI's encoding_format=base64)."""
    import numpy as np

    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()


def vocab_size(m) -> int:
    """The model's vocabulary size as its engine reports it (the tokenizer's before the engine is up)."""
    return m.info.vocab_size if m.info else len(m.tokenizer)


class Api:
    """The shared request machinery of one app, over its ServerState."""

    def __init__(self, state) -> None:
        self.state = state
        self.metrics = state.metrics
        # Tokenization, chat templates and long decodes run here, never on the event loop: a long prompt would
        # stall every stream and health check. One thread, because a fast tokenizer's settings are not safe to
        # share between threads (and the tokenizers library releases the GIL while it encodes anyway).
        self.text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelm-tokenize")

    async def resolve(self, request: Request, model: str | None, kind: Kind = Kind.GENERATE, req=None):
        """The model serving this request (404 naming the available ones), loaded first if it is registered
        but not deployed (on-demand). With traffic management on, a bare name's traffic policy picks the
        version from the request's attributes (`req.user`, headers, the key's name). Its version, arm and the
        load's wait go on the record, from which the gateway sets the x-servelm-model-version, x-servelm-arm
        and x-servelm-load-wait-s headers."""
        rec = record(request)
        model = self.state.models.canonical(model)  # an alias (--served-model-name's further names) is its model
        check_model(rec.api_key, model)  # before anything loads: a key must not bring up a model it may not use
        traffic = getattr(self.state, "traffic", None)
        attrs = None
        if traffic is not None and kind == Kind.GENERATE:
            rec.user = getattr(req, "user", None) or getattr(req, "safety_identifier", None)
            attrs = traffic.attrs(request.headers, rec, getattr(req, "metadata", None))
        m, waited = await self.state.models.load(model, kind, attrs)
        rec.leases.append(m)  # the gateway releases its pin on the model's generation when the request ends
        check_model(rec.api_key, m.served_name)  # the default model, when the request named none
        rec.model = m.served_name
        rec.model_version = m.version.ref if m.version is not None else None
        rec.load_wait_s = waited
        decision = getattr(m, "decision", None)
        rec.decision = decision
        if traffic is not None and kind == Kind.GENERATE:
            rec.arm = decision.arm if decision is not None else None
            rec.capture_text, rec.capture_output = True, traffic.wants_output(m.name)
        return m

    def metrics_of(self, m):
        """The model's own labelled metrics (made on first use for a model that has none yet)."""
        if m.metrics is None:
            m.metrics = self.metrics.for_model(m.served_name)
        return m.metrics

    # -- text --------------------------------------------------------------------------------------
    async def off_loop(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)

    @staticmethod
    def encode(m, text: str, **kw) -> list[int]:
        return m.tokenizer(text, **kw).input_ids

    async def chat_ids(self, m, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                       tools: list[dict] | None = None, add_special_tokens: bool = False, **kw) -> list[int]:
        """The prompt token ids of a conversation (with its tool calls and results, and the tools on offer),
        rendered with the model's chat template, which gets the server's default_chat_template_kwargs under the
        request's own; `add_special_tokens`: the tokenizer's own (a BOS) added on top of what the template
        wrote."""
        tok = m.tokenizer
        api_config = self.state.config.server.api_config
        if "chat_template" in kw and not api_config.trust_request_chat_template:
            raise APIError(400, "this server renders chats with its models' own templates; a request's "
                                "chat_template needs a server started with --trust-request-chat-template",
                           "chat_template")
        if getattr(tok, "chat_template", None) is None and "chat_template" not in kw:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        conv = template_messages(messages)
        kw = {**api_config.chat_template_defaults(), **kw}  # the request's win
        if tools:
            kw["tools"] = tools

        def render() -> list[int]:
            try:
                text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False,
                                               **kw)
            except Exception as e:  # template errors are the caller's input
                raise APIError(400, f"chat template failed: {e}", "messages") from e
            return self.encode(m, text, add_special_tokens=add_special_tokens)
        return await self.off_loop(render)

    # -- admission ---------------------------------------------------------------------------------
    def params(self, m, req, prompt_len: int):
        """The request's SamplingParams, checked against the model's vocabulary and context (400)."""
        try:
            default_max = self.state.admission.default_max_tokens(prompt_len, getattr(req, "n", 1),
                                                                  max(1, m.max_model_len - prompt_len),
                                                                  m.max_model_len)
            params = req.sampling_params(default_max, getattr(m.info, "sampling_defaults", None))
            if isinstance(params, SamplingParams):
                params.check_vocab(m.info.vocab_size if m.info else 1 << 31)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        for name in ("top_logprobs", "logprobs", "prompt_logprobs"):
            self.check_logprobs(m, name, getattr(req, name, None))
        if prompt_len + (params.max_tokens or 0) > m.max_model_len:
            raise APIError(400, f"this model's maximum context length is {m.max_model_len} tokens; the "
                                f"request has {prompt_len} prompt tokens and max_tokens={params.max_tokens} "
                                f"({prompt_len + params.max_tokens} in total)", "max_tokens", "context_length_exceeded")
        return params

    @staticmethod
    def check_logprobs(m, name: str, k) -> None:
        """A 400 naming the field where a request asks for more logprobs than the model's engine gives (its
        --max-logprobs; the engine refuses them too, but could not name the field)."""
        cap = getattr(m.info, "max_logprobs", None)
        if cap is not None and type(k) is int and k > cap:
            raise APIError(400, f"{name} is {k}, more than this model's limit of {cap} (the server's "
                                "--max-logprobs)", name)

    def hold_place(self, m, request: Request) -> None:
        """A generation request's place in its model's queue, taken before its text work (see
        Admission.hold_place): over the high watermark, 503 at once."""
        self.state.admission.hold_place(record(request), m.served_name, m.num_queued, self.metrics_of(m))

    def admit(self, m, request: Request, req, prompts: list[list[int]], params: list) -> int:
        """Admission control for a generation request; returns its engine priority."""
        rec = record(request)
        rec.stream = bool(getattr(req, "stream", False))
        rec.prompt_tokens = sum(len(ids) for ids in prompts)
        cost = rec.prompt_tokens + sum((sp.max_tokens or 0) * sp.n for sp in params)
        admission = self.state.admission
        admission.check_work(max(sp.n for sp in params), rec.prompt_tokens, cost, m.max_model_len)
        return admission.admit(rec, m.served_name, cost, getattr(req, "priority", None), m.num_queued,
                               self.metrics_of(m))

    def cache_salt(self, request: Request, req) -> str | None:
        """The prefix-cache namespace of a request: its API key's (under isolation "key") and its own
        cache_salt. The key's part comes first and is fixed-length, so no chosen salt can name another
        key's namespace."""
        parts = []
        key = record(request).api_key
        if self.state.config.server.auth_config.prefix_cache_isolation == "key" and key is not None:
            parts.append("key:" + key.digest.hex())
        if getattr(req, "cache_salt", None):
            parts.append("salt:" + req.cache_salt)
        return "/".join(parts) or None

    @staticmethod
    def request_ids(request: Request, prefix: str, body_id: str | None = None) -> tuple[str, str]:
        """The response's id and the engine's, as vLLM names them: `prefix` and the request's id, which is the
        client's x-request-id, else the body's request_id, else the gateway's own. A client's ids need not be
        unique, so an engine id made from one gets a random tail."""
        rec = record(request)
        if body_id is not None and not rec.client_named:
            rec.request_id, rec.client_named = body_id, True
        rid = f"{prefix}{rec.request_id}"
        return rid, f"{rid}-{uuid.uuid4().hex[:8]}" if rec.client_named else rid

    def log_prompt(self, request: Request, prompts: list) -> None:
        if self.state.telemetry.log_prompts or record(request).capture_text:
            record(request).prompt_text = json.dumps(prompts if len(prompts) > 1 else prompts[0])

    # -- running requests --------------------------------------------------------------------------
    async def stream_outputs(self, m, rec: RequestRecord, rid: str, ids: list[int], params, prompt: str | None,
                             priority: int, salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Engine outputs for one request, recorded for metrics, logs and traces; a client that goes away
        aborts it."""
        state, metrics = self.state, self.metrics_of(m)
        submitted = time.monotonic()
        rec.submitted = rec.submitted or submitted
        first = last = None
        n_out = cached = 0
        mine = rec.prompt_ids is None  # the request's first prompt: what the prediction log and shadow see
        if mine:
            rec.prompt_ids, rec.params, rec.cache_salt = list(ids), params, salt
        traffic = getattr(state, "traffic", None)
        try:
            if traffic is not None:
                await traffic.fault(m)  # a test hook: a version labelled servelm.fault fails or is slow
            lora = {"lora": m.lora} if getattr(m, "lora", None) else {}  # a LoRA adapter of the base's engine
            gen = generate_outputs(m, rid, ids, params, prompt, priority,
                                   state.config.admission.queue_timeout_s or None, salt, **lora)
            async for out in gen:
                now = time.monotonic()
                served_by = getattr(out, "model_version", None)  # a deployment tags the version that served it
                if served_by is not None and m.version is not None and rec.model_version != served_by:
                    rec.model = rec.model_version = served_by
                new = sum(len(c.token_ids) for c in out.outputs)
                state.admission.started(rec)
                if new:
                    if last is not None:
                        metrics.itl.observe(now - last)
                    first, last = first or now, now
                    n_out += new
                    rec.first_token = min(rec.first_token or now, now)
                    rec.last_token = now
                    rec.completion_tokens += new
                if out.num_cached_tokens > cached:  # known from its first token on; summed over the prompts
                    rec.cached_tokens += out.num_cached_tokens - cached
                    cached = out.num_cached_tokens
                if rec.queue_time is None and "queue_time" in out.metrics:
                    rec.queue_time = out.metrics["queue_time"]
                if mine:
                    rec.output_ids.extend(t for c in out.outputs if c.index == 0 for t in c.token_ids)
                if state.telemetry.log_prompts or rec.capture_output:
                    rec.completion_text = (rec.completion_text or "") + "".join(c.text for c in out.outputs)
                elif rec.capture_text and len(rec.output_head) < OUTPUT_HEAD:
                    rec.output_head += "".join(c.text for c in out.outputs if c.index == 0)
                for c in out.outputs:
                    rec.finish_reason = rec.finish_reason or c.finish_reason
                if out.finished:
                    metrics.observe_finished(submitted, first, now, out.metrics.get("queue_time"), len(ids), n_out,
                                             next((c.finish_reason for c in out.outputs), None),
                                             getattr(params, "n", 1), getattr(params, "max_tokens", None))
                yield out
        except QueueTimeout as e:
            metrics.timeouts.inc()
            raise APIError(408, str(e), code="queue_timeout") from e
        except RequestRejected as e:
            raise APIError(400, str(e)) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e
        finally:
            state.admission.started(rec)  # ended without an output: no longer queued either

    async def open(self, m, request: Request, job: Job) -> AsyncIterator[RequestOutput]:
        """Start a request and wait for its first output before any response bytes, so queue timeouts,
        overload and engine errors get their HTTP status; a client that leaves meanwhile aborts it."""
        gen = self.stream_outputs(m, record(request), *job)
        first = asyncio.ensure_future(anext(gen))
        watcher = asyncio.create_task(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({first, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if first not in done:
            first.cancel()
            with contextlib.suppress(BaseException):
                await first
            raise APIError(499, "client disconnected")
        head = first.result()

        async def rest():
            try:
                yield head
                async for out in gen:
                    yield out
            finally:  # closed early (a client that left): abort now, not whenever the garbage collector runs
                await gen.aclose()
        return rest()

    async def collect(self, m, request: Request, jobs: list[Job]) -> list[dict[int, dict]]:
        """Run several requests to completion, aborting all of them if the client disconnects."""
        rec = record(request)

        async def one(job):
            final: dict[int, dict] = {}
            prompt_lps = None
            async for out in self.stream_outputs(m, rec, *job):
                for c in out.outputs:
                    acc = final.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": [], "finish": None,
                                                     "stop_reason": None})
                    acc["text"] += c.text
                    acc["token_ids"] += c.token_ids
                    acc["logprobs"] += c.logprobs or []
                    acc["finish"], acc["stop_reason"] = c.finish_reason or acc["finish"], c.stop_reason
                if out.prompt_logprobs is not None:
                    prompt_lps = out.prompt_logprobs
            for acc in final.values():  # the prompt's, which one output carries, belong to every sample
                if prompt_lps is not None:
                    acc["prompt_logprobs"] = prompt_lps
            return final

        tasks = [asyncio.create_task(one(j)) for j in jobs]
        watcher = asyncio.create_task(wait_disconnect(request))
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    raise APIError(499, "client disconnected")  # the finally below aborts the requests
                pending.discard(watcher)
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()
            return [t.result() for t in tasks]
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()


async def pump(index: int, outputs: AsyncIterator, into: asyncio.Queue) -> None:
    """Feed (index, output) pairs into a queue shared by several streams; then (index, None), or
    (index, exception) if the stream failed."""
    try:
        async for out in outputs:
            into.put_nowait((index, out))
    except Exception as e:
        into.put_nowait((index, e))
        return
    into.put_nowait((index, None))


async def cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel tasks and wait for them, so that their streams' cleanup (aborts in the engine) has run."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


async def wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)
