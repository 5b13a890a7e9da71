"""EngineClient: the engine surface the HTTP layer uses, whatever serves a model behind it.

One engine process (`worker.client.AsyncEngine`), a control-plane deployment of several workers
(`control.deployment.Deployment`, and a request's `control.lease.Lease` on it), the replicas of a Ray Serve
application (`ray.engine.RayServeEngine`) and the tests' stand-ins all answer the same calls; this Protocol names
them, so the server is written against one typed surface rather than against AsyncEngine's attributes.

Errors `generate` raises (the server maps each to its HTTP status): `RequestRejected` for a request the engine
refuses (an unknown LoRA adapter, a prompt that can never fit, an id already in use; 400), `QueueTimeout` when
it had no output within `queue_timeout` (408), `EngineDeadError` when the engine is not ready or died under the
request (503). `update_config` raises `control.errors.Conflict` where settings cannot change at run time.

Optional parts, which the server looks for with hasattr/getattr because not every implementation has them:
`kv_cache(action, path)` and `lora_adapter(action, name, path)` (a single engine's admin operations),
`engine_pid`, `restarts`, `up_since` and `on_replaced`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from servelm.config.engine import RuntimeSettings
from servelm.engine.step_outputs import EngineStats
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """What the server calls on the engine of a model (see the module docstring for the errors)."""

    # Callbacks the server sets to feed a model's metrics (server/serve.py wire_metrics): on_ready(Ready-like
    # with .stats, restarted), on_down(), on_step(StepOutputs, outputs). None: not wired.
    on_ready: Callable[..., Any] | None
    on_down: Callable[..., Any] | None
    on_step: Callable[..., Any] | None

    @property
    def ready(self) -> bool:
        """Whether it was ready at its last check (check_engine() looks again)."""

    @property
    def info(self) -> Any:
        """What the engine reported when it became ready (max_model_len, vocab_size); None before."""

    @property
    def stats(self) -> EngineStats | None:
        """The engine's counters as of its last step; None while none is known."""

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have; 0 before the engine is ready."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, priority: int = 1, queue_timeout: float | None = None,
                 cache_salt: str | None = None, *, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, the last with finished=True; closing the iterator early aborts it."""

    async def abort(self, request_id: str) -> None:
        """End a request in flight (its stream ends); an unknown id is ignored."""

    def check_engine(self) -> bool:
        """Whether it can serve now (a dead engine is noticed here)."""

    def num_queued(self) -> int:
        """Requests sent to the engine that have no output yet (admission's queue depth)."""

    def num_in_flight(self) -> int:
        """Requests between generate() and their end."""

    def live_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences now, from what is in flight rather than the last step's figures."""

    async def update_config(self, settings: RuntimeSettings) -> None:
        """Change the scheduler's run-time settings now and for engines started later (PATCH /admin/config)."""
