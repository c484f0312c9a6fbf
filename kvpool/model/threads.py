"""How a model step uses the CPU's threads, chosen by measuring.

Three ways to run a step (``Mode``): everything on one thread (``ONE``); the matrix
products and large gathers on all threads and the many small ops between them on one
(``SPLIT``); everything on all threads (``ALL``). Which is fastest depends on what else
the machine is doing, so ``ThreadPolicy`` measures instead of guessing: on an idle
machine ALL is fastest; with another busy process on a core, a worker thread waits for
a core that is taken and ONE wins by far; with workers that never spin, each small op
pays for waking one (the measurements: docs/performance.md, "Threads").

Candidates: ALL, SPLIT and ONE for decode steps and small steps, ALL and ONE for larger
prefill steps, per step kind (decode or not, and the size in powers of two; prefill
steps of 128 tokens or more are one kind). The policy
runs the candidate with the lowest recent time per token and, every ``explore_every``
steps of a kind, each of the others once (less often for a mode that keeps proving much
slower), so that it notices when the machine gets busy or idle again. The mode never
changes results: each op computes the same values on any number of threads (tested bit
for bit).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

PREFILL_KIND_BITS = 8  # prefill steps of 2**(8-1) = 128 tokens or more: one kind
T = TypeVar("T")


def in_passing_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a thread of its own that ends with it (its result
    returned, its exception raised here).

    For setup work (loading a model, building its engine) whose steps then run on
    another, long-lived thread (``AsyncLLM``'s). OpenMP (libgomp, torch's) gives every
    thread that starts a parallel region a pool of workers, kept until that thread ends;
    while the pools hold more threads than there are CPUs, an idle worker spins ~1 us
    instead of GOMP_SPINCOUNT's ~100 us before it sleeps, so each of a decode step's
    ~120 parallel regions wakes a sleeping worker. A model loaded on the thread that then
    serves HTTP left such a pool beside the engine thread's, and every batch-1 step paid
    for it (measured: docs/performance.md, fifteenth session)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    # a daemon: Ctrl-C during a long load ends the process without waiting for it
    thread = threading.Thread(target=run, name="kvpool-setup", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


class Mode(enum.Enum):
    ONE = "one"
    SPLIT = "split"
    ALL = "all"


@dataclass
class _Kind:
    candidates: tuple[Mode, ...]
    seconds_per_token: dict[Mode, float] = field(default_factory=dict)
    last_step: dict[Mode, int] = field(default_factory=dict)  # when each was last run
    steps: int = 0
    # Exploring: the step at which each other mode is next tried, and its interval.
    next_try: dict[Mode, int] = field(default_factory=dict)
    interval: dict[Mode, int] = field(default_factory=dict)


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
        small = decode_only or tokens <= self.small_tokens
        # Decode steps by batch size in powers of two; prefill steps of 128 tokens or
        # more are one kind (their time per token hardly depends on the size, and each
        # kind pays for trying a slow mode on a long step)
        size = tokens.bit_length()
        key = (decode_only, size if decode_only else min(size, PREFILL_KIND_BITS))
        kind = self._kinds.get(key)
        if kind is None:
            kind = _Kind((Mode.ALL, Mode.SPLIT, Mode.ONE) if small else (Mode.ALL, Mode.ONE))
            self._kinds[key] = kind
        kind.steps += 1
        unmeasured = [m for m in kind.candidates if m not in kind.seconds_per_token]
        if unmeasured:
            mode = unmeasured[0]
            if kind.steps == 1:  # setup: run, don't measure
                self._pending = None
                return mode
        else:
            mode = min(kind.candidates, key=lambda m: kind.seconds_per_token[m])
            explore = self._due(kind, [m for m in kind.candidates if m is not mode])
            if explore is not None:
                mode = explore
        self._pending = (kind, mode, tokens)
        return mode

    def _due(self, kind: _Kind, others: list[Mode]) -> Mode | None:
        """The mode (not the best) to try now, if one is due. A mode that keeps proving
        much slower (over 1.5x the best) is tried at doubling intervals, up to 16x
        ``explore_every``, so that exploring costs little when the choice is clear
        (another process on a core makes SPLIT several times slower than ONE)."""
        for mode in others:
            if mode not in kind.next_try:
                kind.interval[mode] = self.explore_every
                kind.next_try[mode] = kind.steps + self.explore_every
        mode = min(others, key=lambda m: kind.next_try[m])
        if kind.steps < kind.next_try[mode]:
            return None
        best = min(kind.seconds_per_token.values())
        if kind.seconds_per_token[mode] > 1.5 * best:
            kind.interval[mode] = min(2 * kind.interval[mode], 16 * self.explore_every)
        else:
            kind.interval[mode] = self.explore_every
        kind.next_try[mode] = kind.steps + kind.interval[mode]
        return mode

    def record(self, seconds: float) -> None:
        """The time of the step just chosen for."""
        if self._pending is None:
            return
        kind, mode, tokens = self._pending
        self._pending = None
        per_token = seconds / tokens
        stale = kind.last_step.get(mode) != kind.steps - 1  # also: never measured
        kind.last_step[mode] = kind.steps
        if stale:
            kind.seconds_per_token[mode] = per_token
        else:
            old = kind.seconds_per_token[mode]
            kind.seconds_per_token[mode] = old + self.alpha * (per_token - old)

    def summary(self) -> dict[str, dict[str, float]]:
        """Current estimates (ms per token) by step kind, for reports and tests."""
        out = {}
        for (decode, size), kind in sorted(self._kinds.items()):
            label = f"{'decode' if decode else 'prefill'} <{2**size} tokens"
            if not decode and size == PREFILL_KIND_BITS:
                label = f"prefill >={2 ** (size - 1)} tokens"
            out[label] = {m.value: s * 1e3 for m, s in kind.seconds_per_token.items()}
        return out
