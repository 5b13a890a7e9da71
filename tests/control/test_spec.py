"""The deployment spec's schema (control/spec.py), how operators' verbs are folded into it
(control/spec_adopt.py), autoscaling's decision (control/autoscale.py) and status conditions
(control/conditions.py): pure functions, no server."""

from __future__ import annotations

import pytest

from servelm.control import spec_adopt
from servelm.control.autoscale import Wish, decide, wanted
from servelm.control.conditions import merge
from servelm.control.errors import ControlError, InvalidRequest
from servelm.control.spec import Autoscaling, DeploymentSpec, parse_text

FULL = {"name": "m", "versions": [{"version": 1, "weight": 90}, {"version": 2, "weight": 10}], "sticky": True,
        "shadow": {"version": 3, "fraction": 0.25, "source": 1}, "workers": 2, "min_workers": 1, "max_workers": 4,
        "strategy": "prefix_aware", "prediction_log": "full",
        "autoscaling": {"target_ongoing_requests": 4, "kv_cache_high": 0.8, "upscale_delay_s": 5,
                        "downscale_delay_s": 60}}


def test_a_spec_round_trips_and_defaults_are_filled():
    spec = DeploymentSpec.from_dict(FULL)
    assert DeploymentSpec.from_dict(spec.to_dict()) == spec
    assert spec.needed() == [1, 2, 3] and spec.primary == 1
    assert spec.policy().to_dict()["shadow"] == {"version": 3, "fraction": 0.25, "source": 1}
    small = DeploymentSpec.from_dict({"name": "m", "versions": [7]})
    assert (small.workers, small.min_workers, small.max_workers, small.strategy, small.prediction_log,
            small.canary, small.autoscaling) == (1, 1, 1, "least_loaded", None, None, None)
    assert DeploymentSpec.from_dict({"name": "m", "versions": [1], "min_workers": 2}).workers == 2


def test_files_hold_one_spec_a_list_or_the_helm_shape_in_yaml_or_json():
    one = "name: a\nversions: [1]\n"
    assert [s.name for s in parse_text(one)] == ["a"]
    assert [s.name for s in parse_text(one + "---\nname: b\nversions: [1]\n---\n")] == ["a", "b"]
    assert [s.name for s in parse_text('[{"name": "a", "versions": [1]}, {"name": "b", "versions": [2]}]')] == \
        ["a", "b"]
    assert [s.name for s in parse_text('{"deployments": [{"name": "c", "versions": [1]}]}')] == ["c"]
    with pytest.raises(ControlError, match="has two specs for 'a'"):
        parse_text(one + "---\n" + one)
    with pytest.raises(ControlError, match=r"f.yaml, spec 2: versions\[0\].version must be an integer") as e:
        parse_text(one + "---\nname: b\nversions: [{version: x}]\n", "f.yaml")
    assert e.value.param == "versions[0].version"
    with pytest.raises(ControlError, match="neither YAML nor JSON"):
        parse_text("name: [", "f.yaml")


@pytest.mark.parametrize(("change", "param"), [
    ({"name": "bad name"}, "name"),
    ({"versions": [{"version": 1, "weight": 0}]}, "versions"),
    ({"versions": [1, 1]}, "versions[1].version"),
    ({"shadow": {"version": 3, "fraction": 2}}, "shadow.fraction"),
    ({"shadow": {"version": 3, "source": 9}}, "shadow.source"),
    ({"min_workers": 3, "max_workers": 2, "workers": 2}, "min_workers"),
    ({"autoscaling": {"target_ongoing_requests": 0}}, "autoscaling.target_ongoing_requests"),
    ({"autoscaling": {"kv_cache_high": 1.5}}, "autoscaling.kv_cache_high"),
    ({"autoscaling": {"cpu": 1}}, "autoscaling.cpu"),
    ({"sticky": "yes"}, "sticky"),
    ({"versions": [1], "canary": {"version": 4, "thresholds": {"alpha": 2}}}, "canary.thresholds"),
    ({"versions": [1], "canary": {"version": 4, "min_requests": 0}}, "canary.min_requests"),
])
def test_each_mistake_is_named(change, param):
    with pytest.raises(ControlError) as e:
        DeploymentSpec.from_dict({**FULL, **change})
    assert isinstance(e.value, InvalidRequest)
    assert (e.value.code, e.value.param) == ("invalid_spec", param), e.value.message


