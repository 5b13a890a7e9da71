"""The desired state of one model's deployment: a `DeploymentSpec`, stored in the registry's database
(control/spec_store.py) and driven into being by the reconciler (control/reconciler.py).

Its parts reuse the control plane's own types and checks: the split is a `TrafficPolicy`'s arms (sticky,
shadow), a canary is a `CanaryConfig` against the split's one weighted version, the routing strategy is a
Deployment's, the prediction-log mode the PredictionLog's, and autoscaling takes the figures the Ray Serve
policy (servelm/ray/app.py) scales on: running + waiting requests per worker and KV cache usage.

`from_dict` accepts the dict form (an admin request body, a YAML/JSON file) and raises InvalidRequest
(code="invalid_spec", param=<the field's path>) naming the first thing wrong; `to_dict` is its inverse.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from servelm.control.canary import CanaryConfig, CanaryThresholds
from servelm.control.errors import ControlError, InvalidRequest
from servelm.control.traffic import Arm, Shadow, TrafficPolicy
from servelm.control.types import MAX_VERSION

STRATEGIES = ("round_robin", "least_loaded", "memory_aware", "prefix_aware")
LOG_MODES = ("off", "metadata", "full")
MAX_WORKERS = 64  # what POST /admin/deployments accepts
NAME = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")  # a registry model name (128: the models table's key length)


def _bad(message: str, param: str) -> ControlError:
    return InvalidRequest(message, code="invalid_spec", param=param)


@dataclass(frozen=True)
class VersionWeight:
    """A version that is deployed, and its share of the model's traffic (weights are normalised; 0: deployed,
    no traffic)."""

    version: int
    weight: float = 1.0


@dataclass(frozen=True)
class CanarySpec:
    """Roll `version` out against the spec's one weighted version, as POST /admin/models/{name}/canary does."""

    version: int
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 100.0)
    min_requests: int = 200
    min_seconds: float = 300.0
    thresholds: Mapping[str, float] = field(default_factory=dict)

    def config(self, model: str, production: int) -> CanaryConfig:
        return CanaryConfig(model=model, production=production, canary=self.version, steps=list(self.steps),
                            min_requests=self.min_requests, min_seconds=self.min_seconds,
                            thresholds=CanaryThresholds(**dict(self.thresholds)))


@dataclass(frozen=True)
class Autoscaling:
    """Workers per version between min_workers and max_workers: enough for every running and waiting request at
    `target_ongoing_requests` each, one more while requests wait and KV cache usage is over `kv_cache_high`.
    A change is made once the wish has held for its delay (up or down)."""

    target_ongoing_requests: float = 8.0
    kv_cache_high: float = 0.9
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    versions: tuple[VersionWeight, ...]
    sticky: bool = False
    canary: CanarySpec | None = None
    shadow: Shadow | None = None
    workers: int = 1  # desired (the starting count when autoscaled)
    min_workers: int = 1
    max_workers: int = 1
    strategy: str = "least_loaded"
    prediction_log: str | None = None  # None: the server's setting stands
    autoscaling: Autoscaling | None = None

    @property
    def primary(self) -> int:
        """The version a canary is compared with: the one with the largest weight (the first among equals)."""
        return max(self.versions, key=lambda v: v.weight).version

    def needed(self) -> list[int]:
        """Every version that must have a deployment: the split's, the canary's and the shadow's."""
        out = [v.version for v in self.versions]
        for extra in (self.canary.version if self.canary else None, self.shadow.version if self.shadow else None):
            if extra is not None and extra not in out:
                out.append(extra)
        return out

    def policy(self, salt: str = "") -> TrafficPolicy:
        """The traffic policy the split asks for (not used while a canary runs: the canary sets its own)."""
        return TrafficPolicy(model=self.name, arms=[Arm(v.version, v.weight) for v in self.versions],
                             sticky=self.sticky, shadow=self.shadow, salt=salt)

    def with_(self, **changes: Any) -> DeploymentSpec:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "versions": [{"version": v.version, "weight": v.weight} for v in self.versions],
            "sticky": self.sticky,
            "canary": None if self.canary is None else {
                "version": self.canary.version, "steps": list(self.canary.steps),
                "min_requests": self.canary.min_requests, "min_seconds": self.canary.min_seconds,
                "thresholds": dict(self.canary.thresholds)},
            "shadow": None if self.shadow is None else {"version": self.shadow.version,
                                                        "fraction": self.shadow.fraction,
                                                        "source": self.shadow.source},
            "workers": self.workers, "min_workers": self.min_workers, "max_workers": self.max_workers,
            "strategy": self.strategy, "prediction_log": self.prediction_log,
            "autoscaling": None if self.autoscaling is None else vars(self.autoscaling).copy(),
        }

    @classmethod
    def from_dict(cls, d: Any) -> DeploymentSpec:
        return _parse(d)


