"""Progress of long loops (loading weights, offline generation, benchmarks): every bar in servelm is made here.

On a terminal it is a tqdm bar. Anywhere else (a server's log file, CI, a pipe) a bar's `\\r` redraws are
noise, so progress becomes a plain log line every `LOG_EVERY_S` seconds and one when the loop ends.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator

logger = logging.getLogger("servelm.progress")
LOG_EVERY_S = 10.0


def progress(iterable: Iterable | None = None, *, desc: str = "", total: int | None = None, unit: str = "it",
             leave: bool = True, disable: bool = False, file=None):
    """A tqdm bar if `file` (default stderr) is a terminal, else a `LogProgress`; both iterate like
    `iterable` and take `update(n)` and `close()`, also as context managers."""
    stream = sys.stderr if file is None else file
    if not disable and _is_terminal(stream):
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, file=stream)
    return LogProgress(iterable, desc=desc, total=total, unit=unit, disable=disable)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LogProgress:
    """tqdm's interface, reporting through logging: what it is doing, how far, how long so far."""

    def __init__(self, iterable: Iterable | None = None, *, desc: str = "", total: int | None = None,
                 unit: str = "it", disable: bool = False, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.iterable = iterable
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.desc, self.unit, self.disable, self.every_s, self.clock = desc, unit, disable, every_s, clock
        self.n = 0
        self.start = self.last = clock()
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if not self.disable and now - self.last >= self.every_s:
            self.last = now
            of = f"/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%)" if self.total else f" {self.unit}"
            logger.info("%s: %d%s, %.1fs so far", self.desc, self.n, of, now - self.start)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.disable:
            logger.info("%s: done, %d %s in %.1fs", self.desc, self.n, self.unit, self.clock() - self.start)
