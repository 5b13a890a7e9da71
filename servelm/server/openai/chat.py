"""POST /v1/chat/completions: a conversation rendered with the model's chat template, n samples, streamed or
not."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.server.common import Api, record, sse, usage
from servelm.server.openai import protocol as p
from servelm.server.openai.logprobs import chat_logprobs, prompt_logprobs
from servelm.server.openai.protocol import APIError
from servelm.server.openai.reasoning import ReasoningStream, effort_kwargs, split
from servelm.server.openai.tools import reply_readers, template_tools


def add_routes(app: FastAPI, api: Api) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(req: p.ChatCompletionRequest, request: Request):
        m = await api.resolve(request, req.model, req=req)
        api.hold_place(m, request)
        effort = effort_kwargs(m.tokenizer, req.reasoning_effort, "reasoning_effort", req.chat_template)
        ids = req.truncate(await api.chat_ids(m, req.messages, req.add_generation_prompt, template_tools(req),
                                              req.add_special_tokens, **{**req.template_kwargs(), **effort}),
                           m.max_model_len)
        params = api.params(m, req, len(ids))
        api_config = api.state.config.server.api_config
        tools, thinking = reply_readers(api_config, m, req, params, ids)
        show = thinking is not None and req.include_reasoning  # the reasoning the response shows
        prio = api.admit(m, request, req, [ids], [params])
        api.log_prompt(request, [msg.text() for msg in req.messages])
        rid, engine_id = api.request_ids(request, "chatcmpl-", req.request_id)
        created, model = int(time.time()), m.served_name
        job = (engine_id, ids, params, None, prio, api.cache_salt(request, req))
        k = req.top_logprobs or 0
        as_ids = req.tokens_as_ids(api_config.return_tokens_as_token_ids)
        # vLLM's rule: a new turn is the response role's; a continued message keeps the role it has
        role = api_config.response_role if req.add_generation_prompt else req.messages[-1].role
        # vLLM's echo: a reply that continues the last message (its role) carries that message's text first
        echoed = req.messages[-1].text() if req.echo and req.messages[-1].role == role else ""

        if req.stream:
            head = await api.open(m, request, job)
            model = record(request).model or model  # the version that took it (a swap may be under way)

            async def events():
                completion_tokens = 0
                streams = {j: tools.stream() for j in range(req.n)} if tools.active else {}
                splits = {j: ReasoningStream(thinking) for j in range(req.n)} if thinking else {}
                # return_token_ids: each choice's new tokens, sent with its next chunk (text held back keeps them)
                unsent: dict[int, list[int]] = {j: [] for j in range(req.n)}
                final_usage, every = req.stream_usage(api_config.enable_force_include_usage)

                def so_far() -> dict:  # continuous_usage_stats: the usage so far, on every chunk
                    return {"usage": usage(len(ids), completion_tokens, record(request).cached_tokens)} if every \
                        else {}
                try:
                    for j in range(req.n):
                        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                   "choices": [{"index": j, "delta": {"role": role, "content": echoed,
                                                                      "refusal": None},
                                                "logprobs": None, "finish_reason": None}], **so_far(),
                                   **({"prompt_token_ids": ids} if req.return_token_ids and j == 0 else {})})
                    async for out in head:
                        for c in out.outputs:
                            completion_tokens += len(c.token_ids)
                            if req.return_token_ids:
                                unsent[c.index] += c.token_ids
                            if not (c.text or c.finish_reason):
                                continue
                            lp = chat_logprobs(c.token_ids, c.logprobs, k, as_ids) if c.logprobs else None
                            text, thought = c.text, ""
                            if c.index in splits:  # the reasoning first, then the content it is followed by
                                thought, text = splits[c.index].feed(c.text, last=c.finish_reason is not None)
                            if c.index in streams:  # tools on offer: calls become delta.tool_calls
                                deltas, finish = streams[c.index].deltas(text, c.finish_reason)
                            else:
                                deltas, finish = [{"content": text}] if text else [], c.finish_reason
                            if thought and show:
                                deltas.insert(0, {"reasoning": thought, "reasoning_content": thought})
                            if not deltas and finish is None:
                                continue  # all of it held back (a tag that may go on) or hidden
                            if finish is not None and not deltas:
                                deltas = [{}]
                            for i, delta in enumerate(deltas):
                                last = i == len(deltas) - 1
                                choice = {"index": c.index, "delta": delta, "logprobs": lp if last else None,
                                          "finish_reason": finish if last else None,
                                          "stop_reason": c.stop_reason if last else None}
                                if req.return_token_ids and last:
                                    choice["token_ids"], unsent[c.index] = unsent[c.index], []
                                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                           "model": model, "choices": [choice], **so_far()})
                    if final_usage:
                        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                   "choices": [], "usage": usage(len(ids), completion_tokens, record(request).cached_tokens)})
                except APIError as e:
                    record(request).error = e.message
                    yield sse(e.body())
                yield sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        [final] = await api.collect(m, request, [job])
        model = record(request).model or model
        choices, completion_tokens = [], 0
        for j in sorted(final):
            acc = final[j]
            completion_tokens += len(acc["token_ids"])
            thought, text = split(thinking, acc["text"]) if thinking else (None, acc["text"])
            message, finish = tools.message(text or "", acc["finish"])
            message["role"] = role
            if text is None and not message.get("tool_calls"):
                message["content"] = None  # all reasoning (cut short before its end)
            if echoed:
                message["content"] = echoed + (message["content"] or "")
            if show:
                message["reasoning"] = message["reasoning_content"] = thought
            choices.append({"index": j, "message": message,
                            "logprobs": chat_logprobs(acc["token_ids"], acc["logprobs"], k, as_ids) if req.logprobs else None,
                            "finish_reason": finish, "stop_reason": acc["stop_reason"],
                            **({"token_ids": acc["token_ids"]} if req.return_token_ids else {})})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": usage(len(ids), completion_tokens, record(request).cached_tokens)}
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        if req.prompt_logprobs is not None:  # vLLM's place for them: the response, not a choice
            body["prompt_logprobs"] = prompt_logprobs(next(iter(final.values())).get("prompt_logprobs"))
        return body
