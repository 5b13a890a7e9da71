"""POST /v1/embeddings (OpenAI's shape) and /embeddings (native), served by the embedding model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request

from servelm.control.types import Kind
from servelm.runtimes.embedder import BadDimensions, EmbedderDown, WrongTask
from servelm.server.common import Api, b64
from servelm.server.openai import protocol as p
from servelm.server.openai.protocol import APIError


async def _embedder(api: Api, request: Request, model: str | None):
    """(embedder, the name responses carry): the server's embedding model when `model` names it or nothing,
    else a deployed (or on-demand loaded) embedding version."""
    state = api.state
    if model is None or model == state.embed_model_name:
        if state.embedder is None:
            raise APIError(404, "this server has no embedding model", "model", "model_not_found")
        return state.embedder, state.embed_model_name
    m = await api.resolve(request, model, Kind.EMBED)
    return m, m.served_name


async def _embed(api: Api, embedder, inputs: list[str | list[int]], truncate: int | None = None,
                 side: str = "right", dimensions: int | None = None):
    """(vectors, prompt tokens) of the inputs (texts, or token ids taken as they are), after the request's caps
    are checked; `truncate`: each input keeps at most that many tokens, its first ones (`side` "right") or its
    last ones ("left"), or none ("none": an input over the model's limit is a 400); `dimensions`: a Matryoshka
    model's vectors cut to that many values."""
    if truncate is None and dimensions is None and side == "right":
        return await pooled(api, inputs, lambda: embedder.embed(inputs))
    return await pooled(api, inputs, lambda: embedder.embed(inputs, truncate, side, dimensions))


async def pooled(api: Api, inputs: list[str | list[int]], run: Callable[[], Awaitable]):
    """`run()`'s answer for these inputs of the embedding model's routes, after the request's caps are checked,
    with the embedding process's failures as API errors."""
    if not inputs or any(not isinstance(s, (str, list)) or not s for s in inputs):
        raise APIError(400, "input must be a non-empty string, a list of non-empty strings, or token ids",
                       "input")
    cap = api.state.config.admission.max_embedding_inputs
    if len(inputs) > cap:
        raise APIError(400, f"input has {len(inputs)} items, over this server's limit of {cap} per request "
                            "(admission.max_embedding_inputs); split it into several requests", "input",
                       "limit_exceeded")
    try:
        return await run()
    except EmbedderDown as e:
        raise APIError(503, str(e), code="embedder_unavailable") from e
    except WrongTask as e:
        raise APIError(400, str(e), "model", "wrong_model_task") from e
    except BadDimensions as e:
        raise APIError(400, str(e), "dimensions") from e
    except ValueError as e:
        raise APIError(400, str(e), "input") from e


def _inputs(given) -> list[str | list[int]]:
    """OpenAI's `input` as a list of inputs: a text, texts, one input's token ids, or several inputs' ids."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]
    return list(given)


def add_routes(app: FastAPI, api: Api) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: p.EmbeddingRequest, request: Request):
        embedder, name = await _embedder(api, request, req.model)
        vectors, tokens = await _embed(api, embedder, _inputs(req.input), req.truncate_prompt_tokens, req.side,
                                       req.dimensions)
        data = []
        for i, v in enumerate(vectors):
            emb = b64(v) if req.encoding_format == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/embeddings")
    async def native_embeddings(req: p.NativeEmbeddingRequest, request: Request):
        embedder, name = await _embedder(api, request, req.model)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        vectors, tokens = await _embed(api, embedder, inputs)
        return {"embeddings": [v.tolist() for v in vectors], "model": name, "usage": {"prompt_tokens": tokens}}
