"""Experiments: per-arm accumulators, the statistics between arms, and a Thompson-sampling bandit.

Memory per arm is bounded: counts and Welford sums are exact; latency samples are kept in a fixed-size
uniform reservoir (Algorithm R), so percentiles and rank tests are over a uniform sample of the window.
The tests are scipy's (Mann-Whitney U, Welch's t from summary statistics, normal quantiles); the
two-proportion z statistic is the textbook pooled one, equal to the square root of the 2x2 chi-square.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from servelm.control.errors import InvalidRequest

LATENCIES = ("ttft", "tpot", "latency")


class Reservoir:
    """A uniform sample of at most `size` values of a stream (Algorithm R), seeded for reproducibility."""

    def __init__(self, size: int = 2048, seed: int = 0) -> None:
        self.size, self.seen, self.values = size, 0, []
        self._rng = random.Random(seed)

    def add(self, x: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(float(x))
        else:
            j = self._rng.randrange(self.seen)
            if j < self.size:
                self.values[j] = float(x)

    def array(self) -> np.ndarray:
        return np.asarray(self.values, dtype=float)

    def quantile(self, q: float) -> float | None:
        return float(np.quantile(self.values, q)) if self.values else None

    def to_dict(self) -> dict:
        return {"size": self.size, "seen": self.seen, "values": list(self.values)}

    @classmethod
    def from_dict(cls, d: dict, seed: int = 0) -> Reservoir:
        """Back from `to_dict` (the random source restarts from `seed` and the count seen: still uniform)."""
        r = cls(int(d["size"]), seed=seed + int(d["seen"]))
        r.seen, r.values = int(d["seen"]), [float(x) for x in d["values"]][:r.size]
        return r


@dataclass
class Welford:
    """Running count, mean and variance (numerically stable)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        """Sample standard deviation (n - 1)."""
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0

    def to_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "m2": self.m2}


