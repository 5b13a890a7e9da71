"""OpenAI's Responses API: POST /v1/responses (text in, text out, streamed as typed events or not), with stored
responses that a later request continues by `previous_response_id`; GET and DELETE /v1/responses/{id}.

Generation is the chat route's: the conversation goes through the model's chat template and the shared `Api`
machinery (admission, metrics, client-disconnect aborts). Stored responses live in this process's memory, at most
`server.responses_store_size` of them (the oldest go first), each visible only to the API key that made it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.server.common import Api, record
from servelm.server.openai import protocol as p
from servelm.server.openai import responses_protocol as r
from servelm.server.openai.protocol import APIError
from servelm.server.openai.reasoning import ReasoningStream, active, split

_ROLES = {"system": p.SystemMessage, "developer": p.DeveloperMessage, "user": p.UserMessage,
          "assistant": p.AssistantMessage}


@dataclass
class Stored:
    owner: str  # the API key's name: only that key reads or continues it
    response: dict
    conversation: list[dict[str, str]]  # its input (with what it continued) and its output, as messages


class ResponseStore:
    """Finished responses by id, the oldest dropped beyond `capacity`. A stored conversation fit the model's
    context, so each entry is bounded by it, and the store by capacity x context."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, item: Stored) -> None:
        if self.capacity < 1:
            return
        self._items[rid] = item
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, owner: str, param: str | None = None) -> Stored:
        item = self._items.get(rid)
        if item is None or item.owner != owner:  # another key's response is as absent as a missing one
            raise APIError(404, f"no stored response with id {rid!r} (responses are kept in memory, at most "
                                f"{self.capacity}, for the API key that made them)", param, "response_not_found")
        return item

    def delete(self, rid: str, owner: str) -> None:
        self.get(rid, owner)
        del self._items[rid]


def _event(seq: list[int], kind: str, payload: dict) -> bytes:
    """One server-sent event of the Responses stream: its type both as the SSE event name and in the data."""
    seq[0] += 1
    data = json.dumps({"type": kind, "sequence_number": seq[0], **payload}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def add_routes(app: FastAPI, api: Api) -> None:
    store = ResponseStore(api.state.config.server.api_config.responses_store_size)

    @app.post("/v1/responses")
    async def create_response(body: r.ResponsesRequest, request: Request):
        owner = record(request).key_name
        history = store.get(body.previous_response_id, owner, "previous_response_id").conversation \
            if body.previous_response_id else []
        new = body.messages()
        m = await api.resolve(request, body.model, req=body)
        api.hold_place(m, request)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        conv = system + history + new
        ids = await api.chat_ids(m, [_ROLES[x["role"]](**x) for x in conv])
        params = api.params(m, body, len(ids))
        prio = api.admit(m, request, body, [ids], [params])
        api.log_prompt(request, [x["content"] for x in conv])
        rid, item_id, rs_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        created = int(time.time())
        job = (rid, ids, params, None, prio, api.cache_salt(request, body))
        # the reply's reasoning becomes a reasoning item
        thinking = active(api.state.config.server.api_config.reasoning_parser)

        def finished(text: str, out_tokens: int, finish: str | None, thought: str | None) -> dict:
            model = record(request).model or m.served_name
            status = "incomplete" if finish == "length" else "completed"
            output = ([r.reasoning_item(rs_id, thought, "completed")] if thought is not None else []) + \
                [r.message_item(item_id, text, "completed")]
            res = r.response_object(rid, created, model, body, status, output,
                                    r.usage(len(ids), out_tokens, record(request).cached_tokens))
            if body.store:  # the conversation goes on from the answer; the reasoning is not sent back
                store.put(rid, Stored(owner, res, history + new + [{"role": "assistant", "content": text}]))
            return res

        if not body.stream:
            [final] = await api.collect(m, request, [job])
            acc = final[0]
            thought, text = split(thinking, acc["text"]) if thinking else (None, acc["text"])
            return finished(text or "", len(acc["token_ids"]), acc["finish"], thought or None)

        head = await api.open(m, request, job)

        async def events():
            seq = [-1]
            where = {"item_id": item_id, "output_index": 0, "content_index": 0}  # the message's place
            in_reasoning = {"item_id": rs_id, "output_index": 0, "content_index": 0}
            start = r.response_object(rid, created, record(request).model or m.served_name, body, "in_progress", [])
            yield _event(seq, "response.created", {"response": start})
            yield _event(seq, "response.in_progress", {"response": start})
            splitter = ReasoningStream(thinking) if thinking else None
            thought: str | None = None  # the reasoning item's text once it is open
            message_open = False

            def open_message():
                """The message item's opening events, after the reasoning item's closing ones if it is open."""
                nonlocal message_open
                message_open, events = True, []
                if thought is not None:
                    events += [_event(seq, "response.reasoning_text.done", {**in_reasoning, "text": thought}),
                               _event(seq, "response.output_item.done",
                                      {"output_index": 0, "item": r.reasoning_item(rs_id, thought, "completed")})]
                    where["output_index"] = 1
                events += [_event(seq, "response.output_item.added", {"output_index": where["output_index"],
                                                                        "item": r.message_item(item_id, "",
                                                                                               "in_progress")}),
                           _event(seq, "response.content_part.added",
                                  {**where, "part": {"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []}})]
                return events

            if splitter is None:  # all content: the message opens at once
                for e in open_message():
                    yield e
            text, n_out, finish = "", 0, None
            try:
                async for out in head:
                    c = out.outputs[0]
                    n_out += len(c.token_ids)
                    finish = c.finish_reason or finish
                    piece_thought, piece = "", c.text
                    if splitter is not None:
                        piece_thought, piece = splitter.feed(c.text, last=c.finish_reason is not None)
                    if piece_thought and not message_open:
                        if thought is None:
                            thought = ""
                            yield _event(seq, "response.output_item.added",
                                         {"output_index": 0, "item": r.reasoning_item(rs_id, "", "in_progress")})
                        thought += piece_thought
                        yield _event(seq, "response.reasoning_text.delta", {**in_reasoning, "delta": piece_thought})
                    if piece:
                        if not message_open:
                            for e in open_message():
                                yield e
                        text += piece
                        yield _event(seq, "response.output_text.delta", {**where, "delta": piece, "logprobs": []})
            except APIError as e:
                record(request).error = e.message
                failed = r.response_object(rid, created, m.served_name, body, "failed", [],
                                           error={"code": e.code or "server_error", "message": e.message})
                yield _event(seq, "response.failed", {"response": failed})
                return
            if not message_open:  # a reply that was all reasoning, or empty: its (empty) answer
                for e in open_message():
                    yield e
            yield _event(seq, "response.output_text.done", {**where, "text": text, "logprobs": []})
            item = r.message_item(item_id, text, "completed")
            yield _event(seq, "response.content_part.done", {**where, "part": item["content"][0]})
            yield _event(seq, "response.output_item.done", {"output_index": where["output_index"], "item": item})
            res = finished(text, n_out, finish, thought)
            yield _event(seq, f"response.{res['status']}", {"response": res})
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return store.get(response_id, record(request).key_name).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        store.delete(response_id, record(request).key_name)
        return {"id": response_id, "object": "response", "deleted": True}

