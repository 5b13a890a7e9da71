"""The config file's `models:` list: the models a server serves from start, each with its workers, routing
strategy and engine overrides on top of the file's `engine` section.

    models:
      - name: smol
        path: /models/SmolLM2-135M-Instruct
        workers: 2
        strategy: least_loaded
        engine: {max_num_seqs: 64}
      - {name: tiny, path: /models/tiny-llama}
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field

from servelm.config.engine import ENGINE_FIELDS, ENGINE_SECTIONS, ConfigError, EngineConfig

STRATEGIES = ("round_robin", "least_loaded", "memory_aware", "prefix_aware")
_PINNED = re.compile(r".*:\d+$")  # name:version is how a request pins a registered version


@dataclass
class ModelSpec:
    """One model declared in the config file."""

    name: str
    path: str
    workers: int = 1
    strategy: str = "round_robin"
    engine: dict = field(default_factory=dict)  # EngineConfig overrides (not model)

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """This model's engine settings: the server's, with its overrides and its path as the model."""
        return base.replace(**self.engine, model=self.path)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_models(value, where: str) -> list[ModelSpec]:
    """The `models:` list of a config file, checked: each entry's keys, types and engine overrides, names
    unique. Raises ConfigError naming the entry."""
    if not isinstance(value, list):
        raise ConfigError("models", value, f"a list of models (name, path, workers, strategy, engine) in {where}")
    allowed = {f.name for f in dataclasses.fields(ModelSpec)}
    engine_fields = set(ENGINE_FIELDS) - {"model"}  # flat names, as on the command line
    hints = {name: typing.get_type_hints(ENGINE_SECTIONS[sec])[name] for name, sec in ENGINE_FIELDS.items()}
    specs: list[ModelSpec] = []
    for i, entry in enumerate(value):
        key = f"models[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(key, entry, "a mapping with name and path")
        unknown = set(entry) - allowed
        if unknown:
            raise ConfigError(f"{key}.{sorted(unknown)[0]}", entry[sorted(unknown)[0]],
                              f"one of the keys {', '.join(sorted(allowed))}")
        name, path = entry.get("name"), entry.get("path")
        if not isinstance(name, str) or not name.strip() or _PINNED.match(name) or any(c.isspace() for c in name):
            raise ConfigError(f"{key}.name", name, "a non-empty name with no spaces, not ending in :<number>")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}.path", path, "a model folder or .gguf file")
        workers = entry.get("workers", 1)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"{key}.workers", workers, "an integer >= 1")
        strategy = entry.get("strategy", "round_robin")
        if strategy not in STRATEGIES:
            raise ConfigError(f"{key}.strategy", strategy, f"one of {', '.join(STRATEGIES)}")
        overrides = entry.get("engine") or {}
        if not isinstance(overrides, dict):
            raise ConfigError(f"{key}.engine", overrides, "a mapping of engine settings")
        from servelm.config.settings import _coerce  # the same coercion as the engine section's

        engine = {}
        for k, v in overrides.items():
            if k not in engine_fields:
                raise ConfigError(f"{key}.engine.{k}", v, "a known engine setting (not model: use path)")
            engine[k] = _coerce(f"{key}.engine.{k}", v, hints[k], where)
        spec = ModelSpec(name, path, workers, strategy, engine)
        try:
            spec.engine_config(EngineConfig())  # the overrides' values are checked as the engine section's
        except ConfigError as e:
            raise ConfigError(f"{key}.engine.{e.key}", e.value, e.allowed) from None
        if any(s.name == name for s in specs):
            raise ConfigError(f"{key}.name", name, "a name no other model in the list has")
        specs.append(spec)
    return specs
