"""`PoolingParams`: how an encoder model's outputs are returned, as vLLM's class of that name says it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """vLLM's PoolingParams, as far as servelm's encoder models use it. `use_activation` False returns a
    classifier's (or cross-encoder's) raw logits instead of its scores or probabilities. `dimensions`
    (Matryoshka embeddings cut to fewer dimensions) is not supported: a value is refused."""

    use_activation: bool | None = None
    dimensions: int | None = None

    def check(self) -> None:
        if self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions is not supported: embeddings keep the model's dimensions")
