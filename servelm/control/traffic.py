"""Traffic policies: which version of a model serves a request.

A policy is per model name and is plain data (to/from dict, so it can be stored and audited). `choose` is a
pure function of the policy, the request's attributes and a random source:

1. segment rules, in order: the first rule whose conditions all hold sends the request to its version;
2. otherwise the weighted split over versions, random per request or sticky (a stable hash of the user key,
   so the same user gets the same version as long as the weights stay the same);
3. independently, a fraction of the traffic served by the shadow's source version is mirrored to the shadow
   version (the caller runs the mirror asynchronously; the client sees only the primary's answer).

HTTP wiring (the router asks `choose` per request, the admin API changes policies) comes with the admin API.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from servelm.control.errors import ControlError, InvalidRequest

USER_HEADER = "x-servelm-user"


def _bad(message: str, param: str) -> ControlError:
    return InvalidRequest(message, code="invalid_policy", param=param)


@dataclass
class RequestAttrs:
    """What a policy may look at in a request. The caller fills it from the request body and headers."""

    user: str | None = None  # the body's `user` field
    key_name: str | None = None  # the API key's name
    key_group: str | None = None  # one group of the API key (tenant); `key_groups` holds them all
    key_groups: frozenset[str] = frozenset()  # the API key's groups (from the keys file)
    headers: Mapping[str, str] = field(default_factory=dict)  # names in any case
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the request's `metadata` object
    flags: frozenset[str] | set[str] = frozenset()  # feature flags on for this request

    def header(self, name: str) -> str | None:
        """A header's value, whatever the case of its name."""
        name = name.lower()
        for k, v in self.headers.items():
            if k.lower() == name:
                return v
        return None

    def sticky_key(self) -> str | None:
        """Who the request is for, for sticky assignment: `user`, else the x-servelm-user header, else the
        API key's name."""
        return self.user or self.header(USER_HEADER) or self.key_name


