"""POST /tokenize and /detokenize with the model's own tokenizer (and chat template)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from servelm.server.common import Api, vocab_size
from servelm.server.openai import protocol as p
from servelm.server.openai.protocol import APIError


def add_routes(app: FastAPI, api: Api) -> None:
    @app.post("/tokenize")
    async def tokenize(req: p.TokenizeRequest, request: Request):
        m = await api.resolve(request, req.model)
        if req.messages is not None:
            ids = await api.chat_ids(m, req.messages)
        elif req.prompt is not None:
            ids = await api.off_loop(lambda: api.encode(m, req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": m.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: p.DetokenizeRequest, request: Request):
        m = await api.resolve(request, req.model)
        vocab = vocab_size(m)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await api.off_loop(m.tokenizer.decode, req.tokens)}
