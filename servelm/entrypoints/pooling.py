"""`LLM.embed`, `LLM.score` and `LLM.classify` for encoder checkpoints (an embedding model, a cross-encoder
reranker, a text classifier), as vLLM's pooling models answer them. The model runs in this process, in batches
of inputs of similar length; the arithmetic is the server's (runtimes/encoder_runner.py), so an answer here is
the one /v1/embeddings, /score, /rerank and /classify give."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np

from servelm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from servelm.pooling_params import PoolingParams
from servelm.progress import progress
from servelm.runtimes.embed_batcher import input_length
from servelm.runtimes.encoder_runner import (
    EncoderRunner,
    Pooled,
    activate,
    check_dimensions,
    cosine,
    cut_dimensions,
    embedding_width,
    model_activation,
    model_labels,
    model_matryoshka,
)

BATCH_SIZE = 32  # inputs run together (as the server's embedding batches)


def _texts(prompts, what: str, ids: bool = False) -> list:
    """One text or several, as vLLM takes them (a {"prompt": text} dict too); with `ids`, a {"prompt_token_ids":
    [...]} dict (vLLM's TokensPrompt) gives its token ids, run as they are."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    out = []
    for p in prompts:
        if ids and isinstance(p, dict) and "prompt_token_ids" in p:
            given = p["prompt_token_ids"]
            if not isinstance(given, (list, tuple)) or not given or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in given):
                raise ValueError(f"{what}: prompt_token_ids must be a non-empty list of token ids")
            out.append(list(given))
        else:
            out.append(p["prompt"] if isinstance(p, dict) and "prompt" in p else p)
    if not out or not all(isinstance(t, list) or (isinstance(t, str) and t) for t in out):
        raise ValueError(f"{what} must be a non-empty string or a list of non-empty strings"
                         + (" or {'prompt_token_ids': [...]} dicts" if ids else ""))
    return out


def _truncation(tokenization_kwargs: dict | None) -> tuple[int | None, str]:
    """vLLM's tokenization_kwargs of a pooling call: truncate_prompt_tokens (each input keeps at most that many
    tokens, -1: the model's limit) and truncation_side ("right", the default, keeps the first ones)."""
    kw = dict(tokenization_kwargs or {})
    k, side = kw.pop("truncate_prompt_tokens", None), kw.pop("truncation_side", None) or "right"
    if kw:
        raise ValueError(f"tokenization_kwargs takes truncate_prompt_tokens and truncation_side, not "
                         f"{', '.join(sorted(kw))}")
    if k is not None and (not isinstance(k, int) or k == 0 or k < -1):
        raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 for the model's limit, got {k!r}")
    if side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    return k, side


def _use_activation(pooling_params: PoolingParams | None, lora_request, task: str) -> bool:
    if lora_request is not None:
        raise ValueError("encoder models take no LoRA adapters")
    if pooling_params is None:
        return True
    pooling_params.check(task)
    return pooling_params.use_activation is not False


class EncoderModel:
    """An encoder folder loaded in this process; `task` is "embed" or "classify" (a sequence classifier)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.runner = EncoderRunner(self.path)
        self.task = self.runner.task
        self.labels = model_labels(self.path) if self.task == "classify" else []
        self.activation = model_activation(self.path) if self.task == "classify" else "classify"
        self._ids = itertools.count()

    def _run(self, items: list, run: Callable[[list], Pooled], desc: str, use_tqdm: bool):
        """Each item's (row, token ids), in the items' order; batches of inputs of similar length, so that
        little of each batch is padding."""
        order = sorted(range(len(items)), key=lambda i: input_length(items[i]))
        rows: list = [None] * len(items)
        bar = progress(total=len(items), desc=desc, unit="input", disable=not use_tqdm)
        for start in range(0, len(order), BATCH_SIZE):
            chunk = order[start:start + BATCH_SIZE]
            out = run([items[i] for i in chunk])
            for j, i in enumerate(chunk):
                rows[i] = (out.rows[j], out.token_ids[j])
            bar.update(len(chunk))
        bar.close()
        return rows

    def _need(self, task: str, call: str) -> None:
        if self.task != task:
            kind = "a sequence classifier (a cross-encoder)" if self.task == "classify" else "an embedding model"
            raise ValueError(f"{self.path.name} is {kind}: {call} needs "
                             + ("an embedding model" if task == "embed" else "a sequence classifier"))

    def embed(self, prompts, use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              lora_request=None, tokenization_kwargs: dict | None = None) -> list[EmbeddingRequestOutput]:
        self._need("embed", "embed()")
        _use_activation(pooling_params, lora_request, "embed")
        k, side = _truncation(tokenization_kwargs)
        dims = pooling_params.dimensions if pooling_params is not None else None
        if dims is not None:
            check_dimensions(dims, model_matryoshka(self.path), embedding_width(self.path, self.runner.recipe),
                             self.path.name)
        inputs = _texts(prompts, "prompts", ids=True)
        rows = self._run([(t, None, k, side) for t in inputs], self.runner.embed, "Embedding", use_tqdm)
        normalize = self.runner.recipe.normalize
        return [EmbeddingRequestOutput(str(next(self._ids)), EmbeddingOutput(
            cut_dimensions(vec, dims, normalize).tolist()), ids) for vec, ids in rows]

    def classify(self, prompts, use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
                 lora_request=None, tokenization_kwargs: dict | None = None) -> list[ClassificationRequestOutput]:
        self._need("classify", "classify()")
        act = _use_activation(pooling_params, lora_request, "classify")
        k, side = _truncation(tokenization_kwargs)
        rows = self._run([(t, None, k, side) for t in _texts(prompts, "prompts", ids=True)], self.runner.classify,
                         "Classifying", use_tqdm)
        return [ClassificationRequestOutput(str(next(self._ids)), ClassificationOutput(
            activate(row[None], self.activation, act)[0].tolist()), ids) for row, ids in rows]

    def score(self, data_1, data_2, use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              lora_request=None, tokenization_kwargs: dict | None = None) -> list[ScoringRequestOutput]:
        """One text_1 against every text_2, or pairs one to one: a cross-encoder reads each pair together (its
        logit through the model's activation), an embedding model scores the cosine similarity of the vectors."""
        act = _use_activation(pooling_params, lora_request, "score")
        k, side = _truncation(tokenization_kwargs)
        one, two = _texts(data_1, "data_1"), _texts(data_2, "data_2")
        if len(one) != 1 and len(one) != len(two):
            raise ValueError(f"data_1 has {len(one)} texts and data_2 {len(two)}: give one, or as many as data_2")
        firsts = one * len(two) if len(one) == 1 else one
        if self.task == "classify":
            rows = self._run([(a, b, k, side) for a, b in zip(firsts, two, strict=True)], self.runner.classify,
                             "Scoring", use_tqdm)
            if len(rows[0][0]) != 1:
                raise ValueError(f"{self.path.name} has {len(rows[0][0])} labels; scores need a cross-encoder with "
                                 "one output (classify() gives each label's probability)")
            return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(float(activate(row[None], self.activation, act)[0, 0])),
                                         ids) for row, ids in rows]
        distinct = list(dict.fromkeys(firsts + two))
        vectors = dict(zip(distinct, self._run([(t, None, k, side) for t in distinct], self.runner.embed,
                                               "Embedding", use_tqdm), strict=True))
        a = np.asarray([vectors[t][0] for t in firsts])
        b = np.asarray([vectors[t][0] for t in two])
        return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(float(s)), vectors[x][1] + vectors[y][1])
                for s, x, y in zip(cosine(a, b), firsts, two, strict=True)]
