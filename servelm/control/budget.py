"""The server's memory budget: what a worker will take before it starts, and whether it fits.

A worker's footprint is its weights (parameters x the dtype it runs in), its KV pool (from the engine
settings, exactly as the engine sizes it) and a fixed allowance for the process itself (the Python and torch
runtime). Read from the checkpoint's config without importing torch. On a GPU whose engine sizes its KV cache
from the device's memory (engine/kv_sizing.py), the worker takes its `gpu_memory_utilization` share of the
device, weights included, and the budget is the device's whole memory.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from servelm.config.engine import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_GB, EngineConfig
from servelm.control.errors import InsufficientMemory
from servelm.control.types import Kind, ModelVersion
from servelm.model.kernels.cpu_features import cpu_has_bf16

GiB = 2**30
DEFAULT_FRACTION = 0.8  # of RAM: the default budget
RUNTIME_BYTES = 300 * 2**20  # an engine process's own resident memory (interpreter, torch) before the model
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def ram_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_bytes(device: str) -> int | None:
    """Memory of the CUDA device `device` names (cuda, cuda:N), from nvidia-smi (no torch in this process);
    None where it cannot be read."""
    index = device.partition(":")[2] or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(float(out.strip().splitlines()[0])) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def itemsize(dtype: str, device: str = "cpu") -> int:
    """Bytes per value of the dtype a worker runs in ("auto" resolved as the loader resolves it)."""
    if dtype == "auto":
        return 2 if device.startswith("cuda") or cpu_has_bf16() else 4
    return _ITEMSIZE[dtype]


def _files_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Footprint:
    """Bytes one worker of a version takes."""

    weights: int
    kv_pool: int
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.runtime

    def describe(self) -> str:
        return (f"{self.total / GiB:.2f} GiB (weights {self.weights / GiB:.2f} + KV pool {self.kv_pool / GiB:.2f} "
                f"+ runtime {self.runtime / GiB:.2f})")


def kv_bytes_per_block(hf_config, block_size: int, size: int) -> int:
    """K and V of every layer for one block, as the engine allocates them."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim * size


def worker_footprint(version: ModelVersion, config: EngineConfig | None) -> Footprint:
    """The footprint of one worker of `version` under `config` (the version's own engine settings applied); an
    embedding worker (no config) runs its encoder in float32 and has no KV pool."""
    from servelm.model.loading.metadata import load_config, resolve_model

    if version.kind == Kind.EMBED or config is None:
        return Footprint(version.num_params * 4 if version.num_params else
                         version.size_bytes or _files_size(Path(version.artifact)), 0)
    size = itemsize(config.model_config.dtype, config.device_config.device)
    if version.num_params:
        weights = version.num_params * size
    else:  # unknown parameter count: what the files hold
        weights = version.size_bytes or _files_size(Path(version.artifact))
    device_memory = (gpu_bytes(config.device_config.device) if config.device_config.device.startswith("cuda") and config.cache_config.num_kv_blocks is None
                     and config.cache_config.kv_cache_memory_gb is None else None)
    if device_memory:  # the engine takes its share of the device and fills what the weights leave with KV blocks
        share = int((config.cache_config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION) * device_memory)
        return Footprint(weights, max(0, share - weights), runtime=0)
    if config.cache_config.num_kv_blocks is not None:
        hf_config = load_config(resolve_model(config.model_config.model, config.model_config.gguf_file))
        kv_size = 1 if config.cache_config.kv_cache_dtype != "auto" else size  # an fp8 cache: one byte an entry
        kv = config.cache_config.num_kv_blocks * kv_bytes_per_block(hf_config, config.cache_config.block_size, kv_size)
    else:
        kv = int((config.cache_config.kv_cache_memory_gb or DEFAULT_KV_CACHE_GB) * GiB)
    return Footprint(weights, kv)


class MemoryBudget:
    """How many bytes all workers together may take (default: 80% of RAM; for a CUDA device its whole memory,
    of which each worker takes its own gpu_memory_utilization share)."""

    def __init__(self, total_bytes: int | None = None, device: str = "cpu") -> None:
        if total_bytes is None:
            memory = gpu_bytes(device) if device.startswith("cuda") else None
            total_bytes = memory or int(DEFAULT_FRACTION * ram_bytes())
        self.total = total_bytes

    def check(self, need: int, in_use: int, what: str) -> None:
        """Raise InsufficientMemory naming the numbers unless `need` more bytes fit beside `in_use`."""
        if in_use + need > self.total:
            raise InsufficientMemory(
                f"{what} needs {need / GiB:.2f} GiB but only {(self.total - in_use) / GiB:.2f} GiB of the "
                f"{self.total / GiB:.2f} GiB memory budget is free ({in_use / GiB:.2f} GiB in use, and no idle "
                "deployment can be unloaded to make room)", code="insufficient_memory")
