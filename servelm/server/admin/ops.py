"""Operator routes: Prometheus `/metrics`, `/server/stats` JSON, and `/admin/config` (admin key)."""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from servelm.config.engine import ConfigError, RuntimeSettings
from servelm.config.settings import GROUP_OF, PRIORITIES
from servelm.server.observability.metrics import spec_decode_summary
from servelm.server.openai.protocol import APIError


def add_ops_routes(app: FastAPI, state) -> None:
    metrics = state.metrics

    def metrics_of(m):
        if m.metrics is None:
            m.metrics = metrics.for_model(m.served_name)
        return m.metrics

    @app.get("/metrics")
    async def prometheus_metrics():
        for m in state.models:
            mm = metrics_of(m)
            mm.engine_up.set(1 if m.check_engine() else 0)
            mm.set_live(*m.live_counts())  # what is true now, not as of the engine's last step
            mm.set_sleep_state(getattr(m.engine, "sleep_state", "awake"))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def server_load():
        """vLLM's load probe, for a load balancer: the generation requests the server is working on, those in
        its engines and those admitted and still being prepared (tokenized, templated) for them."""
        total = 0
        for m in state.models:
            preparing = max(0, state.admission.num_waiting(m.served_name) - m.num_queued())
            total += m.num_in_flight() + preparing
        return {"server_load": total}

    @app.get("/server/stats")
    async def server_stats():
        """The default model's figures at the top level (as with one model), every model's under "models"."""
        default = state.models.default
        out = _engine_stats(state, default, metrics_of(default)) if default is not None else {}
        out["embeddings"] = {**dataclasses.asdict(state.embedder.stats), "pid": state.embedder.pid,
                             "restarts": state.embedder.restarts} if state.embedder else None
        out["models"] = {m.served_name: _engine_stats(state, m, metrics_of(m)) for m in state.models}
        return out

    @app.get("/admin/config")
    async def get_config():
        return {"config": state.config.describe()}

    @app.patch("/admin/config")
    async def patch_config(request: Request):
        try:
            changes = await request.json()
        except ValueError as e:
            raise APIError(400, "body must be a JSON object of settings to change") from e
        if not isinstance(changes, dict) or not changes:
            raise APIError(400, "body must be a non-empty JSON object of settings to change")
        before = (state.config.engine.replace(), dataclasses.replace(state.config.admission),
                  dict(state.config.sources))
        try:
            applied = state.config.patch(changes)
        except ConfigError as e:
            raise APIError(400, str(e), e.key, "invalid_config") from e
        if any(GROUP_OF[k.partition(".")[0]] == "engine" for k in applied):
            settings = RuntimeSettings.of(state.config.engine)
            try:
                for m in state.models:
                    await m.update_config(settings)
            except Exception:  # all or nothing: what GET shows is what the engine runs with
                state.config.engine, state.config.admission, state.config.sources = before
                raise
        return {"applied": applied, "config": state.config.describe()}


def _engine_stats(state, engine, metrics) -> dict:
    """One model's engine, queue, throughput and cache figures."""
    engine.check_engine()  # a dead engine is reported as down, with no ghost requests
    st = engine.stats
    running, waiting = engine.live_counts()
    prompt_tps, gen_tps = metrics.window.rates()
    by_prio = st.waiting_by_priority if st else [0, 0, 0]
    return {
        "engine": {"ready": engine.ready, "pid": getattr(engine, "engine_pid", None),
                   "restarts": getattr(engine, "restarts", 0), "up_since": getattr(engine, "up_since", None),
                   "status": "up" if engine.ready else "down", "in_flight": engine.num_in_flight(),
                   "max_model_len": engine.max_model_len},
        "queue": {"depth": engine.num_queued(), "by_priority": dict(zip(PRIORITIES, by_prio, strict=True)),
                  "shedding": state.admission.shedding},
        "running": running,
        "waiting": waiting,
        "batch_size": st.batch_size if st else 0,
        "throughput": {"prompt_tokens_per_s": round(prompt_tps, 2), "generation_tokens_per_s": round(gen_tps, 2),
                       "window_s": metrics.window.span},
        "kv_cache": {"usage": st.kv_usage, "num_blocks": st.num_kv_blocks, "free_blocks": st.num_free_blocks,
                     "dtype": st.kv_cache_dtype}
        if st else None,
        "prefix_cache": {"queries": st.prefix_cache_queries, "hits": st.prefix_cache_hits,
                         "hit_rate": st.prefix_cache_hit_rate, "evictions": st.num_evictions} if st else None,
        "spec_decode": spec_decode_summary(st) if st else None,
        "scheduler": dataclasses.asdict(st) if st else None,
    }