# -- parsing -------------------------------------------------------------------------------------------------
_TOP = {"name", "versions", "sticky", "canary", "shadow", "workers", "min_workers", "max_workers", "strategy",
        "prediction_log", "autoscaling"}


def _fields(d: Any, allowed: set[str], where: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise _bad(f"{where or 'a deployment spec'} must be an object, not {type(d).__name__}", where or "spec")
    unknown = sorted(set(d) - allowed)
    if unknown:
        at = f"{where}." if where else ""
        raise _bad(f"unknown field {at}{unknown[0]}; known: {', '.join(sorted(allowed))}", f"{at}{unknown[0]}")
    return d


def _int(v: Any, param: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{param} must be an integer from {lo} to {hi}, not {v!r}", param)
    return v


def _num(v: Any, param: str, lo: float = 0.0, hi: float = math.inf, low_open: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if not ok or v < lo or (low_open and v == lo) or v > hi:
        bound = f"{'>' if low_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi != math.inf else "")
        raise _bad(f"{param} must be a finite number {bound}, not {v!r}", param)
    return float(v)


def _version(v: Any, param: str) -> int:
    return _int(v, param, 1, MAX_VERSION)


def _parse(d: Any) -> DeploymentSpec:
    d = _fields(d, _TOP, "")
    name = d.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(f"name must be a registered model's name (letters, digits, '.', '_', '-'), not {name!r}", "name")
    raw = d.get("versions")
    if not isinstance(raw, list) or not raw:
        raise _bad("versions must list at least one {version, weight}", "versions")
    versions: list[VersionWeight] = []
    for i, item in enumerate(raw):
        item = {"version": item} if isinstance(item, int) and not isinstance(item, bool) else item
        item = _fields(item, {"version", "weight"}, f"versions[{i}]")
        v = _version(item.get("version"), f"versions[{i}].version")
        if any(x.version == v for x in versions):
            raise _bad(f"version {v} is listed twice", f"versions[{i}].version")
        versions.append(VersionWeight(v, _num(item.get("weight", 1.0), f"versions[{i}].weight")))
    if not any(v.weight > 0 for v in versions):
        raise _bad("at least one version needs a weight above 0", "versions")
    sticky = d.get("sticky", False)
    if not isinstance(sticky, bool):
        raise _bad("sticky must be true or false", "sticky")
    spec = DeploymentSpec(name=name, versions=tuple(versions), sticky=sticky,
                          canary=_canary(d.get("canary"), versions), shadow=_shadow(d.get("shadow"), versions),
                          **_workers(d), strategy=_strategy(d.get("strategy", "least_loaded")),
                          prediction_log=_mode(d.get("prediction_log")), autoscaling=_autoscaling(d.get("autoscaling")))
    if spec.canary is not None:
        try:  # the canary controller's own checks (steps, thresholds), against the version it is compared with
            spec.canary.config(name, spec.primary)
        except ControlError as e:
            raise _bad(f"canary: {e.message}", f"canary.{e.param or 'steps'}") from None
        except TypeError as e:  # an unknown threshold name
            raise _bad(f"canary.thresholds: {e}", "canary.thresholds") from None
    try:
        spec.policy()  # the traffic policy's own checks
    except ControlError as e:
        raise _bad(e.message, e.param or "versions") from None
    return spec


def _canary(c: Any, versions: list[VersionWeight]) -> CanarySpec | None:
    if c is None:
        return None
    c = _fields(c, {"version", "steps", "min_requests", "min_seconds", "thresholds"}, "canary")
    v = _version(c.get("version"), "canary.version")
    if any(x.version == v for x in versions):
        raise _bad(f"the canary version {v} must not be in versions (the canary sets its traffic itself)",
                   "canary.version")
    if sum(1 for x in versions if x.weight > 0) != 1:
        raise _bad("with a canary, versions must give traffic to exactly one version (the one it is compared "
                   "with)", "versions")
    steps = c.get("steps", [1.0, 5.0, 25.0, 100.0])
    if not isinstance(steps, list) or not steps:
        raise _bad("canary.steps must list percentages", "canary.steps")
    th = c.get("thresholds") or {}
    if not isinstance(th, Mapping):
        raise _bad("canary.thresholds must be an object", "canary.thresholds")
    return CanarySpec(version=v, steps=tuple(_num(s, f"canary.steps[{i}]", 0, 100, low_open=True)
                                             for i, s in enumerate(steps)),
                      min_requests=_int(c.get("min_requests", 200), "canary.min_requests", 1, 10**9),
                      min_seconds=_num(c.get("min_seconds", 300.0), "canary.min_seconds"),
                      thresholds={str(k): _num(x, f"canary.thresholds.{k}") for k, x in th.items()})


def _shadow(s: Any, versions: list[VersionWeight]) -> Shadow | None:
    if s is None:
        return None
    s = _fields(s, {"version", "fraction", "source"}, "shadow")
    v = _version(s.get("version"), "shadow.version")
    source = s.get("source")
    if source is not None:
        source = _version(source, "shadow.source")
        if not any(x.version == source for x in versions):
            raise _bad(f"shadow.source {source} is not one of versions", "shadow.source")
    return Shadow(version=v, fraction=_num(s.get("fraction", 1.0), "shadow.fraction", 0, 1), source=source)


def _workers(d: Mapping[str, Any]) -> dict:
    """workers defaults to min_workers (else 1), min_workers to workers, max_workers to the larger of the two."""
    given = _int(d["workers"], "workers", 1, MAX_WORKERS) if "workers" in d else None
    lo = _int(d.get("min_workers", given or 1), "min_workers", 1, MAX_WORKERS)
    workers = lo if given is None else given
    hi = _int(d.get("max_workers", max(workers, lo)), "max_workers", 1, MAX_WORKERS)
    if workers > hi:
        raise _bad(f"workers ({workers}) is above max_workers ({hi})", "workers")
    if lo > hi:
        raise _bad(f"min_workers ({lo}) is above max_workers ({hi})", "min_workers")
    if not lo <= workers <= hi:
        raise _bad(f"workers ({workers}) must be between min_workers ({lo}) and max_workers ({hi})", "workers")
    return {"workers": workers, "min_workers": lo, "max_workers": hi}


def _strategy(s: Any) -> str:
    if s not in STRATEGIES:
        raise _bad(f"strategy must be one of {', '.join(STRATEGIES)}, not {s!r}", "strategy")
    return s


def _mode(m: Any) -> str | None:
    if m is not None and m not in LOG_MODES:
        raise _bad(f"prediction_log must be one of {', '.join(LOG_MODES)}, not {m!r}", "prediction_log")
    return m


def _autoscaling(a: Any) -> Autoscaling | None:
    if a is None:
        return None
    a = _fields(a, {"target_ongoing_requests", "kv_cache_high", "upscale_delay_s", "downscale_delay_s"},
                "autoscaling")
    base = Autoscaling()
    return Autoscaling(
        target_ongoing_requests=_num(a.get("target_ongoing_requests", base.target_ongoing_requests),
                                     "autoscaling.target_ongoing_requests", 0, low_open=True),
        kv_cache_high=_num(a.get("kv_cache_high", base.kv_cache_high), "autoscaling.kv_cache_high", 0, 1),
        upscale_delay_s=_num(a.get("upscale_delay_s", base.upscale_delay_s), "autoscaling.upscale_delay_s"),
        downscale_delay_s=_num(a.get("downscale_delay_s", base.downscale_delay_s),
                               "autoscaling.downscale_delay_s"))


def load_documents(docs: Any) -> list[dict]:
    """The spec dicts in a parsed file: one spec, a list of them, or {"deployments": [...]} (the Helm values'
    shape); each still to be checked by `DeploymentSpec.from_dict`."""
    out: list[dict] = []
    for doc in docs if isinstance(docs, list) else [docs]:
        if doc is None:  # an empty YAML document (a trailing ---)
            continue
        if isinstance(doc, Mapping) and set(doc) == {"deployments"}:
            out += load_documents(doc["deployments"] or [])
        elif isinstance(doc, list):
            out += load_documents(doc)
        else:
            out.append(doc)
    return out


def parse_text(text: str, source: str = "the file") -> list[DeploymentSpec]:
    """Every spec in a YAML or JSON text (JSON is YAML); a model named twice is an error."""
    import yaml

    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise _bad(f"{source} is neither YAML nor JSON: {e}", "spec") from None
    out: list[DeploymentSpec] = []
    for i, d in enumerate(load_documents(docs)):
        try:
            spec = DeploymentSpec.from_dict(d)
        except ControlError as e:
            raise _bad(f"{source}, spec {i + 1}: {e.message}", e.param or "spec") from None
        if any(s.name == spec.name for s in out):
            raise _bad(f"{source} has two specs for {spec.name!r}", "name")
        out.append(spec)
    return out
