"""The traffic service (control/traffic_service.py) in the HTTP server: what only the server has is plugged in
here (the Prometheus metrics over its registry, the operator's webhook), only generation routes feed it, and
the request path's injected fault is answered as the API error it is to clients (503)."""

from __future__ import annotations

from typing import Any

from servelm.control.errors import ControlError
from servelm.control.traffic_seams import Notifier, TrafficMetricsSink
from servelm.control.traffic_service import TrafficService as ControlTrafficService
from servelm.server.errors import control_api_error
from servelm.server.observability.telemetry import RequestRecord
from servelm.server.observability.traffic_metrics import TrafficMetrics
from servelm.server.observability.webhook import Webhook

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate", "/chat"})


class TrafficService(ControlTrafficService):
    """The control plane's traffic service with the server's metrics (on `metrics_registry`) and webhook."""

    def __init__(self, cp: Any, server_config: Any, metrics_registry: Any, models: Any,
                 queue_timeout_s: float | None = None, embedder: Any = None) -> None:
        def webhook(metrics: TrafficMetricsSink) -> Notifier | None:
            url = server_config.rollout_config.webhook_url
            return Webhook(url, metrics, timeout_s=server_config.rollout_config.webhook_timeout_s,
                           retries=server_config.rollout_config.webhook_retries) if url else None

        super().__init__(cp, server_config, models, lambda svc: TrafficMetrics(metrics_registry, svc), webhook,
                         queue_timeout_s=queue_timeout_s, embedder=embedder)

    async def fault(self, m: Any) -> None:
        # raised inside the engine call, where the request path turns API errors (not control refusals) into
        # the response's status and the request record's
        try:
            await super().fault(m)
        except ControlError as e:
            raise control_api_error(e) from e

    async def complete(self, rec: RequestRecord) -> None:
        """Only generation requests feed traffic management (not embeddings, admin or health routes)."""
        if rec.path in GENERATION_PATHS:
            await super().complete(rec)
