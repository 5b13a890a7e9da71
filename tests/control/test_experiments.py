"""Experiments (servelm/control/experiments.py): accumulators, tests against scipy's reference results,
sample sizes, the report, and the Thompson-sampling bandit."""

import math
import random

import numpy as np
import pytest
from scipy import stats

from servelm.control.experiments import (
    ArmStats,
    Experiment,
    Reservoir,
    ThompsonBandit,
    Welford,
    mean_ci,
    n_for_means,
    n_for_proportions,
    two_proportion_z,
    welch,
)


def test_two_proportion_z_matches_the_chi_square_of_the_2x2_table():
    for x1, n1, x2, n2 in [(30, 1000, 12, 1000), (5, 80, 9, 120), (200, 400, 190, 410)]:
        z, p = two_proportion_z(x1, n1, x2, n2)
        chi2, p_ref, _, _ = stats.chi2_contingency([[x1, n1 - x1], [x2, n2 - x2]], correction=False)
        assert z * z == pytest.approx(chi2) and p == pytest.approx(p_ref)
        # one-sided: half the two-sided p in the observed direction
        _, pg = two_proportion_z(x1, n1, x2, n2, "greater")
        assert pg == pytest.approx(p / 2 if z > 0 else 1 - p / 2)


def test_welch_from_running_stats_matches_scipy_on_raw_values():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.6, 0.2, 300), rng.normal(0.55, 0.3, 200)
    wa, wb = Welford(), Welford()
    for x in a:
        wa.add(x)
    for x in b:
        wb.add(x)
    assert wa.mean == pytest.approx(a.mean()) and wa.std == pytest.approx(a.std(ddof=1))
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert welch(wa, wb) == pytest.approx((ref.statistic, ref.pvalue))
    lo, hi = stats.t.interval(0.95, len(a) - 1, loc=a.mean(), scale=stats.sem(a))
    assert mean_ci(wa) == pytest.approx([lo, hi])


def test_reservoir_is_bounded_and_uniform():
    r = Reservoir(size=1000, seed=3)
    n = 100_000
    for i in range(n):
        r.add(i)
    assert len(r.values) == 1000 and r.seen == n
    # the mean of a uniform sample of 0..n-1: sd of the sample mean ~ n / sqrt(12 * 1000)
    assert abs(np.mean(r.values) - (n - 1) / 2) < 4.5 * n / math.sqrt(12 * 1000)
    # and it holds the whole stream while it fits: exact percentiles
    small = Reservoir(size=100)
    for x in range(50):
        small.add(x)
    assert small.quantile(0.95) == pytest.approx(np.quantile(np.arange(50), 0.95))


def test_sample_sizes_reach_the_power_asked_for_and_not_one_less():
    za = stats.norm.isf(0.025)
    for p1, p2 in [(0.12, 0.10), (0.05, 0.02), (0.5, 0.4)]:
        n = n_for_proportions(p1, p2)
        pbar = (p1 + p2) / 2

        def power(m, p1=p1, p2=p2, pbar=pbar):
            return stats.norm.cdf((abs(p1 - p2) - za * math.sqrt(2 * pbar * (1 - pbar) / m))
                                  / math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / m))
        assert power(n) >= 0.8 > power(n - 1)
    n = n_for_means(0.5, 1.0)
    assert stats.norm.cdf(0.5 * math.sqrt(n / 2) - za) >= 0.8 > stats.norm.cdf(0.5 * math.sqrt((n - 1) / 2) - za)


def fill(arm: ArmStats, rng: random.Random, n: int, err: float, ttft: float, fb: float | None = None) -> None:
    for _ in range(n):
        arm.record(error=rng.random() < err, prompt_tokens=10, completion_tokens=20,
                   ttft=rng.lognormvariate(math.log(ttft), 0.3), tpot=0.02, latency=0.5)
        if fb is not None:
            arm.add_feedback(1.0 if rng.random() < fb else 0.0)


def test_report_finds_a_real_difference_and_not_a_null_one():
    rng = random.Random(5)
    exp = Experiment("e1", {"model": "m"}, ["control", "worse", "same"], started_at=100.0)
    fill(exp.arms["control"], rng, 1500, 0.02, 0.10, fb=0.7)
    fill(exp.arms["worse"], rng, 1500, 0.08, 0.20, fb=0.5)
    fill(exp.arms["same"], rng, 1500, 0.02, 0.10, fb=0.7)
    rep = exp.report(alpha=0.01, error_effect=0.01, feedback_effect=0.05)
    worse, same = rep["comparisons"]["worse"], rep["comparisons"]["same"]
    assert worse["errors"]["significant"] and worse["ttft"]["significant"] and worse["feedback"]["significant"]
    assert not (same["errors"]["significant"] or same["ttft"]["significant"] or same["feedback"]["significant"])
    arm = rep["arms"]["control"]
    assert arm["requests"] == 1500 and arm["prompt_tokens"] == 15000
    assert arm["error_rate_ci"][0] < arm["error_rate"] < arm["error_rate_ci"][1]
    assert arm["feedback"]["ci"][0] < arm["feedback"]["mean"] < arm["feedback"]["ci"][1]
    assert arm["ttft"]["p50"] < arm["ttft"]["p95"] < arm["ttft"]["p99"]
    need = n_for_proportions(exp.arms["control"].error_rate + 0.01, exp.arms["control"].error_rate, 0.01)
    assert same["errors"]["needed_per_arm"] == need and same["errors"]["remaining"] == max(0, need - 1500)


def test_feedback_reaches_the_arm_that_served_the_request():
    exp = Experiment("e", {}, ["a", "b"], started_at=0.0, remember=2)
    exp.record("a", request_id="r1")
    exp.record("b", request_id="r2")
    assert exp.feedback("r2", 1.0) and exp.arms["b"].feedback.n == 1 and exp.arms["a"].feedback.n == 0
    exp.record("a", request_id="r3")  # r1 is forgotten (bounded memory)
    assert not exp.feedback("r1", 1.0) and not exp.feedback("nope", 1.0)
    exp.stop(10.0)
    exp.record("a", request_id="r4")
    assert exp.arms["a"].requests == 2


def test_thompson_bandit_prefers_the_better_arm_but_keeps_exploring():
    bandit = ThompsonBandit([1, 2], min_share=0.05)
    rng = random.Random(11)
    truth = {1: 0.3, 2: 0.7}
    picks = []
    for _ in range(2000):
        v = bandit.choose(rng)
        picks.append(v)
        bandit.update(v, 1.0 if rng.random() < truth[v] else 0.0)
    assert picks[-500:].count(2) / 500 > 0.8
    # exploration alone sends Binomial(2000, 0.05) requests to arm 1
    assert picks.count(1) >= stats.binom.ppf(1e-3, 2000, 0.05)
    again = ThompsonBandit.from_dict(bandit.to_dict())
    assert again.alpha == bandit.alpha and again.beta == bandit.beta


def test_bandit_rejects_bad_settings():
    from servelm.control.errors import ControlError
    with pytest.raises(ControlError):
        ThompsonBandit([1, 2, 3], min_share=0.5)
    with pytest.raises(ControlError):
        ThompsonBandit([1, 1])
