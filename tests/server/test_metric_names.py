"""--metric-names vllm exposes the engine and request metrics under vLLM's names, the ones autoscalers (KEDA,
HPA adapters), routers (the Gateway API Inference Extension's endpoint picker) and vLLM's Grafana dashboards
query; the default keeps servelm's. In-process, with a stub engine."""

from __future__ import annotations

import pytest
from fakes import IdleEngine
from prometheus_client.parser import text_string_to_metric_families

from servelm.config.settings import load

# vLLM's own names (vllm/v1/metrics/loggers.py) of the metrics servelm also keeps, as Prometheus exposes them
VLLM_SERIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:iteration_tokens_total_bucket",
}


def _series(tokenizer, **cli) -> set[str]:
    """The sample names /metrics exposes after one finished request."""
    from starlette.testclient import TestClient

    from servelm.server.api import build_app
    from servelm.server.serve import build_state

    config = load({"embedding_model": "none", "log_requests": False, **cli}, env={})
    with TestClient(build_app(build_state(config, tokenizer, IdleEngine(), "tiny"))) as client:
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
        text = client.get("/metrics").text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_vllm_names_are_what_vllm_exposes(tokenizer):
    series = _series(tokenizer, metric_names="vllm")
    assert series >= VLLM_SERIES, sorted(VLLM_SERIES - series)
    assert not {s for s in series if s.startswith("servelm:num_requests")}
    # the same metrics under servelm's names by default, TPOT by its former vLLM name
    default = _series(tokenizer)
    assert {s.replace("vllm:", "servelm:").replace("request_time_per_output", "time_per_output")
            for s in VLLM_SERIES} <= default
    assert not {s for s in default if s.startswith("vllm:")}


def test_an_unknown_naming_stops_the_start():
    with pytest.raises(ValueError, match="metric_names"):
        load({"metric_names": "sglang"}, env={})
