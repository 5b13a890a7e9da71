"""Traffic policies (servelm/control/traffic.py): split, sticky users, segment rules, shadow, validation."""

import random

import pytest
from scipy import stats

from servelm.control.errors import ControlError, InvalidRequest, NotFound
from servelm.control.traffic import (
    Arm,
    RequestAttrs,
    SegmentRule,
    Shadow,
    TrafficPolicy,
    bucket,
    split,
)

N = 2000


def binomial_band(n: int, p: float, alpha: float = 1e-3) -> tuple[int, int]:
    """The central (1 - alpha) interval of Binomial(n, p): a correct split lands outside it 0.1% of the time."""
    return int(stats.binom.ppf(alpha / 2, n, p)), int(stats.binom.isf(alpha / 2, n, p))


def test_split_90_10_within_binomial_tolerance():
    policy = split("m", {1: 90, 2: 10})
    rng = random.Random(1234)
    counts = {1: 0, 2: 0}
    for _ in range(N):
        d = policy.choose(RequestAttrs(), rng)
        counts[d.version] += 1
        assert d.arm == f"v{d.version}" and d.shadow_version is None
    lo, hi = binomial_band(N, 0.10)
    assert lo <= counts[2] <= hi, (counts, lo, hi)
    assert counts[1] + counts[2] == N


def test_sticky_users_never_switch_and_split_by_users():
    policy = split("m", {1: 90, 2: 10}, sticky=True, salt="exp-1")
    users = [f"user-{i}" for i in range(N)]
    first = {u: policy.choose(RequestAttrs(user=u), random.Random(0)).version for u in users}
    for seed in range(5):  # other random sources, other orders: the same version for each user
        rng = random.Random(seed)
        for u in rng.sample(users, len(users)):
            assert policy.choose(RequestAttrs(user=u), rng).version == first[u]
    lo, hi = binomial_band(N, 0.10)
    assert lo <= sum(v == 2 for v in first.values()) <= hi
    # a policy restored from its dict (another process) buckets users the same way
    again = TrafficPolicy.from_dict(policy.to_dict())
    assert all(again.choose(RequestAttrs(user=u)).version == first[u] for u in users[:200])


def test_sticky_key_is_user_then_header_then_key_name():
    assert RequestAttrs(user="u", headers={"X-Servelm-User": "h"}, key_name="k").sticky_key() == "u"
    assert RequestAttrs(headers={"X-Servelm-User": "h"}, key_name="k").sticky_key() == "h"
    assert RequestAttrs(key_name="k").sticky_key() == "k"
    assert RequestAttrs().sticky_key() is None
    policy = split("m", {1: 50, 2: 50}, sticky=True)
    by_header = policy.choose(RequestAttrs(headers={"x-servelm-user": "alice"})).version
    assert all(policy.choose(RequestAttrs(user="alice"), random.Random(s)).version == by_header
               for s in range(20))


def test_sticky_salt_changes_buckets():
    keys = [f"u{i}" for i in range(200)]
    assert [bucket("a\x00m\x00" + k) for k in keys] != [bucket("b\x00m\x00" + k) for k in keys]
    assert all(0.0 <= bucket(k) < 1.0 for k in keys)


def test_segment_rules_first_match_wins_and_the_rest_splits():
    policy = TrafficPolicy(
        model="m", arms=[Arm(1, 100), Arm(2, 0)],
        segments=[
            SegmentRule(version=3, name="beta-header", headers={"x-beta": ["1", "yes"]}),
            SegmentRule(version=2, name="acme", key_groups=["acme"]),
            SegmentRule(version=4, name="acme-eu", key_groups=["acme"], metadata={"region": "eu"}),
            SegmentRule(version=5, name="flag", flags=["new-ui"], key_names=["k1", "k2"]),
        ])
    rng = random.Random(0)
    # a header sends this key's traffic to the pinned version, whatever else matches later
    d = policy.choose(RequestAttrs(key_name="k1", key_group="acme", headers={"X-Beta": "yes"}), rng)
    assert (d.version, d.arm) == (3, "segment:beta-header")
    # the acme rule comes before the more specific acme-eu one: first match wins
    assert policy.choose(RequestAttrs(key_group="acme", metadata={"region": "eu"}), rng).version == 2
    # all conditions of a rule must hold
    assert policy.choose(RequestAttrs(key_name="k1", flags={"new-ui"}), rng).version == 5
    assert policy.choose(RequestAttrs(key_name="k3", flags={"new-ui"}), rng).version == 1
    assert policy.choose(RequestAttrs(key_name="k1"), rng).version == 1
    assert policy.choose(RequestAttrs(headers={"x-beta": "no"}), rng).arm == "v1"


