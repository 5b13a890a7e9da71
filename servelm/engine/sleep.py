"""Sleep mode: an idle engine gives back the memory of its KV cache and of its weights, so that another program
(a trainer between rollouts) can use it, and takes it again when woken, as vLLM's `sleep` and `wake_up`.

- Level 1 keeps the weights' values: on a GPU they are copied to host memory and their device memory freed; on
  the CPU they are host memory already and stay where they are.
- Level 2 discards them: new weights are loaded after waking them (the engine's update_weights); an engine
  woken without new ones reads the checkpoint it last loaded from disk again, so it never runs on discarded
  weights.
- Either level discards the KV cache, so every cached prefix is forgotten.

Each part (TAGS) sleeps and wakes on its own: a trainer wakes the weights, loads new ones, then wakes the KV
cache, so that the two are never in memory beside its own state at once.

Memory is given back in one of two ways:
- in place (host memory): its pages go back to the OS (madvise MADV_DONTNEED) and read as zeros afterwards, at
  the same addresses, so the kernel tapes, which hold those addresses, stay valid;
- by relocation (a GPU): each storage shrinks to nothing, and on waking grows back at a new address, so the
  CUDA graphs, which hold the old addresses, are dropped at sleep and captured again on waking.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from servelm.model.memory import release_freed_heap, release_pages

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


def checkpoint_tensors_of(model: Any) -> list[torch.Tensor]:
    """The tensors a checkpoint's weights fill (the embedding, the final norm, the head and every layer's): what
    sleeping discards and a weight update writes. Tables derived from the config (RoPE's) are not among them."""
    from servelm.model.weight_update import weight_tensors

    return list(weight_tensors([model.embed, model.norm, model.lm_head, model.layers]).values())


class _Relocated:
    """Storages shrunk to nothing, each with its size and, for those whose values are kept, a host copy."""

    def __init__(self, tensors: list[torch.Tensor], keep: bool) -> None:
        self.held: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        seen: set[int] = set()
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() in seen or s.nbytes() == 0:
                continue
            seen.add(s.data_ptr())
            copy = None
            if keep:
                copy = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=s.device.type == "cuda")
                copy.copy_(_bytes(s))
            self.held.append((s, s.nbytes(), copy))
        for s, _, _ in self.held:
            s.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.held)

    def forget_values(self) -> None:
        """Drop the host copies: the storages come back as zeros."""
        self.held = [(s, n, None) for s, n, _ in self.held]

    def restore(self) -> None:
        """Each storage at its size again, holding its values where they were kept, else zeros."""
        for s, n, copy in self.held:
            s.resize_(n)
            if copy is not None:
                _bytes(s).copy_(copy)
            else:
                _bytes(s).zero_()
        self.held = []


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Sleeper:
    """What of one runner's memory is asleep, and how to put it to sleep and wake it (module docstring).
    `relocate`: give memory back by relocation rather than in place (the default on a GPU)."""

    def __init__(self, runner: Any, relocate: bool | None = None) -> None:
        self.runner = runner
        self.relocate = runner.device.type != "cpu" if relocate is None else relocate
        self.weights = "awake"  # awake | offloaded (values kept) | discarded
        self.kv_cache = "awake"  # awake | discarded
        self.needs_weights = False  # woken from level 2 with no new weights loaded since
        self._weights: _Relocated | None = None
        self._kv: _Relocated | None = None

    @property
    def in_memory(self) -> bool:
        """Whether every part is awake (its memory taken back)."""
        return self.weights == "awake" and self.kv_cache == "awake"

    @property
    def serving(self) -> bool:
        """Whether the engine may run steps: every part awake, the weights holding values (read each step, so no
        list is built)."""
        return self.in_memory and not self.needs_weights

    @property
    def asleep(self) -> list[str]:
        """The parts asleep, of TAGS; "weights" also while they hold no values (woken from level 2 and not
        loaded since, where the engine is otherwise awake)."""
        tags = [tag for tag in TAGS if getattr(self, tag) != "awake"]
        return tags or (["weights"] if self.needs_weights else [])

    def sleep(self, level: int) -> int:
        """Put what is awake to sleep at `level` (1 or 2); the bytes given back."""
        if level not in (1, 2):
            raise ValueError(f"the sleep level is 1 (the weights kept in host memory) or 2 (discarded), not {level}")
        runner, released = self.runner, 0
        if self.relocate and self.in_memory:
            runner.drop_graphs()  # they hold the addresses that move
        if self.kv_cache == "awake":
            kv = [t for pair in runner.kv_caches for t in pair]
            if self.relocate:
                self._kv = _Relocated(kv, keep=False)
                released += self._kv.nbytes
            else:
                released += release_pages(kv)
            runner.drop_swap_space()
            self.kv_cache = "discarded"
        if self.weights == "awake" and (level == 2 or self.relocate):
            weights = checkpoint_tensors_of(runner.model)
            if self.relocate:
                self._weights = _Relocated(weights, keep=level == 1)
                released += self._weights.nbytes
            else:
                released += release_pages(weights)
            self.weights = "offloaded" if level == 1 else "discarded"
        elif self.weights == "awake":
            self.weights = "offloaded"  # level 1 on the CPU: the weights are host memory already
        elif self.weights == "offloaded" and level == 2:  # asleep at level 1, now 2: the kept values go too
            if self._weights is not None:
                self._weights.forget_values()
            else:
                released += release_pages(checkpoint_tensors_of(runner.model))
            self.weights = "discarded"
        if not self.relocate:
            release_freed_heap()  # what the C heap holds free from the last steps' temporaries goes back too
        if self.relocate and runner.device.type == "cuda":
            gc.collect()  # the dropped graphs, should a reference cycle hold their memory pool
            torch.cuda.empty_cache()  # to the driver, where another process can have it
        logger.info("asleep at level %d: %.1f MB given back", level, released / 2**20)
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the parts named (default: all); waking what is awake does nothing."""
        tags = list(TAGS) if tags is None else tags
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            raise ValueError(f"unknown sleep tag {unknown[0]!r}: the tags are {', '.join(TAGS)}")
        woke = any(t in tags and getattr(self, t) != "awake" for t in TAGS)
        if "weights" in tags and self.weights != "awake":
            if self._weights is not None:
                self._weights.restore()
                self._weights = None
            self.needs_weights = self.weights == "discarded"
            self.weights = "awake"
        if "kv_cache" in tags and self.kv_cache != "awake":
            if self._kv is not None:
                self._kv.restore()
                self._kv = None
            self.kv_cache = "awake"
        if woke and self.in_memory and self.relocate:
            self.runner.recapture_graphs()
            if self.runner.model.tapes is not None:  # kernel tapes hold addresses too (relocation on the CPU)
                self.runner.model.tapes.reset()
