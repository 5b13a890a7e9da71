"""An online model of how long an engine step takes, for sizing prefill chunks to a latency target.

On a CPU a step's time is close to linear in the tokens it computes: a fixed part (streaming every weight
once, the host work) plus a part per token (the matmul rows). The model fits `seconds = base + per_token *
tokens` by least squares over the recent steps, older ones weighing less (exponential forgetting), so it
follows the machine as its load changes. Until the steps seen vary enough in size to tell the two parts apart
it predicts nothing, and the scheduler then fills its whole token budget as it would without a target.
"""

from __future__ import annotations


class StepCostModel:
    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay  # weight of the previous steps at each new one: about 1/(1-decay) steps remembered
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token), or None while the steps seen do not pin both down."""
        n = self._n
        if n < 2.0:
            return None
        var = self._xx / n - (self._x / n) ** 2
        mean_x = self._x / n
        # sizes that barely differ (every step a few decodes) cannot separate base from per-token cost
        if var <= (0.25 * mean_x) ** 2 or var <= 1.0:
            return None
        per_token = (self._xy / n - mean_x * self._y / n) / var
        if per_token <= 0.0:
            return None
        return max(0.0, self._y / n - per_token * mean_x), per_token

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step can hold and still be predicted to take at most `seconds` (None: no
        prediction yet). Never negative."""
        f = self.fit()
        if f is None:
            return None
        base, per_token = f
        return max(0, int((seconds - base) / per_token))
