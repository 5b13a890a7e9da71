"""OpenTelemetry spans and request log text, with the app in-process and an in-memory span exporter."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

pytestmark = pytest.mark.server

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


def test_spans_link_to_traceparent_and_nest_under_the_request(llama_dir):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from servelm.config.settings import load
    from servelm.model.loading.metadata import load_config_and_tokenizer
    from servelm.server.api import build_app
    from servelm.server.observability.telemetry import Tracing
    from servelm.server.serve import build_state
    from servelm.worker.client import AsyncEngine

    exporter = InMemorySpanExporter()
    lines = _Lines()
    logging.getLogger("servelm.requests").addHandler(lines)

    async def main():
        config = load({"model": str(llama_dir), "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256,
                       "embedding_model": "none", "log_prompts": True}, env={})
        _, _, tok, _ = load_config_and_tokenizer(str(llama_dir), None, None)
        engine = AsyncEngine(config.engine, tok)
        await engine.start()
        try:
            app = build_app(build_state(config, tok, engine, "tiny", tracing=Tracing(exporter=exporter)))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json={"prompt": "once upon", "max_tokens": 5, "ignore_eos": True},
                                 headers={"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01", "x-request-id": "t1"})
                assert r.status_code == 200
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 4, "stream": True, "ignore_eos": True})
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
                assert (await c.get("/health")).status_code == 200  # probes are not traced
        finally:
            await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        logging.getLogger("servelm.requests").removeHandler(lines)

    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name.startswith("POST ")]
    assert [s.name for s in roots] == ["POST /v1/completions", "POST /v1/chat/completions"]
    first, second = roots
    # the incoming W3C traceparent is honoured: same trace, our root is its child
    assert format(first.context.trace_id, "032x") == PARENT_TRACE
    assert first.parent is not None and format(first.parent.span_id, "016x") == PARENT_SPAN
    assert first.attributes["servelm.request_id"] == "t1" and first.attributes["gen_ai.usage.output_tokens"] == 5
    assert second.parent is None and second.context.trace_id != first.context.trace_id

    def children(root):
        kids = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
        assert all(k.context.trace_id == root.context.trace_id for k in kids)
        assert all(root.start_time <= k.start_time <= k.end_time <= root.end_time for k in kids)
        return {k.name: k for k in kids}

    k1 = children(first)
    assert set(k1) == {"queue", "prefill", "decode"}
    assert k1["queue"].end_time <= k1["prefill"].end_time <= k1["decode"].start_time <= k1["decode"].end_time
    assert set(children(second)) == {"queue", "prefill", "decode", "streaming"}
    assert not any(s.name.endswith("/health") for s in spans)

    # --log-prompts adds the texts to the request's log line
    line = next(x for x in lines.lines if x["request_id"] == "t1")
    assert line["prompt"] == json.dumps("once upon") and isinstance(line["completion"], str)
    assert len(lines.lines) == 2  # one per request, none for the probe
