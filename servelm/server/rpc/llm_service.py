"""servelm.v1.Llm: Generate and Chat (server-streaming), Embed and ListModels over gRPC.

Each call runs the HTTP API's machinery (`servelm.server.common.Api`): the same model resolution, sampling
validation, admission (per-key model access, priorities, load shedding, tokens per minute), metrics and
request logs. A client that cancels a stream, or whose deadline passes, cancels the handler, which aborts the
request in the engine as a disconnecting HTTP client does.
"""

from __future__ import annotations

import asyncio
import uuid

from servelm.server.common import Api
from servelm.server.native.routes import _reason
from servelm.server.openai import protocol as p
from servelm.server.openai.embeddings import _embed, _embedder
from servelm.server.openai.models import model_cards
from servelm.server.rpc.context import Calls, RpcRequest
from servelm.server.rpc.stubs import load

pb, pb_grpc = load("servelm_llm_v1")
SERVICE = "servelm.v1.Llm"


def _body(cls, req, **fields):
    """The native HTTP body model of a gRPC request (its validation, its defaults for unset fields)."""
    # the SamplingOptions fields set (an optional one given, a repeated one not empty), each the native HTTP
    # body's field of the same name
    for f, value in req.sampling.ListFields():
        fields[f.name] = value if isinstance(value, (bool, int, float, str)) else list(value)
    if req.model:
        fields["model"] = req.model
    if req.priority:
        fields["priority"] = req.priority
    return cls(stream=True, **fields)


class LlmService(pb_grpc.LlmServicer):
    def __init__(self, api: Api, calls: Calls) -> None:
        self.api, self.calls = api, calls

    async def Generate(self, request, context):
        async for out in self._stream(request, context, "Generate"):
            yield out

    async def Chat(self, request, context):
        async for out in self._stream(request, context, "Chat"):
            yield out

    async def _stream(self, request, context, what: str):
        api, calls = self.api, self.calls
        req = RpcRequest(context, f"/{SERVICE}/{what}")
        status, error = 499, "client cancelled"
        head = None
        try:
            calls.check(req)
            if what == "Chat":
                msgs = [{"role": m.role, "content": m.content} for m in request.messages]
                body = _body(p.NativeChatRequest, request, messages=msgs)
                m = await api.resolve(req, body.model)
                api.hold_place(m, req)
                ids, prompt = await api.chat_ids(m, body.messages), None
            else:
                body = _body(p.NativeGenerateRequest, request, prompt=request.prompt)
                m = await api.resolve(req, body.model)
                api.hold_place(m, req)
                ids, prompt = await api.off_loop(api.encode, m, body.prompt), body.prompt
            head = await self._start(m, req, ids, body, prompt)
            rid = req.record.request_id
            await context.send_initial_metadata((("x-request-id", rid),))
            position, n_out = -1, 0
            async for out in head:
                c = out.outputs[0]
                position += len(c.token_ids)
                n_out += len(c.token_ids)
                if not (c.text or c.finish_reason):
                    continue
                msg = pb.GenerateResponse(text=c.text, index=max(position, 0), id=rid)
                if c.finish_reason:
                    msg.finish_reason = _reason(c.finish_reason, c.stop_reason)
                    msg.usage.prompt_tokens, msg.usage.completion_tokens = len(ids), n_out
                yield msg
            context.set_trailing_metadata(calls.trailers(req))
            status, error = 200, None
        except asyncio.CancelledError:  # the client cancelled or its deadline passed: the stream's cleanup aborts
            raise
        except Exception as e:
            status = None
            await calls.fail(context, req, e)
        finally:
            if head is not None:  # a cancelled call aborts its request now (a traceback cycle could delay GC)
                await head.aclose()
            if status is not None:
                calls.end(req, status, error)

    async def _start(self, m, req: RpcRequest, ids: list[int], body, prompt: str | None):
        """Validate, admit and start the request; returns its outputs once the first one is there."""
        api = self.api
        params = api.params(m, body.completion(ids, m.max_model_len), len(ids))
        prio = api.admit(m, req, body, [ids], [params])
        api.log_prompt(req, [prompt if prompt is not None else ids])
        job = (f"grpc-{uuid.uuid4().hex}", ids, params, prompt, prio, api.cache_salt(req, body))
        return await api.open(m, req, job)

    async def Embed(self, request, context):
        async with self.calls.unary(context, f"/{SERVICE}/Embed") as req:
            body = p.NativeEmbeddingRequest(model=request.model or None, input=list(request.input))
            embedder, name = await _embedder(self.api, req, body.model)
            vectors, tokens = await _embed(self.api, embedder, body.input)
            req.record.prompt_tokens = tokens
            return pb.EmbedResponse(model=name, prompt_tokens=tokens,
                                    embeddings=[pb.Embedding(values=v.tolist()) for v in vectors])

    async def ListModels(self, request, context):
        async with self.calls.unary(context, f"/{SERVICE}/ListModels"):
            return pb.ListModelsResponse(models=[
                pb.ModelCard(id=c["id"], max_model_len=c.get("max_model_len") or 0,
                             version=str(c.get("version") or "")) for c in model_cards(self.api.state)])