@dataclass
class SegmentRule:
    """Send requests that match every given condition to `version`. Conditions on lists match any listed
    value; a header condition may list the accepted values."""

    version: int
    name: str = ""
    key_names: list[str] = field(default_factory=list)
    key_groups: list[str] = field(default_factory=list)
    headers: dict[str, list[str]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # each key must equal the value
    flags: list[str] = field(default_factory=list)  # every flag must be on

    def matches(self, a: RequestAttrs) -> bool:
        """True when every condition given holds for `a`."""
        if self.key_names and a.key_name not in self.key_names:
            return False
        if self.key_groups and not ({a.key_group, *a.key_groups} & set(self.key_groups)):
            return False
        for h, accepted in self.headers.items():
            if a.header(h) not in accepted:
                return False
        for k, v in self.metadata.items():
            if k not in a.metadata or a.metadata[k] != v:
                return False
        return all(f in a.flags for f in self.flags)

    @property
    def label(self) -> str:
        return f"segment:{self.name or self.version}"

    def to_dict(self) -> dict:
        return {"version": self.version, "name": self.name, "key_names": list(self.key_names),
                "key_groups": list(self.key_groups), "headers": {k: list(v) for k, v in self.headers.items()},
                "metadata": dict(self.metadata), "flags": list(self.flags)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SegmentRule:
        headers = {str(k): [v] if isinstance(v, str) else [str(x) for x in v]
                   for k, v in (d.get("headers") or {}).items()}
        return cls(version=d["version"], name=d.get("name", ""), key_names=list(d.get("key_names") or []),
                   key_groups=list(d.get("key_groups") or []), headers=headers,
                   metadata=dict(d.get("metadata") or {}), flags=list(d.get("flags") or []))


@dataclass
class Arm:
    """One side of the split: a version and its weight (any non-negative numbers; they are normalised)."""

    version: int
    weight: float
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or f"v{self.version}"


@dataclass
class Shadow:
    """Mirror `fraction` of the requests served by `source` (any version when None) to `version`."""

    version: int
    fraction: float
    source: int | None = None


@dataclass
class Decision:
    """Where one request goes: the version that answers, the arm label (for metrics and experiments), and
    the version that gets a mirrored copy, if any."""

    version: int
    arm: str
    shadow_version: int | None = None


@dataclass
class TrafficPolicy:
    """A model's traffic policy. `salt` makes sticky buckets independent between experiments."""

    model: str
    arms: list[Arm]
    sticky: bool = False
    segments: list[SegmentRule] = field(default_factory=list)
    shadow: Shadow | None = None
    salt: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequest(code="invalid_policy") naming the first thing wrong."""
        if not self.model:
            raise _bad("a policy needs a model name", "model")
        if not self.arms:
            raise _bad("a policy needs at least one arm", "arms")
        seen: set[int] = set()
        for i, a in enumerate(self.arms):
            if not isinstance(a.version, int) or isinstance(a.version, bool) or a.version < 1:
                raise _bad(f"arms[{i}].version must be a positive integer", f"arms[{i}].version")
            if a.version in seen:
                raise _bad(f"version {a.version} appears in two arms", f"arms[{i}].version")
            seen.add(a.version)
            if not isinstance(a.weight, (int, float)) or not a.weight >= 0 or a.weight == float("inf"):
                raise _bad(f"arms[{i}].weight must be a finite number >= 0", f"arms[{i}].weight")
        if sum(a.weight for a in self.arms) <= 0:
            raise _bad("the arms' weights must not all be 0", "arms")
        for i, r in enumerate(self.segments):
            if not isinstance(r.version, int) or isinstance(r.version, bool) or r.version < 1:
                raise _bad(f"segments[{i}].version must be a positive integer", f"segments[{i}].version")
            if not (r.key_names or r.key_groups or r.headers or r.metadata or r.flags):
                raise _bad(f"segments[{i}] has no condition (it would match every request)", f"segments[{i}]")
        if self.shadow is not None:
            s = self.shadow
            if not isinstance(s.fraction, (int, float)) or not 0.0 <= s.fraction <= 1.0:
                raise _bad("shadow.fraction must be between 0 and 1", "shadow.fraction")
            if not isinstance(s.version, int) or s.version < 1:
                raise _bad("shadow.version must be a positive integer", "shadow.version")

    def versions(self) -> set[int]:
        """Every version the policy can send traffic to (including the shadow)."""
        out = {a.version for a in self.arms if a.weight > 0} | {r.version for r in self.segments}
        return out | ({self.shadow.version} if self.shadow and self.shadow.fraction > 0 else set())

    def choose(self, attrs: RequestAttrs, rng: random.Random | None = None) -> Decision:
        """The decision for one request (see the module docstring for the order)."""
        rng = rng or random
        rule = next((r for r in self.segments if r.matches(attrs)), None)
        if rule is not None:
            version, arm = rule.version, rule.label
        else:
            key = attrs.sticky_key() if self.sticky else None
            u = bucket(f"{self.salt}\x00{self.model}\x00{key}") if key is not None else rng.random()
            chosen = pick(self.arms, u)
            version, arm = chosen.version, chosen.label
        shadow = None
        s = self.shadow
        if (s is not None and s.version != version and (s.source is None or s.source == version)
                and rng.random() < s.fraction):
            shadow = s.version
        return Decision(version=version, arm=arm, shadow_version=shadow)

    def to_dict(self) -> dict:
        return {"model": self.model, "sticky": self.sticky, "salt": self.salt,
                "arms": [{"version": a.version, "weight": a.weight, "name": a.name} for a in self.arms],
                "segments": [r.to_dict() for r in self.segments],
                "shadow": None if self.shadow is None else {"version": self.shadow.version,
                                                            "fraction": self.shadow.fraction,
                                                            "source": self.shadow.source}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrafficPolicy:
        """Build and validate a policy from its dict form (e.g. an admin request body); malformed input is a
        InvalidRequest, never a KeyError/TypeError."""
        try:
            arms = [Arm(version=a["version"], weight=a.get("weight", 1.0), name=a.get("name", ""))
                    for a in d["arms"]]
            segments = [SegmentRule.from_dict(r) for r in d.get("segments") or []]
            sh = d.get("shadow")
            shadow = None if not sh else Shadow(version=sh["version"], fraction=sh.get("fraction", 0.0),
                                                source=sh.get("source"))
            return cls(model=d["model"], arms=arms, sticky=bool(d.get("sticky", False)), segments=segments,
                       shadow=shadow, salt=str(d.get("salt", "")))
        except ControlError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise _bad(f"malformed traffic policy: {type(e).__name__}: {e}", "policy") from None


def bucket(key: str) -> float:
    """A stable number in [0, 1) for `key` (sha256, so the same in every process and on every machine)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def pick(arms: list[Arm], u: float) -> Arm:
    """The arm whose cumulative-weight interval holds `u` in [0, 1)."""
    total = sum(a.weight for a in arms)
    acc = 0.0
    for a in arms:
        acc += a.weight / total
        if u < acc and a.weight > 0:
            return a
    return next(a for a in reversed(arms) if a.weight > 0)  # u at the rounding edge


def split(model: str, weights: Mapping[int, float], *, sticky: bool = False, salt: str = "") -> TrafficPolicy:
    """A plain weighted split, e.g. `split("m", {1: 90, 2: 10})` (what a canary step sets)."""
    return TrafficPolicy(model=model, arms=[Arm(v, w) for v, w in weights.items()], sticky=sticky, salt=salt)
