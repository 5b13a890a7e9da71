"""What scheduling invariance costs in bf16 on an AMX CPU: the linears on the tile kernel for every row count
(today's dispatch) against the old one, oneDNN's prepacked matmul for inputs of more than 64 rows (faster
for prefill chunks, but its sums change with the row count). Alternating in one process: per repeat, W2's
TTFT and TPOT (one 512-token prompt) and optionally W1's throughput on each side. Prints one JSON object.

  python bench/invariance_ab.py --model DIR --threads 1 --repeats 3 --w1

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from ab_repeats import parser, prompts  # bench/ is on sys.path when run

from servelm.model.layers.blocks import GateUpLinear, Linear, silu_mul
from servelm.model.layers.linear_kernels import _onednn_linear, _onednn_packed

TILE_MAX_ROWS = 64  # the old switch-over


def unpack(tiled: torch.Tensor, n: int, gate_up: bool) -> torch.Tensor:
    """The row-major [n, k] weight back from `pack_weight_for_tiles`'s layout."""
    nb, kb = tiled.shape[:2]
    w = tiled.permute(0, 2, 4, 1, 3, 5).reshape(nb * 32, kb * 32)[:n]
    return w.reshape(n // 32, 2, 16, -1).transpose(0, 1).reshape(n, -1) if gate_up else w


class OldLinear:
    """A Linear with the old dispatch: tiles up to 64 rows, oneDNN beyond."""

    def __init__(self, lin: Linear) -> None:
        self.lin, self.packed = lin, _onednn_packed(unpack(lin.kernel.tiled, lin.out_features, False).contiguous())

    def __call__(self, x):
        if x.shape[0] <= TILE_MAX_ROWS:
            return self.lin(x)
        return _onednn_linear(x, self.packed, self.lin.bias)


class OldGateUp:
    def __init__(self, g: GateUpLinear) -> None:
        self.g, self.packed = g, _onednn_packed(unpack(g.kernel.tiled, g.out_features, True).contiguous())

    def __call__(self, x, fused=None):
        if x.shape[0] <= TILE_MAX_ROWS:
            return self.g(x, fused)
        return silu_mul(_onednn_linear(x, self.packed, None), fused)


def main() -> None:
    a = parser(__doc__).parse_args()
    from servelm import LLM, SamplingParams

    llm = LLM(a.model, dtype="bfloat16", num_threads=a.threads, enable_prefix_caching=False)
    model = llm.engine.core.model
    if model.layers[0].qkv.kernel.name != "amx":
        raise SystemExit("needs the C++ kernels on a CPU with AMX")
    new = [(lw.qkv, lw.o_proj, lw.gate_up, lw.down) for lw in model.layers]
    old = [(OldLinear(q), OldLinear(o), OldGateUp(g), OldLinear(d)) for q, o, g, d in new]

    def select(side: str) -> None:
        for lw, (q, o, g, d) in zip(model.layers, new if side == "invariant" else old, strict=True):
            lw.qkv, lw.o_proj, lw.gate_up, lw.down = q, o, g, d

    vocab = model.spec.vocab_size
    w2, w1 = prompts("W2", vocab)[0], prompts("W1", vocab)

    def gen(batch, n: int) -> float:
        t = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    sides = ("invariant", "onednn_beyond_64")
    res = {s: {"ttft_ms": [], "tpot_ms": [], "w1_tok_s": []} for s in sides}
    for s in sides:
        select(s)
        gen([w2], 4)
    for r in range(a.repeats):
        for s in sides if r % 2 == 0 else sides[::-1]:
            select(s)
            ttft = gen([w2], 1)
            res[s]["ttft_ms"].append(round(1000 * ttft, 1))
            res[s]["tpot_ms"].append(round(1000 * (gen([w2], 64) - ttft) / 63, 3))
            if a.w1:
                res[s]["w1_tok_s"].append(round(64 * 128 / gen(w1, 128), 1))
    out: dict = {"model": a.model, "threads": a.threads, "repeats": res}
    for key in ("ttft_ms", "tpot_ms", "w1_tok_s"):
        if res[sides[0]][key]:
            m = {s: statistics.median(res[s][key]) for s in sides}
            ratio = m[sides[1]] / m[sides[0]] if key != "w1_tok_s" else m[sides[0]] / m[sides[1]]
            out[key] = {**m, "invariant_speed_vs_old": round(ratio, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
