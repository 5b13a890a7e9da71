"""Drift of the served models: per model the data-drift windows (control/drift.py DriftMonitor), per version
the concept-drift windows (ConceptMonitor: feedback score, refusal and empty-output rates, finish-reason mix),
and, when an embedding model is served, a sample of prompt embeddings for the MMD test.

Costs are kept off the request path: features are cheap counts taken on the event loop; a prompt is embedded
only for a sampled share of requests (`drift_embedding_sample`) with a bound on embeddings in flight (the
embedder runs in its own process; a request never waits for it); the MMD test (quadratic in the sample)
runs only in a worker thread (the admin route and the periodic check) and its result is cached until an
embedding window changes, so a /metrics scrape (which runs on the loop) reads the cached result.

An alert that starts (a feature or signal whose alert flag goes from off to on) counts in
servelm:drift_alerts_total / servelm:concept_drift_alerts_total and is passed to `notify` (the webhook).
The periodic check (`run`, every `drift_check_interval_s`) evaluates every model so alerts fire without
anyone asking.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servelm.control.drift import ConceptMonitor, ConceptThresholds, DriftMonitor, DriftThresholds
from servelm.control.errors import NotFound
from servelm.control.traffic_seams import TrafficMetricsSink

logger = logging.getLogger("servelm.traffic")
DRIFT_CHARS = 256  # characters of a prompt profiled for drift (a sample: profiling runs on the event loop)
EMBED_CHARS = 1000  # characters of a prompt embedded (the embedder truncates to its context anyway)


@dataclass
class DriftSnapshot:
    """Copies of one model's windows, taken on the event loop, to report on in a thread."""

    data: DriftMonitor | None
    concept: dict[int, ConceptMonitor] = field(default_factory=dict)


