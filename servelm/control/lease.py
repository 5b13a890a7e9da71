"""A request's hold on what serves it, from the moment its model is resolved to the end of the request.

A swap changes which generation (version + tokenizer + workers) a deployment serves. A request that tokenized
its prompt with one generation's tokenizer must run on that generation's workers and be detokenized by them,
even when a swap switches over between its tokenization and its `generate`. A `Lease` is that pin: everything
the request reads of the model (tokenizer, version, context length, vocabulary, `generate`) comes from the
generation it resolved. While a lease is held the deployment counts it as in use, so a swap drains the old
generation only once its leases are released, and memory eviction or keep-alive expiry leave it alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Lease:
    """An EngineClient (worker/engine_client.py): one request's pin on a deployment's generation (`generation` None: the deployment as it is, for
    deployments without generations, such as an embedding one). Attributes it does not define (abort,
    num_queued, stats, id, describe, ...) are the deployment's. `release()` is idempotent."""

    def __init__(self, deployment: Any, generation: Any = None, on_release: Callable[[], None] | None = None) -> None:
        self.deployment = deployment
        self.generation = generation
        self._on_release = on_release
        self.released = False

    @property
    def version(self):
        return self.generation.version if self.generation is not None else self.deployment.version

    @property
    def served_name(self) -> str:
        return self.version.ref

    @property
    def tokenizer(self):
        if self.generation is not None:
            return self.generation.tokenizer
        return getattr(self.deployment, "tokenizer", None)

    @property
    def info(self):
        return self.generation.info if self.generation is not None else self.deployment.info

    @property
    def max_model_len(self) -> int:
        return self.generation.max_model_len if self.generation is not None else self.deployment.max_model_len

    def generate(self, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None,
                 priority: int = 1, queue_timeout: float | None = None, cache_salt: str | None = None, *,
                 lora: str | None = None):
        """The deployment's generate, on the workers of the pinned generation (`lora` passed on only when a
        request names an adapter: not every deployment's generate takes one)."""
        return self.deployment.generate(request_id, prompt_token_ids, params, prompt, priority, queue_timeout,
                                        cache_salt, generation=self.generation,
                                        **({"lora": lora} if lora is not None else {}))

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self._on_release is not None:
                self._on_release()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.deployment, attr)

    def __repr__(self) -> str:
        return f"Lease({self.served_name!r}{', released' if self.released else ''})"
