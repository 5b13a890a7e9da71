"""CUDA graphs for steps with prompt chunks (mixed prefill + decode steps), where the attention backend can
attend from per-row arrays alone (the Triton backend): `--cuda-graph-mixed-tokens`.

A step of up to `max(sizes)` tokens runs the graph of the smallest captured token count >= its own. Padding
tokens decode a dummy token into the spare KV block (as a decode graph's padding rows do) and belong to no
row, so attention never computes them and their rows of the residual stream are never read. Every graph has
`max_rows + 1` rows: the step's, then rows of no queries (the last always one), and a fixed number of
attention programs, the step's query tiles (`AttentionBackend.mixed_tiles`) followed by tiles of that last
row, which exit at once. So the kernels' grids depend only on the graph's size, as capture needs, while a
decode beside a long prompt chunk still gets one program, not as many as the chunk.

Per step the host writes the inputs into one pinned int64 vector (the tables at the step's own width) and
issues one asynchronous copy; inside the graph fixed-shape device ops spread the tables and the backend derives
its rows (`derive_mixed`). Two vectors alternate, as for decode graphs. Steps that want prompt logprobs,
forks, drafts or LoRA, and tensor-parallel engines, run eagerly.

Without capture (`capture=False`, any device) the same padded buffers run eagerly, which is how CI checks them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from servelm.engine.cuda_graphs import capture_graphs, spread_tables
from servelm.model.attention import AttentionMetadata
from servelm.model.decoder import DecoderLM

logger = logging.getLogger(__name__)


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture for `--cuda-graph-mixed-tokens N`: powers of two from 16 up to N, and N."""
    if max_tokens <= 0:
        return []
    return sorted({s for s in (16, 32, 64, 128, 256, 512, 1024, 2048) if s < max_tokens} | {max_tokens})


