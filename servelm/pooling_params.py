"""`PoolingParams`: how an encoder model's outputs are returned, as vLLM's class of that name says it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """vLLM's PoolingParams, as far as servelm's pooling models use it. `use_activation` False returns a
    classifier's (or cross-encoder's) raw logits instead of its scores or probabilities. `dimensions` cuts a
    Matryoshka embedding model's vectors to that many values (embed only; refused for a model not trained
    for it)."""

    use_activation: bool | None = None
    dimensions: int | None = None

    def check(self, task: str) -> None:
        """Raises ValueError for what the call (`task`: "embed", "classify" or "score") does not take."""
        if self.dimensions is not None and task != "embed":
            raise ValueError(f"PoolingParams.dimensions applies to embed(), not {task}()")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)):
            raise ValueError(f"PoolingParams.dimensions must be an integer, got {self.dimensions!r}")