def test_verbs_fold_into_the_spec():
    spec = DeploymentSpec.from_dict({"name": "m", "versions": [{"version": 1, "weight": 1}], "workers": 1})
    deployed = spec_adopt.on_deployment(spec, "deploy", None, {"name": "m", "version": 2, "workers": 3})
    assert [(v.version, v.weight) for v in deployed.versions] == [(1, 1.0), (2, 0.0)]
    scaled = spec_adopt.on_deployment(deployed, "scale", {"workers": 1}, {"name": "m", "version": 1, "workers": 5})
    assert (scaled.workers, scaled.min_workers, scaled.max_workers) == (5, 1, 5)
    swapped = spec_adopt.on_deployment(scaled, "swap", {"version": 1}, {"version": 3})
    assert [(v.version, v.weight) for v in swapped.versions] == [(3, 1.0), (2, 0.0)]
    unloaded = spec_adopt.on_deployment(swapped, "unload", {"name": "m", "version": 3}, None)
    assert [(v.version, v.weight) for v in unloaded.versions] == [(2, 1.0)]  # the traffic goes to what is left
    assert spec_adopt.on_deployment(unloaded, "unload", {"name": "m", "version": 2}, None) == spec_adopt.DELETE
    split = spec_adopt.on_policy(swapped, "policy.set", {"arms": [{"version": 2, "weight": 30}], "sticky": True,
                                                         "shadow": {"version": 3, "fraction": 0.5}}, None)
    assert [(v.version, v.weight) for v in split.versions] == [(2, 30.0), (3, 0.0)]
    assert (split.sticky, split.shadow.version) == (True, 3)
    cleared = spec_adopt.on_policy(split, "policy.delete", None, production=3)
    assert [(v.version, v.weight) for v in cleared.versions] == [(2, 0.0), (3, 1.0)] and cleared.shadow is None
    canary = spec_adopt.on_canary_start(cleared, {"production": 3, "canary": 2, "steps": [10, 100],
                                                  "min_requests": 5, "min_seconds": 0, "thresholds": {}})
    assert [(v.version, v.weight) for v in canary.versions] == [(3, 1.0)] and canary.canary.version == 2
    assert DeploymentSpec.from_dict(canary.to_dict()) == canary  # what a verb leaves is a valid spec
    assert spec_adopt.on_log_mode(canary, "off").prediction_log == "off"
    assert spec_adopt.on_policy(canary, "bandit.set", {"bandit": {}}, None) is None


def test_autoscaling_wants_the_ray_policy_count_and_waits_its_delays():
    a = Autoscaling(target_ongoing_requests=4, kv_cache_high=0.9, upscale_delay_s=10, downscale_delay_s=100)
    assert wanted(a, 1, running=6, waiting=3, kv_usage=0.1, lo=1, hi=8) == 3
    assert wanted(a, 3, running=2, waiting=1, kv_usage=0.95, lo=1, hi=8) == 4  # waiting with a full KV cache
    assert wanted(a, 1, running=100, waiting=0, kv_usage=0.0, lo=1, hi=5) == 5
    assert wanted(a, 2, running=0, waiting=0, kv_usage=0.0, lo=2, hi=5) == 2
    n, wish = decide(a, 1, 3, None, now=0.0)
    assert (n, wish) == (1, Wish(3, 0.0))
    assert decide(a, 1, 3, wish, now=9.0) == (1, wish)
    assert decide(a, 1, 3, wish, now=10.0) == (3, None)
    assert decide(a, 3, 1, Wish(1, 0.0), now=50.0)[0] == 3  # down waits longer
    assert decide(a, 3, 2, Wish(1, 0.0), now=500.0) == (3, Wish(2, 500.0))  # a new wish starts its own wait
    assert decide(a, 3, 3, Wish(1, 0.0), now=1.0) == (3, None)


def test_a_condition_keeps_its_transition_time_while_its_status_holds():
    first = merge(None, {"Ready": (False, "WorkersStarting", "m:1 is not ready")}, at=1.0)
    same = merge(first, {"Ready": (False, "WorkersStarting", "m:1 still starting")}, at=2.0)
    assert same[0]["last_transition_time"] == 1.0 and same[0]["message"] == "m:1 still starting"
    ready = merge(same, {"Ready": (True, "Serving", "ok"), "Degraded": (False, "Healthy", "")}, at=3.0)
    assert [(c["type"], c["status"], c["last_transition_time"]) for c in ready] == \
        [("Ready", "True", 3.0), ("Degraded", "False", 3.0)]
