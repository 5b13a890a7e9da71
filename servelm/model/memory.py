"""Host memory for the tensors a forward pass streams: anonymous mappings backed by transparent huge pages.

A decode step reads every weight once and the KV blocks of every sequence; with 4 KB pages each 4 KB of
that stream costs a TLB entry, and in a virtual machine a TLB miss is a two-level page walk. Mappings
advised MADV_HUGEPAGE get 2 MB pages where the kernel's THP mode is `madvise` or `always` (the default
on most distributions). On Zen 4 the one-row linear kernel streamed cold bf16 weights at 24 -> 30 GB/s on
one thread and 30 -> 33.5 GB/s on two (W2 TPOT 1.04-1.12x, `bench/huge_pages_ab.py`); decode attention
over the KV pool measured 25% faster.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # one cache line: each tensor starts on its own line, as the kernels' vector loads expect

# Read when a model is built; benchmarks turn it off to compare both placements in one process.
WEIGHTS_IN_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


def anonymous_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a fresh anonymous mapping: zero, and costing no memory until first written.
    The mapping starts on a huge-page boundary and is advised MADV_HUGEPAGE where the OS supports it."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive as long as any view of it
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the OS maps on first write, so unused KV blocks cost no RSS.

    Zeros, not torch.empty: masked attention multiplies unused slots by 0, and 0 * NaN garbage is NaN.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return anonymous_bytes(nbytes).view(dtype).view(shape)


def move_to_huge_pages(slots: list[tuple[object, str]]) -> None:
    """Moves the tensors held at `slots` ((object, attribute name) pairs; None values are skipped) into
    one huge-page mapping as contiguous copies, one after another. Each attribute is rebound as its copy
    is made, so the original can be freed then: the peak is the total plus what is held elsewhere.
    Slots that hold the same tensor share one copy."""
    sizes: dict[int, int] = {}  # by id: the slots keep every original alive until it is rebound
    for obj, name in slots:
        t = getattr(obj, name)
        if t is not None:
            if t.device.type != "cpu":
                raise ValueError(f"{name}: only CPU tensors go into huge pages")
            sizes[id(t)] = t.numel() * t.element_size()
    if not sizes:
        return
    offsets, total = {}, 0
    for key, nbytes in sizes.items():
        offsets[key] = total
        total += -(-nbytes // ALIGN) * ALIGN
    arena = anonymous_bytes(total)
    moved: dict[int, torch.Tensor] = {}
    for obj, name in slots:
        t = getattr(obj, name)
        if t is None:
            continue
        key = id(t)
        if key not in moved:
            off = offsets[key]
            moved[key] = arena[off:off + sizes[key]].view(t.dtype).view(t.shape).copy_(t)
        setattr(obj, name, moved[key])
    release_freed_heap()


def release_freed_heap() -> None:
    """Hands memory that the C heap holds free back to the OS (glibc's malloc_trim). Large tensors freed
    during loading otherwise stay resident: glibc raises its mmap threshold after freeing a mapped
    chunk, so later large blocks come from the heap, whose free pages it keeps."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def release_pages(tensors: list[torch.Tensor]) -> int:
    """Hands the host memory under `tensors` back to the OS, keeping their addresses (madvise MADV_DONTNEED):
    each page wholly inside one of their byte ranges reads as zero afterwards and costs no memory until written
    again. Pages a range shares with other data at its ends are left alone. The bytes given back (of ranges
    whose pages may never have been written, so at most that much memory); 0 where the OS has no madvise."""
    advise = getattr(mmap, "MADV_DONTNEED", None)
    if advise is None:
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    released = 0
    for start, end in _merged_ranges(tensors):
        first, last = -(-start // page) * page, end // page * page
        if last > first and madvise(first, last - first, advise) == 0:
            released += last - first
    return released


def _merged_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The byte ranges the tensors span (a view's from its first to its last element), overlaps merged."""
    spans = []
    for t in tensors:
        if t.numel() == 0:
            continue
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
