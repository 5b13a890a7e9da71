"""What a control operation raises when it refuses: one class per kind of refusal, none of them knowing HTTP.

The server maps each class to its status in one place (`servelm.server.errors.CONTROL_STATUS`); `code` is a
short machine-readable reason and `param` the request field at fault, both passed through to the client."""

from __future__ import annotations


class ControlError(Exception):
    """A control operation refused; catch this to handle every refusal alike."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


class InvalidRequest(ControlError):
    """What was asked for is malformed or cannot be served (a bad policy, spec, artifact or argument)."""


class Forbidden(ControlError):
    """Asked for something the server's configuration does not allow (a path outside the model roots)."""


class NotFound(ControlError):
    """The model, version, deployment, canary or experiment named does not exist."""


class Conflict(ControlError):
    """Not possible in the current state (an illegal transition, a deployment that exists, a running canary)."""


class Unavailable(ControlError):
    """Not possible right now, but may be on a retry (a deployment unloaded under memory pressure)."""


class InsufficientMemory(ControlError):
    """The memory budget has no room for what was asked, even after unloading idle deployments."""
