"""Canary controller (servelm/control/canary.py): holds, advances, promotes a healthy canary and rolls back a
degraded one (errors, latency or feedback injected into synthetic traffic), with a fake clock."""

import math
import random

import pytest

from servelm.control.canary import (
    ADVANCE,
    HOLD,
    PROMOTE,
    ROLLBACK,
    CanaryConfig,
    CanaryController,
    CanaryThresholds,
)
from servelm.control.errors import ControlError, InvalidRequest
from servelm.control.traffic import RequestAttrs

PROD, CANARY = 1, 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def controller(clock: FakeClock, **kw) -> CanaryController:
    cfg = CanaryConfig(model="m", production=PROD, canary=CANARY, steps=[1, 5, 25, 100], min_requests=100,
                       min_seconds=60.0, **kw)
    return CanaryController(cfg, clock)


def drive(ctl: CanaryController, clock: FakeClock, *, seed: int = 0, err: float = 0.01, slow: float = 1.0,
          feedback: float = 0.7, limit: int = 200_000) -> list:
    """Synthetic traffic through the controller's own policy: each request advances the clock by 10 ms; the
    controller is evaluated every 200 requests. The canary's error rate, TTFT/TPOT multiplier and feedback
    success rate are the fault injected."""
    rng = random.Random(seed)
    decisions = []
    policy = ctl.policy()
    for i in range(limit):
        clock.now += 0.01
        v = policy.choose(RequestAttrs(user=f"u{i}"), rng).version
        bad = v == CANARY
        ctl.record(v, error=rng.random() < (err if bad else 0.01),
                   ttft=rng.lognormvariate(math.log(0.05 * (slow if bad else 1.0)), 0.25),
                   tpot=rng.lognormvariate(math.log(0.02 * (slow if bad else 1.0)), 0.2))
        ctl.feedback(v, 1.0 if rng.random() < (feedback if bad else 0.7) else 0.0)
        if i % 200 == 199:
            d = ctl.evaluate()
            if d.action != HOLD:
                decisions.append(d)
                policy = ctl.policy()
            if d.action in (PROMOTE, ROLLBACK):
                return decisions
    raise AssertionError(f"no final decision after {limit} requests: {decisions}")


def test_healthy_canary_walks_every_step_and_is_promoted():
    clock = FakeClock()
    ctl = controller(clock)
    assert ctl.weights() == {PROD: 99.0, CANARY: 1.0}
    decisions = drive(ctl, clock)
    assert [(d.action, d.percent) for d in decisions] == [(ADVANCE, 5.0), (ADVANCE, 25.0), (PROMOTE, 100.0)]
    assert not any(c.failed for d in decisions for c in d.checks)
    assert all(c.ran for c in decisions[-1].checks)  # every check had data at the last step
    assert ctl.status == "promoting"  # decided; "promoted" once the runner has applied it
    ctl.promotion_applied(True)
    assert ctl.status == "promoted" and ctl.weights() == {PROD: 0.0, CANARY: 100.0}
    assert ctl.evaluate().action == HOLD  # finished: nothing more to do


@pytest.mark.parametrize("fault,check", [
    ({"err": 0.2}, "error_rate"),
    ({"slow": 2.0}, "ttft_p95"),
    ({"feedback": 0.3}, "feedback"),
])
def test_degraded_canary_is_rolled_back_with_reasons(fault, check):
    clock = FakeClock()
    ctl = controller(clock)
    decisions = drive(ctl, clock, **fault)
    final = decisions[-1]
    assert final.action == ROLLBACK and final.percent == 0.0
    assert any(r.startswith(check) for r in final.reasons), final.reasons
    assert {c.name for c in final.checks if c.failed} >= {check}
    assert ctl.status == "rolled_back" and ctl.weights() == {PROD: 100.0, CANARY: 0.0}
    assert ctl.policy().choose(RequestAttrs(user="x")).version == PROD
    ctl.record(CANARY, error=True)  # after the decision nothing changes any more
    assert ctl.evaluate().action == HOLD


def test_small_difference_within_the_margin_is_not_a_rollback():
    clock = FakeClock()
    ctl = controller(clock, thresholds=CanaryThresholds(latency_ratio=1.5))
    assert drive(ctl, clock, slow=1.1)[-1].action == PROMOTE


def test_a_step_is_held_for_its_minimum_time_and_requests():
    clock = FakeClock()
    ctl = controller(clock)
    rng = random.Random(1)
    for _ in range(150):  # enough requests, no time: hold, saying why
        for v in (PROD, CANARY):
            ctl.record(v, error=False, ttft=rng.uniform(0.04, 0.06), tpot=0.02)
    d = ctl.evaluate()
    assert d.action == HOLD and d.percent == 1.0 and any("s more" in r for r in d.reasons)
    clock.now += 61
    d = ctl.evaluate()
    assert (d.action, d.step, d.percent) == (ADVANCE, 1, 5.0)
    clock.now += 61  # time, no requests in the new window: hold
    d = ctl.evaluate()
    assert d.action == HOLD and any("requests" in r for r in d.reasons)


def test_state_round_trips_and_config_is_validated():
    clock = FakeClock()
    ctl = controller(clock)
    ctl.step = 2
    again = CanaryController.from_dict(ctl.to_dict(), clock)
    assert again.step == 2 and again.percent == 25.0 and again.config == ctl.config
    for bad in [dict(production=1, canary=1), dict(production=1, canary=2, steps=[5, 1]),
                dict(production=1, canary=2, steps=[0, 10]),
                dict(production=1, canary=2, thresholds=CanaryThresholds(alpha=2))]:
        with pytest.raises(ControlError) as e:
            CanaryConfig(model="m", **bad)
        assert isinstance(e.value, InvalidRequest)
    with pytest.raises(ControlError):
        CanaryConfig.from_dict({"model": "m", "production": 1, "canary": 2, "nope": 1})
