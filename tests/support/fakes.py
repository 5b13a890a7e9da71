"""Stand-ins for an engine or deployment in in-process app tests: the status surface the routes read, idle."""

from __future__ import annotations

from pathlib import Path
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


class RecordingEngine(IdleEngine):
    """An IdleEngine that records each request it is given: (engine request id, prompt ids, SamplingParams)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, list[int], object]] = []

    @property
    def engine_ids(self) -> list[str]:
        return [rid for rid, _, _ in self.requests]

    @property
    def prompts(self) -> list[list[int]]:
        return [ids for _, ids, _ in self.requests]

    async def generate(self, rid, ids, params, *args, **kw):
        self.requests.append((rid, list(ids), params))
        async for out in super().generate(rid, ids, params, *args, **kw):
            yield out


class StubEngine:
    """AsyncEngine's surface without a process: answers every request with its model path (the artifact of the
    version it serves; "+NAME" with LoRA adapter NAME) and remembers the prompt ids and adapter of each request.
    It holds the adapters its config loads at start and those loaded since, as the engine does, and refuses a
    request for one it does not hold."""

    made: list[StubEngine] = []

    def __init__(self, config: EngineConfig, tokenizer=None, start_timeout: float = 0.0) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.ready, self.stopped, self.info, self.stats = False, False, None, None
        self.max_model_len, self.restarts, self.engine_pid = 256, 0, None
        self.on_ready = self.on_down = self.on_step = None
        self.prompts: list[list[int]] = []
        self.used: list[str | None] = []  # each request's adapter
        self.loras: dict[str, str] = {}  # the adapters it holds: name -> path
        StubEngine.made.append(self)

    def launch(self) -> None:
        pass

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def wait_ready(self) -> None:
        from servelm.config.engine import parse_lora_module

        self.ready, self.info = True, SimpleNamespace(vocab_size=100)
        self.loras = dict(parse_lora_module(m)[:2] for m in self.config.lora_config.lora_modules) if self.config.lora_config.enable_lora \
            else {}

    async def lora_adapter(self, action: str, name: str, path: str = ""):

        from servelm.config.engine import parse_lora_module
        from servelm.worker import messages as m

        if not self.ready:
            raise EngineDeadError("the engine is not ready")
        if not self.config.lora_config.enable_lora:
            return m.LoraDone(0, "this engine serves no LoRA adapters (start it with --enable-lora)")
        if action == "load":
            if not (Path(path) / "adapter_config.json").is_file():
                return m.LoraDone(0, f"{path} is not a PEFT LoRA adapter folder (no adapter_config.json)")
            self.loras[name] = path
        elif self.loras.pop(name, None) is None:
            return m.LoraDone(0, f"no adapter named {name!r} is loaded")
        kept = tuple(x for x in self.config.lora_config.lora_modules if parse_lora_module(x)[0] != name)
        kept += (f"{name}={path}",) if action == "load" else ()
        self.config = self.config.replace(lora_modules=kept, enable_lora=True)
        return m.LoraDone(0, None, [{"name": n, "path": p} for n, p in self.loras.items()])

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

    async def generate(self, rid, ids, params, prompt=None, priority=1, queue_timeout=None, cache_salt=None,
                       lora=None):
        if self.stopped:
            raise EngineDeadError("this worker was shut down")
        if lora is not None and lora not in self.loras:
            raise ValueError(f"adapter {lora!r} is not loaded in this engine")
        self.prompts.append(list(ids))
        self.used.append(lora)
        text = self.config.model_config.model + (f"+{lora}" if lora else "")
        yield RequestOutput(rid, prompt, list(ids), [CompletionOutput(0, text, [1], finish_reason="length")], True)


def stub_deployment_workers(monkeypatch) -> None:
    """Deployments (servelm.control.deployment) start StubEngines, and their tokenizer is the string
    "tokenizer-name:version"."""
    from servelm.control import deployment

    StubEngine.made = []
    monkeypatch.setattr(deployment, "AsyncEngine", StubEngine)
    monkeypatch.setattr(deployment, "load_tokenizer", lambda version, config: f"tokenizer-{version.ref}")
