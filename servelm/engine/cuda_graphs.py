"""CUDA graphs for decode steps: the model's forward pass and its logits, captured once per batch size.

A decode step of a small model on a GPU is mostly kernel launches (a few hundred per step, each a few
microseconds of CPU time); replaying a captured graph issues them all at once. Graphs replay fixed
addresses and shapes, so every input of a captured step lives in a static buffer. A step of n decodes runs the
graph of the smallest captured size >= n; the padding rows decode a dummy token whose key and value land in a
spare KV block that no sequence owns.

What the host does per step is the point here, since a small model's step is bound by it: it writes the step's
inputs into one pinned staging vector with a few numpy slice assignments (no tensor built per step, no Python
loop over rows) and issues one asynchronous copy of exactly the bytes the step needs, then the replay. The
staging vector holds the block tables at the step's own width (the longest table), so a step copies
rows x that width, never rows x the model's longest context; the graph itself spreads them into the static
[rows, max_blocks] table with a few fixed-shape device ops, and derives what the attention backend wants
from the static buffers on the device (`AttentionBackend.derive_decode`). Two staging vectors alternate, so
the host may fill the next step's while the last copy is still in flight.

With tensor parallelism every rank captures the same sizes in the same order (the all-reduces inside the
graphs are NCCL collectives that must pair up across ranks) and each step replays the same size on every
rank: the worker ranks get the driver's unpadded decode inputs and pad them here as the driver does.

The same padded static-buffer path runs without capture on the CPU (`capture=False`), which is how CI
checks its padding and metadata against the eager path; on the GPU `tests/gpu/test_gpu.py` checks replays.
"""

from __future__ import annotations

import contextlib
import gc
import logging

import numpy as np
import torch

from servelm.model.attention import AttentionMetadata
from servelm.model.decoder import DecoderLM
from servelm.model.layers.blocks import graph_warmup

logger = logging.getLogger(__name__)

# the staging vector: [table width, then per row: token ids | positions | KV slots | context lengths, then the
# rows' block tables at the table width]
_HEADER = 1
_COLUMNS = 4


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: every power of two to 16, then steps of 16 to 256 (as vLLM does, coarser)."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [s for s in sizes if s < max_num_seqs] + [min(max_num_seqs, 256)]


