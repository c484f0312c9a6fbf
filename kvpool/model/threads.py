"""How a model step uses the CPU's threads, chosen by measuring.

Three ways to run a step (``Mode``): everything on one thread (``ONE``); the matrix
products and large gathers on all threads and the many small ops between them on one
(``SPLIT``); everything on all threads (``ALL``). Which is fastest depends on what else
the machine is doing, so ``ThreadPolicy`` measures instead of guessing. Measured on 2
cores (decode step at batch 1 / 8 / 32, 512-token prefill):

- machine otherwise idle: SPLIT 13.2 / 31.5 / 64.8 ms, ONE 17.2 / 38.7 / 87.6 ms; prefill
  ALL 474 ms, ONE 900 ms;
- one busy process beside it: SPLIT 73 / 102 / 153 ms, ONE 17.5 / 39 / 89 ms; prefill
  ALL 1,348 ms, ONE 898 ms: the worker thread waits for a core that is taken.

Every step kind (decode or prefill, and its size in powers of two) has two candidates:
SPLIT and ONE for decode steps and small steps, ALL and ONE for larger prefill steps. The
policy runs the candidate with the lower recent time per token and, every
``explore_every`` steps of a kind, the other one once, so that it notices when the
machine gets busy or idle again. The mode never changes results: each op computes the
same values on any number of threads (tested bit for bit).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Mode(enum.Enum):
    ONE = "one"
    SPLIT = "split"
    ALL = "all"


@dataclass
class _Kind:
    candidates: tuple[Mode, Mode]
    seconds_per_token: dict[Mode, float] = field(default_factory=dict)
    last_step: dict[Mode, int] = field(default_factory=dict)  # when each was last run
    steps: int = 0


class ThreadPolicy:
    """Picks a ``Mode`` per step and learns from the step's measured time.

    ``choose(tokens, decode_only)`` before a step, ``record(seconds)`` after it. With one
    thread available the answer is always ``ONE``. Estimates are exponential moving
    averages of seconds per token (weight ``alpha`` for a new sample) over a mode's
    consecutive steps; a sample replaces the estimate instead when the mode had not run
    in the step before (an exploring step: its old estimate is stale). The first step of
    a kind is not measured: it pays one-off setup (oneDNN primitives for new shapes).
    """

    def __init__(
        self,
        max_threads: int,
        *,
        small_tokens: int = 8,
        explore_every: int = 32,
        alpha: float = 0.3,
    ) -> None:
        self.max_threads = max_threads
        self.small_tokens = small_tokens
        self.explore_every = explore_every
        self.alpha = alpha
        self._kinds: dict[tuple[bool, int], _Kind] = {}
        self._pending: tuple[_Kind, Mode, int] | None = None

    def choose(self, tokens: int, decode_only: bool) -> Mode:
        if self.max_threads <= 1:
            self._pending = None
            return Mode.ONE
        split = decode_only or tokens <= self.small_tokens
        key = (decode_only, tokens.bit_length())
        kind = self._kinds.get(key)
        if kind is None:
            kind = _Kind((Mode.SPLIT, Mode.ONE) if split else (Mode.ALL, Mode.ONE))
            self._kinds[key] = kind
        kind.steps += 1
        unmeasured = [m for m in kind.candidates if m not in kind.seconds_per_token]
        if unmeasured:
            mode = unmeasured[0]
            if kind.steps == 1:  # setup: run, don't measure
                self._pending = None
                return mode
        else:
            best = min(kind.candidates, key=lambda m: kind.seconds_per_token[m])
            other = kind.candidates[1] if best is kind.candidates[0] else kind.candidates[0]
            mode = other if kind.steps % self.explore_every == 0 else best
        self._pending = (kind, mode, tokens)
        return mode

    def record(self, seconds: float) -> None:
        """The time of the step just chosen for."""
        if self._pending is None:
            return
        kind, mode, tokens = self._pending
        self._pending = None
        per_token = seconds / tokens
        stale = kind.last_step.get(mode) != kind.steps - 1
        kind.last_step[mode] = kind.steps
        if stale or mode not in kind.seconds_per_token:
            kind.seconds_per_token[mode] = per_token
        else:
            old = kind.seconds_per_token[mode]
            kind.seconds_per_token[mode] = old + self.alpha * (per_token - old)

    def summary(self) -> dict[str, dict[str, float]]:
        """Current estimates (ms per token) by step kind, for reports and tests."""
        out = {}
        for (decode, size), kind in sorted(self._kinds.items()):
            label = f"{'decode' if decode else 'prefill'} <{2**size} tokens"
            out[label] = {m.value: s * 1e3 for m, s in kind.seconds_per_token.items()}
        return out
