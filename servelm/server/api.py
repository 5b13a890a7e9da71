"""The OpenAI-compatible HTTP API (FastAPI). It validates, tokenizes, streams; the engine process generates."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.config.settings import ServeConfig
from servelm.outputs import RequestOutput
from servelm.server import protocol as p
from servelm.server.admission import Admission
from servelm.server.auth import KeyStore
from servelm.server.embeddings import EmbedderDown
from servelm.server.errors import install_error_handlers
from servelm.server.metrics import Metrics
from servelm.server.openapi import install_openapi
from servelm.server.protocol import APIError
from servelm.server.telemetry import RequestRecord, Telemetry
from servelm.worker.client import AsyncEngine, EngineDeadError, QueueTimeout, RequestRejected


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    tokenizer: object
    config: ServeConfig
    keys: KeyStore
    metrics: Metrics
    admission: Admission
    telemetry: Telemetry
    embedder: object | None = None
    embed_model_name: str | None = None
    created: int = 0


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def build_app(state: ServerState):
    """The FastAPI app wrapped in the gateway (request ids, body limit, keys, telemetry)."""
    from servelm.server.docs import add_docs_routes
    from servelm.server.gateway import Gateway
    from servelm.server.ops import add_ops_routes

    app = FastAPI(title="servelm", description="OpenAI-compatible LLM server", docs_url=None, redoc_url=None)
    add_docs_routes(app)  # Swagger UI and ReDoc with local assets: they work offline
    app.state.servelm = state
    engine, tok = state.engine, state.tokenizer
    metrics = state.metrics
    # Tokenization, chat templates and long decodes run here, never on the event loop: a long prompt would
    # stall every stream and health check. One thread, because a fast tokenizer's settings are not safe to
    # share between threads (and the tokenizers library releases the GIL while it encodes anyway).
    text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelm-tokenize")

    async def _off_loop(fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(text_pool, fn, *args)

    def _encode(text: str, **kw) -> list[int]:
        return tok(text, **kw).input_ids

    install_error_handlers(app)
    install_openapi(app, lambda: engine.info.vocab_size if engine.info else None, lambda: engine.max_model_len)

    # -- health ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not engine.check_engine():  # the process itself, not the last word from it
            raise APIError(503, "the engine is not ready", code="engine_unavailable")
        return {"status": "ready", "models": _model_ids()}

    # -- models ------------------------------------------------------------------------------------
    def _model_ids() -> list[str]:
        return [state.model_name] + ([state.embed_model_name] if state.embedder else [])

    def _model_card(mid: str) -> dict:
        card = {"id": mid, "object": "model", "created": state.created, "owned_by": "servelm"}
        if mid == state.model_name:
            card["max_model_len"] = engine.max_model_len
        return card

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(m) for m in _model_ids()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in _model_ids():
            raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
        return _model_card(model_id)

    def _check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")

    # -- generation helpers ------------------------------------------------------------------------
    def _params(req, prompt_len: int):
        try:
            default_max = state.admission.default_max_tokens(prompt_len, getattr(req, "n", 1),
                                                             max(1, engine.max_model_len - prompt_len))
            params = req.sampling_params(default_max)
            params.check_vocab(engine.info.vocab_size if engine.info else 1 << 31)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        if prompt_len + (params.max_tokens or 0) > engine.max_model_len:
            raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens; the "
                                f"request has {prompt_len} prompt tokens and max_tokens={params.max_tokens} "
                                f"({prompt_len + params.max_tokens} in total)", "max_tokens", "context_length_exceeded")
        return params

    def _admit(request: Request, req, prompts: list[list[int]], params: list) -> int:
        """Admission control for a generation request; returns its engine priority."""
        rec = _record(request)
        rec.stream = bool(getattr(req, "stream", False))
        rec.prompt_tokens = sum(len(ids) for ids in prompts)
        cost = rec.prompt_tokens + sum((sp.max_tokens or 0) * sp.n for sp in params)
        state.admission.check_work(max(sp.n for sp in params), rec.prompt_tokens, cost)
        return state.admission.admit(rec, state.model_name, cost, getattr(req, "priority", None))

    def _cache_salt(request: Request, req) -> str | None:
        """The prefix-cache namespace of a request: its API key's (under isolation "key") and its own
        cache_salt. The key's part comes first and is fixed-length, so no chosen salt can name another
        key's namespace."""
        parts = []
        key = _record(request).api_key
        if state.config.server.prefix_cache_isolation == "key" and key is not None:
            parts.append("key:" + key.digest.hex())
        if getattr(req, "cache_salt", None):
            parts.append("salt:" + req.cache_salt)
        return "/".join(parts) or None

    async def _stream_outputs(rec: RequestRecord, rid: str, ids: list[int], params, prompt: str | None,
                              priority: int, salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Engine outputs for one request, recorded for metrics, logs and traces; a client that goes away
        aborts it."""
        submitted = time.monotonic()
        rec.submitted = rec.submitted or submitted
        first = last = None
        n_out = 0
        try:
            gen = engine.generate(rid, ids, params, prompt, priority, state.config.admission.queue_timeout_s, salt)
            async for out in gen:
                now = time.monotonic()
                new = sum(len(c.token_ids) for c in out.outputs)
                if new:
                    if last is not None:
                        metrics.itl.observe(now - last)
                    first, last = first or now, now
                    n_out += new
                    rec.first_token = min(rec.first_token or now, now)
                    rec.last_token = now
                    rec.completion_tokens += new
                if rec.queue_time is None and "queue_time" in out.metrics:
                    rec.queue_time = out.metrics["queue_time"]
                if state.telemetry.log_prompts:
                    rec.completion_text = (rec.completion_text or "") + "".join(c.text for c in out.outputs)
                for c in out.outputs:
                    rec.finish_reason = rec.finish_reason or c.finish_reason
                if out.finished:
                    metrics.observe_finished(submitted, first, now, out.metrics.get("queue_time"), len(ids), n_out,
                                             next((c.finish_reason for c in out.outputs), None))
                yield out
        except QueueTimeout as e:
            metrics.timeouts.inc()
            raise APIError(408, str(e), code="queue_timeout") from e
        except RequestRejected as e:
            raise APIError(400, str(e)) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e

    async def _open(request: Request, job) -> AsyncIterator[RequestOutput]:
        """Start a request and wait for its first output before any response bytes, so queue timeouts,
        overload and engine errors get their HTTP status; a client that leaves meanwhile aborts it."""
        gen = _stream_outputs(_record(request), *job)
        first = asyncio.ensure_future(anext(gen))
        watcher = asyncio.create_task(_wait_disconnect(request))
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
            yield head
            async for out in gen:
                yield out
        return rest()

    def _log_prompt(request: Request, prompts: list) -> None:
        if state.telemetry.log_prompts:
            _record(request).prompt_text = json.dumps(prompts if len(prompts) > 1 else prompts[0])

    async def _collect(request: Request, jobs: list[tuple]):
        """Run several requests to completion, aborting all of them if the client disconnects."""
        rec = _record(request)

        async def one(job):
            final: dict[int, dict] = {}
            async for out in _stream_outputs(rec, *job):
                for c in out.outputs:
                    acc = final.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": [], "finish": None,
                                                     "stop_reason": None})
                    acc["text"] += c.text
                    acc["token_ids"] += c.token_ids
                    acc["logprobs"] += c.logprobs or []
                    acc["finish"], acc["stop_reason"] = c.finish_reason or acc["finish"], c.stop_reason
                    if out.prompt_logprobs is not None:
                        acc["prompt_logprobs"] = out.prompt_logprobs
            return final

        tasks = [asyncio.create_task(one(j)) for j in jobs]
        watcher = asyncio.create_task(_wait_disconnect(request))
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

    def _logprobs_chat(token_ids: list[int], entries: list, k: int) -> dict:
        def item(lp) -> dict:
            text = lp.decoded_token or ""
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

        content = []
        for tid, pos in zip(token_ids, entries, strict=False):
            top = sorted(pos.values(), key=lambda v: -v.logprob)[:k]
            content.append({**item(pos[tid]), "top_logprobs": [item(v) for v in top]})
        return {"content": content}

    def _logprobs_completion(token_ids: list[int], entries: list, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, pos in zip(token_ids, entries, strict=False):
            lp = pos[tid]
            tokens.append(lp.decoded_token)
            token_lps.append(lp.logprob)
            tops.append({v.decoded_token: v.logprob for v in pos.values()})
            offsets.append(offset)
            offset += len(lp.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo_logprobs(ids: list[int], entries: list | None) -> dict:
        """The prompt's part of an echoed completion's logprobs: its tokens, their logprobs (None for the
        first, which nothing predicts), the top alternatives and text offsets from 0."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for j, tid in enumerate(ids):
            pos = entries[j] if entries is not None and j < len(entries) else None
            lp = pos[tid] if pos is not None else None
            text = lp.decoded_token if lp is not None else tok.decode([tid])
            tokens.append(text)
            token_lps.append(lp.logprob if lp is not None else None)
            tops.append({v.decoded_token: v.logprob for v in pos.values()} if pos is not None else None)
            offsets.append(offset)
            offset += len(text or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _completion_logprobs(ids: list[int], acc: dict, echo: bool, offset: int) -> dict:
        gen = _logprobs_completion(acc["token_ids"], acc["logprobs"], offset)
        if not echo:
            return gen
        head = _echo_logprobs(ids, acc.get("prompt_logprobs"))
        return {k: head[k] + gen[k] for k in gen}

    # -- completions -------------------------------------------------------------------------------
    async def _completion_prompts(prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            return [(prompt, await _off_loop(_encode, prompt))]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if isinstance(prompt[0], str):
            return list(zip(prompt, await _off_loop(lambda: [_encode(s) for s in prompt]), strict=True))
        return [(None, list(ids)) for ids in prompt]

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, request: Request):
        _check_model(req.model)
        prompts = await _completion_prompts(req.prompt)
        vocab = engine.info.vocab_size if engine.info else len(tok)
        for _, ids in prompts:
            if not ids:
                raise APIError(400, "prompt must contain at least one token", "prompt")
            if not all(0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        base = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        plist = [_params(req, len(ids)) for _, ids in prompts]
        prio = _admit(request, req, [ids for _, ids in prompts], plist)
        _log_prompt(request, [text if text is not None else ids for text, ids in prompts])
        salt = _cache_salt(request, req)
        jobs = [(f"{base}-{i}", ids, sp, text, prio, salt)
                for i, ((text, ids), sp) in enumerate(zip(prompts, plist, strict=True))]
        # the text echoed for each prompt (token-id prompts decoded, off the loop)
        echo_texts = await _off_loop(lambda: [text if text is not None else tok.decode(ids)
                                              for text, ids in prompts]) if req.echo else None
        model = state.model_name
        n = req.n

        if req.stream:
            # Every prompt runs at once, as without streaming: the others are submitted before the first
            # one's output is awaited, and their chunks are interleaved as they come.
            merged: asyncio.Queue = asyncio.Queue()
            pumps = [asyncio.create_task(_pump(i, _stream_outputs(_record(request), *jobs[i]), merged))
                     for i in range(1, len(jobs))]
            try:
                head = await _open(request, jobs[0])
            except BaseException:
                await _cancel(pumps)
                raise

            echoed: set[int] = set()

            def choices_of(i: int, out: RequestOutput) -> list[dict]:
                """The chunk choices one engine output of prompt i makes: the echoed prompt first (with its
                logprobs, which come with the first output), then each sample's new text."""
                ids = jobs[i][1]
                choices = []
                if req.echo and i not in echoed:
                    echoed.add(i)
                    lp = _echo_logprobs(ids, out.prompt_logprobs) if req.logprobs is not None else None
                    choices += [{"index": i * n + j, "text": echo_texts[i],
                                 "logprobs": lp, "finish_reason": None} for j in range(n)]
                for c in out.outputs:
                    if req.max_tokens == 0:  # echo only: the token the engine ran is not part of the answer
                        if c.finish_reason:
                            choices.append({"index": i * n + c.index, "text": "", "logprobs": None,
                                            "finish_reason": "length", "stop_reason": None})
                        continue
                    if c.text or c.finish_reason:
                        choices.append({"index": i * n + c.index, "text": c.text,
                                        "logprobs": _logprobs_completion(c.token_ids, c.logprobs, 0)
                                        if c.logprobs else None,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                return choices

            async def events():
                completion_tokens = 0
                pumps.append(asyncio.create_task(_pump(0, head, merged)))
                try:
                    running = len(jobs)
                    while running:
                        i, out = await merged.get()
                        if out is None:  # prompt i is done
                            running -= 1
                            continue
                        if isinstance(out, BaseException):
                            raise out
                        if req.max_tokens != 0:
                            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                        for choice in choices_of(i, out):
                            yield _sse({"id": base, "object": "text_completion", "created": created,
                                        "model": model, "choices": [choice]})
                    if req.stream_options and req.stream_options.include_usage:
                        prompt_tokens = sum(len(j[1]) for j in jobs)
                        yield _sse({"id": base, "object": "text_completion", "created": created, "model": model,
                                    "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
                except APIError as e:
                    _record(request).error = e.message
                    yield _sse(e.body())
                finally:  # a client gone or an error: the prompts still running are aborted
                    await _cancel(pumps)
                yield _sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await _collect(request, jobs)
        choices, completion_tokens = [], 0
        for i, (final, (_, ids, _, _, _, _)) in enumerate(zip(results, jobs, strict=True)):
            for j in sorted(final):
                acc = final[j]
                if req.max_tokens == 0:  # echo only: the one token the engine ran is not part of the answer
                    acc.update(text="", token_ids=[], logprobs=[], finish="length", stop_reason=None)
                completion_tokens += len(acc["token_ids"])
                prefix = echo_texts[i] if req.echo else ""
                choices.append({"index": i * n + j, "text": prefix + acc["text"],
                                "logprobs": _completion_logprobs(ids, acc, req.echo, len(prefix))
                                if req.logprobs is not None else None,
                                "finish_reason": acc["finish"], "stop_reason": acc["stop_reason"]})
        prompt_tokens = sum(len(j[1]) for j in jobs)
        return {"id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens)}

    # -- chat --------------------------------------------------------------------------------------
    async def _chat_ids(messages: list[p.ChatMessage], add_generation_prompt: bool = True, **kw) -> list[int]:
        if getattr(tok, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        conv = [{"role": msg.role, "content": msg.text()} for msg in messages]

        def render() -> list[int]:
            try:
                text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False,
                                               **kw)
            except Exception as e:  # template errors are the caller's input
                raise APIError(400, f"chat template failed: {e}", "messages") from e
            return _encode(text, add_special_tokens=False)
        return await _off_loop(render)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: p.ChatCompletionRequest, request: Request):
        _check_model(req.model)
        ids = await _chat_ids(req.messages, req.add_generation_prompt, **(req.chat_template_kwargs or {}))
        params = _params(req, len(ids))
        prio = _admit(request, req, [ids], [params])
        _log_prompt(request, [m.text() for m in req.messages])
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created, model = int(time.time()), state.model_name
        job = (rid, ids, params, None, prio, _cache_salt(request, req))

        if req.stream:
            head = await _open(request, job)

            async def events():
                completion_tokens = 0
                try:
                    for j in range(req.n):
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [{"index": j, "delta": {"role": "assistant", "content": "", "refusal": None},
                                                 "logprobs": None, "finish_reason": None}]})
                    async for out in head:
                        for c in out.outputs:
                            completion_tokens += len(c.token_ids)
                            if not (c.text or c.finish_reason):
                                continue
                            delta = {"content": c.text} if c.text else {}
                            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                        "model": model, "choices": [{
                                            "index": c.index, "delta": delta,
                                            "logprobs": _logprobs_chat(c.token_ids, c.logprobs, req.top_logprobs or 0) if c.logprobs else None,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
                    if req.stream_options and req.stream_options.include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [], "usage": _usage(len(ids), completion_tokens)})
                except APIError as e:
                    _record(request).error = e.message
                    yield _sse(e.body())
                yield _sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        [final] = await _collect(request, [job])
        choices, completion_tokens = [], 0
        for j in sorted(final):
            acc = final[j]
            completion_tokens += len(acc["token_ids"])
            choices.append({"index": j, "message": {"role": "assistant", "content": acc["text"], "refusal": None},
                            "logprobs": _logprobs_chat(acc["token_ids"], acc["logprobs"], req.top_logprobs or 0) if req.logprobs else None,
                            "finish_reason": acc["finish"], "stop_reason": acc["stop_reason"]})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": _usage(len(ids), completion_tokens)}

    # -- tokenizer ---------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(req: p.TokenizeRequest):
        _check_model(req.model)
        if req.messages is not None:
            ids = await _chat_ids(req.messages)
        elif req.prompt is not None:
            ids = await _off_loop(lambda: _encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: p.DetokenizeRequest):
        _check_model(req.model)
        vocab = engine.info.vocab_size if engine.info else len(tok)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await _off_loop(tok.decode, req.tokens)}

    # -- native endpoints --------------------------------------------------------------------------
    async def _native(request: Request, ids: list[int], body: p.NativeGenerateRequest, prompt: str | None):
        max_tokens = body.max_tokens
        if "max_tokens" not in body.model_fields_set:  # the default never asks for more than the context holds
            max_tokens = max(1, min(max_tokens, engine.max_model_len - len(ids)))
        creq = p.CompletionRequest(prompt=ids, max_tokens=max_tokens, temperature=body.temperature,
                                   top_p=body.top_p, stop=body.stop_sequences)
        params = _params(creq, len(ids))
        prio = _admit(request, body, [ids], [params])
        _log_prompt(request, [prompt if prompt is not None else ids])
        rid = f"gen-{uuid.uuid4().hex}"
        job = (rid, ids, params, prompt, prio, _cache_salt(request, body))

        def reason(c) -> str | None:
            if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
                return "stop_sequence"
            return c.finish_reason

        if body.stream:
            head = await _open(request, job)

            async def events():
                position = -1  # index: the position in the output of the event's last token
                try:
                    async for out in head:
                        c = out.outputs[0]
                        position += len(c.token_ids)
                        if c.text or c.finish_reason:
                            yield _sse({"token": c.text, "index": position, "finish_reason": reason(c)})
                except APIError as e:
                    _record(request).error = e.message
                    yield _sse(e.body())
            return StreamingResponse(events(), media_type="text/event-stream")
        [final] = await _collect(request, [job])
        acc = final[0]
        return {"id": rid, "text": acc["text"],
                "finish_reason": "stop_sequence" if acc["finish"] == "stop" and isinstance(acc["stop_reason"], str)
                else acc["finish"], "usage": _usage(len(ids), len(acc["token_ids"]))}

    @app.post("/generate")
    async def native_generate(body: p.NativeGenerateRequest, request: Request):
        return await _native(request, await _off_loop(_encode, body.prompt), body, body.prompt)

    @app.post("/chat")
    async def native_chat(body: p.NativeChatRequest, request: Request):
        return await _native(request, await _chat_ids(body.messages), body, None)

    # -- embeddings --------------------------------------------------------------------------------
    async def _embed(inputs: list[str]):
        if state.embedder is None:
            raise APIError(404, "this server has no embedding model", "model", "model_not_found")
        if not inputs or any(not isinstance(s, str) or not s for s in inputs):
            raise APIError(400, "input must be a non-empty string or a list of non-empty strings", "input")
        cap = state.config.admission.max_embedding_inputs
        if len(inputs) > cap:
            raise APIError(400, f"input has {len(inputs)} items, over this server's limit of {cap} per request "
                                "(admission.max_embedding_inputs); split it into several requests", "input",
                           "limit_exceeded")
        try:
            return await state.embedder.embed(inputs)
        except EmbedderDown as e:
            raise APIError(503, str(e), code="embedder_unavailable") from e
        except ValueError as e:
            raise APIError(400, str(e), "input") from e

    @app.post("/v1/embeddings")
    async def embeddings(req: p.EmbeddingRequest):
        if req.model is not None and req.model != state.embed_model_name:
            raise APIError(404, f"model {req.model!r} does not exist or is not an embedding model", "model",
                           "model_not_found")
        inputs = [req.input] if isinstance(req.input, str) else req.input
        vectors, tokens = await _embed(inputs)
        data = []
        for i, v in enumerate(vectors):
            emb = _b64(v) if req.encoding_format == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": state.embed_model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/embeddings")
    async def native_embeddings(req: p.NativeEmbeddingRequest):
        inputs = [req.input] if isinstance(req.input, str) else req.input
        vectors, tokens = await _embed(inputs)
        return {"embeddings": [v.tolist() for v in vectors], "model": state.embed_model_name,
                "usage": {"prompt_tokens": tokens}}

    add_ops_routes(app, state)
    return Gateway(app, state)


def _record(request: Request) -> RequestRecord:
    return request.state.record


def _b64(vec) -> str:
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()


async def _pump(index: int, outputs: AsyncIterator, into: asyncio.Queue) -> None:
    """Feed (index, output) pairs into a queue shared by several streams; then (index, None), or
    (index, exception) if the stream failed."""
    try:
        async for out in outputs:
            into.put_nowait((index, out))
    except Exception as e:
        into.put_nowait((index, e))
        return
    into.put_nowait((index, None))


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel tasks and wait for them, so that their streams' cleanup (aborts in the engine) has run."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)
