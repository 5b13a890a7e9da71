"""Progressive canary rollout with automatic rollback.

The controller holds a canary version at each traffic step (e.g. 1% -> 5% -> 25% -> 100%) for at least a
number of canary requests and seconds, and compares the canary with production over the same window (both
windows restart at each step):

- error rate: one-sided two-proportion z test (canary > production);
- TTFT p95, TTFT p99, TPOT p95: one-sided Mann-Whitney U (canary's latencies stochastically larger) and the
  canary's quantile above `latency_ratio` times production's;
- feedback (when both sides have enough): one-sided Welch t (canary's mean lower).

A check fails when its test is significant at alpha / (number of checks) (Bonferroni, so the whole step has
family-wise error alpha) AND the difference is larger than its practical margin. Any failed check rolls
back at once, even mid-step (checking repeatedly only makes rollbacks likelier: the safe direction); a step
whose hold is over with no failed check advances; a clean last step (or a next step of 100%) promotes.

The controller only decides. The caller applies each decision: traffic weights (`weights()`), the registry
transition (CANARY -> PRODUCTION through the zero-downtime swap, or -> ROLLBACK), the audit entry and the
alert metric. The clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from servelm.control.errors import ControlError, InvalidRequest
from servelm.control.experiments import ArmStats, mann_whitney, two_proportion_z, welch
from servelm.control.traffic import TrafficPolicy, split

HOLD, ADVANCE, PROMOTE, ROLLBACK = "hold", "advance", "promote", "rollback"
LATENCY_CHECKS = (("ttft", 0.95), ("ttft", 0.99), ("tpot", 0.95))


@dataclass
class CanaryThresholds:
    """When a difference counts as a degradation: significant at `alpha` (over all checks) and beyond the
    margin."""

    alpha: float = 0.01
    error_margin: float = 0.005  # absolute error-rate increase tolerated
    latency_ratio: float = 1.2  # canary quantile tolerated up to this times production's
    feedback_margin: float = 0.0  # drop of the feedback mean tolerated
    min_samples: int = 30  # per side, before a check is run


@dataclass
class CanaryConfig:
    """A rollout of `canary` against `production` for `model`."""

    model: str
    production: int
    canary: int
    steps: list[float] = field(default_factory=lambda: [1.0, 5.0, 25.0, 100.0])  # percent to the canary
    min_requests: int = 200  # canary requests per step (production needs as many)
    min_seconds: float = 300.0  # per step
    thresholds: CanaryThresholds = field(default_factory=CanaryThresholds)

    def __post_init__(self) -> None:
        def bad(msg: str, param: str) -> ControlError:
            return InvalidRequest(msg, code="invalid_canary", param=param)
        if self.production == self.canary:
            raise bad("the canary and production versions must differ", "canary")
        if not self.steps or any(not 0 < s <= 100 for s in self.steps) or self.steps != sorted(set(self.steps)):
            raise bad("steps must be increasing percentages in (0, 100]", "steps")
        if self.min_requests < 1 or self.min_seconds < 0:
            raise bad("min_requests must be >= 1 and min_seconds >= 0", "min_requests")
        t = self.thresholds
        if not 0 < t.alpha < 1 or t.latency_ratio < 1 or t.error_margin < 0 or t.min_samples < 2:
            raise bad("thresholds: 0 < alpha < 1, latency_ratio >= 1, error_margin >= 0, min_samples >= 2",
                      "thresholds")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CanaryConfig:
        try:
            th = CanaryThresholds(**(d.get("thresholds") or {}))
            rest = {k: v for k, v in d.items() if k != "thresholds"}
            return cls(**rest, thresholds=th)
        except TypeError as e:
            raise InvalidRequest(f"malformed canary config: {e}", code="invalid_canary") from None


@dataclass
class Check:
    """One comparison: the values on both sides, the test's p-value, and whether it failed."""

    name: str
    canary: float | None
    production: float | None
    p: float | None
    failed: bool
    ran: bool = True


@dataclass
class CanaryDecision:
    action: str  # hold | advance | promote | rollback
    step: int
    percent: float  # the canary's share of traffic to apply now
    reasons: list[str]
    checks: list[Check]

    def to_dict(self) -> dict:
        return asdict(self)