class MixedGraphs:
    def __init__(self, model: DecoderLM, kv_caches: list, block_size: int, max_blocks: int, spare_block: int,
                 sizes: list[int], max_rows: int, capture: bool, pool=None) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.max_blocks, self.spare_block = block_size, max_blocks, spare_block
        self.sizes = sorted(set(sizes))
        self.device = model.embed.device
        # per size: rows (the step's at most, plus one of no queries) and attention programs (tiles)
        self.rows = {t: min(t, max_rows) + 1 for t in self.sizes}
        self.tiles = {t: model.attn.max_mixed_tiles(t, self.rows[t]) for t in self.sizes}
        self.layouts = {t: self._layout(t) for t in self.sizes}
        length = max(self.layouts[t]["tables"][0] + self.rows[t] * max_blocks for t in self.sizes)
        self.staged = torch.zeros(length, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self._host = [torch.zeros(length, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._columns = torch.arange(max_blocks, device=self.device)
        self._row_ids = torch.arange(max(self.rows.values()), device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        if capture:
            self._capture(pool)

    def _layout(self, size: int) -> dict[str, tuple[int, int]]:
        """Where each input lives in the vector for a graph of `size` tokens: (offset, length); the tables
        last, at the step's width (header: the width)."""
        r, n = self.rows[size], self.tiles[size]
        spans, at = {}, 1
        for name, length in (("ids", size), ("positions", size), ("slots", size), ("q_starts", r), ("q_lens", r),
                             ("ctx_lens", r), ("logits", r), ("tile_rows", n), ("tile_ids", n)):
            spans[name] = (at, length)
            at += length
        spans["tables"] = (at, 0)
        return spans

    def can_run(self, num_tokens: int, num_rows: int, width: int) -> bool:
        return (0 < num_tokens <= self.sizes[-1] and width <= self.max_blocks
                and num_rows < self.rows[self._size(num_tokens)])

    def _size(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)

    # -- the step's inputs -------------------------------------------------------------------------------
    def _stage(self, ids, positions, slots, q_starts, q_lens, ctx_lens, logits_idx, tables, size: int) -> None:
        """Writes a step (tokens, then its rows: each one's first token, token count, context length and block
        table [rows, width]; the token index of each sampled row) padded to the graph of `size` tokens."""
        width = max(1, tables.shape[1])
        buf = self._host[self._turn].numpy()
        buf[0] = width
        tile_rows, tile_ids = self.model.attn.mixed_tiles(q_lens)
        pads = {"ids": 0, "positions": 0, "slots": self.spare_block * self.block_size, "q_starts": 0, "q_lens": 0,
                "ctx_lens": 0, "logits": 0, "tile_rows": self.rows[size] - 1, "tile_ids": 0}
        values = {"ids": ids, "positions": positions, "slots": slots, "q_starts": q_starts, "q_lens": q_lens,
                  "ctx_lens": ctx_lens, "logits": logits_idx, "tile_rows": tile_rows, "tile_ids": tile_ids}
        layout = self.layouts[size]
        for name, (at, length) in layout.items():
            if name == "tables":
                continue
            v = values[name]
            buf[at:at + len(v)] = v
            buf[at + len(v):at + length] = pads[name]
        at = layout["tables"][0]
        bt = buf[at:at + self.rows[size] * width].reshape(self.rows[size], width)
        bt[:len(tables), :tables.shape[1]] = tables
        bt[len(tables):] = self.spare_block
        end = at + self.rows[size] * width
        self.staged[:end].copy_(self._host[self._turn][:end], non_blocking=True)
        self._turn ^= 1

    def _unstage(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Token ids, positions, attention metadata and sampled token indices from the staged vector, with
        fixed-shape device ops only (captured with the graph)."""
        s, layout = self.staged, self.layouts[size]
        view = {name: s[at:at + length] for name, (at, length) in layout.items() if name != "tables"}
        tables = spread_tables(s[layout["tables"][0]:], self._row_ids[:self.rows[size]], s[0], self._columns,
                               self.spare_block)
        none = view["q_starts"][:0]
        meta = AttentionMetadata(slot_mapping=view["slots"], decode_idx=none, decode_block_tables=none[:, None],
                                 decode_seq_lens=none, prefills=[], block_size=self.block_size, max_query_len=size)
        meta.derived = self.model.attn.derive_mixed(view["q_starts"], view["q_lens"], view["ctx_lens"], tables,
                                                    view["tile_rows"], view["tile_ids"])
        return view["ids"], view["positions"], meta, view["logits"]

    # -- running -----------------------------------------------------------------------------------------
    def run(self, ids, positions, slots, q_starts, q_lens, ctx_lens, logits_idx, tables,
            device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled rows' logits [len(logits_idx), vocab] of a step with prompt chunks (never one launched
        behind another: `device_ids` is always None here)."""
        assert device_ids is None
        size = self._size(len(ids))
        self._stage(ids, positions, slots, q_starts, q_lens, ctx_lens, logits_idx, tables, size)
        graph, logits = self.graphs.get(size, (None, None))
        if graph is None:  # not captured (the CPU)
            logits = self._forward(size)
        else:
            graph.replay()
        return logits[:len(logits_idx)]

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, meta, logits_idx = self._unstage(size)
        hidden = self.model.forward(ids, positions, self.kv_caches, meta)
        return self.model.logits(hidden[logits_idx])

    @torch.inference_mode()
    def _capture(self, pool) -> None:
        one = np.ones(1, dtype=np.int64)

        def stage_dummy(size: int) -> None:  # one row of one token, at position 0 in the spare block
            self._stage(0 * one, 0 * one, one * self.spare_block * self.block_size, 0 * one, one, one, 0 * one,
                        np.full((1, 1), self.spare_block, dtype=np.int64), size)

        self.graphs = capture_graphs(self.sizes, stage_dummy, self._forward, pool)
        logger.info("captured CUDA graphs for mixed steps of up to %s tokens", self.sizes)
