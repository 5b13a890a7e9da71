"""Starting the models a server serves from start: `servelm serve MODEL` (one), and the config file's
`models:` list (several, each with its own engine process and tokenizer).

Every engine process is launched before any is waited for, so the models load side by side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from servelm.config.engine import ConfigError, EngineConfig

logger = logging.getLogger("servelm.server")


@dataclass
class Launch:
    """One fixed model to start: its served name and engine settings."""

    name: str
    engine: EngineConfig


def fixed_models(config) -> list[Launch]:
    """What to start: MODEL (given as an argument, flag or env, or nothing else is declared) under
    served_model_name, then each `models:` entry under its name."""
    from servelm.model.metadata import resolve_model

    out: list[Launch] = []
    ec, srv = config.engine, config.server
    if not config.models or config.sources.get("engine.model") != "default":
        out.append(Launch(srv.served_model_name or resolve_model(ec.model, ec.gguf_file).name, ec))
    for spec in config.models:
        if spec.workers != 1:
            raise ConfigError(f"models[{spec.name}].workers", spec.workers,
                              "1 here: several workers per model need the deployments of the control plane")
        out.append(Launch(spec.name, spec.engine_config(dataclasses.replace(ec, tokenizer=None))))
    names = [launch.name for launch in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError("models.name", dup, "a name that differs from served_model_name and every other model")
    return out


async def start_engines(launches: list[Launch], start_timeout: float) -> list[tuple[Any, Any, str]]:
    """Launch every engine, load each tokenizer meanwhile, wait until all are warm: [(engine, tokenizer,
    name)]. If one fails to start, the others are shut down and the error raised."""
    from servelm.model.metadata import load_tokenizer, resolve_model
    from servelm.worker.client import AsyncEngine  # light: no torch, no transformers

    engines = []
    try:
        for launch in launches:
            engine = AsyncEngine(launch.engine, start_timeout=start_timeout)
            engine.launch()  # the engine process imports torch and loads the model while this one goes on
            engines.append(engine)
        tokenizers = []
        for launch, engine in zip(launches, engines, strict=True):
            ec = launch.engine
            tok = load_tokenizer(resolve_model(ec.model, ec.gguf_file), ec.tokenizer)
            engine.set_tokenizer(tok)
            tokenizers.append(tok)
        await asyncio.gather(*(e.wait_ready() for e in engines))
    except BaseException:
        await asyncio.gather(*(e.shutdown() for e in engines), return_exceptions=True)
        raise
    return [(e, t, launch.name) for e, t, launch in zip(engines, tokenizers, launches, strict=True)]
