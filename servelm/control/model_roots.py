"""Where `register` may import models from: the server's allowed model roots.

An admin key must not turn the server into a reader of any file it can open, so a registration's path must lie
under an allowed root (after symlinks are resolved). The roots are the ones configured explicitly
(`server.model_roots`, directories separated by ':'), plus what the operator already pointed the server at:
the folder holding each model it was started with (`servelm serve MODEL`, the config file's `models:` list,
`--embedding-model DIR`), so other versions kept beside them can be registered, and the default models
installed with servelm. A configured model directly under `/` or the home directory adds only itself (its
parent would open everything).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from servelm.control.errors import Forbidden


def parse_roots(value: str | None) -> list[Path]:
    """`server.model_roots`: directories separated by ':' (os.pathsep); empty parts are ignored."""
    return [Path(p).expanduser() for p in (value or "").split(os.pathsep) if p.strip()]


def _beside(path: str) -> Path:
    """The folder a configured model lives in (itself when that folder would be / or the home directory)."""
    p = Path(path).expanduser().resolve()
    parent = p.parent
    return p if parent == Path(parent.anchor) or parent == Path.home().resolve() else parent


def allowed_roots(config) -> list[Path]:
    """The model roots of a ServeConfig, resolved, without duplicates."""
    from servelm.model.loading.source import default_model_path
    from servelm.runtimes.embedder import default_embedding_path

    roots = parse_roots(config.server.storage_config.model_roots)
    configured = [spec.path for spec in config.models]
    if config.engine.model_config.model:
        configured.append(config.engine.model_config.model)
    if config.server.embedding_config.embedding_model not in ("default", "none"):
        configured.append(config.server.embedding_config.embedding_model)
    roots += [_beside(p) for p in configured]
    with contextlib.suppress(FileNotFoundError):  # not installed
        roots.append(default_model_path())
    packaged_embedder = default_embedding_path()
    if packaged_embedder is not None:
        roots.append(packaged_embedder)
    out: list[Path] = []
    for r in roots:
        r = r.resolve()
        if r not in out:
            out.append(r)
    return out


def check_path(path: str, roots: list[Path]) -> None:
    """Forbidden unless `path` (symlinks resolved) is one of `roots` or lies under one."""
    real = Path(path).expanduser().resolve()
    if any(real == r or r in real.parents for r in roots):
        return
    listed = ", ".join(str(r) for r in roots) or "none"
    raise Forbidden(f"path {str(path)!r} is outside the server's allowed model roots ({listed}); an "
                    "operator can add directories with --model-roots / SERVELM_MODEL_ROOTS", code="path_not_allowed",
                    param="path")
