"""How an imperative admin verb on a model that has a spec changes that spec, so the spec stays the one
desired state (otherwise the reconciler would undo the verb on its next pass).

The rule: a verb that succeeds is written into the spec, as the smallest change that makes the spec ask for
what the verb did. Each function here is that change for one verb, a pure function of the spec and the
verb's record; None means the verb does not touch what the spec owns.

- deploy NAME:V: V joins `versions` with weight 0 (deployed, no traffic); it runs the spec's worker count;
- scale: `workers` (min/max widened to hold it);
- swap (and promotions and rollbacks, which swap): the old version's entry names the new version;
- unload: the version leaves the spec (its weight goes to the first one left; the last: the spec is deleted);
- traffic policy set (PUT traffic, PUT/DELETE shadow, an experiment's start): `versions` weights, `sticky`,
  `shadow` (versions not in the policy stay, at weight 0); policy removed: the PRODUCTION version (else the
  first) takes all traffic, no shadow;
- canary started: `canary` (its production version takes all traffic);
- prediction-log mode: `prediction_log`.

What the system does by itself (a canary's steps, its promotion or rollback, evictions) is not a verb: the
reconciler reads a canary's outcome itself (control/reconciler.py).
"""

from __future__ import annotations

from servelm.control.spec import CanarySpec, DeploymentSpec, VersionWeight
from servelm.control.traffic import Shadow

DELETE = "delete"  # what on_deployment returns when the spec's last version was unloaded


def on_deployment(spec: DeploymentSpec, action: str, before: dict | None, after: dict | None
                  ) -> DeploymentSpec | str | None:
    versions = list(spec.versions)
    have = {v.version for v in versions}
    if action == "deploy" and after is not None:
        v = int(after["version"])
        return None if v in spec.needed() else spec.with_(versions=(*versions, VersionWeight(v, 0.0)))
    if action == "scale" and after is not None:
        n = int(after["workers"])
        return spec.with_(workers=n, min_workers=min(spec.min_workers, n), max_workers=max(spec.max_workers, n))
    if action == "swap" and before is not None and after is not None:
        old, new = int(before["version"]), int(after["version"])
        if old not in have or new in have:
            return None
        return spec.with_(versions=tuple(VersionWeight(new, v.weight) if v.version == old else v for v in versions))
    if action == "unload" and before is not None:
        gone = int(before["version"])
        if spec.canary is not None and spec.canary.version == gone:
            return spec.with_(canary=None)
        if spec.shadow is not None and spec.shadow.version == gone:
            return spec.with_(shadow=None)
        left = [v for v in versions if v.version != gone]
        if len(left) == len(versions):
            return None
        if not left:
            return DELETE
        if not any(v.weight > 0 for v in left):
            left[0] = VersionWeight(left[0].version, 1.0)
        shadow = spec.shadow if spec.shadow is None or spec.shadow.source != gone else None
        return spec.with_(versions=tuple(left), shadow=shadow,
                          canary=spec.canary if len([v for v in left if v.weight > 0]) == 1 else None)
    return None


def on_policy(spec: DeploymentSpec, action: str, record: dict | None, production: int | None
              ) -> DeploymentSpec | None:
    """A traffic policy stored (`record`, its dict form) or removed (None). A bandit is not a split: not
    adopted (the reconciler leaves a bandit's traffic alone, see there)."""
    if record is not None and "bandit" in record:
        return None
    if record is None:
        keep = production if production in {v.version for v in spec.versions} else spec.versions[0].version
        return spec.with_(versions=tuple(VersionWeight(v.version, 1.0 if v.version == keep else 0.0)
                                         for v in spec.versions), shadow=None, sticky=False, canary=None)
    arms = [VersionWeight(int(a["version"]), float(a["weight"])) for a in record["arms"]]
    listed = {a.version for a in arms}
    rest = [VersionWeight(v.version, 0.0) for v in spec.versions if v.version not in listed]
    sh = record.get("shadow")
    shadow = Shadow(int(sh["version"]), float(sh["fraction"]), sh.get("source")) if sh else None
    return spec.with_(versions=tuple(arms + rest), sticky=bool(record.get("sticky")), shadow=shadow, canary=None)


def on_canary_start(spec: DeploymentSpec, config: dict) -> DeploymentSpec:
    prod, canary = int(config["production"]), int(config["canary"])
    versions = [VersionWeight(v.version, 1.0 if v.version == prod else 0.0)
                for v in spec.versions if v.version != canary]
    if prod not in {v.version for v in versions}:
        versions.insert(0, VersionWeight(prod, 1.0))
    return spec.with_(versions=tuple(versions), canary=CanarySpec(
        version=canary, steps=tuple(float(s) for s in config["steps"]), min_requests=int(config["min_requests"]),
        min_seconds=float(config["min_seconds"]), thresholds=dict(config.get("thresholds") or {})))


def on_log_mode(spec: DeploymentSpec, mode: str) -> DeploymentSpec:
    return spec.with_(prediction_log=mode)
