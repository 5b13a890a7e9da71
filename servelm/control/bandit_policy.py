"""A traffic policy that learns: Thompson sampling over a model's versions (control.experiments.
ThompsonBandit), rewarded by POST /v1/feedback, with a minimum exploration share per version. It stands where
a TrafficPolicy does (DeploymentManager.route calls `choose`); its posterior lives in memory and is stored
with the policy when the policy is set (a restart starts from that)."""

from __future__ import annotations

import random
from typing import Any

from servelm.control.experiments import ThompsonBandit
from servelm.control.traffic import Arm, Decision, RequestAttrs


class BanditPolicy:
    """Per request: the version whose sampled Beta posterior is highest (or, with probability
    min_share x arms, a uniformly chosen one)."""

    sticky, segments, shadow, salt = False, (), None, ""

    def __init__(self, model: str, bandit: ThompsonBandit) -> None:
        self.model, self.bandit = model, bandit

    @property
    def arms(self) -> list[Arm]:
        return [Arm(v, 1.0) for v in self.bandit.versions]

    def versions(self) -> set[int]:
        return set(self.bandit.versions)

    def choose(self, attrs: RequestAttrs | None = None, rng: random.Random | None = None) -> Decision:
        v = self.bandit.choose(rng)
        return Decision(version=v, arm=f"v{v}")

    def reward(self, version: int, score: float) -> None:
        self.bandit.update(version, score)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "bandit": self.bandit.to_dict(), "sticky": False, "salt": "",
                "arms": [{"version": a.version, "weight": a.weight, "name": a.name} for a in self.arms],
                "segments": [], "shadow": None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BanditPolicy:
        return cls(d["model"], ThompsonBandit.from_dict(d["bandit"]))