class DecodeGraphs:
    def __init__(self, model: DecoderLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_blocks: int, spare_block: int, sizes: list[int], capture: bool, with_logits: bool = True,
                 pool=None) -> None:
        """`with_logits` False: the graphs end at the hidden states (a tensor-parallel worker rank, whose
        logits nobody reads: the driver alone samples). `pool`: the CUDA graphs' memory pool (`capture_graphs`)."""
        self.model = model
        self.with_logits = with_logits
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.spare_block = spare_block
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.device = model.embed.device
        length = _HEADER + self.max_size * (_COLUMNS + max_blocks)
        self.staged = torch.zeros(length, dtype=torch.long, device=self.device)  # what the graphs read
        # pinned where the copy crosses to a GPU, so that it is asynchronous and needs no bounce buffer
        pin = self.device.type == "cuda"
        self._host = [torch.zeros(length, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._turn = 0
        self._columns = torch.arange(max_blocks, device=self.device)
        self._rows = torch.arange(self.max_size, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        if capture:
            self._capture(pool)

    # -- the step's inputs -------------------------------------------------------------------------------
    def _stage(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
               lens: np.ndarray, size: int) -> None:
        """Writes a step of n = len(ids) decodes, padded to `size` rows, into the next staging vector and
        copies it to the device. `tables` is [n, width] (width >= every row's blocks)."""
        n, width = len(ids), max(1, tables.shape[1])
        buf = self._host_np[self._turn]
        buf[0] = width
        body = buf[_HEADER:_HEADER + _COLUMNS * size].reshape(_COLUMNS, size)
        for row, values, pad in ((0, ids, 0), (1, positions, 0), (2, slots, self.spare_block * self.block_size),
                                 (3, lens, 1)):
            body[row, :n] = values
            body[row, n:] = pad
        end = _HEADER + _COLUMNS * size + size * width
        bt = buf[_HEADER + _COLUMNS * size:end].reshape(size, width)
        bt[:n, :tables.shape[1]] = tables
        bt[n:] = self.spare_block
        self.staged[:end].copy_(self._host[self._turn][:end], non_blocking=True)
        self._turn ^= 1

    def _unstage(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The token ids, positions and attention metadata of a `size`-row step, from the staged vector with
        fixed-shape device ops only (they are captured with the graph): slices for the per-row columns, and the
        block tables spread from the step's width into [size, max_blocks] (columns past the width, never
        read for attention, name the spare block so that every entry is a valid block)."""
        s = self.staged
        body = s[_HEADER:_HEADER + _COLUMNS * size].view(_COLUMNS, size)
        width = s[0]
        tables = spread_tables(s[_HEADER + _COLUMNS * size:], self._rows[:size], width, self._columns,
                               self.spare_block)
        meta = AttentionMetadata(slot_mapping=body[2], decode_idx=self._rows[:size], decode_block_tables=tables,
                                 decode_seq_lens=body[3], prefills=[], block_size=self.block_size)
        meta.derived = self.model.attn.derive_decode(meta)
        return body[0], body[1], meta

    # -- running -----------------------------------------------------------------------------------------
    def can_run(self, num_decodes: int, longest_table: int) -> bool:
        return 0 < num_decodes <= self.max_size and longest_table <= self.max_blocks

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
            lens: np.ndarray, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, vocab] of a step of n decodes (the last row of each is its only token), hidden states
        [n, hidden] without `with_logits`; `tables` is the rows' block tables, [n, width] padded with any valid
        block. `device_ids`: the n token ids already on the device (async scheduling: the tokens of the step
        in flight), written over `ids` in the staged vector after its copy, in the same stream."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        self._stage(ids, positions, slots, tables, lens, size)
        if device_ids is not None:
            self.staged[_HEADER:_HEADER + n].copy_(device_ids)
        graph, logits = self.graphs.get(size, (None, None))
        if graph is None:  # not captured (the CPU)
            return self._forward(size)[:n]
        graph.replay()
        return logits[:n]

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, meta = self._unstage(size)
        hidden = self.model.forward(ids, positions, self.kv_caches, meta)
        return self.model.logits(hidden) if self.with_logits else hidden

    @torch.inference_mode()
    def _capture(self, pool) -> None:
        none = np.zeros(0, dtype=np.int64)

        def stage_dummy(size: int) -> None:  # every row a dummy decode in the spare block
            self._stage(none, none, none, np.zeros((0, 1), dtype=np.int64), none, size)

        self.graphs = capture_graphs(self.sizes, stage_dummy, self._forward, pool)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)


def spread_tables(flat: torch.Tensor, rows: torch.Tensor, width: torch.Tensor, columns: torch.Tensor,
                  spare_block: int) -> torch.Tensor:
    """Block tables staged row after row at the step's `width` (a device scalar) in `flat`, spread into
    [len(rows), len(columns)] with fixed-shape device ops (capturable); columns past the width, never read for
    attention, name the spare block so that every entry is a valid block."""
    index = (rows[:, None] * width + columns[None, :]).clamp_(max=flat.numel() - 1)
    return torch.where(columns[None, :] < width, flat[index], spare_block)


def capture_graphs(sizes: list[int], stage_dummy, forward, pool=None) -> dict:
    """{size: (graph, its output)} for each size, largest first, so that the smaller graphs reuse the memory
    the largest one allocated in the graphs' memory `pool` (a new one when None; a runner's decode and
    mixed-step graphs share one): `stage_dummy(size)` puts a valid step of that size in the static buffers, an
    eager `forward(size)` compiles the Triton kernels the capture launches and creates the cuBLAS handles, then
    a captured one records it.

    Every graph writes its output into the first rows of one buffer allocated outside the pool (sized by the
    largest graph), so that the output a graph computes in the pool is freed when its capture ends and the
    next capture reuses it: the graphs' memory is the largest graph's working memory and that one buffer, not
    a logits tensor per graph (0.5 GiB over the decode sizes of a 128k-token vocabulary). A replay overwrites
    the rows the previous one returned, which the caller has consumed by then (steps run in stream order)."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graphs, out = {}, None
    with no_automatic_collection():
        for size in reversed(sizes):
            stage_dummy(size)
            with graph_warmup():
                warm = forward(size)
            if out is None:
                out = torch.empty_like(warm)
            del warm
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                y = forward(size)
                rows = out[:y.shape[0]]
                rows.copy_(y)
                del y
            graphs[size] = (graph, rows)
        torch.cuda.synchronize()
    return graphs


@contextlib.contextmanager
def no_automatic_collection():
    """Python's cyclic garbage collector off (after one collection) while graphs are captured. A collection that
    an allocation triggers inside a capture runs the finalizers of whatever garbage it finds, such as an earlier
    engine's graphs, pinned buffers and events: CUDA calls that a capture forbids (the capture is invalidated, or
    the process aborts) or that it would record into the graph. Seen on an H200 when an engine was built in a
    process that had dropped others. (vLLM freezes the collector during capture for the same reason.)"""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
