"""How many KV cache blocks an engine gets.

A number of blocks (`num_kv_blocks`) or a budget in GiB (`kv_cache_memory_gb`, 1 GiB by default on the CPU)
when given. On a GPU without either, as vLLM: the engine may use `gpu_memory_utilization` (default 0.9) of the
device's memory; a profile run of the largest step the scheduler can form (a prompt chunk of
`max_num_batched_tokens` tokens, then logits and sampling for `max_num_seqs` rows) measures the peak of the
weights and activations, and the KV cache gets what is left after that peak and after the memory on the device
that is not this process's tensors (the CUDA context, libraries, other processes).

CUDA graphs are captured after the KV cache exists (they record its addresses), so their memory cannot come
out of a measurement of the real ones. Before the cache is sized, the engine captures its largest decode graph
(and its largest mixed-step graph, where enabled) over a cache of one block, measures what the device lost to
them, and frees them; the KV cache gets that much less. The graphs share one memory pool and one output
buffer (engine/cuda_graphs.py), so the smaller graphs captured later fit in what the largest took.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from servelm.config.engine import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_GB, EngineConfig

logger = logging.getLogger("servelm.engine")

GiB = 2**30


class DeviceMemory(Protocol):
    """The device's memory counters the plan reads (torch.cuda's on a GPU; a stand-in in tests)."""

    def total(self) -> int: ...

    def used(self) -> int:
        """Bytes in use on the whole device, by every process (total - free)."""
        ...

    def reserved(self) -> int:
        """Bytes this process's tensor allocator holds from the device."""
        ...

    def reset_peak(self) -> None: ...

    def peak_allocated(self) -> int:
        """The most bytes this process's tensors held at once since reset_peak."""
        ...


class CudaMemory:
    def __init__(self, device) -> None:
        import torch

        self.cuda, self.device = torch.cuda, device

    def total(self) -> int:
        return self.cuda.mem_get_info(self.device)[1]

    def used(self) -> int:
        free, total = self.cuda.mem_get_info(self.device)
        return total - free

    def reserved(self) -> int:
        return self.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        gc.collect()  # what was dropped last (the profile's runner, the measured graphs) leaves the device
        self.cuda.synchronize(self.device)
        self.cuda.empty_cache()
        self.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        self.cuda.synchronize(self.device)
        return self.cuda.max_memory_allocated(self.device)


@dataclass(frozen=True)
class KVPlan:
    """The blocks the KV cache gets, and the figures they came from (for the log and for errors)."""

    num_blocks: int
    block_bytes: int
    budget: int = 0  # bytes this engine may use on the device (utilization x total); 0 when not planned
    peak: int = 0  # weights and the largest step's activations at their peak
    other: int = 0  # device memory that is not this process's tensors
    graphs: int = 0  # what the CUDA graphs will take, measured on the largest before the cache existed
    dtype: str = ""  # the cache's element type (bfloat16, float8_e4m3fn, ...): it sets block_bytes

    def describe(self) -> str:
        kv = self.num_blocks * self.block_bytes / GiB
        blocks = f"{self.num_blocks} blocks" + (f" of {self.dtype}" if self.dtype else "")
        if not self.budget:
            return f"KV cache {kv:.2f} GiB ({blocks})"
        graphs = f", {self.graphs / GiB:.2f} GiB of CUDA graphs" if self.graphs else ""
        return (f"KV cache {kv:.2f} GiB ({blocks}): {self.budget / GiB:.2f} GiB for this engine, "
                f"less {self.peak / GiB:.2f} GiB of weights and activations at the largest step's peak{graphs} "
                f"and {self.other / GiB:.2f} GiB of other memory on the device")


def plan_kv_blocks(config: EngineConfig, block_bytes: int, memory: DeviceMemory | None,
                   profile: Callable[[], None], dtype: str = "", graphs: Callable[[], object] | None = None
                   ) -> KVPlan:
    """The KV cache's size under `config`: `memory` (a GPU's counters) plans from the device's memory with
    `profile` (the largest step, run once) when neither a block count nor a GiB budget is given. `block_bytes`
    is in the cache's element type `dtype` (an fp8 cache's blocks are half a bfloat16 one's: twice as many fit).
    `graphs`, where the engine captures CUDA graphs, captures the largest ones and returns what holds them: the
    device memory they take is measured, then released."""
    if config.cache_config.num_kv_blocks is not None:
        return KVPlan(config.cache_config.num_kv_blocks, block_bytes, dtype=dtype)
    if config.cache_config.kv_cache_memory_gb is not None or memory is None:
        gb = config.cache_config.kv_cache_memory_gb or DEFAULT_KV_CACHE_GB
        return KVPlan(max(1, int(gb * GiB) // block_bytes), block_bytes, dtype=dtype)
    utilization = config.cache_config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    total = memory.total()
    budget = int(utilization * total)
    memory.reset_peak()
    profile()
    peak = memory.peak_allocated()
    other = max(0, memory.used() - memory.reserved())
    graph_bytes = 0
    if graphs is not None:
        memory.reset_peak()  # the profile's freed activations leave the device first
        before = memory.used()
        held = graphs()
        # the warm-up passes' freed activations leave too (later steps reuse such memory, which the profile's
        # peak counts); the graphs' own pool stays while they live
        memory.reset_peak()
        graph_bytes = max(0, memory.used() - before)
        del held
        memory.reset_peak()  # and the graphs' pool with them
    free = budget - peak - other - graph_bytes
    if free < block_bytes:
        raise ValueError(
            f"no device memory is left for the KV cache: --gpu-memory-utilization {utilization:g} of "
            f"{total / GiB:.2f} GiB is {budget / GiB:.2f} GiB, of which the weights and the largest step's "
            f"activations ({config.scheduler_config.max_num_batched_tokens} tokens, {config.scheduler_config.max_num_seqs} sequences) take "
            f"{peak / GiB:.2f} GiB at their peak, CUDA graphs {graph_bytes / GiB:.2f} GiB and other memory on the "
            f"device {other / GiB:.2f} GiB; raise --gpu-memory-utilization, lower --max-num-batched-tokens or "
            "--max-num-seqs (or --cuda-graph-mixed-tokens), or give --kv-cache-memory-gb")
    return KVPlan(free // block_bytes, block_bytes, budget, peak, other, graph_bytes, dtype)


def check_model_len(plan: KVPlan, block_size: int, max_model_len: int | None, model_max: int) -> int:
    """The context length the engine serves: the configured one, which must fit the KV cache; else the model's,
    which a KV cache sized from the device's memory must hold too (as vLLM: an error with the numbers, so
    that the user chooses), and a fixed-size cache lowers with a warning."""
    capacity = plan.num_blocks * block_size
    if max_model_len is not None and max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
    if max_model_len is not None and max_model_len > capacity:
        raise ValueError(f"max_model_len={max_model_len} does not fit the KV cache: {plan.describe()} holds "
                         f"{capacity} tokens ({plan.num_blocks} blocks x {block_size}); "
                         + ("raise --gpu-memory-utilization or lower max_model_len" if plan.budget else
                            "add blocks or lower max_model_len"))
    if max_model_len is not None:
        return max_model_len
    if capacity >= model_max:
        return model_max
    if plan.budget:
        raise ValueError(f"the model's context length {model_max} does not fit the KV cache: {plan.describe()} "
                         f"holds {capacity} tokens; set --max-model-len {capacity} or lower, or raise "
                         "--gpu-memory-utilization")
    logger.warning("max_model_len lowered from %d to the KV cache capacity %d", model_max, capacity)
    return capacity
