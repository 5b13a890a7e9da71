"""Recording a Triton kernel's launch grids in a test, the kernel still running."""

from __future__ import annotations


def record_grids(monkeypatch, module, name: str) -> list[tuple]:
    """Replaces `module.name` (a Triton kernel) for the test with one that appends each launch's grid to the
    returned list, then launches the real kernel."""
    grids, real = [], getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(module, name, Spy())
    return grids
