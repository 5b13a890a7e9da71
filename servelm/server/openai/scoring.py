"""Scores, reranking and classification over the embedding model's process, as vLLM serves them.

POST /score (and /v1/score) scores text pairs; POST /rerank (and /v1/rerank, /v2/rerank: Jina's and Cohere's
shape) orders documents by their score with a query. A cross-encoder (a `*ForSequenceClassification` model with
one output, such as ms-marco-MiniLM or bge-reranker) reads each pair together and scores it with its logit through
the activation its config names (runtimes/encoder_runner.py's model_activation, as vLLM's); an embedding model (a
bi-encoder) scores the cosine similarity of the two texts' vectors.
POST /classify gives each text's label and per-label probabilities from a sequence classifier.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import FastAPI, Request

from servelm.runtimes.encoder_runner import activate, cosine
from servelm.server.common import Api
from servelm.server.openai import protocol as p
from servelm.server.openai.embeddings import _embed, _embedder, pooled
from servelm.server.openai.protocol import APIError


async def _scores(api: Api, model, one: list[str], two: list[str], req):
    """(scores of the pairs, tokens read): a cross-encoder reads each pair once; an embedding model embeds each
    distinct side once, in one batch. `req` has the request's truncation and use_activation."""
    truncate, side = req.truncate_prompt_tokens, req.side
    firsts = one * len(two) if len(one) == 1 else one
    if model.task == "classify":
        logits, tokens = await pooled(api, firsts, lambda: model.classify(firsts, two, truncate, side))
        logits = np.asarray(logits)
        if logits.shape[1] != 1:
            raise APIError(400, f"this classifier has {logits.shape[1]} labels; scores need a cross-encoder with "
                                "one output (POST /classify gives each label's probability)", "model",
                           "wrong_model_task")
        return activate(logits, model.activation, req.use_activation)[:, 0], tokens
    vectors, tokens = await _embed(api, model, one + two, truncate, side)
    vectors = np.asarray(vectors)
    first, second = vectors[:len(one)], vectors[len(one):]
    if len(one) == 1:
        first = np.repeat(first, len(two), axis=0)
    return cosine(first, second), tokens


def add_routes(app: FastAPI, api: Api) -> None:
    async def score(req: p.ScoreRequest, request: Request):
        one, two = req.pairs()
        model, name = await _embedder(api, request, req.model)
        scores, tokens = await _scores(api, model, one, two, req)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(req: p.RerankRequest, request: Request):
        docs = req.docs
        model, name = await _embedder(api, request, req.model)
        scores, tokens = await _scores(api, model, [req.query], docs, req)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])  # stable: equal scores keep their order
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for i in order[:req.top_n or len(docs)]]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def classify(req: p.ClassifyRequest, request: Request):
        texts = req.inputs
        model, name = await _embedder(api, request, req.model)
        logits, tokens = await pooled(api, texts, lambda: model.classify(texts, None, req.truncate_prompt_tokens,
                                                                         req.side))
        labels, probs = model.labels, activate(logits, model.activation, req.use_activation)
        data = [{"index": i, "label": labels[int(np.argmax(row))] if int(np.argmax(row)) < len(labels) else None,
                 "probs": row.tolist(), "num_classes": len(row)} for i, row in enumerate(probs)]
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # vLLM's paths; the API documentation lists each operation once, under its first
    for paths, route in ((("/score", "/v1/score"), score), (("/rerank", "/v1/rerank", "/v2/rerank"), rerank),
                         (("/classify",), classify)):
        for path in paths:
            app.post(path, include_in_schema=path == paths[0])(route)
