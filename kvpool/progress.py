"""Progress lines for long work, on stderr so that stdout stays a clean table or JSON."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress("simulating", total=n) as p: ... p.advance()``.

    Redraws one line at most ten times a second on a terminal; elsewhere (logs, CI)
    prints a line at every tenth of the work, so output stays short.
    """

    def __init__(self, label: str, total: int, *, stream=None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._draw(final=True)

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self._tty and now - self._last_draw >= 0.1:
            self._last_draw = now
            self._draw()
        elif not self._tty:
            decile = 10 * self.done // self.total
            if decile != self._last_decile and decile < 10:
                self._last_decile = decile
                self._draw()

    def _draw(self, final: bool = False) -> None:
        elapsed = time.perf_counter() - self._start
        pct = 100.0 * min(self.done, self.total) / self.total
        line = f"{self.label}: {self.done}/{self.total} ({pct:.0f}%) {elapsed:.1f}s"
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
