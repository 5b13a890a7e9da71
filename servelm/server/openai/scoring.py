"""Scores and reranking over the embedding model, as vLLM serves them for bi-encoders: POST /score (and
/v1/score) gives the cosine similarity of text pairs; POST /rerank (and /v1/rerank, /v2/rerank: Jina's and
Cohere's shape) orders documents by their similarity to a query."""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import FastAPI, Request

from servelm.server.common import Api
from servelm.server.openai import protocol as p
from servelm.server.openai.embeddings import _embed, _embedder


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine similarity of each row of `a` with the same row of `b` (a row of zeros scores 0)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.divide((a * b).sum(axis=1), norms, out=np.zeros(len(a)), where=norms > 0)


async def _scores(api: Api, embedder, one: list[str], two: list[str], truncate: int | None):
    """(scores of the pairs, tokens embedded): each distinct side embedded once, in one batch."""
    vectors, tokens = await _embed(api, embedder, one + two, truncate)
    vectors = np.asarray(vectors)
    first, second = vectors[:len(one)], vectors[len(one):]
    if len(one) == 1:
        first = np.repeat(first, len(two), axis=0)
    return cosine(first, second), tokens


def add_routes(app: FastAPI, api: Api) -> None:
    async def score(req: p.ScoreRequest, request: Request):
        one, two = req.pairs()
        embedder, name = await _embedder(api, request, req.model)
        scores, tokens = await _scores(api, embedder, one, two, req.truncate_prompt_tokens)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(req: p.RerankRequest, request: Request):
        docs = req.docs
        embedder, name = await _embedder(api, request, req.model)
        scores, tokens = await _scores(api, embedder, [req.query], docs, req.truncate_prompt_tokens)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])  # stable: equal scores keep their order
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for i in order[:req.top_n or len(docs)]]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # vLLM's paths; the API documentation lists each operation once, under its first
    for paths, route in ((("/score", "/v1/score"), score), (("/rerank", "/v1/rerank", "/v2/rerank"), rerank)):
        for path in paths:
            app.post(path, include_in_schema=path == paths[0])(route)
