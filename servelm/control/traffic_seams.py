"""What the traffic service needs of the process it runs in, as small Protocols: the server supplies its
Prometheus metrics, its webhook and the request records of its gateway; the control plane only calls them."""

from __future__ import annotations

from typing import Any, Protocol


class Increment(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class LabelledCounter(Protocol):
    """A counter with labels (prometheus_client's Counter is one)."""

    def labels(self, *values: str) -> Increment: ...


class TrafficMetricsSink(Protocol):
    """The counters the traffic service, the canary runner and the drift watch feed."""

    feedback: LabelledCounter
    rollbacks: LabelledCounter
    promotions: LabelledCounter
    canary_failures: LabelledCounter
    shadow_requests: LabelledCounter
    shadow_dropped: LabelledCounter
    drift_alerts: LabelledCounter
    concept_alerts: LabelledCounter
    drift_embeddings: LabelledCounter

    def request(self, name: str, version: int | None, arm: str, error: bool, latency: float,
                ttft: float | None) -> None: ...


class Notifier(Protocol):
    """Where operator events go (canary rollbacks, failed promotions, drift alerts): `send` never waits and may
    be called from any thread; `start` in the event loop before the first `send`."""

    def start(self) -> None: ...

    def send(self, event: dict) -> None: ...

    async def close(self) -> None: ...


class ServedRequest(Protocol):
    """What the traffic service reads of a generation request the server answered (the server's
    RequestRecord): who made it, what was asked and answered, and when."""

    request_id: str
    model: str | None
    model_version: str | None
    status: int
    error: str | None
    arm: str | None
    user: str | None
    key_name: str
    api_key: Any
    start: float
    first_token: float | None
    last_token: float | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    prompt_text: str | None
    completion_text: str | None
    output_head: str
    prompt_ids: list | None
    output_ids: list
    params: Any
    cache_salt: str | None
    decision: Any
    traffic_done: bool
