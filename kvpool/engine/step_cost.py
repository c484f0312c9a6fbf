"""``StepCost``: how long a step takes, learned from the steps that ran, so that the
scheduler can size prompt chunks to keep streams moving.

A step that computes a long prompt chunk beside decoding requests holds every one of
their next tokens until it ends: 2048 prompt tokens deep into a long context took 13 s
of the default model's step on a 2-core CPU, and an 8B-class model's takes minutes.
The scheduler therefore gives a step's prompt chunks a time budget while requests are
streaming or waiting (``tokens_within``), and leaves chunks at the token budget when
nobody waits for anything.

Model: a step's time = the decode rows' time (a moving average over steps without
prompt tokens: mostly reading the weights, about the same for a few rows or one) + for
each prompt chunk of n tokens starting at context position s, n (a + b (s + n / 2)):
a per token (the products), b per token and context position (attention reads the
context). (a, b) is a least-squares fit over the steps with prompt tokens, older steps
weighing less (``_KEEP`` a step), so that it follows the machine and the model; a chunk
deep into a long prompt costs several times one at its start, which one average per
token would learn only after overshooting.

Invariants: estimates are non-negative; ``tokens_within`` never exceeds what it is
asked for, and the scheduler gives a step at least ``MIN_PROMPT_CHUNK`` prompt tokens
(every step makes progress on prompts, and the products keep their widest kernels).
"""

from __future__ import annotations

# Fewest prompt tokens a step computes while requests stream. The int8 products run
# their widest passes from 32 activation rows, and a step's weights are read once for
# all its rows: below this, prompts would advance at a fraction of their speed.
MIN_PROMPT_CHUNK = 32
# Weight of the newest decode step in its moving average, and the weight each older
# prompt step keeps in the fit, a step later.
_NEWEST = 0.3
_KEEP = 0.8
# Context positions enter the fit in thousands of tokens (its sums then stay of one size).
_SCALE = 1000.0


class StepCost:
    """Moving estimates of a decode step's time and of prompt tokens' (seconds)."""

    def __init__(self) -> None:
        self.decode_step: float | None = None  # a step of decode rows only
        self.per_token = 0.0  # a: seconds a prompt token
        self.per_token_context = 0.0  # b: seconds a prompt token and 1000 context positions
        self._measured = False
        # the fit's weighted sums: x = (tokens, tokens x mean position / 1000), y = seconds
        self._xx = [0.0, 0.0, 0.0]  # sum x0 x0, x0 x1, x1 x1
        self._xy = [0.0, 0.0]

    @property
    def measured(self) -> bool:
        """A step with prompt tokens has been seen."""
        return self._measured

    def observe(self, decode_rows: int, chunks: list[tuple[int, int]], seconds: float) -> None:
        """A step that computed ``decode_rows`` single tokens and the prompt ``chunks``
        ((start, tokens) each) took ``seconds``."""
        if seconds < 0:
            return
        tokens = sum(n for _, n in chunks)
        if tokens == 0:
            if decode_rows > 0:
                old = self.decode_step
                self.decode_step = seconds if old is None else old + _NEWEST * (seconds - old)
            return
        if tokens < MIN_PROMPT_CHUNK:
            return  # dominated by the step's fixed part: says little per token
        fixed = (self.decode_step or 0.0) if decode_rows > 0 else 0.0
        y = max(seconds - fixed, 0.0)
        x0 = float(tokens)
        x1 = sum(n * (s + n / 2) for s, n in chunks) / _SCALE
        self._xx = [_KEEP * v for v in self._xx]
        self._xy = [_KEEP * v for v in self._xy]
        self._xx[0] += x0 * x0
        self._xx[1] += x0 * x1
        self._xx[2] += x1 * x1
        self._xy[0] += x0 * y
        self._xy[1] += x1 * y
        self.per_token, self.per_token_context = self._fit()
        self._measured = True

    def _fit(self) -> tuple[float, float]:
        """Least squares (a, b) >= 0; a one-parameter fit where the steps do not tell
        the two apart (contexts alike) or one would be negative."""
        s00, s01, s11 = self._xx
        r0, r1 = self._xy
        det = s00 * s11 - s01 * s01
        if det > 1e-9 * s00 * s11:
            a = (s11 * r0 - s01 * r1) / det
            b = (s00 * r1 - s01 * r0) / det
            if a >= 0 and b >= 0:
                return a, b
        return max(r0 / s00, 0.0), 0.0  # per token only

    def prompt_seconds(self, tokens: int, start: int) -> float:
        """Expected seconds of a prompt chunk of ``tokens`` starting at ``start``."""
        return tokens * (self.per_token + self.per_token_context * (start + tokens / 2) / _SCALE)

    def tokens_within(self, seconds: float, start: int, most: int) -> int:
        """Prompt tokens from context position ``start`` expected to take at most
        ``seconds`` (0 to ``most``); 0 before anything is measured."""
        if not self._measured or seconds <= 0:
            return 0
        a = self.per_token + self.per_token_context * start / _SCALE
        b = self.per_token_context / _SCALE / 2  # seconds = n a + n^2 b
        if b > 0:
            n = (-a + (a * a + 4 * b * seconds) ** 0.5) / (2 * b)
        else:
            n = seconds / a if a > 0 else most
        return max(0, min(most, int(n)))
