"""Prometheus metrics, named like vLLM's under `servelm:`, or exactly as vLLM names them with
`--metric-names vllm` (`vllm:` and vLLM's current names), so that autoscalers, routers and dashboards built for
vLLM read them unchanged.

Engine-wide figures arrive with every engine step (`on_step`); per-request figures are observed by the API
as each engine request finishes (`observe_finished`); HTTP outcomes by the gateway middleware.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from servelm.engine.step_outputs import EngineStats

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_PER_TOKEN = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_N = (1, 2, 5, 10, 20)

# Engine counters that arrive as cumulative totals in EngineStats: metric suffix -> stats field.
_ENGINE_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prefill tokens computed (prefix cache hits excluded)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "Sequences preempted (recompute or swap)."),
    "num_priority_preemptions": ("num_priority_preemptions", "Preemptions to make room for a higher priority."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "kv_cache_evictions": ("num_evictions", "Cached KV blocks evicted to make room."),
    "spec_decode_num_draft_tokens": ("spec_proposed_tokens", "Speculative draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("spec_accepted_tokens", "Speculative draft tokens accepted."),
    "spec_decode_num_emitted_tokens": ("spec_emitted_tokens", "Tokens produced by speculative verifications."),
    "spec_decode_num_verifications": ("spec_verifications", "Speculative verifications (one per sequence step)."),
    "spec_decode_num_fallbacks": ("spec_fallbacks", "Requests whose speculation switched off for low acceptance."),
}
# Per draft position (0 = the first draft token), cumulative lists in EngineStats.
_SPEC_POSITION_COUNTERS = {
    "spec_decode_num_draft_tokens_per_pos": ("spec_proposed_by_position", "Draft tokens verified, by position."),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_accepted_by_position", "Draft tokens accepted, by position."),
}


def spec_decode_summary(st: EngineStats) -> dict | None:
    """Speculative decoding's figures for /server/stats (None when it never ran)."""
    if not st.spec_verifications:
        return None
    by_pos = [a / p if p else None for a, p in zip(st.spec_accepted_by_position, st.spec_proposed_by_position,
                                                    strict=False)]
    return {"proposed_tokens": st.spec_proposed_tokens, "accepted_tokens": st.spec_accepted_tokens,
            "emitted_tokens": st.spec_emitted_tokens, "verifications": st.spec_verifications,
            "acceptance_rate": st.spec_accepted_tokens / st.spec_proposed_tokens if st.spec_proposed_tokens else 0.0,
            "acceptance_rate_by_position": by_pos,
            "mean_accepted_length": st.spec_accepted_tokens / st.spec_verifications,
            # tokens per verification forward: the most a step could gain over one token per step
            "tokens_per_verification": st.spec_emitted_tokens / st.spec_verifications,
            "fallbacks": st.spec_fallbacks}


SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

# Where vLLM's current name differs from servelm's (under --metric-names vllm).
VLLM_NAMES = {"time_per_output_token_seconds": "request_time_per_output_token_seconds"}


def metric_name(name: str, names: str = "servelm") -> str:
    """The exposed name of metric `name` under the --metric-names setting `names`."""
    return f"vllm:{VLLM_NAMES.get(name, name)}" if names == "vllm" else f"servelm:{name}"


