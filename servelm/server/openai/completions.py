"""POST /v1/completions: one or several prompts (text or token ids), n samples each, echo, logprobs, streamed
or not."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.outputs import RequestOutput
from servelm.server.common import Api, cancel, pump, record, sse, usage, vocab_size
from servelm.server.openai import protocol as p
from servelm.server.openai.logprobs import completion_logprobs, echo_logprobs, prompt_logprobs, with_echo
from servelm.server.openai.protocol import APIError


async def _prompts(api: Api, m, prompt, special: bool = True) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt in a completions request; `special`: with the tokenizer's special
    tokens added to a text (token ids are taken as they are)."""
    if isinstance(prompt, str):
        return [(prompt, await api.off_loop(lambda: api.encode(m, prompt, add_special_tokens=special)))]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [(None, list(prompt))]
    if isinstance(prompt[0], str):
        return list(zip(prompt, await api.off_loop(lambda: [api.encode(m, s, add_special_tokens=special)
                                                            for s in prompt]), strict=True))
    return [(None, list(ids)) for ids in prompt]


def add_routes(app: FastAPI, api: Api) -> None:
    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, request: Request):
        m = await api.resolve(request, req.model, req=req)
        api.hold_place(m, request)
        tok = m.tokenizer
        prompts = [(text, ids) if len(cut := req.truncate(ids, m.max_model_len)) == len(ids) else (None, cut)
                   for text, ids in await _prompts(api, m, req.prompt, req.add_special_tokens)]  # a cut prompt echoes its kept tokens
        vocab = vocab_size(m)
        for _, ids in prompts:
            if not ids:
                raise APIError(400, "prompt must contain at least one token", "prompt")
            if not all(0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        base, engine_base = api.request_ids(request, "cmpl-", req.request_id)
        created = int(time.time())
        plist = [api.params(m, req, len(ids)) for _, ids in prompts]
        prio = api.admit(m, request, req, [ids for _, ids in prompts], plist)
        api.log_prompt(request, [text if text is not None else ids for text, ids in prompts])
        salt = api.cache_salt(request, req)
        jobs = [(f"{engine_base}-{i}", ids, sp, text, prio, salt)
                for i, ((text, ids), sp) in enumerate(zip(prompts, plist, strict=True))]
        # the text echoed for each prompt (token-id prompts decoded, off the loop)
        echo_texts = await api.off_loop(lambda: [text if text is not None else tok.decode(ids)
                                                 for text, ids in prompts]) if req.echo else None
        model = m.served_name
        n = req.n
        as_ids = req.tokens_as_ids(api.state.config.server.api_config.return_tokens_as_token_ids)

        if req.stream:
            # Every prompt runs at once, as without streaming: the others are submitted before the first
            # one's output is awaited, and their chunks are interleaved as they come.
            merged: asyncio.Queue = asyncio.Queue()
            pumps = [asyncio.create_task(pump(i, api.stream_outputs(m, record(request), *jobs[i]), merged))
                     for i in range(1, len(jobs))]
            try:
                head = await api.open(m, request, jobs[0])
            except BaseException:
                await cancel(pumps)
                raise
            model = record(request).model or model  # the version that took it (a swap may be under way)

            echoed: set[int] = set()
            started: set[int] = set()  # return_token_ids: the choices whose first chunk (with the prompt's ids) went

            def choices_of(i: int, out: RequestOutput) -> list[dict]:
                """The chunk choices one engine output of prompt i makes: the echoed prompt first (with its
                logprobs, which come with the first output), then each sample's new text."""
                ids = jobs[i][1]
                choices = []
                if req.echo and i not in echoed:
                    echoed.add(i)
                    lp = echo_logprobs(tok, ids, out.prompt_logprobs, as_ids=as_ids) if req.logprobs is not None else None
                    choices += [{"index": i * n + j, "text": echo_texts[i],
                                 "logprobs": lp, "finish_reason": None} for j in range(n)]
                for c in out.outputs:
                    if req.max_tokens == 0:  # echo only: the token the engine ran is not part of the answer
                        if c.finish_reason:
                            choices.append({"index": i * n + c.index, "text": "", "logprobs": None,
                                            "finish_reason": "length", "stop_reason": None})
                        continue
                    if c.text or c.finish_reason or (req.return_token_ids and c.token_ids):
                        choice = {"index": i * n + c.index, "text": c.text,
                                  "logprobs": completion_logprobs(c.token_ids, c.logprobs, 0, as_ids) if c.logprobs else None,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        if req.return_token_ids:
                            choice["token_ids"] = c.token_ids
                            if choice["index"] not in started:
                                started.add(choice["index"])
                                choice["prompt_token_ids"] = ids
                        choices.append(choice)
                return choices

            async def events():
                completion_tokens = 0
                prompt_tokens = sum(len(j[1]) for j in jobs)
                final_usage, every = req.stream_usage(api.state.config.server.api_config.enable_force_include_usage)
                pumps.append(asyncio.create_task(pump(0, head, merged)))
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
                        so_far = {"usage": usage(prompt_tokens, completion_tokens, record(request).cached_tokens)} \
                            if every else {}  # continuous_usage_stats
                        for choice in choices_of(i, out):
                            yield sse({"id": base, "object": "text_completion", "created": created,
                                       "model": model, "choices": [choice], **so_far})
                    if final_usage:
                        yield sse({"id": base, "object": "text_completion", "created": created, "model": model,
                                   "choices": [], "usage": usage(prompt_tokens, completion_tokens, record(request).cached_tokens)})
                except APIError as e:
                    record(request).error = e.message
                    yield sse(e.body())
                finally:  # a client gone or an error: the prompts still running are aborted
                    await cancel(pumps)
                yield sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await api.collect(m, request, jobs)
        model = record(request).model or model
        choices, completion_tokens = [], 0
        for i, (final, (_, ids, _, _, _, _)) in enumerate(zip(results, jobs, strict=True)):
            for j in sorted(final):
                acc = final[j]
                if req.max_tokens == 0:  # echo only: the one token the engine ran is not part of the answer
                    acc.update(text="", token_ids=[], logprobs=[], finish="length", stop_reason=None)
                completion_tokens += len(acc["token_ids"])
                prefix = echo_texts[i] if req.echo else ""
                choices.append({"index": i * n + j, "text": prefix + acc["text"],
                                "logprobs": with_echo(tok, ids, acc, req.echo, len(prefix), req.logprobs, as_ids)
                                if req.logprobs is not None else None,
                                "finish_reason": acc["finish"], "stop_reason": acc["stop_reason"],
                                **({"prompt_logprobs": prompt_logprobs(acc.get("prompt_logprobs"))}
                                   if req.prompt_logprobs is not None else {}),
                                **({"prompt_token_ids": ids, "token_ids": acc["token_ids"]}
                                   if req.return_token_ids else {})})
        prompt_tokens = sum(len(j[1]) for j in jobs)
        return {"id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, record(request).cached_tokens)}
