"""Decode steps replayed from kernel tapes (model/kernels/tape.py) against the Python layer loop, and optionally
against the former hand-written C++ decode loop (`decode_layers.cpp`, removed; `--old-kernels` names a
kernel library built from a checkout that still has it, e.g. main before the tapes), alternating in one
process so that a noisy minute hits every side alike: W2's TPOT (one 512-token prompt, 128 tokens) and
optionally W1's throughput, per repeat. Prints one JSON object with each side's repeats, medians and ratios.

  python bench/decode_loop_ab.py --model DIR --threads 1 --repeats 5 [--dtype float32] \
      [--old-kernels OLD_CHECKOUT/servelm/model/kernels/lib/libservelm_amx.so]

A benchmark, not a test: CI does not run it.
"""

from __future__ import annotations

import ctypes
import json
import types

import torch
from ab_repeats import alternate, parser  # bench/ is on sys.path when run

from servelm.model.decoder import DecoderLM

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class OldLoop:
    """The removed C++ layer loop, called as the removed glue in decoder.py and kernel_ops.py called it."""

    def __init__(self, path: str, model: DecoderLM) -> None:
        self.model = model
        self.fn = ctypes.CDLL(path).servelm_decode_layers
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = (_P, _P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, _P, _D, _D)
        none = torch.empty(0, dtype=model.dtype)
        flat = []
        for lw in model.layers:  # 10 per layer, in decode_layers.cpp's order
            flat += [lw.input_norm, getattr(lw.qkv.kernel, "tiled", None), none if lw.qkv.bias is None else lw.qkv.bias, getattr(lw.o_proj.kernel, "tiled", None),
                     none if lw.o_proj.bias is None else lw.o_proj.bias, lw.post_norm, getattr(lw.gate_up.kernel, "tiled", None),
                     getattr(lw.down.kernel, "tiled", None), none if lw.q_norm is None else lw.q_norm, none if lw.k_norm is None else lw.k_norm]
        if any(t is None for t in flat):
            raise SystemExit("the old C++ loop does not apply to this model (a linear without packed weights)")
        self.flat = flat
        self.w = (ctypes.c_void_p * len(flat))(*[t.data_ptr() if t.numel() else None for t in flat])
        s, lw = model.spec, model.layers[0]
        self.win = (ctypes.c_int64 * s.num_layers)(*[w or 0 for w in s.sliding_windows])
        self.sz = (ctypes.c_int64 * 4)(lw.qkv.out_features, lw.o_proj.out_features, lw.gate_up.out_features,
                                       lw.down.out_features)
        self.hd = (ctypes.c_int64 * 3)(s.num_heads, s.num_kv_heads, s.head_dim)
        self.caches = None

    def forward(self, input_ids, positions, kv_caches, meta):
        m = self.model
        if meta.prefills:
            return DecoderLM.forward(m, input_ids, positions, kv_caches, meta)
        with torch.inference_mode():
            if self.caches is None or self.caches[0] is not kv_caches:
                flat = [c for kv in kv_caches for c in kv]
                self.caches = (kv_caches, (ctypes.c_void_p * len(flat))(*[t.data_ptr() for t in flat]))
            h = m.embed[input_ids]
            out = torch.empty_like(h)
            k0, bt = kv_caches[0][0], meta.decode_block_tables
            rc = self.fn(out.data_ptr(), h.data_ptr(), h.shape[0], h.shape[1], positions.data_ptr(),
                         m.cos.data_ptr(), m.sin.data_ptr(), m.cos.shape[0], self.w, self.caches[1], k0.shape[0],
                         k0.shape[1], meta.slot_mapping.data_ptr(), bt.data_ptr(), bt.shape[1],
                         meta.decode_seq_lens.data_ptr(), m.norm.data_ptr(), self.win, m.spec.num_layers, self.sz,
                         self.hd, m.spec.rms_norm_eps, m.attn.scale)
            if rc != 0:
                raise RuntimeError("decode_layers failed")
            return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--old-kernels", default=None, help="a kernel library that has servelm_decode_layers")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = p.parse_args()
    from servelm import LLM

    llm = LLM(a.model, dtype=a.dtype, num_threads=a.threads, enable_prefix_caching=False)
    model = llm.engine.core.model
    tapes = model.tapes
    if tapes is None:
        raise SystemExit("decode tapes do not apply on this machine/model")
    old = OldLoop(a.old_kernels, model) if a.old_kernels else None

    def select(side: str):
        model.tapes = tapes if side == "tape" else None
        if side == "old_cpp":
            model.forward = types.MethodType(lambda self, *args: old.forward(*args), model)
        else:
            model.__dict__.pop("forward", None)
        return llm

    sides = ("tape", "python") + (("old_cpp",) if old else ())
    out = {"model": a.model, "dtype": a.dtype, "threads": a.threads, "clock": a.clock,
           **alternate(select, sides, model.spec.vocab_size, a.repeats, a.w1, a.clock)}
    out["tapes"] = {"recorded": tapes.recorded, "replayed": tapes.replayed, "refused": tapes.refused}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
