"""A GGUF file split into several the way llama.cpp's converter splits a model (`--split-max-tensors`): gguf-py's
writer, which both use, puts the model's metadata in the first file, the split keys in each, and names them
NAME-00001-of-0000N.gguf."""

from __future__ import annotations

from pathlib import Path

import gguf


def split_gguf(src: Path, out: Path, max_tensors: int) -> list[Path]:
    """`src` rewritten as the files of a split model, at most `max_tensors` tensors each (`out`: the name the
    files are numbered after); the files, in order."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents(), split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":  # the writer's own
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
