"""Per-request record, the one-line JSON request log, and OpenTelemetry spans built from the record.

The gateway middleware creates a `RequestRecord` for every HTTP request; handlers fill in what they learn
(key, model, tokens, timings); when the response ends the middleware hands it to `Telemetry.finish`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field

from servelm.logs import named_in_log_config

_request_logger = logging.getLogger("servelm.requests")


OUTPUT_HEAD = 64  # characters of a completion kept when its text is not (concept drift classifies them)

@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    start: float = field(default_factory=time.monotonic)
    # the client chose request_id (x-request-id, or a body's request_id): unique only if the client made it so
    client_named: bool = False
    start_ns: int = field(default_factory=time.time_ns)  # wall clock, for span timestamps
    key_name: str = "anonymous"
    api_key: object = None  # the caller's ApiKey, None without keys
    model: str | None = None
    model_version: str | None = None  # name:version of the registered version that served it
    load_wait_s: float | None = None  # seconds it waited for its model to load on demand
    leases: list = field(default_factory=list)  # what serves it (ServedModel), released when the request ends
    priority: str | None = None
    status: int = 200
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    reserved_tokens: int = 0  # taken from the key's token bucket at admission
    waiting_for: str | None = None  # the model whose admission queue counts it until its first output
    submitted: float | None = None  # handed to the engine
    queue_time: float | None = None  # engine: arrival to first scheduled
    first_token: float | None = None
    last_token: float | None = None
    first_byte: float | None = None  # first response body bytes sent
    end: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_text: str | None = None
    completion_text: str | None = None
    # traffic management (control/traffic_service.py): the policy's decision, what the prediction log and the shadow
    # mirror need of the request, and whether its end was handled already
    arm: str | None = None
    user: str | None = None
    decision: object = None  # control.traffic.Decision, where a traffic policy chose the version
    capture_text: bool = False  # keep the prompt text (the prediction log, drift's character classes)
    capture_output: bool = False  # keep the completion text (a full prediction log)
    output_head: str = ""  # else the completion's first characters (concept drift: refusal, empty output)
    prompt_ids: list | None = None  # the first prompt's token ids
    cache_salt: str | None = None  # its prefix-cache namespace (a shadow copy runs in the same one)
    params: object = None  # its SamplingParams
    output_ids: list = field(default_factory=list)  # its first sample's output token ids
    traffic_done: bool = False
    traceparent: str | None = None
    tracestate: str | None = None
    _ended: bool = False

    def to_ns(self, t: float) -> int:
        return self.start_ns + int((t - self.start) * 1e9)

    def log_fields(self, with_text: bool, max_len: int | None = None) -> dict:
        """The request log line's fields; `with_text` adds the prompt and completion, each cut to `max_len`
        characters when it is set (vLLM's --max-log-len)."""
        def ms(a: float | None, b: float | None) -> float | None:
            return round(1000 * (b - a), 2) if a is not None and b is not None else None

        d = {"event": "request", "request_id": self.request_id, "method": self.method, "path": self.path,
             "key": self.key_name, "model": self.model, "priority": self.priority, "status": self.status,
             "stream": self.stream, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
             "completion_tokens": self.completion_tokens,
             "queue_ms": round(1000 * self.queue_time, 2) if self.queue_time is not None else None,
             "ttft_ms": ms(self.start, self.first_token), "e2e_ms": ms(self.start, self.end),
             "finish_reason": self.finish_reason}
        if self.error:
            d["error"] = self.error
        if with_text:
            d["prompt"], d["completion"] = (t[:max_len] if isinstance(t, str) and max_len is not None else t
                                            for t in (self.prompt_text, self.completion_text))
        return d


def setup_request_log() -> None:
    """Request lines go to stderr as bare JSON, one per line, whatever the other loggers look like; or where the
    operator's --log-config-file sends the servelm.requests logger."""
    if named_in_log_config(_request_logger.name):
        return
    _request_logger.setLevel(logging.INFO)
    _request_logger.propagate = False
    if not any(getattr(h, "_servelm", False) for h in _request_logger.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        h._servelm = True
        _request_logger.addHandler(h)


class Tracing:
    """Spans request > queue, prefill, decode, streaming, built at the end of each request from its record."""

    def __init__(self, exporter=None, endpoint: str | None = None, service_name: str = "servelm") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is not None:  # tests: an in-memory exporter, exported at once
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("servelm")
        self.propagator = TraceContextTextMapPropagator()

    def record(self, rec: RequestRecord) -> None:
        from opentelemetry import trace

        carrier = {k: v for k, v in (("traceparent", rec.traceparent), ("tracestate", rec.tracestate)) if v}
        parent = self.propagator.extract(carrier) if carrier else None
        end = rec.end or time.monotonic()
        attrs = {"http.request.method": rec.method, "url.path": rec.path, "http.response.status_code": rec.status,
                 "servelm.request_id": rec.request_id, "servelm.key": rec.key_name,
                 "gen_ai.request.model": rec.model or "", "gen_ai.usage.input_tokens": rec.prompt_tokens,
                 "gen_ai.usage.output_tokens": rec.completion_tokens}
        root = self.tracer.start_span(f"{rec.method} {rec.path}", context=parent, kind=trace.SpanKind.SERVER,
                                      start_time=rec.start_ns, attributes=attrs)
        if rec.status >= 500:
            root.set_status(trace.Status(trace.StatusCode.ERROR, rec.error or ""))
        ctx = trace.set_span_in_context(root)

        def child(name: str, a: float | None, b: float | None) -> None:
            if a is not None and b is not None and b >= a:
                self.tracer.start_span(name, context=ctx, start_time=rec.to_ns(a)).end(end_time=rec.to_ns(b))

        if rec.submitted is not None:
            scheduled = rec.submitted + rec.queue_time if rec.queue_time is not None else rec.first_token
            child("queue", rec.submitted, scheduled if scheduled is not None else end)
            child("prefill", scheduled, rec.first_token)
            child("decode", rec.first_token, rec.last_token)
        if rec.stream:
            child("streaming", rec.first_byte, end)
        root.end(end_time=rec.to_ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()


class Telemetry:
    """Where a finished request goes: metrics, the request log, traces."""

    def __init__(self, metrics, log_requests: bool, log_prompts: bool, tracing: Tracing | None,
                 max_log_len: int | None = None) -> None:
        self.metrics, self.log_requests, self.log_prompts, self.tracing = metrics, log_requests, log_prompts, tracing
        self.max_log_len = max_log_len
        if log_requests:
            setup_request_log()

    def finish(self, rec: RequestRecord, quiet: bool) -> None:
        if rec._ended:
            return
        rec._ended = True
        rec.end = rec.end or time.monotonic()
        self.metrics.requests.labels(rec.model or self.metrics.model_name, rec.key_name, str(rec.status)).inc()
        if rec.status == 499:
            self.metrics.aborts.inc()
        if quiet:  # health probes and scrapes: counted, not logged or traced
            return
        if self.log_requests:
            _request_logger.info(json.dumps(rec.log_fields(self.log_prompts, self.max_log_len), separators=(",", ":")))
        if self.tracing is not None:
            self.tracing.record(rec)
