"""The C++ CPU kernels (paged decode and prefill attention, AMX tile matmul with an optional fused
SiLU-and-multiply, single-row bf16 matmul, fused bf16 norm/rotary/SiLU, row argmax): which build variant
this CPU runs, loaded once per process.

The libraries are compiled when servelm is installed (`kernels/build.py`, one per instruction-set level),
never at start. `load()` takes the best variant whose instruction sets this CPU has (read from
/proc/cpuinfo), says once which one, and falls back to the PyTorch path, with one warning, where none
was built or none fits. `SERVELM_CPU_KERNELS` chooses: `auto` (default), `0` (off: the PyTorch path), or
a variant name (`amx`, `avx512bf16`, `avx2`, `portable`), which is refused if this CPU lacks what it needs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from servelm.config import env
from servelm.model.kernels import build as kernel_build
from servelm.model.kernels.cpu_features import cpu_flags
from servelm.model.kernels.ops import CpuKernels

logger = logging.getLogger(__name__)
_module: CpuKernels | None = None
_tried = False


def enabled() -> bool:
    return env.cpu_kernels() not in ("0", "off", "false", "none")


def choose_variant(built: list[str], flags: frozenset[str], wanted: str = "auto", machine: str | None = None
                   ) -> tuple[str | None, str]:
    """The variant to load among those `built` for a CPU with `flags`, and why: the first (best) variant of
    this architecture whose required features the CPU has all of, or `wanted` if it names one the CPU can
    run. (None, reason) when there is none."""
    table = {v.name: v for v in kernel_build.variants(machine)}
    if wanted not in ("auto", "1", "on", "true", ""):
        v = table.get(wanted)
        if v is None:
            return None, f"no kernel variant {wanted!r} (this architecture has {', '.join(table)})"
        missing = sorted(set(v.requires) - flags)
        if missing:
            return None, f"this CPU lacks {', '.join(missing)}, which variant {wanted!r} needs"
        if wanted not in built:
            return None, f"variant {wanted!r} was not built"
        return wanted, f"variant {wanted!r} as SERVELM_CPU_KERNELS asks"
    for v in table.values():
        if v.name in built and set(v.requires) <= flags:
            return v.name, f"the best variant this CPU runs ({v.name})"
    return None, "no built variant runs on this CPU"


def manifest(lib_dir: Path = kernel_build.OUT_DIR) -> dict | None:
    try:
        return json.loads((lib_dir / kernel_build.MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def load_variant(name: str, lib_dir: Path = kernel_build.OUT_DIR) -> CpuKernels:
    """One built variant, loaded whatever the CPU (tests load each variant the CPU can execute)."""
    return CpuKernels(lib_dir / kernel_build.library_name(name), name)


def load() -> CpuKernels | None:
    """The kernels for this process, or None when turned off or unavailable (the variant is chosen and
    logged once)."""
    global _module, _tried
    if not enabled():  # read on every call: turning them off takes effect at once
        return None
    if _tried:
        return _module
    dot = env.cpu_bf16_dot()  # a bad value is an error at every load, not a silent fallback
    _tried = True
    found = manifest()
    if found is None:
        logger.warning("servelm CPU kernels are not built (a source checkout that was not installed): using the "
                       "PyTorch path; build them with `pip install -e .` or `python -m servelm.model.kernels.build`")
        return None
    current = kernel_build.source_digest()
    if found.get("sources") != current:
        logger.warning("servelm CPU kernels in %s were built from other sources than these: using the PyTorch "
                       "path; rebuild with `python -m servelm.model.kernels.build`", kernel_build.OUT_DIR)
        return None
    wanted = env.cpu_kernels()
    name, why = choose_variant(found.get("built", []), cpu_flags(), wanted)
    if name is None:
        failed = "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in found.get("failed", {}).items())
        logger.warning("servelm CPU kernels unavailable (%s%s): using the PyTorch path", why,
                       f"; failed builds: {failed}" if failed else "")
        return None
    try:
        _module = load_variant(name)
    except OSError as e:  # e.g. a library copied to a machine without libgomp
        logger.warning("servelm CPU kernels could not be loaded (%s): using the PyTorch path", e)
        return None
    logger.info("servelm CPU kernels: %s", why)
    if dot != "auto" and _module.bf16_dot() != "none":  # the variant multiplies bf16 pairs (AVX512-BF16)
        _module.set_bf16_dot(dot)
        logger.info("servelm CPU kernels multiply bf16 pairs with %s, as SERVELM_CPU_BF16_DOT asks",
                    "the dot-product instruction" if dot == "bf16" else "float FMAs")
    return _module


def build(src_dir: Path = kernel_build.SRC_DIR, variant: str | None = None) -> CpuKernels:
    """Builds the kernels of `src_dir` (another checkout's, for a side-by-side benchmark) into the cache,
    keyed by everything that changes the build, and loads the best variant for this CPU (or `variant`).
    Raises when it cannot build."""
    from servelm.model.loading.source import cache_dir

    out = cache_dir() / "kernels" / kernel_build.build_key(src_dir)
    found = manifest(out)
    if found is None:
        found = kernel_build.build(out, src_dir, log=logger.info)
    name, why = choose_variant(found["built"], cpu_flags(), variant or "auto")
    if name is None:
        raise RuntimeError(f"no kernel build for this CPU: {why}; failed: {found['failed']}")
    return load_variant(name, out)
