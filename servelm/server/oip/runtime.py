"""Non-LLM models over the Open Inference Protocol: which registry version a request names, loading it, and
running requests through its dynamic batcher with admission (model access, priority), queuing and metrics.

Models are the registry's versions of kind `predict` (scikit-learn, XGBoost, ONNX artifacts). A request for
`name` gets its PRODUCTION version, or, where none is, its newest version in a deployable state (VALIDATED
onward, up to PRODUCTION); `name` with a version gets that version if it is deployable. A version is loaded
on first use (in a thread, off the event loop) and stays loaded. Batching is per version: the version's
labels `batch_window_ms`, `max_batch_size` and `max_queue` override the server's `oip_*` settings.

The server's own embedding model (`/v1/embeddings`) is served here too, as version 1 of its name: one BYTES
input of texts (shape [N]), one FP32 output `embedding` (shape [N, dim]), the same vectors as /v1/embeddings
(a sequence classifier's: `probs`, shape [N, labels], as /classify gives them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
from prometheus_client import Gauge, Histogram

from servelm.config.settings import PRIORITIES
from servelm.control.errors import ControlError
from servelm.control.types import Kind, ModelVersion, State
from servelm.runtimes.embedder import EmbedderDown
from servelm.runtimes.encoder_runner import activate
from servelm.runtimes.predict_batcher import PredictBatcher, QueueFull
from servelm.runtimes.predictors import Predictor, TensorSpec, load_predictor
from servelm.server.middleware.admission import check_model
from servelm.server.openai.protocol import APIError

logger = logging.getLogger("servelm.server")
SERVABLE = frozenset({State.VALIDATED, State.STAGING, State.STAGING_TESTED, State.CANARY, State.PRODUCTION})
_RESOLVE_TTL_S = 1.0  # how long a name -> version answer is reused (a promotion is seen within a second)
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class EmbedderPredictor(Predictor):
    """The server's embedding model as a predictor. `predict` runs on the batcher's thread and waits for the
    embedder, which lives on the event loop (its own batching and process). A sequence classifier's output is
    `probs` (shape [N, labels]: what /classify gives) instead of `embedding`."""

    runtime = "embedding"

    def __init__(self, embedder, loop: asyncio.AbstractEventLoop) -> None:
        self.embedder, self.loop = embedder, loop
        self.classifier = getattr(embedder, "task", "embed") == "classify"
        self.inputs = [TensorSpec("text", "BYTES", [-1])]
        self.outputs = [TensorSpec("probs" if self.classifier else "embedding", "FP32", [-1, -1])]

    def predict(self, inputs, outputs):
        texts = []
        for x in self.single_input(inputs).reshape(-1):
            text = x.decode("utf-8") if isinstance(x, bytes) else str(x)  # UnicodeDecodeError is a ValueError
            if not text:
                raise ValueError("every text must be non-empty")
            texts.append(text)
        if self.classifier:
            logits, _ = asyncio.run_coroutine_threadsafe(self.embedder.classify(texts), self.loop).result()
            return {"probs": activate(np.asarray(logits), self.embedder.activation).astype(np.float32)}
        vectors, _ = asyncio.run_coroutine_threadsafe(self.embedder.embed(texts), self.loop).result()
        return {"embedding": np.asarray(vectors, dtype=np.float32)}


@dataclass
class Loaded:
    version: ModelVersion
    predictor: Predictor
    batcher: PredictBatcher


class OipModels:
    def __init__(self, state) -> None:
        self.state = state
        self._loaded: dict[str, Loaded] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self._resolved: dict[tuple[str, str | None], tuple[float, ModelVersion]] = {}
        r = state.metrics.registry
        self.m_latency = Histogram("servelm:oip_request_duration_seconds", "Open Inference Protocol requests: "
                                   "time from queuing to result.", ["model_name"], buckets=_LATENCY, registry=r)
        self.m_batch = Histogram("servelm:oip_batch_rows", "Rows per predictor call (dynamic batching).",
                                 ["model_name"], buckets=_ROWS, registry=r)
        self.m_batch_requests = Histogram("servelm:oip_batch_requests", "Requests per predictor call.",
                                          ["model_name"], buckets=_ROWS, registry=r)
        self.m_queue = Gauge("servelm:oip_queue_depth", "Requests waiting for a batch, per model.", ["model_name"],
                             registry=r)

    # -- which version --------------------------------------------------------------------------------
    def _registry(self):
        control = getattr(self.state, "control", None)
        if control is None:
            raise APIError(404, "this server has no model registry (start it with --data-dir to serve "
                                "scikit-learn, XGBoost or ONNX models)", "model", "model_not_found")
        return control.registry

    def _lookup(self, name: str, version: str | None) -> ModelVersion:
        reg = self._registry()
        if version is not None:
            if not version.isdigit() or not 0 < int(version) <= 2**31 - 1:
                raise APIError(404, f"model {name!r} has no version {version!r}", "version", "model_not_found")
            try:
                mv = reg.get(name, int(version))
            except ControlError as e:
                raise APIError(404, e.message, "version", "model_not_found") from e
            if mv.state not in SERVABLE:
                raise APIError(404, f"{mv.ref} is {mv.state.value}: only versions from VALIDATED to PRODUCTION are "
                                    "served", "version", "model_not_found")
        else:
            mv = reg.production(name)
            if mv is None:
                mv = next((v for v in reversed(reg.versions(name)) if v.state in SERVABLE), None)
            if mv is None:
                raise APIError(404, f"no servable model {name!r} (it needs a version from VALIDATED to "
                                    "PRODUCTION)", "model", "model_not_found")
        if mv.kind != Kind.PREDICT:
            raise APIError(404, f"{mv.ref} is a {mv.kind.value} model: use the OpenAI API (/v1) for it", "model",
                           "model_not_found")
        return mv

    async def resolve(self, name: str, version: str | None, key=None) -> ModelVersion:
        """The version a request names (404 otherwise); 403 if the caller's key may not use the model."""
        check_model(key, name)
        served = self._served_embedder(name, version)
        if served is not None:
            return served
        now = time.monotonic()
        hit = self._resolved.get((name, version))
        if hit is not None and now - hit[0] < _RESOLVE_TTL_S:
            return hit[1]
        mv = await asyncio.to_thread(self._lookup, name, version)  # a database read: off the event loop
        self._resolved[(name, version)] = (now, mv)
        return mv

    def _served_embedder(self, name: str, version: str | None) -> ModelVersion | None:
        """The server's embedding model when `name` is it (version 1, the only one), else None."""
        st = self.state
        if getattr(st, "embedder", None) is None or name != st.embed_model_name:
            return None
        if version not in (None, "1"):
            raise APIError(404, f"model {name!r} has no version {version!r} (the server's embedding model is "
                                "version 1)", "version", "model_not_found")
        return ModelVersion(name, 1, State.PRODUCTION, Kind.EMBED, artifact="", sha256="", source="served")

    # -- loading --------------------------------------------------------------------------------------
    async def load(self, mv: ModelVersion) -> Loaded:
        if mv.ref in self._loaded:
            return self._loaded[mv.ref]
        task = self._loading.get(mv.ref)
        if task is None:
            task = asyncio.create_task(self._load(mv))
            self._loading[mv.ref] = task
            task.add_done_callback(lambda _: self._loading.pop(mv.ref, None))
        return await asyncio.shield(task)

    async def _load(self, mv: ModelVersion) -> Loaded:
        try:
            if mv.kind == Kind.EMBED:
                pred = EmbedderPredictor(self.state.embedder, asyncio.get_running_loop())
            else:
                pred = await asyncio.to_thread(load_predictor, mv.artifact)
        except (ImportError, ValueError, OSError) as e:
            raise APIError(503, f"{mv.ref} cannot be loaded: {e}", code="model_unavailable") from e
        window, max_batch, max_queue = self._batching(mv)
        ref = mv.ref

        def on_batch(rows: int, requests: int, _: float) -> None:
            self.m_batch.labels(ref).observe(rows)
            self.m_batch_requests.labels(ref).observe(requests)

        loaded = Loaded(mv, pred, PredictBatcher(pred, ref, window / 1000, max_batch, max_queue, on_batch))
        self._loaded[ref] = loaded
        logger.info("loaded %s (%s): batch window %.1f ms, at most %d rows per batch, %d queued", ref,
                    pred.runtime, window, max_batch, max_queue)
        return loaded

    def _batching(self, mv: ModelVersion) -> tuple[float, int, int]:
        srv = self.state.config.server
        out = []
        for label, default, cast in (("batch_window_ms", srv.oip_config.oip_batch_window_ms, float),
                                     ("max_batch_size", srv.oip_config.oip_max_batch_size, int),
                                     ("max_queue", srv.oip_config.oip_max_queue, int)):
            raw = mv.labels.get(label)
            try:
                value = cast(raw) if raw is not None else default
            except ValueError:
                value = -1
            if not value >= (0 if label == "batch_window_ms" else 1):
                raise APIError(503, f"{mv.ref} has an invalid label {label}={raw!r}", code="model_unavailable")
            out.append(value)
        return out[0], out[1], out[2]

    def loaded(self, mv: ModelVersion) -> Loaded | None:
        return self._loaded.get(mv.ref)

    # -- running --------------------------------------------------------------------------------------
    def priority(self, rec, params: dict) -> int:
        """The request's priority (its `priority` parameter: high | normal | low or 0..2), checked against
        its key as a generation request's is."""
        requested = params.get("priority")
        if requested is not None and not (requested in PRIORITIES or (isinstance(requested, int)
                                                                      and 0 <= requested < len(PRIORITIES))):
            raise APIError(400, f"priority must be one of {', '.join(PRIORITIES)} or 0..2", "parameters.priority")
        prio = self.state.admission.priority(rec.api_key, requested)
        rec.priority = PRIORITIES[prio]
        return prio

    async def infer(self, rec, mv: ModelVersion, inputs: dict[str, np.ndarray], outputs: list[str] | None,
                    params: dict) -> dict[str, np.ndarray]:
        """Run one request through the version's batcher; APIError for bad input (400), a full queue (503)."""
        rec.model = rec.model_version = mv.ref
        prio = self.priority(rec, params)
        loaded = await self.load(mv)
        pred = loaded.predictor
        names = [o.name for o in pred.outputs]
        if outputs:
            unknown = [o for o in outputs if o not in names]
            if unknown:
                raise APIError(400, f"{mv.ref} has no output {unknown[0]!r}; outputs: {', '.join(names)}", "outputs")
        else:
            outputs = names[:1] if pred.runtime == "sklearn" else names
        check_inputs(pred, inputs)
        cap = self.state.config.admission.max_embedding_inputs
        if mv.kind == Kind.EMBED and next(iter(inputs.values())).size > cap:
            raise APIError(400, f"over this server's limit of {cap} texts per request "
                                "(admission.max_embedding_inputs)", "inputs", "limit_exceeded")
        if len({len(a) for a in inputs.values()}) != 1:
            raise APIError(400, "every input must have the same first (batch) dimension", "inputs")
        t0 = time.perf_counter()
        gauge = self.m_queue.labels(mv.ref)
        gauge.inc()
        try:
            result = await loaded.batcher.submit(inputs, list(outputs), prio)
        except QueueFull as e:
            self.state.metrics.backpressure.inc()
            raise APIError(503, f"{mv.ref}: {e}", code="overloaded", headers={"Retry-After": "1"}) from e
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{mv.ref} could not run these inputs: {e}", "inputs") from e
        except EmbedderDown as e:
            raise APIError(503, str(e), code="embedder_unavailable") from e
        finally:
            gauge.dec()
        self.m_latency.labels(mv.ref).observe(time.perf_counter() - t0)
        return result

    def metadata(self, mv: ModelVersion, loaded: Loaded) -> dict:
        versions = ["1"] if mv.kind == Kind.EMBED else [
            str(v.version) for v in self._registry().versions(mv.name) if v.state in SERVABLE and v.kind == Kind.PREDICT]
        return {"name": mv.name, "versions": versions, "platform": loaded.predictor.runtime,
                "inputs": [vars(t) for t in loaded.predictor.inputs],
                "outputs": [vars(t) for t in loaded.predictor.outputs]}

    def close(self) -> None:
        for loaded in self._loaded.values():
            loaded.batcher.close()


def check_inputs(pred: Predictor, inputs: dict[str, np.ndarray]) -> None:
    """400 for inputs that do not fit the model's declared inputs (before they are queued)."""
    if not inputs:
        raise APIError(400, "the request has no inputs", "inputs")
    specs = pred.inputs
    if len(specs) == 1 and len(inputs) == 1:  # one input: whatever the client called it
        pairs = [(specs[0], next(iter(inputs.values())))]
    else:
        missing = [s.name for s in specs if s.name not in inputs]
        if missing:
            raise APIError(400, f"missing input {missing[0]!r}; the model takes {[s.name for s in specs]}", "inputs")
        pairs = [(s, inputs[s.name]) for s in specs]
    for spec, arr in pairs:
        if arr.ndim != len(spec.shape) or any(d >= 0 and d != a for d, a in zip(spec.shape[1:], arr.shape[1:],
                                                                               strict=False)):
            raise APIError(400, f"input {spec.name!r} must have shape {spec.shape} (-1: any), got "
                                f"{list(arr.shape)}", "inputs")
        if (arr.dtype == object) != (spec.datatype == "BYTES"):
            raise APIError(400, f"input {spec.name!r} must be {spec.datatype}", "inputs")