class DriftWatch:
    """Every model's drift windows; `notify(event)` is called (from any thread) when an alert starts."""

    def __init__(self, cfg: Any, metrics: TrafficMetricsSink, embedder: Any = None,
                 notify: Callable[[dict], None] | None = None) -> None:
        if embedder is not None and getattr(embedder, "task", "embed") != "embed":
            # the server's embedding-process model is a classifier (a cross-encoder): it gives no vectors
            logger.info("prompt-embedding drift is off: the server's embedding model is a sequence classifier")
            embedder = None
        self.cfg, self.metrics, self.embedder, self.notify = cfg, metrics, embedder, notify
        self.data: dict[str, DriftMonitor] = {}
        self.concept: dict[str, dict[int, ConceptMonitor]] = {}  # model -> version -> monitor
        self.sample = float(cfg.observability_config.drift_embedding_sample)
        self.max_inflight = 2  # embeddings for drift waiting on the embedder at once (more are skipped)
        self._inflight: set[asyncio.Task] = set()
        self._mmd: dict[str, tuple[int, dict]] = {}  # model -> (embedding epoch, embedding feature result)
        self._alerting: dict[tuple, bool] = {}  # (model, feature) or (model, version, signal) -> alerting
        self._lock = threading.Lock()  # reports run in threads and on the loop; transitions are counted once
        self._task: asyncio.Task | None = None

    # -- feeding (event loop) ----------------------------------------------------------------------
    def monitor(self, name: str) -> DriftMonitor:
        d = self.data.get(name)
        if d is None:
            th = DriftThresholds(min_samples=self.cfg.observability_config.drift_min_samples)
            d = self.data[name] = DriftMonitor(name, th, window=self.cfg.observability_config.drift_window)
        return d

    def concept_of(self, name: str, version: int) -> ConceptMonitor:
        per = self.concept.setdefault(name, {})
        c = per.get(version)
        if c is None:
            th = ConceptThresholds(min_samples=self.cfg.observability_config.drift_min_samples)
            c = per[version] = ConceptMonitor(f"{name}:{version}", th, window=self.cfg.observability_config.drift_window)
        return c

    def observe(self, name: str, version: int | None, *, text: str | None, prompt_ids: Any, output_tokens: int,
                output: str | None, finish_reason: str | None) -> None:
        """One successful generation request: data features, the version's outcome, maybe an embedding."""
        self.monitor(name).observe(prompt=text[:DRIFT_CHARS] if text else None, prompt_tokens=prompt_ids,
                                   output_tokens=output_tokens)
        if version is not None:
            self.concept_of(name, version).observe(output=output, finish_reason=finish_reason or "abort")
        if self.embedder is not None and text and self.sample > 0 and random.random() < self.sample:
            if len(self._inflight) >= self.max_inflight:
                self.metrics.drift_embeddings.labels(name, "skipped").inc()
                return
            task = asyncio.get_running_loop().create_task(self._embed(name, text[:EMBED_CHARS]))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _embed(self, name: str, text: str) -> None:
        try:
            vecs, _ = await self.embedder.embed([text])
        except Exception as e:  # the embedder is down or busy: this sample is lost, nothing else
            logger.debug("embedding a prompt for drift failed: %s", e)
            self.metrics.drift_embeddings.labels(name, "failed").inc()
            return
        self.monitor(name).observe(embedding=vecs[0])
        self.metrics.drift_embeddings.labels(name, "embedded").inc()

    async def drain(self) -> None:
        """Wait for the embeddings in flight (tests, shutdown)."""
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)

    def feedback(self, name: str, version: int | None, score: float) -> None:
        if version is not None:
            self.concept_of(name, version).observe(feedback=score)

    def set_reference(self, name: str) -> int:
        """The live windows of `name` (data and every version's concept) become the references; returns the
        requests in the data window frozen."""
        mon = self.data.get(name)
        if mon is None:
            raise NotFound(f"no drift data for {name!r} yet", code="not_found", param="model")
        n = len(mon.live.prompt_len)
        mon.set_reference()
        for c in self.concept.get(name, {}).values():
            c.set_reference()
        return n

    # -- reporting ---------------------------------------------------------------------------------
    def snapshot(self, name: str) -> DriftSnapshot:
        """On the event loop: copies to report on elsewhere."""
        mon = self.data.get(name)
        return DriftSnapshot(mon.snapshot() if mon is not None else None,
                             {v: c.snapshot() for v, c in self.concept.get(name, {}).items()})

    def report(self, name: str, snap: DriftSnapshot | DriftMonitor | None = None, fresh: bool = True) -> dict:
        """The model's drift report: data features (with the embedding MMD), concept signals per version, and
        `alert` overall. `fresh`: compute a stale MMD (only in a thread); otherwise the cached one is used.
        404 when the model has served nothing yet."""
        if snap is None:
            snap = DriftSnapshot(self.data.get(name), dict(self.concept.get(name, {})))
        elif isinstance(snap, DriftMonitor):
            snap = DriftSnapshot(snap, dict(self.concept.get(name, {})))
        if snap.data is None and not snap.concept:
            raise NotFound(f"no drift data for {name!r} yet; models with data: "
                           f"{', '.join(self.data) or 'none'}", code="not_found", param="model")
        mon = snap.data or DriftMonitor(name, DriftThresholds(min_samples=self.cfg.observability_config.drift_min_samples), window=1)
        cached = self._mmd.get(name)
        if cached is not None and cached[0] == mon.embedding_epoch:
            emb = cached[1]
        elif fresh:
            emb = mon.embedding_report()
            self._mmd[name] = (mon.embedding_epoch, emb)
        else:  # stale and no thread to compute it in: the last result, flagged
            emb = {**cached[1], "stale": True} if cached is not None else {
                "n_ref": len(mon.reference.embeddings), "n_live": len(mon.live.embeddings), "alert": False,
                "evaluated": False}
        rep = mon.report(embedding=emb)
        rep["embedding_sample"] = self.sample if self.embedder is not None else 0.0
        concept = {f"v{v}": c.report() for v, c in sorted(snap.concept.items())}
        rep["concept"] = concept
        rep["data_alert"] = rep["alert"]
        rep["concept_alert"] = any(c["alert"] for c in concept.values())
        rep["alert"] = rep["data_alert"] or rep["concept_alert"]
        self._transitions(name, rep, snap)
        return rep

    def _transitions(self, name: str, rep: dict, snap: DriftSnapshot) -> None:
        started: list[dict] = []
        with self._lock:
            for feature, f in rep["features"].items():
                if f["alert"] and not self._alerting.get((name, feature), False):
                    self.metrics.drift_alerts.labels(name, feature).inc()
                    started.append({"kind": "data", "feature": feature,
                                    **{k: v for k, v in f.items() if k != "alert"}})
                self._alerting[(name, feature)] = f["alert"]
            for v in snap.concept:
                for signal, f in rep["concept"][f"v{v}"]["signals"].items():
                    key = (name, v, signal)
                    if f["alert"] and not self._alerting.get(key, False):
                        self.metrics.concept_alerts.labels(name, str(v), signal).inc()
                        started.append({"kind": "concept", "version": v, "signal": signal,
                                        **{k: x for k, x in f.items() if k != "alert"}})
                    self._alerting[key] = f["alert"]
        if started and self.notify is not None:
            for s in started:
                self.notify({"event": "drift.alert", "model": name, **s})

    def alerting(self) -> dict[tuple, bool]:
        with self._lock:
            return dict(self._alerting)

    # -- the periodic check ------------------------------------------------------------------------
    def start(self, interval_s: float) -> None:
        if self._task is None and interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(interval_s))

    async def check(self) -> dict[str, dict]:
        """Evaluate every model now (reports in a thread): what the periodic check does each time."""
        out = {}
        for name in sorted(set(self.data) | set(self.concept)):
            snap = self.snapshot(name)
            out[name] = await asyncio.to_thread(self.report, name, snap, True)
        return out

    async def _run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check()
            except Exception:
                logger.exception("periodic drift check failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for t in list(self._inflight):
            t.cancel()
