"""The engine's LoRA adapters: which are known (name -> path), which are loaded (an LRU bound), which a step's
rows use (`batch`), and the prefix-cache namespace of each (an adapter's KV differs from the base's for the
same tokens, so its blocks are its own)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from servelm.lora import LoRARequest
from servelm.model.decoder import DecoderLM
from servelm.model.layers.lora import LoraBatch, LoraError, LoraLinears, LoraWeights, load_lora

logger = logging.getLogger(__name__)


@dataclass
class AdapterInfo:
    """What the engine reports about a known adapter."""

    name: str
    path: str
    lora_int_id: int
    base_model_name: str | None
    loaded: bool
    rank: int | None
    nbytes: int | None
    load_s: float | None
    requests: int  # unfinished requests using it


def adapter_digest(path: str) -> str:
    """SHA-256 over an adapter folder's config and weight files."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.name == "adapter_config.json" or f.name.startswith("adapter_model."):
            h.update(f.name.encode() + b"\0")
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


class LoraManager:
    def __init__(self, model: DecoderLM, max_rank: int, max_loras: int, max_cpu_loras: int | None) -> None:
        if model.tp is not None:
            raise LoraError("LoRA adapters need tensor_parallel_size=1 (adapters are not sharded)")
        self.model = model
        self.device = model.embed.device
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_loras, 32) if max_cpu_loras is None else max_cpu_loras
        self.known: dict[str, LoRARequest] = {}
        # least recently used first. On the CPU an adapter is held as the linears a step runs (its matrices packed
        # for the C++ kernels); on a GPU as CPU tensors, and the ones a step uses as linears on the device
        self.loaded: OrderedDict[str, LoraLinears | LoraWeights] = OrderedDict()
        self.on_device: OrderedDict[str, LoraLinears] = OrderedDict()
        self.load_s: dict[str, float] = {}
        self.refs: dict[str, int] = {}  # unfinished requests per adapter
        # prefix-cache namespace per adapter: a digest of its files, so blocks cached for an adapter's old weights
        # are never hits for new ones (a persisted KV cache included), and one adapter under two names shares them
        self.cache_keys: dict[str, str] = {}

    # -- registration ------------------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> AdapterInfo:
        """Register and load an adapter (raises LoraError if it cannot serve this base model). Registering a
        name again with the same path is a no-op; with another path it replaces the adapter."""
        old = self.known.get(lora.lora_name)
        if old is not None and (not lora.lora_path or old.lora_path == lora.lora_path):
            self._load(lora.lora_name)
            return self.info(lora.lora_name)
        if not lora.lora_path:
            raise LoraError(f"adapter {lora.lora_name!r} is not loaded and the request gives no path")
        if old is not None and self.refs.get(lora.lora_name):
            raise LoraError(f"adapter {lora.lora_name!r} is in use by {self.refs[lora.lora_name]} requests; "
                            "unload it when they finish, or load the new one under another name")
        weights, seconds = self._read(lora.lora_name, lora.lora_path)
        self.known[lora.lora_name] = lora
        self._drop(lora.lora_name)
        self.loaded[lora.lora_name] = weights
        self.load_s[lora.lora_name] = seconds
        self.cache_keys[lora.lora_name] = adapter_digest(lora.lora_path)
        self._evict()
        logger.info("LoRA adapter %s loaded from %s: rank %d, %s, %.2f MiB in %.3f s", lora.lora_name,
                    lora.lora_path, weights.rank, "/".join(weights.targets), weights.nbytes / 2**20, seconds)
        return self.info(lora.lora_name)

    def remove(self, name: str) -> bool:
        """Forget an adapter; False if unknown. Raises LoraError while requests use it."""
        if name not in self.known:
            return False
        if self.refs.get(name):
            raise LoraError(f"adapter {name!r} is in use by {self.refs[name]} requests")
        del self.known[name]
        self._drop(name)
        self.cache_keys.pop(name, None)
        self.load_s.pop(name, None)
        return True

    def info(self, name: str) -> AdapterInfo:
        lr, w = self.known[name], self.loaded.get(name)
        return AdapterInfo(name, lr.lora_path, lr.lora_int_id, lr.base_model_name, w is not None,
                           w.rank if w is not None else None, w.nbytes if w is not None else None,
                           self.load_s.get(name), self.refs.get(name, 0))

    def adapters(self) -> list[AdapterInfo]:
        return [self.info(n) for n in self.known]

    # -- requests ----------------------------------------------------------------------------------
    def acquire(self, lora: LoRARequest) -> str:
        """For a new request: the adapter registered (from its path, if new) and loaded; returns its prefix-cache
        namespace. Raises LoraError."""
        if lora.lora_name not in self.known or (lora.lora_path and lora.lora_path != self.known[lora.lora_name].lora_path):
            self.add(lora)
        else:
            self._load(lora.lora_name)
        self.refs[lora.lora_name] = self.refs.get(lora.lora_name, 0) + 1
        return self.cache_keys[lora.lora_name]

    def release(self, name: str) -> None:
        n = self.refs.get(name, 0) - 1
        if n > 0:
            self.refs[name] = n
        else:
            self.refs.pop(name, None)
            self._evict()

    @property
    def active(self) -> bool:
        """Some unfinished request uses an adapter (a step must look at its rows)."""
        return bool(self.refs)

    def batch(self, names: list[str | None]) -> LoraBatch | None:
        """The LoraBatch of a step whose row i uses adapter names[i] (None: the base model)."""
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name is not None:
                rows.setdefault(name, []).append(i)
        if not rows:
            return None
        groups = []
        for name, idx in rows.items():
            w = self._weights_on_device(name)
            groups.append((w, None if len(idx) == len(names) else torch.tensor(idx, device=self.device)))
        return LoraBatch(groups)

    # -- memory ------------------------------------------------------------------------------------
    def _read(self, name: str, path: str) -> tuple[LoraLinears | LoraWeights, float]:
        t0 = time.perf_counter()
        w = load_lora(name, path, self.model.spec, self.model.dtype, self.max_rank)
        if self.device.type == "cpu":
            w = w.on(self.device)
        return w, time.perf_counter() - t0

    def _load(self, name: str) -> LoraLinears | LoraWeights:
        w = self.loaded.get(name)
        if w is None:  # evicted: read again from its path
            w, self.load_s[name] = self._read(name, self.known[name].lora_path)
            self.loaded[name] = w
            self._evict()
        self.loaded.move_to_end(name)
        return w

    def _weights_on_device(self, name: str) -> LoraLinears:
        w = self._load(name)
        if isinstance(w, LoraLinears):
            return w
        d = self.on_device.get(name)
        if d is None:
            d = self.on_device[name] = w.on(self.device)
            while len(self.on_device) > self.max_loras:  # the scheduler keeps a step's adapters within max_loras
                self.on_device.popitem(last=False)
        self.on_device.move_to_end(name)
        return d

    def _drop(self, name: str) -> None:
        self.loaded.pop(name, None)
        self.on_device.pop(name, None)

    def _evict(self) -> None:
        """Unload least recently used adapters that no request uses while over the bound (adapters in use stay,
        even past it)."""
        over = len(self.loaded) - self.max_cpu_loras
        for name in list(self.loaded):
            if over <= 0:
                break
            if not self.refs.get(name):
                self._drop(name)
                over -= 1
