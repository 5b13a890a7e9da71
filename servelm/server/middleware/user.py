"""The operator's own ASGI middleware, named by import path (vLLM's --middleware): a class is added with
`app.add_middleware`, an async function `(request, call_next)` as an HTTP middleware. They sit inside the
gateway, so a request reaches them with its id, key and limits already checked."""

from __future__ import annotations

import importlib
import inspect
from typing import Any


def resolve(path: str) -> Any:
    """The object `path` (package.module.Name) names; ValueError saying what is wrong otherwise."""
    module, _, name = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ValueError(f"middleware {path!r}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"middleware {path!r}: module {module!r} has no {name!r}") from None
    if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
        raise ValueError(f"middleware {path!r}: neither a class (ASGI middleware) nor an async function "
                         "(request, call_next)")
    return obj


def install(app: Any, paths: tuple[str, ...]) -> None:
    """Add each, the first given outermost (Starlette wraps the last added around the others)."""
    for path in reversed(paths):
        obj = resolve(path)
        if inspect.isclass(obj):
            app.add_middleware(obj)
        else:
            app.middleware("http")(obj)
