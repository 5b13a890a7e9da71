"""The Python modules of servelm's .proto files, generated with grpcio-tools on first import into a cache.

Why on import and not at build time: a build hook would make grpcio-tools a build requirement of every
install (with or without the `grpc` extra), and an editable install (`pip install -e .`) would keep stubs
from whatever .proto was there at install time. Here the cache key is a hash of the .proto files and of the
grpcio-tools and protobuf versions, so the stubs always match both the shipped protos and the runtime that
imports them; generating takes ~0.3 s, once per key. The cache is `$SERVELM_CACHE_DIR/grpc-stubs` (default
~/.cache/servelm/grpc-stubs), falling back to a temporary directory if unwritable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

PROTO_DIR = Path(__file__).parent / "protos"
PROTOS = ("servelm_llm_v1", "servelm_oip_v2")
_lock = threading.Lock()
_loaded: dict[str, tuple[ModuleType, ModuleType]] = {}


def cache_root() -> Path:
    from servelm.model.loading.source import (
        cache_dir,  # servelm's one cache: $SERVELM_CACHE_DIR or ~/.cache/servelm
    )

    return cache_dir()


def _key() -> str:
    from importlib.metadata import version

    h = hashlib.sha256()
    for name in PROTOS:
        h.update((PROTO_DIR / f"{name}.proto").read_bytes())
    h.update(f"grpcio-tools {version('grpcio-tools')} protobuf {version('protobuf')}".encode())
    return h.hexdigest()[:16]


def _generate(out: Path) -> None:
    """Run protoc (grpcio-tools' bundled one) on every proto into `out`, atomically."""
    import grpc_tools
    from grpc_tools import protoc

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=out.parent))
    try:
        include = Path(grpc_tools.__file__).parent / "_proto"
        args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={tmp}",
                f"--grpc_python_out={tmp}", *(str(PROTO_DIR / f"{n}.proto") for n in PROTOS)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR}")
        try:
            tmp.rename(out)  # another process may have won the race: its output is the same
        except OSError:
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stub_dir() -> Path:
    key = _key()
    for root in (cache_root(), Path(tempfile.gettempdir()) / f"servelm-{os.getuid()}"):
        out = root / "grpc-stubs" / key
        if out.is_dir():
            return out
        try:
            _generate(out)
            return out
        except OSError:
            continue
    raise RuntimeError("cannot write the generated gRPC stubs anywhere (set SERVELM_CACHE_DIR)")


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # the *_pb2_grpc module imports its *_pb2 by this top-level name
    spec.loader.exec_module(mod)
    return mod


def load(proto: str) -> tuple[ModuleType, ModuleType]:
    """(messages, services) modules of one of PROTOS: `<proto>_pb2` and `<proto>_pb2_grpc`."""
    with _lock:
        if proto not in _loaded:
            d = _stub_dir()
            pb2 = sys.modules.get(f"{proto}_pb2") or _import(f"{proto}_pb2", d / f"{proto}_pb2.py")
            _loaded[proto] = (pb2, _import(f"{proto}_pb2_grpc", d / f"{proto}_pb2_grpc.py"))
        return _loaded[proto]
