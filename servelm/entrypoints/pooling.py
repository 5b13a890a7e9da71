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
from servelm.progress import progress
from servelm.runtimes.encoder_runner import EncoderRunner, Pooled, cosine, model_labels, probabilities

BATCH_SIZE = 32  # inputs run together (as the server's embedding batches)


def _texts(prompts, what: str) -> list[str]:
    """One text or several, as vLLM takes them (a {"prompt": text} dict too)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    out = [p["prompt"] if isinstance(p, dict) and "prompt" in p else p for p in prompts]
    if not out or not all(isinstance(t, str) and t for t in out):
        raise ValueError(f"{what} must be a non-empty string or a list of non-empty strings")
    return out


class EncoderModel:
    """An encoder folder loaded in this process; `task` is "embed" or "classify" (a sequence classifier)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.runner = EncoderRunner(self.path)
        self.task = self.runner.task
        self.labels = model_labels(self.path) if self.task == "classify" else []
        self._ids = itertools.count()

    def _run(self, items: list, run: Callable[[list], Pooled], desc: str, use_tqdm: bool):
        """Each item's (row, token ids), in the items' order; batches of inputs of similar length, so that
        little of each batch is padding."""
        order = sorted(range(len(items)), key=lambda i: len(str(items[i])))
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

    def embed(self, prompts, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        self._need("embed", "embed()")
        texts = _texts(prompts, "prompts")
        items = texts if truncate_prompt_tokens is None else [(t, truncate_prompt_tokens) for t in texts]
        rows = self._run(items, self.runner.embed, "Embedding", use_tqdm)
        return [EmbeddingRequestOutput(str(next(self._ids)), EmbeddingOutput(vec.tolist()), ids)
                for vec, ids in rows]

    def classify(self, prompts, use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        self._need("classify", "classify()")
        texts = _texts(prompts, "prompts")
        rows = self._run([(t, None, None) for t in texts], self.runner.classify, "Classifying", use_tqdm)
        return [ClassificationRequestOutput(str(next(self._ids)), ClassificationOutput(probs.tolist()), ids)
                for probs, ids in ((probabilities(row[None])[0], ids) for row, ids in rows)]

    def score(self, data_1, data_2, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """One text_1 against every text_2, or pairs one to one: a cross-encoder reads each pair together (the
        sigmoid of its logit), an embedding model scores the cosine similarity of the two vectors."""
        one, two = _texts(data_1, "data_1"), _texts(data_2, "data_2")
        if len(one) != 1 and len(one) != len(two):
            raise ValueError(f"data_1 has {len(one)} texts and data_2 {len(two)}: give one, or as many as data_2")
        firsts = one * len(two) if len(one) == 1 else one
        if self.task == "classify":
            rows = self._run([(a, b, truncate_prompt_tokens) for a, b in zip(firsts, two, strict=True)],
                             self.runner.classify, "Scoring", use_tqdm)
            if len(rows[0][0]) != 1:
                raise ValueError(f"{self.path.name} has {len(rows[0][0])} labels; scores need a cross-encoder with "
                                 "one output (classify() gives each label's probability)")
            return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(float(probabilities(row[None])[0, 0])),
                                         ids) for row, ids in rows]
        vectors = self.embed(list(dict.fromkeys(firsts + two)), truncate_prompt_tokens, use_tqdm)
        by_text = {t: v for t, v in zip(dict.fromkeys(firsts + two), vectors, strict=True)}
        a = np.asarray([by_text[t].outputs.embedding for t in firsts])
        b = np.asarray([by_text[t].outputs.embedding for t in two])
        return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(float(s)),
                                     by_text[x].prompt_token_ids + by_text[y].prompt_token_ids)
                for s, x, y in zip(cosine(a, b), firsts, two, strict=True)]

