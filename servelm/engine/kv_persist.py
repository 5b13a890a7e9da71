"""Save the prefix cache's blocks to a file and restore them, so a restarted engine keeps its prefix hits.

File format (version 1), little-endian:

    magic         8 bytes   b"SLMKVC\\r\\n"
    version       u32       FORMAT_VERSION
    header_len    u32
    header        JSON      format_version, model_hash, dtype, kv_cache_dtype, block_size, layout, num_blocks,
                            block_bytes
    header_sha    32 bytes  SHA-256 of everything above
    num_blocks records, least recently used first:
        key          32 bytes  the block's chain hash (block_pool.hash_block)
        content_len  u32
        content      bytes     the key's preimage: parent key, token ids (int64), generated-token marker
        payload      block_bytes: for each layer K then V, each [block_size, num_kv_heads, head_dim] row-major,
                     in kv_cache_dtype (the model's dtype, or float8_e4m3fn for --kv-cache-dtype fp8)
    file_sha      32 bytes  SHA-256 of everything before it

A restore refuses a file written for another model, dtype, KV cache dtype, block size or layout
(KVMismatchError: an fp8 cache's bytes are never read as bfloat16 ones, nor the reverse; a file from before
kv_cache_dtype was recorded holds the model's dtype), and
rejects a damaged one (KVFormatError): truncated, bit-flipped, a key that is not the hash of its tokens.
Nothing is registered in the cache before the whole file has been read and its checksum matched, so a bad
file leaves the cache as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from servelm.engine.block_pool import is_partial
from servelm.model.attention.kv_quant import raw

if TYPE_CHECKING:
    from servelm.engine.core import EngineCore
    from servelm.model.loading.source import ModelSource
    from servelm.model.spec import ModelSpec

MAGIC = b"SLMKVC\r\n"
FORMAT_VERSION = 1
FILE_SUFFIX = ".kvcache"
_CHUNK = 64  # blocks copied between the file and the KV tensors at a time
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GENERATED = b"generated"  # block_pool.block_preimage's marker


class KVFormatError(ValueError):
    """The file is not an intact KV cache file (truncated, corrupted, not one at all)."""


class KVMismatchError(ValueError):
    """The file is intact but was written for another model, dtype, block size or layout."""


@dataclass
class KVTransfer:
    """What a save or restore did."""

    path: str
    num_blocks: int  # blocks written, or restored into the cache
    num_skipped: int  # restore: blocks already cached, or left out for want of free blocks
    size_bytes: int
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def model_hash(source: ModelSource, spec: ModelSpec, quantization: str = "none") -> str:
    """SHA-256 of what the cached keys and values depend on besides the tokens: the weight files' bytes and
    the architecture as loaded (a --sliding-window override changes the values), and the weights'
    quantization if any. Not the dtype: the header names that on its own, so a mismatch says which it is.
    Reads every weight file once (about 1-2 GB/s)."""
    h = hashlib.sha256(b"servelm-kv-model\0")
    if quantization != "none":  # quantized weights give other keys and values (none: the hash as before)
        h.update(f"quantization={quantization}".encode())
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        h.update(f.name.encode() + b"=")
        h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    files = [source.path] if source.kind == "gguf" else sorted(source.path.glob("*.safetensors"))
    for path in files:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def default_file(directory: str | Path, digest: str) -> Path:
    """The file a model's cache is kept in inside a --kv-cache-persist directory (one per model)."""
    return Path(directory) / f"{digest[:16]}{FILE_SUFFIX}"


def _header(core: EngineCore, digest: str, num_blocks: int) -> dict:
    s = core.model.spec
    dtype = str(core.model.dtype).removeprefix("torch.")
    kv_dtype = str(core.runner.kv_caches[0][0].dtype).removeprefix("torch.")
    return {
        "format_version": FORMAT_VERSION, "model_hash": digest, "dtype": dtype, "kv_cache_dtype": kv_dtype,
        "block_size": core.config.cache_config.block_size,
        "layout": {"num_layers": s.num_layers, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
                   "order": "per block: per layer K then V, each [block_size, num_kv_heads, head_dim]",
                   "batch_invariant": core.config.device_config.batch_invariant},
        "num_blocks": num_blocks, "block_bytes": _block_bytes(core),
    }


def _block_bytes(core: EngineCore) -> int:
    s = core.model.spec
    itemsize = core.runner.kv_caches[0][0].dtype.itemsize
    return 2 * s.num_layers * core.config.cache_config.block_size * s.num_kv_heads * s.head_dim * itemsize


