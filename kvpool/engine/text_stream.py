"""``TextStream``: a request's output text, released piece by piece as tokens arrive.

Invariants: the text released so far is always a prefix of the final text; the final
text stops before the first stop string (which is never released); a tail that could be
the start of a stop string, or an incomplete UTF-8 character (decoded as U+FFFD), is
held back until the next tokens settle it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class TextStream:
    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self.sent = ""  # released so far
        self.stopped = False  # a stop string was found: the text is final
        self.matched: str | None = None  # which one (the first in the text)

    def update(self, output_ids: Sequence[int], *, final: bool = False) -> str:
        """The new text that is safe to release after ``output_ids`` (all output tokens
        so far). ``final``: the request ended, release everything left."""
        if self.stopped:
            return ""
        text = self._decode(output_ids)
        cut = self._first_stop(text)
        if cut is not None:
            self.matched = min(
                (s for s in self._stop if text.startswith(s, cut)), key=len, default=None
            )
            text, self.stopped, final = text[:cut], True, True
        if not final:
            hold = self._stop_prefix_len(text)
            if text.endswith("\ufffd"):
                hold = max(hold, 1)
            text = text[: len(text) - hold]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def _first_stop(self, text: str) -> int | None:
        found = [text.find(s, max(0, len(self.sent) - len(s))) for s in self._stop]
        found = [i for i in found if i >= 0]
        return min(found) if found else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
