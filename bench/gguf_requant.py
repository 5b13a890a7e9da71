"""Copies a GGUF file with its attention/MLP linear weights requantized to another block type (Q8_0, Q4_0,
Q4_1), everything else (metadata, embedding, norms) as it is: the one SmolLM2 file available offline is Q4_1,
and bench/quantization.py measures the other formats' kernels on these copies. The requantized weights are
the file's dequantized values quantized again, so their accuracy says nothing about the format; their speed
is the format's.

  nice python bench/gguf_requant.py Q8_0 /tmp/smollm2-q8_0.gguf

A benchmark helper, not a test: CI does not run it.
"""

from __future__ import annotations

import argparse
import re

import gguf
import numpy as np

from servelm.model.loading.gguf_loader import dequantize
from servelm.model.loading.source import default_model_path

_LINEAR = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


def requantize(src: str, dst: str, qtype: str) -> dict[str, int]:
    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # numpy order: rows first
        if _LINEAR.match(t.name):
            dense = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(dense, target), raw_dtype=target)
            counts[qtype] = counts.get(qtype, 0) + 1
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # its bytes as they are
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("qtype", choices=["Q8_0", "Q4_0", "Q4_1"])
    p.add_argument("out")
    p.add_argument("--src", default=None, help="GGUF file (default: SmolLM2-135M's Q4_1)")
    args = p.parse_args()
    print(requantize(str(args.src or default_model_path()), args.out, args.qtype))


if __name__ == "__main__":
    main()