class _HashingWriter:
    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> None:
        self.sha.update(data)
        self.f.write(data)
        self.size += len(data)


@torch.inference_mode()
def save(core: EngineCore, path: str | Path, digest: str) -> KVTransfer:
    """Write every cached block to `path` (atomically: a temporary file renamed over it, readable by its owner
    only, since it holds prompts' token ids). Run between engine steps."""
    t0 = time.perf_counter()
    path = Path(path)
    # full blocks only: a partly filled one's slots past its key are whatever was there (see partial_preimage)
    blocks = [b for b in core.kv.pool.cached_blocks() if not is_partial(b[2])]
    header = json.dumps(_header(core, digest, len(blocks)), sort_keys=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            w = _HashingWriter(f)
            w.write(MAGIC + struct.pack("<II", FORMAT_VERSION, len(header)) + header)
            w.write(w.sha.copy().digest())  # the header's own checksum
            caches = _raw_caches(core)
            for i in range(0, len(blocks), _CHUNK):
                chunk = blocks[i:i + _CHUNK]
                data = _gather(caches, [b for b, _, _ in chunk])
                raw = data.view(torch.uint8).reshape(len(chunk), -1).numpy()
                for j, (_, key, content) in enumerate(chunk):
                    w.write(key + struct.pack("<I", len(content)) + content)
                    w.write(memoryview(raw[j]))
            f.write(w.sha.digest())
            size = w.size + 32
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return KVTransfer(str(path), len(blocks), 0, size, time.perf_counter() - t0)


def _raw_caches(core: EngineCore) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The KV caches with fp8 ones as bytes: the file holds bytes either way, and PyTorch gathers and scatters
    few float8 tensors."""
    return [tuple(map(raw, kv)) for kv in core.runner.kv_caches]


def _gather(caches: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int]) -> torch.Tensor:
    """[len(blocks), layers, 2, block_size, kv_heads, head_dim] on the CPU: one block's payload contiguous."""
    k0 = caches[0][0]
    if k0.device.type != "cpu":  # one gather per layer, then one copy to the host
        idx = torch.tensor(blocks, device=k0.device)
        return torch.stack([torch.stack([k[idx], v[idx]], 1) for k, v in caches], 1).cpu()
    # on the CPU a plain copy per block and layer beats index_select/advanced indexing by 20x and more
    out = torch.empty(len(blocks), len(caches), 2, *k0.shape[1:], dtype=k0.dtype)
    for j, b in enumerate(blocks):
        for layer, (k, v) in enumerate(caches):
            out[j, layer, 0].copy_(k[b])
            out[j, layer, 1].copy_(v[b])
    return out


def _scatter(caches: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int], data: torch.Tensor) -> None:
    """The inverse of _gather: write data[j] into block blocks[j] of every layer."""
    k0 = caches[0][0]
    if k0.device.type != "cpu":
        idx = torch.tensor(blocks, device=k0.device)
        data = data.to(k0.device)
        for layer, (k, v) in enumerate(caches):
            k[idx] = data[:, layer, 0]
            v[idx] = data[:, layer, 1]
        return
    for j, b in enumerate(blocks):
        for layer, (k, v) in enumerate(caches):
            k[b].copy_(data[j, layer, 0])
            v[b].copy_(data[j, layer, 1])


class _HashingReader:
    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise KVFormatError("the file is truncated")
        self.sha.update(data)
        return data


def read_header(f: BinaryIO) -> tuple[dict, _HashingReader]:
    """The checked header of an open file, and the reader positioned at the first record."""
    r = _HashingReader(f)
    if r.read(len(MAGIC)) != MAGIC:
        raise KVFormatError("not a servelm KV cache file (bad magic)")
    version, hlen = struct.unpack("<II", r.read(8))
    if version != FORMAT_VERSION:
        raise KVFormatError(f"format version {version} is not supported (this servelm reads {FORMAT_VERSION})")
    if hlen > 1 << 20:
        raise KVFormatError("the header is corrupt (implausible length)")
    raw = r.read(hlen)
    if f.read(32) != r.sha.digest():
        raise KVFormatError("the header is corrupt (checksum mismatch)")
    r.sha.update(r.sha.copy().digest())
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise KVFormatError(f"the header is corrupt ({e})") from None
    return header, r