class Metrics:
    """The server's metrics; per-model figures carry a model_name label. `for_model(name)` is a view bound to
    another model's labels over the same registry (several models behind one server). `names`: servelm's or
    vLLM's metric names (--metric-names)."""

    def __init__(self, model_name: str, names: str = "servelm") -> None:
        disable_created_metrics()  # *_created series only add noise to scrapes
        self.registry = r = CollectorRegistry()
        f: dict = {}

        def gauge(name: str, help_: str, labels=("model_name",)) -> None:
            f[name] = Gauge(metric_name(name, names), help_, list(labels), registry=r)

        def counter(name: str, help_: str, labels=("model_name",)) -> None:
            f[name] = Counter(metric_name(name, names), help_, list(labels), registry=r)

        def hist(name: str, help_: str, buckets) -> None:
            f[name] = Histogram(metric_name(name, names), help_, ["model_name"], buckets=buckets, registry=r)

        # gauges (vLLM: num_requests_running/waiting, kv_cache_usage_perc)
        gauge("num_requests_running", "Requests in the running batch.")
        gauge("num_requests_waiting", "Requests queued in the engine.")
        gauge("num_requests_swapped", "Requests swapped out to CPU.")
        gauge("num_requests_waiting_by_priority", "Requests queued in the engine, by priority class.",
              ("model_name", "priority"))
        gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        gauge("engine_up", "1 while the engine process is ready, else 0.")
        gauge("engine_sleep_state", "Sleep mode, as vLLM's: 1 for the engine's state (awake, weights_offloaded "
              "after a level-1 sleep, discard_all after a level-2 one), 0 for the others.",
              ("model_name", "sleep_state"))
        gauge("lora_requests_info", "With LoRA adapters: the adapters of the running and the waiting requests "
              "(comma-separated labels, as vLLM's), set to the time of the last step.",
              ("model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"))
        counter("engine_restarts", "Engine process restarts after a crash.")
        for name, (_, help_) in _ENGINE_COUNTERS.items():  # engine counters
            counter(name, help_)
        for name, (_, help_) in _SPEC_POSITION_COUNTERS.items():
            counter(name, help_, ("model_name", "position"))
        # per-step histograms (vLLM: iteration_tokens_total)
        hist("iteration_tokens_total", "Tokens computed per engine step.", _TOKENS)
        hist("batch_size", "Sequences per engine step.", _BATCH)
        # per-request histograms
        hist("time_to_first_token_seconds", "Time to first token.", _LATENCY)
        hist("time_per_output_token_seconds", "Mean time per output token after the first, per request.",
             _PER_TOKEN)
        hist("inter_token_latency_seconds", "Time between successive outputs of a request.", _PER_TOKEN)
        hist("e2e_request_latency_seconds", "Request latency, arrival to last token.", _E2E)
        hist("request_queue_time_seconds", "Time from arrival to first scheduled.", _LATENCY)
        hist("request_prefill_time_seconds", "Time from first scheduled to the first token (the prompt's "
             "computation, in chunks beside other requests' steps).", _E2E)
        hist("request_decode_time_seconds", "Time from the first token to the last.", _E2E)
        hist("request_inference_time_seconds", "Time from first scheduled to the last token.", _E2E)
        hist("request_params_n", "The n (samples) of each request.", _N)
        hist("request_params_max_tokens", "The max_tokens of each request.", _TOKENS)
        hist("request_prompt_tokens", "Prompt length per request.", _TOKENS)
        hist("request_generation_tokens", "Generated tokens per request.", _TOKENS)
        counter("request_success", "Finished generation requests, by finish reason.",
                ("model_name", "finished_reason"))
        # HTTP outcomes
        counter("requests", "HTTP requests by model, API key name and status.", ("model_name", "key", "status"))
        counter("rate_limited_requests", "Requests refused with 429, by key and limit.", ("key", "limit"))
        counter("backpressure_rejections", "Requests refused with 503 because the queue was over its watermark.")
        counter("request_timeouts", "Requests removed after waiting longer than the queue timeout (408).")
        counter("request_aborts", "Requests aborted because the client went away.")
        self._bind(f, model_name)

    def for_model(self, model_name: str) -> Metrics:
        """The same metrics, bound to another model's label (its own gauges, counters and window)."""
        view = object.__new__(Metrics)
        view.registry = self.registry
        view._bind(self._families, model_name)
        return view

    def _bind(self, f: dict, model_name: str) -> None:
        self._families = f
        self.model_name = model_name
        m = {"model_name": model_name}
        self.running = f["num_requests_running"].labels(**m)
        self.waiting = f["num_requests_waiting"].labels(**m)
        self.swapped = f["num_requests_swapped"].labels(**m)
        self.waiting_by_priority = f["num_requests_waiting_by_priority"]
        self.kv_usage = f["kv_cache_usage_perc"].labels(**m)
        self.engine_up = f["engine_up"].labels(**m)
        self._sleep_state = {state: f["engine_sleep_state"].labels(model_name, state) for state in SLEEP_STATES}
        self.engine_restarts = f["engine_restarts"].labels(**m)
        self._lora_info = f["lora_requests_info"]
        self._lora_labels: tuple | None = None  # the series now exposed: a new set of adapters replaces it
        self._engine_counters = {field: f[name].labels(**m) for name, (field, _) in _ENGINE_COUNTERS.items()}
        self._position_counters = {field: f[name] for name, (field, _) in _SPEC_POSITION_COUNTERS.items()}
        self._last: EngineStats | None = None
        self.iteration_tokens = f["iteration_tokens_total"].labels(**m)
        self.batch_size = f["batch_size"].labels(**m)
        self.ttft = f["time_to_first_token_seconds"].labels(**m)
        self.tpot = f["time_per_output_token_seconds"].labels(**m)
        self.itl = f["inter_token_latency_seconds"].labels(**m)
        self.e2e = f["e2e_request_latency_seconds"].labels(**m)
        self.queue_time = f["request_queue_time_seconds"].labels(**m)
        self.prefill_time = f["request_prefill_time_seconds"].labels(**m)
        self.decode_time = f["request_decode_time_seconds"].labels(**m)
        self.inference_time = f["request_inference_time_seconds"].labels(**m)
        self.params_n = f["request_params_n"].labels(**m)
        self.params_max_tokens = f["request_params_max_tokens"].labels(**m)
        self.prompt_len = f["request_prompt_tokens"].labels(**m)
        self.gen_len = f["request_generation_tokens"].labels(**m)
        self.success = f["request_success"]
        self.requests = f["requests"]
        self.rate_limited = f["rate_limited_requests"]
        self.backpressure = f["backpressure_rejections"].labels(**m)
        self.timeouts = f["request_timeouts"].labels(**m)
        self.aborts = f["request_aborts"].labels(**m)
        self.window = ThroughputWindow()

    def on_ready(self, stats: EngineStats, restarted: bool) -> None:
        self._last = stats  # a new engine process: its counters start here (warm-up excluded)
        self.engine_up.set(1)
        if restarted:
            self.engine_restarts.inc()
        self._gauges(stats)

    def on_engine_down(self) -> None:
        """The engine process is gone: nothing runs, waits or holds KV cache any more."""
        self.engine_up.set(0)
        for g in (self.running, self.waiting, self.swapped, self.kv_usage):
            g.set(0)
        if self._lora_labels is not None:  # no adapters run or wait any more
            self._lora_info.remove(*self._lora_labels)
            self._lora_labels = None
        for name in ("high", "normal", "low"):
            self.waiting_by_priority.labels(self.model_name, name).set(0)

    def set_sleep_state(self, state: str) -> None:
        for name, g in self._sleep_state.items():
            g.set(1 if name == state else 0)

    def set_live(self, running: int, waiting: int) -> None:
        """Running and waiting sequences as the API counts them at read time (engine steps lag behind)."""
        self.running.set(running)
        self.waiting.set(waiting)

    def on_step(self, stats: EngineStats, num_batched_tokens: int, ran: bool) -> None:
        self._gauges(stats)
        last = self._last
        deltas = {}
        for field, counter in self._engine_counters.items():
            d = getattr(stats, field) - (getattr(last, field) if last else 0)
            if d > 0:
                counter.inc(d)
                deltas[field] = d
        for field, counter in self._position_counters.items():
            before = getattr(last, field) if last else []
            for pos, n in enumerate(getattr(stats, field)):
                d = n - (before[pos] if pos < len(before) else 0)
                child = counter.labels(self.model_name, str(pos))  # a position never accepted shows as 0
                if d > 0:
                    child.inc(d)
        self._last = stats
        self.window.add(deltas.get("prompt_tokens", 0), deltas.get("generation_tokens", 0))
        if ran:
            self.iteration_tokens.observe(num_batched_tokens)
            self.batch_size.observe(stats.batch_size)

    def _gauges(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting + s.num_swapped)
        self.swapped.set(s.num_swapped)
        self.kv_usage.set(s.kv_usage)
        for name, n in zip(("high", "normal", "low"), s.waiting_by_priority, strict=False):
            self.waiting_by_priority.labels(self.model_name, name).set(n)
        if s.max_loras:
            labels = (self.model_name, str(s.max_loras), ",".join(s.running_lora_adapters),
                      ",".join(s.waiting_lora_adapters))
            if labels != self._lora_labels and self._lora_labels is not None:
                self._lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
            self._lora_info.labels(*labels).set(time.time())

    def observe_finished(self, arrival: float, first_token: float | None, end: float, queue_time: float | None,
                         prompt_tokens: int, output_tokens: int, finish_reason: str | None, n: int = 1,
                         max_tokens: int | None = None) -> None:
        """One engine request (all its samples) has finished. Its phases, as vLLM splits them: queued (arrival
        to first scheduled), prefill (to the first token), decode (to the last)."""
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.observe((end - first_token) / (output_tokens - 1))
            self.decode_time.observe(end - first_token)
        self.e2e.observe(end - arrival)
        if queue_time is not None:
            queue_time = max(0.0, queue_time)
            self.queue_time.observe(queue_time)
            scheduled = min(arrival + queue_time, first_token if first_token is not None else end)
            if first_token is not None:
                self.prefill_time.observe(first_token - scheduled)
            self.inference_time.observe(end - scheduled)
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        self.prompt_len.observe(prompt_tokens)
        self.gen_len.observe(output_tokens)
        self.success.labels(self.model_name, finish_reason or "abort").inc()


class ThroughputWindow:
    """Prompt and generation tokens/s over the last minute."""

    def __init__(self, span: float = 60.0, clock=time.monotonic) -> None:
        self.span, self.clock = span, clock
        self.start = clock()
        self._events: deque[tuple[float, int, int]] = deque()

    def add(self, prompt: int, generation: int) -> None:
        if prompt or generation:
            self._events.append((self.clock(), prompt, generation))

    def rates(self) -> tuple[float, float]:
        now = self.clock()
        while self._events and self._events[0][0] < now - self.span:
            self._events.popleft()
        elapsed = max(1e-9, min(self.span, now - self.start))
        return (sum(e[1] for e in self._events) / elapsed, sum(e[2] for e in self._events) / elapsed)
