"""POST /v1/messages (streamed as Anthropic's typed events, or whole) and /v1/messages/count_tokens.

A request becomes the chat completions request it means (messages, tools, sampling fields: protocol.py), so it is
validated, templated, admitted, sampled and parsed for tool calls as chat is; only the answer's shape differs:
content blocks (thinking under a reasoning parser, text, tool_use) and Anthropic's stop reasons."""

from __future__ import annotations

import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.server.anthropic import protocol as a
from servelm.server.common import Api, record
from servelm.server.errors import shaped_errors
from servelm.server.ollama.protocol import validate
from servelm.server.openai.protocol import APIError
from servelm.server.openai.reasoning import ReasoningStream, split
from servelm.server.openai.tools import delta_events, reply_readers, template_tools


async def _body(request: Request, cls):
    try:
        data = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    return validate(cls, data)


def _event(kind: str, payload: dict) -> bytes:
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def _input(arguments: str) -> dict:
    """A tool call's arguments as the input object Anthropic returns (text that is not an object: under "raw")."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"raw": arguments}
    return value if isinstance(value, dict) else {"raw": arguments}


class _Blocks:
    """The streamed reply's content blocks in order, each opened, filled by deltas and stopped."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def _start(self, block: dict) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict) -> list[bytes]:
        return [_event("content_block_delta", {"index": self.index, "delta": delta})]

    def thinking(self, text: str) -> list[bytes]:
        out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def tool_use(self, call_id: str, name: str) -> list[bytes]:
        return self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_input(self, piece: str) -> list[bytes]:
        return self._delta({"type": "input_json_delta", "partial_json": piece})

    def chat_delta(self, d: dict) -> list[bytes]:
        """One chat-completions delta (content, or a tool call's start or arguments) as this reply's events."""
        return delta_events(d, self.text, self.tool_use, self.tool_input)


def add_routes(app: FastAPI, api: Api) -> None:
    async def prompt(request: Request, body) -> tuple:
        """(model, chat request, prompt ids) of a Messages or count_tokens request."""
        conv = body.chat_messages()
        req = body.chat_request(conv) if isinstance(body, a.MessagesRequest) else None
        tf = req if req is not None else body.tool_fields()
        m = await api.resolve(request, body.model, req=req)
        if req is not None:
            api.hold_place(m, request)
        ids = await api.chat_ids(m, req.messages if req is not None else _chat_messages(conv), True,
                                 template_tools(tf))
        return m, req, ids

    @app.post("/v1/messages/count_tokens")
    @shaped_errors
    async def count_tokens(request: Request):
        body = await _body(request, a.CountTokensRequest)
        _, _, ids = await prompt(request, body)
        return {"input_tokens": len(ids)}

    @app.post("/v1/messages")
    @shaped_errors
    async def messages(request: Request):
        body = await _body(request, a.MessagesRequest)
        m, req, ids = await prompt(request, body)
        params = api.params(m, req, len(ids))
        tools, thinking = reply_readers(api.state.config.server.api_config, m, req, params, ids)
        prio = api.admit(m, request, req, [ids], [params])
        api.log_prompt(request, [msg.text() for msg in req.messages])
        rid = f"msg_{uuid.uuid4().hex}"
        job = (rid, ids, params, None, prio, api.cache_salt(request, req))

        def usage(out_tokens: int) -> dict:
            return {"input_tokens": len(ids), "output_tokens": out_tokens,
                    "cache_read_input_tokens": record(request).cached_tokens, "cache_creation_input_tokens": 0}

        if not body.stream:
            [final] = await api.collect(m, request, [job])
            acc = final[0]
            thought, text = split(thinking, acc["text"]) if thinking else (None, acc["text"])
            message, finish = tools.message(text or "", acc["finish"])
            content = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
            if message["content"]:
                content.append({"type": "text", "text": message["content"]})
            content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                         "input": _input(c["function"]["arguments"])} for c in message.get("tool_calls", [])]
            reason, sequence = a.stop_reason(finish, acc["stop_reason"])
            return {"id": rid, "type": "message", "role": "assistant", "model": record(request).model or m.served_name,
                    "content": content, "stop_reason": reason, "stop_sequence": sequence,
                    "usage": usage(len(acc["token_ids"]))}

        head = await api.open(m, request, job)
        model = record(request).model or m.served_name

        async def events():
            yield _event("message_start", {"message": {
                "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage(0)}})
            blocks = _Blocks()
            splitter = ReasoningStream(thinking) if thinking else None
            calls = tools.stream() if tools.active else None
            n_out, finish, stop = 0, None, None
            try:
                async for out in head:
                    c = out.outputs[0]
                    n_out += len(c.token_ids)
                    thought, piece = "", c.text
                    if splitter is not None:
                        thought, piece = splitter.feed(c.text, last=c.finish_reason is not None)
                    if thought and blocks.index < 0 or thought and blocks.open == "thinking":
                        for e in blocks.thinking(thought):
                            yield e
                    if calls is not None:
                        deltas, reported = calls.deltas(piece, c.finish_reason)
                    else:
                        deltas, reported = ([{"content": piece}] if piece else []), c.finish_reason
                    for d in deltas:
                        for e in blocks.chat_delta(d):
                            yield e
                    if c.finish_reason is not None:
                        finish, stop = reported, c.stop_reason
            except APIError as e:
                record(request).error = e.message
                yield _event("error", {"error": {"type": a.error_type(e.status), "message": e.message}})
                return
            for e in blocks.stop():
                yield e
            reason, sequence = a.stop_reason(finish, stop)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": {"output_tokens": n_out}})
            yield _event("message_stop", {})
        return StreamingResponse(events(), media_type="text/event-stream")


def _chat_messages(conv: list[dict]) -> list:
    """Chat messages (the chat route's types) from their dicts, for the chat template."""
    from servelm.server.openai import protocol as p

    roles = {"system": p.SystemMessage, "user": p.UserMessage, "assistant": p.AssistantMessage,
             "tool": p.ToolMessage}
    return [roles[x["role"]](**x) for x in conv]
