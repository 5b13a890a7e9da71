"""Ollama's API: POST /api/generate, /api/chat (NDJSON streams), /api/embed, /api/embeddings, /api/show and
GET /api/tags, /api/ps, /api/version, so Ollama's clients and UIs work against servelm unchanged. A pull of a
model the server serves succeeds at once (there is nothing to fetch); the rest of its model management (pulls of
other models, push, create, copy, delete, blobs) answers 501, saying where servelm's models come from.

Generation goes through the same `Api` machinery as the OpenAI routes (model resolution, admission, metrics,
client-disconnect aborts), `format` through the same grammars as response_format, and `tools` through the same
chat template arguments and tool-call parsers as tool_choice auto; only the request and response shapes are
Ollama's (a tool call: `message.tool_calls: [{"function": {"name": ..., "arguments": {...}}}]`). Errors are Ollama's shape,
{"error": "message"}, with the same HTTP status as the OpenAI routes would give (a failure after the stream
began is a last {"error": ...} line, as Ollama sends it). The routes stay out of /openapi.json, whose error
schema is OpenAI's: Ollama's own API reference documents them.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.control.types import Kind
from servelm.server.common import Api, record
from servelm.server.errors import shaped_errors
from servelm.server.ollama import protocol as o
from servelm.server.openai import protocol as p
from servelm.server.openai.embeddings import _embed, _embedder
from servelm.server.openai.logprobs import chat_logprobs
from servelm.server.openai.protocol import APIError
from servelm.server.openai.reasoning import ReasoningStream, fit_params, split
from servelm.server.openai.tool_parsers import ToolCall, ToolStream, parse, tool_schemas
from servelm.server.openai.tools import choose_parser
from servelm.version import __version__

NDJSON = "application/x-ndjson"


def _now() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(a: float | None, b: float | None) -> int:
    return int((b - a) * 1e9) if a is not None and b is not None and b >= a else 0


async def _body(request: Request, cls):
    try:
        data = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    return o.validate(cls, data)


async def _resolve(api: Api, request: Request, model: str | None, kind: Kind = Kind.GENERATE, req=None):
    """The model a request names; Ollama's clients add ':latest' to a bare name, which servelm's names lack."""
    try:
        return await api.resolve(request, model, kind, req=req)
    except APIError as e:
        if e.status != 404 or not model or not model.endswith(":latest"):
            raise
        return await api.resolve(request, model.removesuffix(":latest"), kind, req=req)


def _done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"


class _Reply:
    """How a generation's text becomes Ollama's payloads: {"response": text} (generate) or {"message": {...}}
    (chat), with the reasoning as `thinking` where a reasoning parser splits it off."""

    def __init__(self, chat: bool, thinking: str | None = None) -> None:
        self.chat, self.thinking = chat, thinking
        self.splitter = ReasoningStream(thinking) if thinking else None

    def payload(self, text: str, calls: list[ToolCall] | None = None, thought: str | None = None) -> dict:
        extra = {"thinking": thought} if thought else {}
        if not self.chat:
            return {"response": text, **extra}
        message = {"role": "assistant", "content": text, **extra}
        if calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                     for c in calls]
        return {"message": message}

    def chunks(self, text: str, finish: str | None) -> list[dict]:
        """The payloads of the streamed lines for new text (and, with finish, the end), before the last line."""
        thought, text = self._split(text, finish)
        return ([self.payload("", thought=thought)] if thought else []) + self._content_chunks(text, finish)

    def _content_chunks(self, text: str, finish: str | None) -> list[dict]:
        return [self.payload(text)] if text else []

    def _split(self, text: str, finish: str | None) -> tuple[str, str]:
        """(reasoning, content) of a streamed piece of text."""
        if self.splitter is None:
            return "", text
        return self.splitter.feed(text, last=finish is not None)

    def whole(self, text: str, finish: str | None) -> dict:
        thought, text = split(self.thinking, text) if self.thinking else (None, text)
        return self._whole(text or "", finish, thought)

    def _whole(self, text: str, finish: str | None, thought: str | None) -> dict:
        return self.payload(text, thought=thought)


class _ToolReply(_Reply):
    """Chat with tools on offer: calls in the reply (in the format `parser` reads) become message.tool_calls,
    streamed as soon as each is complete; a reply cut short by num_predict stays text."""

    def __init__(self, parser: str, tools: list[dict], thinking: str | None = None) -> None:
        super().__init__(chat=True, thinking=thinking)
        self.schemas = tool_schemas(tools)
        self.parser, self.stream = parser, ToolStream(parser, self.schemas)

    def _content_chunks(self, text: str, finish: str | None) -> list[dict]:
        out = []
        content, calls = self.stream.feed(text) if text else ("", [])
        if content or calls:
            out.append(self.payload(content, calls))
        if finish is not None:
            if finish == "length":
                content, calls, self.stream.pending = self.stream.pending, [], ""
            else:
                content, calls = self.stream.finish()
            if content or calls:
                out.append(self.payload(content, calls))
        return out

    def _whole(self, text: str, finish: str | None, thought: str | None) -> dict:
        if finish == "length":
            return self.payload(text, thought=thought)
        content, calls = parse(self.parser, text, self.schemas)
        return self.payload(content or "" if calls else text, calls, thought)


async def _run(api: Api, m, request: Request, body, ids: list[int], prompt: str | None, reply: _Reply,
               extra_final):
    """Run one generation; `reply` shapes its text, `extra_final(output_ids)` adds to the final line."""
    opts = o.Options.parse(body.options)
    params = api.params(m, opts, len(ids))
    params.structured_outputs = body.structured()
    k = body.logprobs_k()
    if k is not None:
        api.check_logprobs(m, "top_logprobs", k)
        params.logprobs = k
    if reply.thinking:
        fit_params(reply.thinking, params, m.tokenizer, ids)
    if isinstance(reply, _ToolReply) and reply.parser == "mistral":
        params.skip_special_tokens = False  # [TOOL_CALLS] is a special token: the parser must see it
    prio = api.admit(m, request, body, [ids], [params])
    api.log_prompt(request, [prompt if prompt is not None else ids])
    rec = record(request)
    job = (f"ollama-{uuid.uuid4().hex}", ids, params, prompt, prio, api.cache_salt(request, body))
    model = m.served_name if body.model is None else body.model  # Ollama echoes the name asked for

    def final(finish, out_ids: list[int]) -> dict:
        end = time.monotonic()
        return {"model": model, "created_at": _now(), **reply.payload(""), "done": True,
                "done_reason": _done_reason(finish),
                **extra_final(out_ids), "total_duration": _ns(rec.start, end),
                "load_duration": int((rec.load_wait_s or 0) * 1e9), "prompt_eval_count": len(ids),
                "prompt_eval_duration": _ns(rec.submitted, rec.first_token), "eval_count": len(out_ids),
                "eval_duration": _ns(rec.first_token, rec.last_token)}

    if body.stream:
        head = await api.open(m, request, job)

        async def lines():
            out_ids: list[int] = []
            finish = None
            try:
                async for out in head:
                    c = out.outputs[0]
                    out_ids += c.token_ids
                    finish = c.finish_reason or finish
                    payloads = reply.chunks(c.text, c.finish_reason)
                    if k is not None and c.token_ids:  # the new tokens' logprobs ride on their first line
                        payloads = payloads or [reply.payload("")]
                        payloads[0] = {**payloads[0], "logprobs": _logprobs(c.token_ids, c.logprobs, k)}
                    for payload in payloads:
                        yield _line({"model": model, "created_at": _now(), **payload, "done": False})
                yield _line(final(finish, out_ids))
            except APIError as e:
                rec.error = e.message
                yield _line({"error": e.message})
        return StreamingResponse(lines(), media_type=NDJSON)
    [res] = await api.collect(m, request, [job])
    acc = res[0]
    lps = {"logprobs": _logprobs(acc["token_ids"], acc["logprobs"], k)} if k is not None else {}
    return {**final(acc["finish"], acc["token_ids"]), **reply.whole(acc["text"], acc["finish"]), **lps}


def _logprobs(token_ids: list[int], entries: list | None, k: int) -> list[dict]:
    """Ollama's logprobs: per token {token, logprob, bytes, top_logprobs: the k most likely}, as OpenAI's chat
    gives them."""
    return chat_logprobs(token_ids, entries or [], k)["content"]


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _loaded(model: str | None, unloads: bool = False) -> dict:
    """Ollama's answer to a request with no prompt or messages: the model is loaded, or (`unloads`: keep_alive 0
    for a model loaded on demand, what `ollama stop` sends) it is being unloaded."""
    return {"model": model, "created_at": _now(), "response": "", "done": True,
            "done_reason": "unload" if unloads else "load"}


def _keep_alive(m, keep_alive) -> float | None:
    """Ollama's keep_alive for the model serving the request: from now on it stays loaded that long once idle
    (0: it is unloaded as soon as it is idle; negative: kept). servelm honours it for a model that expires, one
    loaded on demand; the server's own model and deployments an operator keeps stay loaded whatever a client
    says. Returns the seconds where it applied, else None (a value that is no duration is a 400 either way)."""
    seconds = o.keep_alive_seconds(keep_alive)
    deployment = getattr(m, "deployment", None)
    if seconds is None or deployment is None or getattr(deployment, "keep_alive_s", None) is None:
        return None
    deployment.keep_alive_s = seconds
    return seconds


def _expires_at(m) -> str:
    """/api/ps's expires_at: when a model loaded on demand unloads if it stays idle (RFC 3339, UTC); Ollama's
    zero time for a model that does not expire."""
    keep, last = getattr(m, "keep_alive_s", None), getattr(m, "last_used", None)
    if keep is None or last is None:
        return "0001-01-01T00:00:00Z"
    left = max(0.0, keep - (time.monotonic() - last))
    return datetime.fromtimestamp(time.time() + left, timezone.utc).isoformat().replace("+00:00", "Z")


def _parameters(m) -> str:
    """Ollama's `parameters` of /api/show (its Modelfile's PARAMETER lines, "name value" per line): the model's
    sampling defaults from its generation config, under Ollama's option names."""
    defaults = getattr(getattr(m, "info", None), "sampling_defaults", None) or {}
    return "\n".join(f"{o.OPTION_NAMES.get(k, k)} {v}" for k, v in defaults.items())


