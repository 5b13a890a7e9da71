"""The native endpoints: POST /generate (a prompt) and /chat (messages), with a simpler body and stream."""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.server.common import Api, record, sse, usage
from servelm.server.openai import protocol as p
from servelm.server.openai.protocol import APIError


def _reason(finish: str | None, stop_reason) -> str | None:
    """finish_reason in the native API's words: a stop string is "stop_sequence"."""
    return "stop_sequence" if finish == "stop" and isinstance(stop_reason, str) else finish


async def _native(api: Api, m, request: Request, ids: list[int], body: p.NativeGenerateRequest,
                  prompt: str | None):
    params = api.params(m, body.completion(ids, m.max_model_len), len(ids))
    prio = api.admit(m, request, body, [ids], [params])
    api.log_prompt(request, [prompt if prompt is not None else ids])
    rid = f"gen-{uuid.uuid4().hex}"
    job = (rid, ids, params, prompt, prio, api.cache_salt(request, body))

    if body.stream:
        head = await api.open(m, request, job)

        async def events():
            position = -1  # index: the position in the output of the event's last token
            try:
                async for out in head:
                    c = out.outputs[0]
                    position += len(c.token_ids)
                    if c.text or c.finish_reason:
                        yield sse({"token": c.text, "index": position,
                                   "finish_reason": _reason(c.finish_reason, c.stop_reason)})
            except APIError as e:
                record(request).error = e.message
                yield sse(e.body())
        return StreamingResponse(events(), media_type="text/event-stream")
    [final] = await api.collect(m, request, [job])
    acc = final[0]
    return {"id": rid, "text": acc["text"], "finish_reason": _reason(acc["finish"], acc["stop_reason"]),
            "usage": usage(len(ids), len(acc["token_ids"]), record(request).cached_tokens)}


def add_routes(app: FastAPI, api: Api) -> None:
    @app.post("/generate")
    async def native_generate(body: p.NativeGenerateRequest, request: Request):
        m = await api.resolve(request, body.model)
        api.hold_place(m, request)
        return await _native(api, m, request, await api.off_loop(api.encode, m, body.prompt), body, body.prompt)

    @app.post("/chat")
    async def native_chat(body: p.NativeChatRequest, request: Request):
        m = await api.resolve(request, body.model)
        api.hold_place(m, request)
        return await _native(api, m, request, await api.chat_ids(m, body.messages), body, None)
