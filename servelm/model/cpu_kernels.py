"""C++ CPU kernels (paged decode and prefill attention, AMX tile matmul with an optional fused
SiLU-and-multiply, single-row bf16 matmul, fused bf16 norm/rotary/SiLU, row argmax), compiled on first
use with torch's extension builder and cached.

`SERVELM_CPU_KERNELS=0` turns them off (the PyTorch paths are used instead). A machine that cannot
compile them (no compiler, no ninja) falls back the same way, with one warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SRC_DIR = Path(__file__).parent / "csrc"
_module = None
_tried = False
# No -ffast-math: the kernels promise PyTorch's exact results, and fast-math turns x / y into an approximate
# reciprocal and folds NaN checks away. (A per-file `#pragma GCC optimize("no-fast-math")` instead stopped
# the vec.h helpers from inlining and made the elementwise kernels 3x slower.) `omp simd reduction`
# still vectorizes the attention kernel's sums.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def enabled() -> bool:
    return os.environ.get("SERVELM_CPU_KERNELS", "1") != "0"


def load():
    """The compiled module, or None when disabled or unavailable."""
    global _module, _tried
    if not enabled():
        return None
    if _tried:
        return _module
    _tried = True
    try:
        logger.info("loading servelm CPU kernels (compiled on first use only)")
        _module = build()
    except Exception as e:  # a missing compiler must not stop the engine
        logger.warning("servelm CPU kernels unavailable, using the PyTorch path: %s", e)
        _module = None
    return _module


def build(src_dir: Path = _SRC_DIR):
    """Compiles (or finds in the cache) the kernels of `src_dir`; benchmarks pass another checkout's csrc
    to compare two builds in one process. Raises when they cannot be built."""
    from torch.utils.cpp_extension import load as build_extension

    from servelm.model.source import cache_dir

    sources = sorted(src_dir.glob("*.cpp"))
    files = sources + sorted(src_dir.glob("*.h"))
    digest = hashlib.sha1(torch.__version__.encode())
    for f in files:
        digest.update(f.read_bytes())
    tag = digest.hexdigest()[:12]
    build_dir = cache_dir() / "kernels" / tag
    # Build from a copy inside the cache: torch's builder rebuilds whenever the source paths change, so
    # building from the checkout would recompile (minutes) for every clone or move of the same code.
    src_copy = build_dir / "src"
    src_copy.mkdir(parents=True, exist_ok=True)
    for f in files:
        dst = src_copy / f.name
        if not dst.exists() or dst.read_bytes() != f.read_bytes():
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
            shutil.copyfile(f, tmp)
            os.replace(tmp, dst)  # atomic: a process building at the same moment never reads half a file
    return build_extension(name=f"servelm_cpu_{tag}", sources=[str(src_copy / f.name) for f in sources],
                           build_directory=str(build_dir), extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           verbose=False)
