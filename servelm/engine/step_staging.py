"""An eager step's inputs crossing to the GPU as one copy from a pinned buffer.

Why: an eager step (prompt chunks, mixed steps, decodes without CUDA graphs) moved its inputs one tensor at a
time from pageable memory: the token ids, positions, KV slots, the decode rows' indices, lengths and block
tables, the sampled rows and the attention backend's per-row arrays, about a dozen copies, each a synchronous
trip through a bounce buffer that the host waits for. Here the host writes them, whatever their dtypes, into one
pinned byte vector with numpy slice assignments, and one asynchronous copy moves them into a device byte
vector, of which each input is then a typed view.

Two pairs of vectors alternate: the host fills one while the copy from the other may still be in flight (a step
launched behind another under asynchronous scheduling), and a step's device views stay valid while the next
step is being prepared. A vector too small for a step is replaced by a larger one; the device's caching
allocator orders the old one's release after the work already queued on the stream.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # every input starts at a multiple of 16 bytes (any dtype's alignment; views need their own)


class StepStaging:
    """`stage` puts a step's host arrays on `device` in one copy; `capacity`: the vectors' first size in bytes."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []
        self._turn = 0
        for _ in range(2):
            self._host.append(self._new_host(capacity))
            self._dev.append(torch.empty(capacity, dtype=torch.uint8, device=device))

    def _new_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def stage(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """`arrays` on the device, in one copy: a view of the device vector per array, of its shape and dtype."""
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // _ALIGN) * _ALIGN
        turn = self._turn
        self._turn ^= 1
        if end > self._host[turn].numel():
            size = max(end, 2 * self._host[turn].numel())
            self._host[turn] = self._new_host(size)
            self._dev[turn] = torch.empty(size, dtype=torch.uint8, device=self.device)
        host = self._host[turn].numpy()
        for a, at in zip(arrays, offsets, strict=True):
            host[at:at + a.nbytes].view(a.dtype)[:] = a.ravel()
        dev = self._dev[turn]
        dev[:end].copy_(self._host[turn][:end], non_blocking=True)
        return [dev[at:at + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
                for a, at in zip(arrays, offsets, strict=True)]
