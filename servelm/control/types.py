"""The control plane's shared vocabulary: a model version as the registry records it, its lifecycle states and
kinds (the errors control operations raise are in `control.errors`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from servelm.config.engine import EngineConfig


class State(str, Enum):
    """A version's lifecycle state (see `lifecycle.ALLOWED` for the transitions)."""

    REGISTERED = "REGISTERED"
    VALIDATING = "VALIDATING"
    VALIDATED = "VALIDATED"
    FAILED = "FAILED"
    STAGING = "STAGING"
    STAGING_TESTED = "STAGING_TESTED"
    CANARY = "CANARY"
    PRODUCTION = "PRODUCTION"
    ROLLBACK = "ROLLBACK"
    DEPRECATED = "DEPRECATED"
    ARCHIVED = "ARCHIVED"


class Kind(str, Enum):
    """What a version's workers do: generate text (engine-core workers), embed it (embedding workers), or
    predict (a scikit-learn, XGBoost or ONNX model, served over the Open Inference Protocol). A `lora` version
    is a PEFT LoRA adapter of one GENERATE version (its `base`): it has no workers of its own, it runs in the
    workers of a deployment of its base, and requests see it as a generation model."""

    GENERATE = "generate"
    EMBED = "embed"
    PREDICT = "predict"
    LORA = "lora"

    @property
    def serves(self) -> Kind:
        """The kind of requests it answers: an adapter answers generation requests."""
        return Kind.GENERATE if self is Kind.LORA else self


MAX_VERSION = 2**31 - 1  # version numbers above this are refused: SQLite's integers (and sanity) end near there


@dataclass
class ModelVersion:
    """One registered version of a model: its immutable artifact and what is known about it."""

    name: str
    version: int
    state: State
    kind: Kind
    artifact: str  # the path inside the content-addressed store (a folder, or a .gguf file)
    sha256: str  # digest over the artifact's files (names and contents), checked before serving
    source: str  # where it was registered from
    architecture: str | None = None
    dtype: str | None = None
    size_bytes: int = 0
    num_params: int | None = None
    created_by: str = "system"
    created_at: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    engine: dict = field(default_factory=dict)  # EngineConfig overrides for this version's workers
    golden_prompts: list[str] = field(default_factory=list)
    golden_outputs: list[str] = field(default_factory=list)  # recorded by validation (greedy)
    failure: str | None = None  # why validation failed
    base: str | None = None  # a LORA version: the `name:version` of the GENERATE version it adapts

    @property
    def base_ref(self) -> tuple[str, int] | None:
        """(name, version) of a LORA version's base; None for other kinds."""
        if self.base is None:
            return None
        name, _, version = self.base.rpartition(":")
        return name, int(version)

    @property
    def ref(self) -> str:
        """How clients name this version: `name:version`."""
        return f"{self.name}:{self.version}"

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The engine settings of this version's workers: the server's, with this version's overrides and its
        artifact as the model (and its own chat template, if it has one: not the one given for MODEL)."""
        return base.replace(**{"chat_template": None, **self.engine}, model=self.artifact, gguf_file=None)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["state"], d["kind"], d["ref"] = self.state.value, self.kind.value, self.ref
        return d
