"""The prediction log's OTLP sink: each entry also leaves as an OpenTelemetry log record, exported over
OTLP/HTTP (protobuf) by opentelemetry-sdk's batching processor to a collector (`--prediction-log-otlp-endpoint`).

The record: event name `servelm.prediction`, timestamp = the entry's time, attributes for the metadata
(`servelm.request_id`, `servelm.model`, `servelm.model_version`, `servelm.arm`, `servelm.key`, `enduser.id`,
`servelm.prompt_tokens`, `servelm.completion_tokens`, `servelm.latency_s`, `servelm.ttft_s`,
`servelm.finish_reason`, `servelm.error`; absent ones are left out), and as body a map of the (redacted)
`prompt` and `output` when the model's mode is full (empty otherwise).

Export is asynchronous (a background thread batches and posts), so a slow or absent collector never delays a
response; the database / JSON-lines file stays the durable record (RPO 0). An erasure cannot reach what a
collector already received.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("servelm.traffic")
ATTRIBUTES = (("request_id", "servelm.request_id"), ("model", "servelm.model"), ("version", "servelm.model_version"),
              ("arm", "servelm.arm"), ("key_name", "servelm.key"), ("user", "enduser.id"),
              ("prompt_tokens", "servelm.prompt_tokens"), ("completion_tokens", "servelm.completion_tokens"),
              ("latency_s", "servelm.latency_s"), ("ttft_s", "servelm.ttft_s"),
              ("finish_reason", "servelm.finish_reason"), ("error", "servelm.error"))


class OtlpSink:
    """Exports prediction-log rows (the dicts PredictionLog writes) to `endpoint`
    (e.g. http://collector:4318/v1/logs)."""

    def __init__(self, endpoint: str, service_name: str = "servelm", timeout_s: float = 5.0,
                 exporter: Any = None) -> None:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.resources import Resource

        self.endpoint = endpoint
        self.provider = LoggerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_log_record_processor(BatchLogRecordProcessor(
            exporter or OTLPLogExporter(endpoint=endpoint, timeout=timeout_s)))
        self.logger = self.provider.get_logger("servelm.predictions")

    def export(self, rows: list[dict]) -> None:
        """Queue the rows for export (returns at once)."""
        for row in rows:
            attrs = {name: row[k] for k, name in ATTRIBUTES if row.get(k) is not None}
            body = {k: row[k] for k in ("prompt", "output") if row.get(k) is not None}
            at = row["at"]  # whole seconds apart: a float of nanoseconds since 1970 is only good to 256 ns
            self.logger.emit(timestamp=int(at) * 10**9 + round((at - int(at)) * 1e9), body=body, attributes=attrs,
                             event_name="servelm.prediction")

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export what is queued now; whether it finished in time."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def close(self) -> None:
        self.provider.shutdown()
