"""Starting the models a server serves from start: `servelm serve MODEL` (one), and the config file's
`models:` list (several, each with its own engine process and tokenizer).

Every engine process is launched before any is waited for, so the models load side by side.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from servelm.config.engine import ConfigError, EngineConfig

logger = logging.getLogger("servelm.server")


@dataclass
class Launch:
    """One fixed model to start: its served name and engine settings; with several workers (or a routing
    strategy), a control-plane Deployment instead of one AsyncEngine."""

    name: str
    engine: EngineConfig
    spec: Any = None  # the config file's ModelSpec, for models from the `models:` list

    @property
    def pooled(self) -> bool:
        return self.spec is not None and (self.spec.workers > 1 or self.spec.strategy != "round_robin")


def serves_cli_model(config) -> bool:
    """Whether MODEL is served: given as an argument, flag or env, or nothing else is declared."""
    return not config.models or config.sources.get("model.model") != "default"


def pooling_model(config):
    """MODEL's folder when the server runs it as its embedding model (vLLM's pooling runner: --runner pooling,
    or auto and an embedding model's folder) in place of a generation engine, else None. Raises ConfigError
    where that leaves two embedding models, or more than one name for it; ValueError or FileNotFoundError where
    --runner pooling names no pooling model."""
    from servelm.model.loading.metadata import pooling_folder

    if not serves_cli_model(config):
        return None
    mc, srv = config.engine.model_config, config.server
    folder = pooling_folder(mc.model, mc.gguf_file, mc.runner, mc.hf_overrides)
    if folder is None:
        return None
    other = srv.embedding_config.embedding_model
    if other not in ("default", "none"):
        raise ConfigError("embedding_model", other, f"none beside MODEL {mc.model!r}, an embedding model that is "
                          "the server's embedding model (--runner pooling): drop one of them")
    if len(srv.api_config.served_model_name or ()) > 1:
        raise ConfigError("served_model_name", srv.api_config.served_model_name,
                          "one name for an embedding model served as MODEL")
    return folder


def cli_aliases(config) -> tuple[str, ...]:
    """The further names --served-model-name gives MODEL (after the first, its id), when MODEL is served."""
    names = config.server.api_config.served_model_name or ()
    return tuple(names[1:]) if serves_cli_model(config) else ()


def fixed_models(config) -> list[Launch]:
    """What to start: MODEL (given as an argument, flag or env, or nothing else is declared; not a pooling
    model, which the embedder runs) under served_model_name's first name, then each `models:` entry under
    its name. The entries take the engine section's settings but not MODEL's tokenizer, chat template,
    revision or hf_overrides."""
    from servelm.model.loading.hub import served_name

    out: list[Launch] = []
    ec, srv = config.engine, config.server
    if serves_cli_model(config) and pooling_model(config) is None:  # a pooling MODEL runs in the embedder
        name = srv.api_config.served_model_name[0] if srv.api_config.served_model_name else served_name(ec.model_config.model, ec.model_config.gguf_file)
        out.append(Launch(name, ec))
    for spec in config.models:
        base = ec.replace(tokenizer=None, chat_template=None, revision=None, hf_overrides=None)
        engine = spec.engine_config(base)  # an entry's own hf_overrides apply to it (in its engine's loader)
        out.append(Launch(spec.name, engine, spec))
    names = [launch.name for launch in out] + list(cli_aliases(config))
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError("models.name", dup, "a name that differs from served_model_name and every other model")
    return out


async def start_engines(launches: list[Launch], start_timeout: float,
                        engine_factory=None) -> list[tuple[Any, Any, str]]:
    """Launch every engine, load each tokenizer meanwhile, wait until all are warm: [(engine, tokenizer,
    name)]. If one fails to start, the others are shut down and the error raised. `engine_factory(config,
    start_timeout=...)` makes each single engine (default AsyncEngine; servelm.ray passes its Ray one)."""
    from servelm.model.loading.metadata import model_tokenizer
    from servelm.worker.client import AsyncEngine  # light: no torch, no transformers

    make = engine_factory or AsyncEngine
    engines: list = [None] * len(launches)
    tokenizers: list = []
    try:
        for i, launch in enumerate(launches):
            if not launch.pooled:
                engines[i] = make(launch.engine, start_timeout=start_timeout)
                engines[i].launch()  # the engine process imports torch and loads the model meanwhile
        for i, launch in enumerate(launches):
            tok = model_tokenizer(launch.engine.model_config)
            tokenizers.append(tok)
            if launch.pooled:
                engines[i] = _deployment(launch, tok, start_timeout)
            else:
                engines[i].set_tokenizer(tok)
        await asyncio.gather(*(e.start() if launch.pooled else e.wait_ready()
                               for e, launch in zip(engines, launches, strict=True)))
    except BaseException:
        await asyncio.gather(*(e.shutdown() for e in engines if e is not None), return_exceptions=True)
        raise
    return [(e, t, launch.name) for e, t, launch in zip(engines, tokenizers, launches, strict=True)]


def _deployment(launch: Launch, tokenizer, start_timeout: float):
    """A model of the `models:` list with several workers: a Deployment of an unregistered version (its
    path as the artifact), served under its plain name."""
    try:
        from servelm.control.deployment import Deployment
    except ImportError as e:  # the deployments piece is not installed in this build
        raise ConfigError(f"models[{launch.name}].workers", launch.spec.workers,
                          "1: this build has no deployments of several workers") from e
    from servelm.control.types import Kind, ModelVersion, State

    spec = launch.spec
    version = ModelVersion(spec.name, 0, State.PRODUCTION, Kind.GENERATE, spec.path, "", spec.path,
                           engine=dict(spec.engine))
    base = launch.engine.replace(model=spec.path)
    return Deployment(version, base, spec.workers, spec.strategy, tokenizer, spec.name, start_timeout)