def _details(m) -> dict:
    """Ollama's model details from what the engine reported when it became ready (empty for an embedding
    model or an engine not ready yet)."""
    info = getattr(m, "info", None)
    arch = getattr(info, "architecture", "")
    if not arch:
        return {"parent_model": "", "format": "servelm", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    family = arch.removesuffix("ForCausalLM").lower()  # LlamaForCausalLM -> llama, as Ollama names families
    n = info.num_params
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n else ""
    quant = info.quantization if info.quantization not in ("", "none") else \
        {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(info.dtype, info.dtype.upper())
    return {"parent_model": "", "format": "servelm", "family": family, "families": [family],
            "parameter_size": size, "quantization_level": quant.upper()}


MANAGED_ELSEWHERE = (
    "servelm does not pull, push, create, copy or delete models over the Ollama API: it serves the models it was "
    "started with (download one with `servelm pull hf.co/ORG/NAME:QUANT`, then `servelm serve hf.co/ORG/NAME:QUANT`) "
    "and the versions of its model registry (POST /admin/models with the admin key)")


@shaped_errors
async def _manage_models(request: Request):
    raise APIError(501, MANAGED_ELSEWHERE, code="not_implemented")


def add_routes(app: FastAPI, api: Api) -> None:
    state = api.state
    parsers = state.config.server.api_config  # tool_call_parser, reasoning_parser

    @app.post("/api/generate", include_in_schema=False)
    @shaped_errors
    async def generate(request: Request):
        body = await _body(request, o.GenerateRequest)
        body.refuse_unsupported()
        thinking = body.thinking(parsers.reasoning_parser)
        m = await _resolve(api, request, body.model, req=body)
        kept = _keep_alive(m, body.keep_alive)
        if not body.prompt and not body.context:
            return _loaded(body.model or m.served_name, unloads=kept == 0)
        api.hold_place(m, request)
        prompt = body.prompt or ""
        if body.raw or getattr(m.tokenizer, "chat_template", None) is None:
            text = (body.system + "\n\n" if body.system and not body.raw else "") + prompt
            ids = await api.off_loop(lambda: api.encode(m, text, add_special_tokens=not body.context))
        else:  # Ollama puts the prompt (and system) through the model's template, as a user turn
            conv = ([p.SystemMessage(role="system", content=body.system)] if body.system else []) + \
                [p.UserMessage(role="user", content=prompt)]
            ids = await api.chat_ids(m, conv, **body.template_kwargs(m.tokenizer))
        ids = list(body.context or []) + ids
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return await _run(api, m, request, body, ids, None, _Reply(chat=False, thinking=thinking),
                          lambda out_ids: {"context": ids + out_ids})

    @app.post("/api/chat", include_in_schema=False)
    @shaped_errors
    async def chat(request: Request):
        body = await _body(request, o.ChatRequest)
        body.refuse_unsupported()
        thinking = body.thinking(parsers.reasoning_parser)
        m = await _resolve(api, request, body.model, req=body)
        kept = _keep_alive(m, body.keep_alive)
        if not body.messages:
            done = _loaded(body.model or m.served_name, unloads=kept == 0)
            del done["response"]
            return {**done, "message": {"role": "assistant", "content": ""}}
        api.hold_place(m, request)
        msgs = [x.to_chat(i) for i, x in enumerate(body.messages)]
        tools = body.template_tools()
        ids = await api.chat_ids(m, msgs, tools=tools, **body.template_kwargs(m.tokenizer))
        reply = _ToolReply(choose_parser(parsers.tool_call_parser, getattr(m.tokenizer, "chat_template", None)),
                           tools, thinking) if tools else _Reply(chat=True, thinking=thinking)
        return await _run(api, m, request, body, ids, None, reply, lambda _: {})

    @app.post("/api/embed", include_in_schema=False)
    @shaped_errors
    async def embed(request: Request):
        body = await _body(request, o.EmbedRequest)
        start = time.monotonic()
        embedder, name = await _embedder(api, request, _embed_model(body.model))
        _keep_alive(embedder, body.keep_alive)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        vectors, tokens = await _embed(api, embedder, inputs, dimensions=body.dimensions,
                                       side="right" if body.truncate else "none")  # false: too long is an error
        return {"model": body.model or name, "embeddings": [v.tolist() for v in vectors],
                "total_duration": _ns(start, time.monotonic()), "load_duration": 0, "prompt_eval_count": tokens}

    @app.post("/api/embeddings", include_in_schema=False)
    @shaped_errors
    async def embeddings(request: Request):
        body = await _body(request, o.LegacyEmbeddingsRequest)
        embedder, _ = await _embedder(api, request, _embed_model(body.model))
        _keep_alive(embedder, body.keep_alive)
        vectors, _ = await _embed(api, embedder, [body.prompt])
        return {"embedding": vectors[0].tolist()}

    def _embed_model(model: str | None) -> str | None:
        if model and model.endswith(":latest") and model.removesuffix(":latest") == state.embed_model_name:
            return state.embed_model_name
        return model

    def entries() -> list[tuple[str, object, bool]]:
        """(name, model, is embedding) of every model the server answers for."""
        out = [(m.served_name, m, False) for m in state.models]
        if state.embedder is not None:
            out.append((state.embed_model_name, state.embedder, True))
        out += [(m.served_name, m, True) for m in state.models.deployed(Kind.EMBED)]
        return out

    def tag(name: str, m) -> dict:
        return {"name": name, "model": name, "modified_at": _now(), "size": 0,
                "digest": uuid.uuid5(uuid.NAMESPACE_URL, "servelm:" + name).hex, "details": _details(m)}

    @app.get("/api/tags", include_in_schema=False)
    async def tags():
        return {"models": [tag(n, m) for n, m, _ in entries()]}

    @app.get("/api/ps", include_in_schema=False)
    async def ps():
        # servelm's own models stay loaded for the server's life; on-demand ones until idle for their keep_alive
        return {"models": [{**tag(n, m), "expires_at": _expires_at(m), "size_vram": 0,
                            "context_length": getattr(m, "max_model_len", 0) if not emb else 0}
                           for n, m, emb in entries()]}

    def find(name: str) -> tuple[object, bool] | None:
        """(model, is embedding) the server answers `name` with (Ollama's ":latest" tag dropped), or None."""
        found = {n: (m, emb) for n, m, emb in entries()}
        return found.get(name) or found.get(name.removesuffix(":latest"))

    @app.post("/api/pull", include_in_schema=False)
    @shaped_errors
    async def pull(request: Request):
        """Ollama's pull of a model the server already serves: nothing to fetch, so its stream ends in
        "success" at once, as Ollama's does for a model that is up to date (scripts and UIs pull before they
        run). Any other model is a 501 saying where servelm's models come from."""
        body = await _body(request, o.PullRequest)
        name = body.model or body.name
        if not name:
            raise APIError(400, "model is required", "model")
        if find(name) is None:
            raise APIError(501, MANAGED_ELSEWHERE, code="not_implemented")
        statuses = [{"status": "pulling manifest"}, {"status": "success"}]
        if not body.stream:
            return statuses[-1]
        return StreamingResponse((json.dumps(x) + "\n" for x in statuses), media_type=NDJSON)

    # The rest of Ollama's model management: servelm's models come from its start (MODEL, models:), the Hugging
    # Face cache (`servelm pull`) and the governed registry (/admin/models), not from clients; a 501 says so,
    # where a 404 would read as "that model does not exist".
    for path, methods in (("/api/push", ["POST"]), ("/api/create", ["POST"]),
                          ("/api/copy", ["POST"]), ("/api/delete", ["DELETE"]),
                          ("/api/blobs/{digest}", ["HEAD", "POST"])):
        app.add_api_route(path, _manage_models, methods=methods, include_in_schema=False)

    @app.get("/api/version", include_in_schema=False)
    async def version():
        return {"version": __version__}

    @app.post("/api/show", include_in_schema=False)
    @shaped_errors
    async def show(request: Request):
        body = await _body(request, o.ShowRequest)
        name = body.model or body.name
        if not name:
            raise APIError(400, "model is required", "model")
        found = find(name)
        if found is None:
            raise APIError(404, f"model {name!r} not found", "model", "model_not_found")
        m, emb = found
        template = "" if emb else (getattr(m.tokenizer, "chat_template", None) or "")
        details = _details(m)
        # GGUF's keys, as Ollama gives them: clients (Continue, LiteLLM) read the context length from
        # model_info[general.architecture + ".context_length"]
        arch = "bert" if emb else details["family"] or "servelm"
        context = 0 if emb else getattr(m, "max_model_len", 0)
        info = {"general.architecture": arch, f"{arch}.context_length": context, "servelm.context_length": context}
        params = getattr(getattr(m, "info", None), "num_params", 0)
        if params:
            info["general.parameter_count"] = params
        return {"modelfile": "", "parameters": _parameters(m), "template": template, "details": details,
                "model_info": info, "capabilities": ["embedding"] if emb else ["completion"],
                "modified_at": _now()}