def test_shadow_mirrors_a_fraction_of_its_source_only():
    policy = TrafficPolicy(model="m", arms=[Arm(1, 50), Arm(2, 50)], shadow=Shadow(version=3, fraction=0.2,
                                                                                   source=1))
    rng = random.Random(7)
    served1 = mirrored = 0
    for _ in range(N):
        d = policy.choose(RequestAttrs(), rng)
        if d.version == 2:
            assert d.shadow_version is None
        else:
            served1 += 1
            mirrored += d.shadow_version == 3
    lo, hi = binomial_band(served1, 0.2)
    assert lo <= mirrored <= hi
    # a shadow never mirrors a request to the version that serves it
    same = TrafficPolicy(model="m", arms=[Arm(3, 1)], shadow=Shadow(version=3, fraction=1.0))
    assert same.choose(RequestAttrs()).shadow_version is None


def test_round_trip_through_dict():
    policy = TrafficPolicy(model="m", arms=[Arm(1, 9, "control"), Arm(2, 1, "treatment")], sticky=True,
                           segments=[SegmentRule(version=2, headers={"x-a": ["b"]}, metadata={"t": 1})],
                           shadow=Shadow(version=3, fraction=0.5, source=1), salt="s")
    again = TrafficPolicy.from_dict(policy.to_dict())
    assert again == policy
    assert again.versions() == {1, 2, 3}
    # a header condition given as one string is accepted
    assert TrafficPolicy.from_dict({"model": "m", "arms": [{"version": 1}],
                                    "segments": [{"version": 1, "headers": {"x": "y"}}]}).segments[0].headers == {
        "x": ["y"]}


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "arms": []}, "arms"),
    ({"model": "", "arms": [{"version": 1}]}, "model"),
    ({"model": "m", "arms": [{"version": 0, "weight": 1}]}, "arms[0].version"),
    ({"model": "m", "arms": [{"version": 1, "weight": -1}]}, "arms[0].weight"),
    ({"model": "m", "arms": [{"version": 1, "weight": 0}]}, "arms"),
    ({"model": "m", "arms": [{"version": 1}, {"version": 1}]}, "arms[1].version"),
    ({"model": "m", "arms": [{"version": 1}], "segments": [{"version": 2}]}, "segments[0]"),
    ({"model": "m", "arms": [{"version": 1}], "shadow": {"version": 2, "fraction": 1.5}}, "shadow.fraction"),
    ({"model": "m"}, "policy"),
    ({"model": "m", "arms": [{"weight": 1}]}, "policy"),
    ({"model": "m", "arms": "nope"}, "policy"),
])
def test_invalid_policies_are_400(body, param):
    with pytest.raises(ControlError) as e:
        TrafficPolicy.from_dict(body)
    assert isinstance(e.value, InvalidRequest)
    assert (e.value.code, e.value.param) == ("invalid_policy", param)


def test_policies_are_stored_and_every_change_audited(database_url):
    from servelm.control import db
    from servelm.control.audit import Audit
    from servelm.control.policies import PolicyStore
    engine = db.open_engine(database_url)
    audit = Audit(engine)
    store = PolicyStore(engine, audit)
    p1, p2 = split("m", {1: 90, 2: 10}, sticky=True), split("m", {1: 50, 2: 50})
    store.set_policy(p1, actor="alice")
    store.set_policy(p2, actor="bob")
    store.put("canary", "m", {"step": 1}, actor="system", action="canary.advance")
    # a new store over the same database (a restarted server) sees the same policy
    again = PolicyStore(db.open_engine(database_url), Audit(engine))
    assert again.policy("m") == p2 and again.all("canary") == {"m": {"step": 1}} and again.policy("x") is None
    assert again.delete("policy", "m", actor="carol") == p2.to_dict() and again.policy("m") is None
    entries = [(e["actor"], e["action"], e["target"], e["before"], e["after"]) for e in audit.entries()]
    assert entries == [("alice", "policy.set", "policy:m", None, p1.to_dict()),
                       ("bob", "policy.set", "policy:m", p1.to_dict(), p2.to_dict()),
                       ("system", "canary.advance", "canary:m", None, {"step": 1}),
                       ("carol", "policy.delete", "policy:m", p2.to_dict(), None)]
    assert audit.verify() == (True, None)
    with pytest.raises(ControlError) as e:
        again.delete("policy", "m", actor="carol")
    assert isinstance(e.value, NotFound)
    with pytest.raises(ControlError):
        again.get("nope", "m")
