"""A GGUF file's header (metadata and tensor table) read with `struct`: no torch, no numpy, no gguf.

gguf.GGUFReader builds a numpy view for every element of every metadata array (a 49k-token vocabulary:
3-4 s here). Loading needs the scalars, the strings and a few short arrays (per-layer patterns); the
vocabulary arrays are walked over, not decoded (the tokenizer comes from transformers' conversion).

A model split into several files by llama.cpp (`gguf-split`, or the converter's `--split-max-size`), named
`NAME-00001-of-0000N.gguf` and so on, reads as one header: the first file's metadata (the model's) and every
file's tensors, each with the file it lies in.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = 0x46554747  # b"GGUF" little-endian
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct formats (strings and arrays are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_FLOAT32 = 6
# Scalar arrays up to this length are read (per-layer values); longer ones (vocabularies) are skipped.
MAX_ARRAY = 4096


# llama.cpp's names for the files of a split model
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class GGUFHeader:
    """Metadata (arrays longer than MAX_ARRAY or of strings as None) and where each tensor's bytes lie."""

    fields: dict[str, object]
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # name, GGUF shape (innermost first), type, offset
    data_offset: int
    float32_keys: frozenset[str] = frozenset()  # keys stored as float32 (their exact decimal is the shortest)
    # a split model: each file with its data offset, and each tensor's file (an index into `shards`)
    shards: tuple[tuple[Path, int], ...] = ()
    shard_of: tuple[int, ...] = ()

    def locate(self, i: int, path: Path) -> tuple[Path, int]:
        """The file tensor i lies in and its bytes' offset there (`path`: the model's file, unsplit)."""
        if self.shards:
            file, data = self.shards[self.shard_of[i]]
            return file, data + self.tensors[i][3]
        return path, self.data_offset + self.tensors[i][3]


def shard_names(name: str) -> list[str]:
    """The file names of the GGUF model a file named `name` belongs to: a split model's (whichever of its files
    `name` is), in order, else `name` alone."""
    m = SHARD_NAME.match(name)
    if m is None or not 1 <= int(m["no"]) <= int(m["count"]):
        return [name]
    return [f"{m['stem']}-{i:05d}-of-{m['count']}.gguf" for i in range(1, int(m["count"]) + 1)]


def gguf_shards(path: Path) -> list[Path]:
    """The files of the GGUF model `path` names (shard_names, beside it). FileNotFoundError naming the files
    of a split model missing beside it."""
    paths = [path.with_name(n) for n in shard_names(path.name)]
    missing = [p.name for p in paths if not p.is_file()] if len(paths) > 1 else []
    if missing:
        raise FileNotFoundError(f"{path.name} is one of the {len(paths)} files of a split GGUF model, and "
                                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not beside it")
    return paths


def shard_stem(name: str) -> str:
    """A GGUF file's name without `.gguf` and, for a split model's file, without `-0000K-of-0000N`."""
    m = SHARD_NAME.match(name)
    return m["stem"] if m is not None else name.removesuffix(".gguf")


def _read_value(buf, off: int, vtype: int):
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, off)
        return bytes(buf[off + 8:off + 8 + n]).decode("utf-8", errors="replace"), off + 8 + n
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            end = off + count * struct.calcsize("<" + fmt)
            return (list(struct.unpack_from(f"<{count}{fmt}", buf, off)) if count <= MAX_ARRAY else None), end
        if etype == _STRING:  # vocabularies and merges: skipped without decoding
            for _ in range(count):
                off += 8 + struct.unpack_from("<Q", buf, off)[0]
            return None, off
        for _ in range(count):
            off = _read_value(buf, off, etype)[1]
        return None, off
    raise ValueError(f"bad GGUF metadata value type {vtype}")


def read_gguf_header(buf) -> GGUFHeader:
    magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic:#x}, version {version})")
    off, fields, f32 = 24, {}, set()
    for _ in range(n_kv):
        key, off = _read_value(buf, off, _STRING)
        (vtype,) = struct.unpack_from("<I", buf, off)
        fields[key], off = _read_value(buf, off + 4, vtype)
        if vtype == _FLOAT32:
            f32.add(key)
    tensors = []
    for _ in range(n_tensors):
        name, off = _read_value(buf, off, _STRING)
        (ndim,) = struct.unpack_from("<I", buf, off)
        shape = struct.unpack_from(f"<{ndim}Q", buf, off + 4)
        ttype, toff = struct.unpack_from("<IQ", buf, off + 4 + 8 * ndim)
        off += 4 + 8 * ndim + 12
        tensors.append((name, shape, ttype, toff))
    align = int(fields.get("general.alignment") or _DEFAULT_ALIGNMENT)
    return GGUFHeader(fields, tensors, -(-off // align) * align, frozenset(f32))


def _read_one(path: Path) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return read_gguf_header(buf)


def read_gguf_file_header(path: Path) -> GGUFHeader:
    """The header of the GGUF model `path` names: one file's, or a split model's files' as one."""
    paths = gguf_shards(path)
    if len(paths) == 1:
        return _read_one(path)
    heads = [_read_one(p) for p in paths]
    for i, (p, h) in enumerate(zip(paths, heads, strict=True)):
        if h.fields.get("split.no") != i or h.fields.get("split.count") != len(paths):
            raise ValueError(f"{p.name} is named as file {i + 1} of {len(paths)} of a split GGUF model, but its "
                             f"metadata says file {h.fields.get('split.no', 0) + 1} of {h.fields.get('split.count', 1)}")
    tensors = [t for h in heads for t in h.tensors]
    if heads[0].fields.get("split.tensors.count", len(tensors)) != len(tensors):
        raise ValueError(f"{paths[0].name}: the split GGUF model's files hold {len(tensors)} tensors, its metadata "
                         f"says {heads[0].fields['split.tensors.count']}")
    first = heads[0]  # the model's metadata is in its first file
    return GGUFHeader(first.fields, tensors, first.data_offset, first.float32_keys,
                      tuple((p, h.data_offset) for p, h in zip(paths, heads, strict=True)),
                      tuple(i for i, h in enumerate(heads) for _ in h.tensors))


def read_f32_tensor(path: Path, head: GGUFHeader, name: str) -> list[float] | None:
    """A small float32 tensor's values (e.g. rope_freqs), None where the file has no such tensor."""
    for i, (tname, shape, ttype, _) in enumerate(head.tensors):
        if tname == name:
            if ttype != 0:  # GGML_TYPE_F32
                raise ValueError(f"GGUF tensor {name} is of type {ttype}, expected float32")
            n = 1
            for d in shape:
                n *= d
            file, offset = head.locate(i, path)
            with open(file, "rb") as f:
                f.seek(offset)
                return list(struct.unpack(f"<{n}f", f.read(4 * n)))
    return None
