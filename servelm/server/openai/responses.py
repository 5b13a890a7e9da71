"""OpenAI's Responses API: POST /v1/responses (text and function calls in and out, streamed as typed events or
not), with stored responses that a later request continues by `previous_response_id`; GET and DELETE
/v1/responses/{id}.

Generation is the chat route's: the conversation goes through the model's chat template and the shared `Api`
machinery (admission, metrics, client-disconnect aborts). Stored responses live in this process's memory, or in
Redis shared by the server's replicas (response_store.py).
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.server.common import Api, record
from servelm.server.openai import protocol as p
from servelm.server.openai import responses_protocol as r
from servelm.server.openai.protocol import APIError
from servelm.server.openai.reasoning import ReasoningStream, effort_kwargs, split
from servelm.server.openai.response_store import Stored, store_for
from servelm.server.openai.tools import delta_events, reply_readers, template_tools

_ROLES = {"system": p.SystemMessage, "developer": p.DeveloperMessage, "user": p.UserMessage,
          "assistant": p.AssistantMessage, "tool": p.ToolMessage}


def _event(seq: list[int], kind: str, payload: dict) -> bytes:
    """One server-sent event of the Responses stream: its type both as the SSE event name and in the data."""
    seq[0] += 1
    data = json.dumps({"type": kind, "sequence_number": seq[0], **payload}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class _Items:
    """A response's output items in order (a reasoning item, the message, function calls), each opened and
    closed with its typed events when streaming; `output` is what the response object lists."""

    def __init__(self, seq: list[int] | None = None) -> None:
        self.seq = seq  # None: not streamed, no events
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.thought: str | None = None
        self.text: str | None = None  # all the reply's text (None: none yet)
        self._piece = ""  # the open message item's text
        self.calls: list[dict] = []

    def _event(self, kind: str, payload: dict) -> list[bytes]:
        return [] if self.seq is None else [_event(self.seq, kind, payload)]

    def _start(self, item: dict) -> list[bytes]:
        out = self.close()
        self.open = item
        return out + self._event("response.output_item.added", {"output_index": len(self.output), "item": item})

    def close(self) -> list[bytes]:
        """The open item's closing events; it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] == "reasoning":
            done = r.reasoning_item(item["id"], self.thought, "completed")
            out = self._event("response.reasoning_text.done", {**at, "content_index": 0, "text": self.thought})
        elif item["type"] == "message":
            done = r.message_item(item["id"], self._piece, "completed")
            out = self._event("response.output_text.done", {**at, "content_index": 0, "text": self._piece,
                                                            "logprobs": []}) + \
                self._event("response.content_part.done", {**at, "content_index": 0, "part": done["content"][0]})
        else:
            done = {**item, "status": "completed"}
            self.calls.append(done)
            out = self._event("response.function_call_arguments.done", {**at, "name": item["name"],
                                                                        "arguments": item["arguments"]})
        self.output.append(done)
        return out + self._event("response.output_item.done", {"output_index": at["output_index"], "item": done})

    def reasoning(self, delta: str) -> list[bytes]:
        out = []
        if self.thought is None:
            self.thought = ""
            out = self._start(r.reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress"))
        self.thought += delta
        return out + self._event("response.reasoning_text.delta", {
            "item_id": self.open["id"], "output_index": len(self.output), "content_index": 0, "delta": delta})

    def text_delta(self, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            self.text, self._piece = self.text or "", ""
            out = self._start(r.message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress"))
            out += self._event("response.content_part.added", {
                "item_id": self.open["id"], "output_index": len(self.output), "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        self.text += delta
        self._piece += delta
        if not delta:
            return out
        return out + self._event("response.output_text.delta", {
            "item_id": self.open["id"], "output_index": len(self.output), "content_index": 0, "delta": delta,
            "logprobs": []})

    def call(self, call_id: str, name: str) -> list[bytes]:
        return self._start(r.function_call_item(f"fc_{uuid.uuid4().hex}", call_id, name, "", "in_progress"))

    def arguments(self, delta: str) -> list[bytes]:
        self.open["arguments"] += delta
        return self._event("response.function_call_arguments.delta", {
            "item_id": self.open["id"], "output_index": len(self.output), "delta": delta})

    def delta(self, d: dict) -> list[bytes]:
        """One chat-completions delta (content, or a tool call's start or arguments) as this response's events."""
        return delta_events(d, self.text_delta, self.call, self.arguments)

    def finish(self) -> list[bytes]:
        """Close the last item; a reply with neither text nor calls still answers an (empty) message."""
        out = self.close()
        if self.text is None and not self.calls:
            out += self.text_delta("") + self.close()
        return out

    def message(self) -> dict:
        """The reply as the assistant message a continued conversation carries (not its reasoning)."""
        msg: dict = {"role": "assistant", "content": self.text}
        if self.calls:
            msg["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        return msg


def add_routes(app: FastAPI, api: Api) -> None:
    store = store_for(api.state.config.server)

    @app.post("/v1/responses")
    async def create_response(body: r.ResponsesRequest, request: Request):
        owner = record(request).key_name
        history = (await store.get(body.previous_response_id, owner, "previous_response_id")).conversation \
            if body.previous_response_id else []
        new = body.messages()
        tool_fields = body.tool_fields()
        m = await api.resolve(request, body.model, req=body)
        api.hold_place(m, request)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        conv = system + history + new
        effort = effort_kwargs(m.tokenizer, body.reasoning.effort if body.reasoning else None, "reasoning.effort")
        ids = await api.chat_ids(m, [_ROLES[x["role"]](**x) for x in conv], tools=template_tools(tool_fields),
                                 **effort)
        params = api.params(m, body, len(ids))
        # the reply's reasoning becomes a reasoning item, its calls function_call items
        tools, thinking = reply_readers(api.state.config.server.api_config, m, tool_fields, params, ids)
        prio = api.admit(m, request, body, [ids], [params])
        api.log_prompt(request, [x["content"] for x in conv])
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        job = (rid, ids, params, None, prio, api.cache_salt(request, body))

        async def finished(items: _Items, out_tokens: int, finish: str | None) -> dict:
            model = record(request).model or m.served_name
            status = "incomplete" if finish == "length" else "completed"
            res = r.response_object(rid, created, model, body, status, items.output,
                                    r.usage(len(ids), out_tokens, record(request).cached_tokens))
            if body.store:  # the conversation goes on from the answer; the reasoning is not sent back
                await store.put(rid, Stored(owner, res, history + new + [items.message()]))
            return res

        if not body.stream:
            [final] = await api.collect(m, request, [job])
            acc, items = final[0], _Items()
            thought, text = split(thinking, acc["text"]) if thinking else (None, acc["text"])
            if thought:
                items.reasoning(thought)
            message, finish = tools.message(text or "", acc["finish"])
            if message["content"] or not message.get("tool_calls"):
                items.text_delta(message["content"] or "")
            for c in message.get("tool_calls", []):
                items.call(c["id"], c["function"]["name"])
                items.arguments(c["function"]["arguments"])
            items.close()
            return await finished(items, len(acc["token_ids"]), acc["finish"])

        head = await api.open(m, request, job)

        async def events():
            seq = [-1]
            start = r.response_object(rid, created, record(request).model or m.served_name, body, "in_progress", [])
            yield _event(seq, "response.created", {"response": start})
            yield _event(seq, "response.in_progress", {"response": start})
            items = _Items(seq)
            splitter = ReasoningStream(thinking) if thinking else None
            calls = tools.stream() if tools.active else None
            n_out, finish = 0, None
            try:
                async for out in head:
                    c = out.outputs[0]
                    n_out += len(c.token_ids)
                    finish = c.finish_reason or finish
                    thought, piece = "", c.text
                    if splitter is not None:
                        thought, piece = splitter.feed(c.text, last=c.finish_reason is not None)
                    if thought and items.text is None and not items.calls:  # reasoning comes before the answer
                        for e in items.reasoning(thought):
                            yield e
                    deltas = calls.deltas(piece, c.finish_reason)[0] if calls is not None else \
                        ([{"content": piece}] if piece else [])
                    for d in deltas:
                        for e in items.delta(d):
                            yield e
            except APIError as e:
                record(request).error = e.message
                failed = r.response_object(rid, created, m.served_name, body, "failed", [],
                                           error={"code": e.code or "server_error", "message": e.message})
                yield _event(seq, "response.failed", {"response": failed})
                return
            for e in items.finish():
                yield e
            res = await finished(items, n_out, finish)
            yield _event(seq, f"response.{res['status']}", {"response": res})
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return (await store.get(response_id, record(request).key_name)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        await store.delete(response_id, record(request).key_name)
        return {"id": response_id, "object": "response", "deleted": True}

