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
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket", "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket",
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


def _stats(**kw):
    from servelm.engine.step_outputs import EngineStats

    return EngineStats(num_running=1, num_waiting=1, num_swapped=0, kv_usage=0.1, num_kv_blocks=64,
                       num_free_blocks=60, prefix_cache_queries=0, prefix_cache_hits=0, prefix_cache_hit_rate=0.0,
                       num_preemptions=0, num_swaps=0, num_evictions=0, num_steps=1, prompt_tokens=0,
                       generation_tokens=0, **kw)


def _lora_series(metrics, name: str) -> list[dict]:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return [s.labels for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


@pytest.mark.parametrize("names", ["servelm", "vllm"])
def test_lora_requests_info_follows_the_adapters_in_use(names):
    """vLLM's lora_requests_info (what the Inference Extension reads for adapter affinity): one series whose labels
    name the running and the waiting adapters, replaced when they change; none without LoRA."""
    from servelm.server.observability.metrics import Metrics, metric_name

    m, series = Metrics("tiny", names), metric_name("lora_requests_info", names)
    m.on_step(_stats(), 0, True)
    assert _lora_series(m, series) == []  # LoRA off: no series
    m.on_step(_stats(max_loras=2, running_lora_adapters=["sql"], waiting_lora_adapters=["chat", "math"]), 4, True)
    assert _lora_series(m, series) == [{"model_name": "tiny", "max_lora": "2", "running_lora_adapters": "sql",
                                        "waiting_lora_adapters": "chat,math"}]
    m.on_step(_stats(max_loras=2, running_lora_adapters=["chat", "sql"]), 4, True)
    assert [s["running_lora_adapters"] for s in _lora_series(m, series)] == ["chat,sql"]
    m.on_engine_down()
    assert _lora_series(m, series) == []


def test_a_requests_phases_add_up():
    """Queued 1 s, its first token 2 s after it was scheduled, its last 7 s after that: prefill 2, decode 7,
    inference 9 (their sum), each in its own histogram; its n and max_tokens too."""
    from servelm.server.observability.metrics import Metrics

    m = Metrics("tiny")
    m.observe_finished(100.0, 103.0, 110.0, 1.0, prompt_tokens=5, output_tokens=8, finish_reason="length", n=2,
                       max_tokens=8)

    def total(name: str) -> float:
        return m.registry.get_sample_value(f"servelm:{name}_sum", {"model_name": "tiny"})

    assert (total("request_prefill_time_seconds"), total("request_decode_time_seconds"),
            total("request_inference_time_seconds"), total("request_queue_time_seconds")) == (2.0, 7.0, 9.0, 1.0)
    assert (total("request_params_n"), total("request_params_max_tokens")) == (2.0, 8.0)
