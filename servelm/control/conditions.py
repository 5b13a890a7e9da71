"""Status conditions, as Kubernetes controllers report them: each a type (Ready, Progressing, Degraded), a
status ("True", "False", "Unknown"), a reason (one CamelCase word for scripts), a message (for people) and
the time its status last changed. Setting a condition to the status it has keeps its transition time."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
TYPES = (READY, PROGRESSING, DEGRADED)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str
    last_transition_time: float

    def to_dict(self) -> dict:
        return asdict(self)


def merge(before: list[dict] | None, now: dict[str, tuple[bool, str, str]], at: float | None = None
          ) -> list[dict]:
    """The conditions `now` ({type: (status, reason, message)}), each keeping the transition time it had in
    `before` when its status did not change."""
    at = time.time() if at is None else at
    old = {c["type"]: c for c in before or []}
    out = []
    for kind in TYPES:
        if kind not in now:
            continue
        ok, reason, message = now[kind]
        status = "True" if ok else "False"
        prev = old.get(kind)
        since = prev["last_transition_time"] if prev is not None and prev["status"] == status else at
        out.append(Condition(kind, status, reason, message, since).to_dict())
    return out