def check_compatible(header: dict, expected: dict) -> None:
    """Raise KVMismatchError naming the first difference that makes the file's blocks unusable here."""
    for key, what in (("model_hash", "model"), ("dtype", "dtype"), ("kv_cache_dtype", "KV cache dtype"),
                      ("block_size", "block size"), ("layout", "KV layout")):
        have, want = header.get(key), expected[key]
        if key == "kv_cache_dtype" and have is None:  # written before the field: its cache was in `dtype`
            have = header.get("dtype")
        if have != want:
            if key == "model_hash":
                have, want = str(have)[:16], want[:16]
            raise KVMismatchError(f"the KV cache file was saved for a different {what} ({have}; this engine: "
                                  f"{want}); it cannot be restored here")


@torch.inference_mode()
def load(core: EngineCore, path: str | Path, digest: str) -> KVTransfer:
    """Restore a file's blocks into free blocks of the pool as cached free blocks (never evicting a cached
    prefix; the most recently used ones first when the pool is short). Raises KVMismatchError, KVFormatError
    or OSError; on any error the cache is left as it was. Run between engine steps."""
    t0 = time.perf_counter()
    pool, bs = core.kv.pool, core.config.cache_config.block_size
    if not pool.enable_caching:
        raise KVMismatchError("prefix caching is off in this engine: there is no cache to restore into")
    expected = _header(core, digest, 0)
    taken: list[int] = []
    with open(path, "rb") as f:
        header, r = read_header(f)
        check_compatible(header, expected)
        n, block_bytes = header.get("num_blocks"), expected["block_bytes"]
        if not isinstance(n, int) or n < 0 or header.get("block_bytes") != block_bytes:
            raise KVFormatError("the header is corrupt (block count or size)")
        room = len(pool.free_plain)
        first_kept = max(0, n - room)  # the least recently used records are the ones left out
        restored: list[tuple[int, bytes, bytes]] = []
        staged: list[tuple[int, bytes]] = []
        skipped = 0
        caches = _raw_caches(core)
        dtype = caches[0][0].dtype
        shape = (len(caches), 2, bs, core.model.spec.num_kv_heads, core.model.spec.head_dim)
        vocab = core.model.spec.vocab_size

        def flush() -> None:
            if not staged:
                return
            raw = bytearray(b"".join(p for _, p in staged))
            _scatter(caches, [b for b, _ in staged], torch.frombuffer(raw, dtype=dtype).reshape(len(staged), *shape))
            staged.clear()

        try:
            for i in range(n):
                key = r.read(32)
                (clen,) = struct.unpack("<I", r.read(4))
                if clen > 64 + 8 * bs:
                    raise KVFormatError(f"block record {i} is corrupt (content length {clen})")
                content = r.read(clen)
                payload = r.read(block_bytes)
                _check_record(i, key, content, bs, vocab)
                if i < first_kept or key in pool.cached:
                    skipped += 1
                    continue
                block = pool.take_plain()
                if block is None:  # cannot happen: room was counted above
                    skipped += 1
                    continue
                taken.append(block)
                staged.append((block, payload))
                restored.append((block, key, content))
                if len(staged) >= _CHUNK:
                    flush()
            flush()
            trailer = f.read(32)
            if len(trailer) != 32:
                raise KVFormatError("the file is truncated")
            if trailer != r.sha.digest():
                raise KVFormatError("the file is corrupt (checksum mismatch)")
            if f.read(1):
                raise KVFormatError("the file is corrupt (data after the checksum)")
        except BaseException:
            pool.return_plain(taken)  # written to, but plain free blocks: nothing ever reads them unwritten
            raise
    for block, key, content in restored:
        pool.restore_cached(block, key, content)
    size = os.path.getsize(path)
    return KVTransfer(str(path), len(restored), skipped, size, time.perf_counter() - t0)


def _check_record(i: int, key: bytes, content: bytes, block_size: int, vocab: int) -> None:
    """The key must be the hash of the stored content, and the content a block's preimage: a parent key, then
    block_size token ids in the vocabulary, then at most the generated-token marker and its count."""
    if hashlib.sha256(content).digest() != key:
        raise KVFormatError(f"block record {i} is corrupt (its key is not the hash of its tokens)")
    body = 32 + 8 * block_size
    tail = content[body:]
    if len(content) < body or (tail and (len(tail) != len(_GENERATED) + 8 or not tail.startswith(_GENERATED))):
        raise KVFormatError(f"block record {i} is corrupt (not a block of {block_size} tokens)")
    tokens = torch.frombuffer(bytearray(content[32:body]), dtype=torch.int64)
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        raise KVFormatError(f"block record {i} holds token ids outside the vocabulary")
