"""A version's lifecycle: exactly these states and transitions, nothing more.

REGISTERED -> VALIDATING -> VALIDATED | FAILED; FAILED -> REGISTERED; VALIDATED -> STAGING -> STAGING_TESTED
-> CANARY -> PRODUCTION | ROLLBACK; ROLLBACK -> VALIDATED; PRODUCTION -> DEPRECATED -> ARCHIVED.
"""

from __future__ import annotations

from servelm.control.errors import Conflict
from servelm.control.types import State

ALLOWED: dict[State, tuple[State, ...]] = {
    State.REGISTERED: (State.VALIDATING,),
    State.VALIDATING: (State.VALIDATED, State.FAILED),
    State.VALIDATED: (State.STAGING,),
    State.FAILED: (State.REGISTERED,),
    State.STAGING: (State.STAGING_TESTED,),
    State.STAGING_TESTED: (State.CANARY,),
    State.CANARY: (State.PRODUCTION, State.ROLLBACK),
    State.PRODUCTION: (State.DEPRECATED,),
    State.ROLLBACK: (State.VALIDATED,),
    State.DEPRECATED: (State.ARCHIVED,),
    State.ARCHIVED: (),
}

# States in which a version is (or is about to be) serving or being checked: it may not be deleted or
# garbage-collected.
ACTIVE: frozenset[State] = frozenset({State.VALIDATING, State.STAGING, State.STAGING_TESTED, State.CANARY,
                                      State.PRODUCTION})


def allowed_next(current: State) -> tuple[State, ...]:
    """The states `current` may move to."""
    return ALLOWED[current]


def check(current: State, to: State, what: str = "the version") -> None:
    """Refuse an illegal transition with a 409 that names the current state and the allowed next ones."""
    if to not in ALLOWED[current]:
        nxt = ", ".join(s.value for s in ALLOWED[current]) or "none (final state)"
        raise Conflict(f"cannot move {what} to {to.value}: it is {current.value}; allowed next: {nxt}",
                       code="illegal_transition")