class CanaryController:
    """Decides each step of one rollout. Feed it every request of both versions (`record`, `feedback`) and
    call `evaluate()` as often as convenient (e.g. every few seconds)."""

    def __init__(self, config: CanaryConfig, clock: Callable[[], float] = time.monotonic,
                 step: int = 0) -> None:
        self.config, self.clock, self.step = config, clock, step
        self.status = "running"  # | promoting | promoted | failed (promotion not applied) | rolled_back
        self._new_window()

    def _new_window(self) -> None:
        self.step_started = self.clock()
        self.windows = {v: ArmStats(f"v{v}") for v in (self.config.production, self.config.canary)}

    def promotion_applied(self, ok: bool) -> None:
        """The PROMOTE decision was carried out (promoted) or could not be (failed)."""
        self.status = "promoted" if ok else "failed"

    @property
    def percent(self) -> float:
        """The canary's share of traffic now (0 after a rollback, 100 after promotion)."""
        return {"promoted": 100.0, "rolled_back": 0.0}.get(self.status, self.config.steps[self.step])

    def weights(self) -> dict[int, float]:
        c = self.config
        return {c.production: 100.0 - self.percent, c.canary: self.percent}

    def policy(self, sticky: bool = True) -> TrafficPolicy:
        """The split to apply now (sticky by default, so a user does not flip between versions)."""
        w = {v: x for v, x in self.weights().items() if x > 0}
        return split(self.config.model, w, sticky=sticky, salt=f"canary:{self.config.canary}")

    def record(self, version: int, **kw: Any) -> None:
        """One request served by `version` (keyword arguments as ArmStats.record); others are ignored."""
        if self.status == "running" and version in self.windows:
            self.windows[version].record(**kw)

    def feedback(self, version: int, score: float) -> None:
        if self.status == "running" and version in self.windows:
            self.windows[version].add_feedback(score)

    def checks(self) -> list[Check]:
        """The comparisons over the current window."""
        c, th = self.config, self.config.thresholds
        can, prod = self.windows[c.canary], self.windows[c.production]
        alpha = th.alpha / (1 + len(LATENCY_CHECKS) + 1)  # Bonferroni over every check
        out = []
        ran = min(can.requests, prod.requests) >= th.min_samples
        _, p = two_proportion_z(can.errors, can.requests, prod.errors, prod.requests, "greater")
        out.append(Check("error_rate", can.error_rate, prod.error_rate, p if ran else None,
                         ran and p < alpha and can.error_rate - prod.error_rate > th.error_margin, ran))
        tested: dict[str, float] = {}
        for kind, q in LATENCY_CHECKS:
            a, b = can.samples[kind], prod.samples[kind]
            ran = min(len(a.values), len(b.values)) >= th.min_samples
            if not ran:
                out.append(Check(f"{kind}_p{int(q * 100)}", a.quantile(q), b.quantile(q), None, False, False))
                continue
            if kind not in tested:
                tested[kind] = mann_whitney(a.array(), b.array(), "greater")[1]
            cq, pq = a.quantile(q), b.quantile(q)
            out.append(Check(f"{kind}_p{int(q * 100)}", cq, pq, tested[kind],
                             tested[kind] < alpha and cq > th.latency_ratio * pq))
        ran = min(can.feedback.n, prod.feedback.n) >= th.min_samples
        p = welch(can.feedback, prod.feedback, "less")[1] if ran else None
        out.append(Check("feedback", can.feedback.mean if can.feedback.n else None,
                         prod.feedback.mean if prod.feedback.n else None, p,
                         ran and p < alpha and prod.feedback.mean - can.feedback.mean > th.feedback_margin, ran))
        return out

    def evaluate(self) -> CanaryDecision:
        """The decision now; advancing starts the next step's window, promote/rollback end the rollout."""
        c = self.config
        if self.status != "running":
            return CanaryDecision(HOLD, self.step, self.percent, [f"rollout finished: {self.status}"], [])
        checks = self.checks()
        failed = [k for k in checks if k.failed]
        if failed:
            self.status = "rolled_back"
            reasons = [f"{k.name}: canary {k.canary:.4g} vs production {k.production:.4g} (p={k.p:.2g})"
                       for k in failed]
            return CanaryDecision(ROLLBACK, self.step, 0.0, reasons, checks)
        can, prod = self.windows[c.canary], self.windows[c.production]
        waiting = []
        if min(can.requests, prod.requests) < c.min_requests:
            waiting.append(f"needs {c.min_requests} requests per version (canary {can.requests}, "
                           f"production {prod.requests})")
        held = self.clock() - self.step_started
        if held < c.min_seconds:
            waiting.append(f"needs {c.min_seconds - held:.0f} s more at {self.percent:g}%")
        if waiting:
            return CanaryDecision(HOLD, self.step, self.percent, waiting, checks)
        last = self.step + 1 >= len(c.steps) or c.steps[self.step + 1] >= 100
        if last:
            self.status = "promoting"  # "promoted" only once the runner has applied it (promotion_applied)
            return CanaryDecision(PROMOTE, self.step, 100.0,
                                  [f"step {self.step} ({c.steps[self.step]:g}%) clean: promote"], checks)
        self.step += 1
        self._new_window()
        return CanaryDecision(ADVANCE, self.step, self.percent,
                              [f"step {self.step - 1} clean: {c.steps[self.step - 1]:g}% -> {self.percent:g}%"],
                              checks)

    def to_dict(self) -> dict:
        """What to persist to resume after a restart (the windows: `windows_state`)."""
        return {"config": self.config.to_dict(), "step": self.step, "status": self.status}

    def windows_state(self) -> dict:
        """The current step's windows and how long the step has been held: saved so that a restart carries on
        the step where it was instead of starting its windows again."""
        return {"canary": self.config.canary, "step": self.step, "held_s": self.clock() - self.step_started,
                "windows": {str(v): w.to_dict() for v, w in self.windows.items()}}

    def restore_windows(self, d: dict) -> bool:
        """Take back `windows_state()` when it is of this rollout's current step; whether it was."""
        if d.get("canary") != self.config.canary or d.get("step") != self.step:
            return False
        windows = {int(v): ArmStats.from_dict(w) for v, w in d["windows"].items()}
        if set(windows) != set(self.windows):
            return False
        self.windows = windows
        self.step_started = self.clock() - float(d.get("held_s", 0.0))
        return True

    @classmethod
    def from_dict(cls, d: dict, clock: Callable[[], float] = time.monotonic) -> CanaryController:
        ctl = cls(CanaryConfig.from_dict(d["config"]), clock, step=int(d.get("step", 0)))
        ctl.status = d.get("status", "running")
        return ctl