@dataclass
class ArmStats:
    """What one arm (a version under a policy) did in a window."""

    name: str
    reservoir_size: int = 2048
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    feedback: Welford = field(default_factory=Welford)
    samples: dict[str, Reservoir] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, k in enumerate(LATENCIES):
            self.samples.setdefault(k, Reservoir(self.reservoir_size, seed=zlib.crc32(f"{self.name}/{i}".encode())))

    def record(self, *, error: bool = False, prompt_tokens: int = 0, completion_tokens: int = 0,
               ttft: float | None = None, tpot: float | None = None, latency: float | None = None) -> None:
        """One served request. Latencies (seconds) of failed requests are not sampled."""
        self.requests += 1
        self.errors += bool(error)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if error:
            return
        for k, v in (("ttft", ttft), ("tpot", tpot), ("latency", latency)):
            if v is not None:
                self.samples[k].add(v)

    def add_feedback(self, score: float) -> None:
        self.feedback.add(float(score))

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        """Everything the arm knows (counts, feedback sums, latency samples): saved across a restart."""
        return {"name": self.name, "reservoir_size": self.reservoir_size, "requests": self.requests,
                "errors": self.errors, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "feedback": self.feedback.to_dict(),
                "samples": {k: r.to_dict() for k, r in self.samples.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> ArmStats:
        a = cls(d["name"], int(d.get("reservoir_size", 2048)), int(d["requests"]), int(d["errors"]),
                int(d["prompt_tokens"]), int(d["completion_tokens"]), Welford(**d["feedback"]))
        for i, k in enumerate(LATENCIES):
            if k in d.get("samples", {}):
                a.samples[k] = Reservoir.from_dict(d["samples"][k], seed=zlib.crc32(f"{a.name}/{i}".encode()))
        return a

    def summary(self, confidence: float = 0.95) -> dict[str, Any]:
        """Counts, error rate with its Wilson interval, latency percentiles, feedback mean with its t
        interval."""
        out: dict[str, Any] = {"requests": self.requests, "errors": self.errors, "error_rate": self.error_rate,
                               "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        if self.requests:
            ci = stats.binomtest(self.errors, self.requests).proportion_ci(confidence, method="wilson")
            out["error_rate_ci"] = [ci.low, ci.high]
        for k, r in self.samples.items():
            out[k] = {"n": r.seen, **{f"p{int(q * 100)}": r.quantile(q) for q in (0.5, 0.95, 0.99)}}
        fb = self.feedback
        out["feedback"] = {"n": fb.n, "mean": fb.mean if fb.n else None, "std": fb.std, "ci": mean_ci(fb, confidence)}
        return out


def mean_ci(w: Welford, confidence: float = 0.95) -> list[float] | None:
    """Student-t interval for the mean (None below 2 values)."""
    if w.n < 2:
        return None
    half = stats.t.ppf(0.5 + confidence / 2, w.n - 1) * w.std / math.sqrt(w.n)
    return [w.mean - half, w.mean + half]


def two_proportion_z(x1: int, n1: int, x2: int, n2: int, alternative: str = "two-sided") -> tuple[float, float]:
    """Pooled two-proportion z test of p1 vs p2: (z, p-value); alternative 'greater' tests p1 > p2."""
    if n1 == 0 or n2 == 0:
        return 0.0, 1.0
    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 0.0, 1.0
    z = (x1 / n1 - x2 / n2) / se
    if alternative == "two-sided":
        return z, float(2 * stats.norm.sf(abs(z)))
    return z, float(stats.norm.sf(z) if alternative == "greater" else stats.norm.cdf(z))


def mann_whitney(a: np.ndarray, b: np.ndarray, alternative: str = "two-sided") -> tuple[float, float]:
    """Mann-Whitney U of a vs b ('greater': a tends to be larger): (U, p-value); (nan, 1) when empty."""
    if len(a) == 0 or len(b) == 0:
        return float("nan"), 1.0
    r = stats.mannwhitneyu(a, b, alternative=alternative)
    return float(r.statistic), float(r.pvalue)


def welch(a: Welford, b: Welford, alternative: str = "two-sided") -> tuple[float, float]:
    """Welch's t test of mean(a) vs mean(b) from summary statistics: (t, p-value); (nan, 1) when too few."""
    if a.n < 2 or b.n < 2 or (a.std == 0 and b.std == 0):
        return float("nan"), 1.0
    r = stats.ttest_ind_from_stats(a.mean, a.std, a.n, b.mean, b.std, b.n, equal_var=False,
                                   alternative=alternative)
    return float(r.statistic), float(r.pvalue)


def n_for_proportions(p1: float, p2: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Requests per arm for a two-sided two-proportion z test to detect p1 vs p2."""
    if p1 == p2:
        raise InvalidRequest("the effect must not be 0", code="invalid_effect")
    za, zb = stats.norm.isf(alpha / 2), stats.norm.ppf(power)
    pbar = (p1 + p2) / 2
    n = (za * math.sqrt(2 * pbar * (1 - pbar)) + zb * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))) ** 2
    return math.ceil(n / (p1 - p2) ** 2)


def n_for_means(effect: float, std: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Observations per arm for a two-sided test to detect a difference `effect` in means with this std."""
    if effect == 0:
        raise InvalidRequest("the effect must not be 0", code="invalid_effect")
    za, zb = stats.norm.isf(alpha / 2), stats.norm.ppf(power)
    return math.ceil(2 * ((za + zb) * std / effect) ** 2)


def compare(a: ArmStats, b: ArmStats, *, alpha: float = 0.05, power: float = 0.8,
            error_effect: float | None = None, feedback_effect: float | None = None) -> dict[str, Any]:
    """Tests of arm `a` against baseline `b`, and how many more requests/feedbacks each arm still needs to
    detect the given effects (absolute error-rate difference; feedback mean difference)."""
    z, pz = two_proportion_z(a.errors, a.requests, b.errors, b.requests)
    out: dict[str, Any] = {"errors": {"test": "two-proportion z", "z": z, "p": pz, "significant": pz < alpha}}
    for k in LATENCIES:
        u, pu = mann_whitney(a.samples[k].array(), b.samples[k].array())
        out[k] = {"test": "Mann-Whitney U", "u": u, "p": pu, "significant": pu < alpha}
    t, pt = welch(a.feedback, b.feedback)
    out["feedback"] = {"test": "Welch t", "t": t, "p": pt, "significant": pt < alpha,
                       "diff": a.feedback.mean - b.feedback.mean if a.feedback.n and b.feedback.n else None}
    if error_effect:
        base = b.error_rate
        need = n_for_proportions(min(base + error_effect, 1.0), base, alpha, power)
        out["errors"].update(needed_per_arm=need, remaining=max(0, need - min(a.requests, b.requests)))
    if feedback_effect and a.feedback.n + b.feedback.n > 2:
        pooled = math.sqrt((a.feedback.std ** 2 + b.feedback.std ** 2) / 2) or 1.0
        need = n_for_means(feedback_effect, pooled, alpha, power)
        out["feedback"].update(needed_per_arm=need, remaining=max(0, need - min(a.feedback.n, b.feedback.n)))
    return out


class Experiment:
    """A named experiment: a traffic policy (as a dict), its arms' stats, start/stop times, and the arm that
    served each recent request id (so feedback arriving later lands on the right arm)."""

    def __init__(self, name: str, policy: dict, arms: list[str], *, started_at: float,
                 baseline: str | None = None, remember: int = 100_000) -> None:
        if not arms:
            raise InvalidRequest("an experiment needs arms", code="invalid_experiment")
        dup = sorted({a for a in arms if arms.count(a) > 1})
        if dup:  # two arms under one label would merge their statistics silently
            raise InvalidRequest(f"arm labels must be unique; repeated: {', '.join(dup)} (name the arms)",
                                 code="invalid_experiment", param="arms")
        if baseline is not None and baseline not in arms:
            raise InvalidRequest(f"baseline {baseline!r} is not an arm of the experiment; its arms: "
                                 f"{', '.join(arms)}", code="invalid_experiment", param="baseline")
        self.name, self.policy, self.started_at = name, policy, started_at
        self.stopped_at: float | None = None
        self.baseline = baseline or arms[0]
        self.arms = {a: ArmStats(a) for a in arms}
        self._served: OrderedDict[str, str] = OrderedDict()
        self._remember = remember

    def record(self, arm: str, request_id: str | None = None, **kw: Any) -> None:
        """One request served by `arm` (keyword arguments as ArmStats.record). Ignored once stopped."""
        if self.stopped_at is not None or arm not in self.arms:
            return
        self.arms[arm].record(**kw)
        if request_id is not None:
            self._served[request_id] = arm
            if len(self._served) > self._remember:
                self._served.popitem(last=False)

    def feedback(self, request_id: str, score: float) -> bool:
        """Attach feedback to the arm that served `request_id`; False when the id is unknown (too old)."""
        arm = self._served.get(request_id)
        if arm is None:
            return False
        self.arms[arm].add_feedback(score)
        return True

    def stop(self, at: float) -> None:
        self.stopped_at = at

    def windows_state(self) -> dict:
        """The arms' statistics, saved across a restart."""
        return {"arms": {k: a.to_dict() for k, a in self.arms.items()}}

    def restore_windows(self, d: dict) -> None:
        for k, a in d.get("arms", {}).items():
            if k in self.arms:
                self.arms[k] = ArmStats.from_dict(a)

    def report(self, *, alpha: float = 0.05, error_effect: float | None = 0.01,
               feedback_effect: float | None = None) -> dict[str, Any]:
        """What `GET /admin/experiments/{id}` shows: per-arm summaries and each arm against the baseline."""
        base = self.arms[self.baseline]
        return {"name": self.name, "policy": self.policy, "started_at": self.started_at,
                "stopped_at": self.stopped_at, "baseline": self.baseline,
                "arms": {k: a.summary(1 - alpha) for k, a in self.arms.items()},
                "comparisons": {k: compare(a, base, alpha=alpha, error_effect=error_effect,
                                           feedback_effect=feedback_effect)
                                for k, a in self.arms.items() if k != self.baseline}}


class ThompsonBandit:
    """Thompson sampling over versions with a Beta posterior on a reward in [lo, hi] (scaled to [0, 1],
    fractional rewards update both parameters). With probability `min_share * k` a request goes to a
    uniformly chosen arm, so every arm keeps at least `min_share` of the traffic."""

    def __init__(self, versions: list[int], *, min_share: float = 0.05, lo: float = 0.0, hi: float = 1.0) -> None:
        if not versions or len(set(versions)) != len(versions):
            raise InvalidRequest("a bandit needs distinct versions", code="invalid_policy")
        if not 0 <= min_share * len(versions) <= 1:
            raise InvalidRequest("min_share times the number of arms must be at most 1",
                                 code="invalid_policy", param="min_share")
        if not hi > lo:
            raise InvalidRequest("the reward range needs hi > lo", code="invalid_policy")
        self.versions, self.min_share, self.lo, self.hi = list(versions), min_share, lo, hi
        self.alpha = {v: 1.0 for v in versions}
        self.beta = {v: 1.0 for v in versions}

    def choose(self, rng: random.Random | None = None) -> int:
        rng = rng or random.Random()
        if rng.random() < self.min_share * len(self.versions):
            return rng.choice(self.versions)
        return max(self.versions, key=lambda v: rng.betavariate(self.alpha[v], self.beta[v]))

    def update(self, version: int, reward: float) -> None:
        if version not in self.alpha:
            return
        r = min(max((reward - self.lo) / (self.hi - self.lo), 0.0), 1.0)
        self.alpha[version] += r
        self.beta[version] += 1.0 - r

    def to_dict(self) -> dict:
        return {"versions": self.versions, "min_share": self.min_share, "lo": self.lo, "hi": self.hi,
                "alpha": {str(v): a for v, a in self.alpha.items()}, "beta": {str(v): b for v, b in self.beta.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> ThompsonBandit:
        b = cls(list(d["versions"]), min_share=d["min_share"], lo=d["lo"], hi=d["hi"])
        b.alpha = {int(k): float(v) for k, v in d["alpha"].items()}
        b.beta = {int(k): float(v) for k, v in d["beta"].items()}
        return b
