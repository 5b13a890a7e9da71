"""Stand-ins for an engine or deployment in in-process app tests: the status surface the routes read, idle."""

from __future__ import annotations

from types import SimpleNamespace

from servelm.config.engine import EngineConfig
from servelm.outputs import CompletionOutput, RequestOutput
from servelm.worker.client import EngineDeadError, RequestRejected


class IdleEngine:
    """An EngineClient that is always ready with nothing queued or running: it answers every request at once with
    one finished, empty output (subclasses replace `generate` with what their test needs) and keeps the
    scheduler settings it was given."""

    ready, stats, info, max_model_len = True, None, None, 256
    on_ready = on_down = on_step = None
    settings = None  # the RuntimeSettings of the last update_config

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None, *,
                       lora=None):
        if lora is not None:
            raise RequestRejected(f"no LoRA adapter named {lora!r}")
        yield RequestOutput(rid, prompt, list(ids), [CompletionOutput(0, "", [], finish_reason="length")], True)

    async def update_config(self, settings) -> None:
        self.settings = settings

    def num_queued(self) -> int:
        return 0

    def num_in_flight(self) -> int:
        return 0

    def live_counts(self) -> tuple[int, int]:
        return 0, 0

    def check_engine(self) -> bool:
        return True

    async def abort(self, rid) -> None:
        pass


class StubEngine:
    """AsyncEngine's surface without a process: answers every request with its model path (the artifact of the
    version it serves) and remembers the prompt ids it was given."""

    made: list[StubEngine] = []

    def __init__(self, config: EngineConfig, tokenizer=None, start_timeout: float = 0.0) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.ready, self.stopped, self.info, self.stats = False, False, None, None
        self.max_model_len, self.restarts, self.engine_pid = 256, 0, None
        self.on_ready = self.on_down = self.on_step = None
        self.prompts: list[list[int]] = []
        StubEngine.made.append(self)

    def launch(self) -> None:
        pass

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def wait_ready(self) -> None:
        self.ready, self.info = True, SimpleNamespace(vocab_size=100)

    async def shutdown(self) -> None:
        self.ready, self.stopped = False, True

    def num_in_flight(self) -> int:
        return 0

    def num_queued(self) -> int:
        return 0

    def live_counts(self) -> tuple[int, int]:
        return 0, 0

    def check_engine(self) -> bool:
        return self.ready

    async def abort(self, rid: str) -> None:
        pass

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None):
        if self.stopped:
            raise EngineDeadError("this worker was shut down")
        self.prompts.append(list(ids))
        yield RequestOutput(rid, prompt, list(ids), [CompletionOutput(0, self.config.model, [1], finish_reason="length")],
                            True)


def stub_deployment_workers(monkeypatch) -> None:
    """Deployments (servelm.control.deployment) start StubEngines, and their tokenizer is the string
    "tokenizer-name:version"."""
    from servelm.control import deployment

    StubEngine.made = []
    monkeypatch.setattr(deployment, "AsyncEngine", StubEngine)
    monkeypatch.setattr(deployment, "load_tokenizer", lambda version, config: f"tokenizer-{version.ref}")
