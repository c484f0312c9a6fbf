"""``StepCost``: how long a step takes, learned from the steps that ran, so that the
scheduler can size prompt chunks to keep streams moving.

A step that computes a long prompt chunk beside decoding requests holds every one of
their next tokens until it ends: 2048 prompt tokens deep into a long context took 13 s
of the default model's step on a 2-core CPU, and an 8B-class model's takes minutes.
The scheduler therefore caps the prompt tokens of a step while requests are streaming
(``prompt_tokens_within``), and leaves chunks at the token budget when nobody waits.

Model: a step's time = the decode rows' step time (measured on steps without prompt
tokens: mostly reading the weights, the same for a few rows or one) + a cost per prompt
token (measured on steps with at least ``MIN_PROMPT_CHUNK`` of them, the decode part
taken off). Both are moving averages that follow the latest steps: a prompt's tokens
cost more as its context grows (attention), and the batch changes.

Invariants: estimates are non-negative; ``prompt_tokens_within`` is at least
``MIN_PROMPT_CHUNK`` (every step makes progress on prompts, and the products keep their
widest kernels: 32 activation rows) and at most the token budget it is given.
"""

from __future__ import annotations

# Fewest prompt tokens a step computes while requests stream. The int8 products run
# their widest passes from 32 activation rows, and a step's weights are read once for
# all its rows: below this, prompts would advance at a fraction of their speed.
MIN_PROMPT_CHUNK = 32
# Weight of the newest step in the moving averages.
_NEWEST = 0.3


class StepCost:
    """Moving estimates of a decode step's time and of a prompt token's (seconds)."""

    def __init__(self) -> None:
        self.decode_step: float | None = None  # a step of decode rows only
        self.per_prompt_token: float | None = None

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step that computed ``decode_rows`` single tokens and ``prompt_tokens``
        tokens of longer chunks took ``seconds``."""
        if seconds < 0:
            return
        if prompt_tokens == 0:
            if decode_rows > 0:
                self.decode_step = _average(self.decode_step, seconds)
            return
        if prompt_tokens < MIN_PROMPT_CHUNK:
            return  # dominated by the step's fixed part: says little per token
        fixed = (self.decode_step or 0.0) if decode_rows > 0 else 0.0
        per_token = max(seconds - fixed, 0.0) / prompt_tokens
        self.per_prompt_token = _average(self.per_prompt_token, per_token)

    def prompt_tokens_within(self, seconds: float, budget: int) -> int:
        """Prompt tokens a step beside decoding requests may compute to take about
        ``seconds``: between ``MIN_PROMPT_CHUNK`` and ``budget``; the minimum until a
        prompt token's cost has been measured."""
        low = min(MIN_PROMPT_CHUNK, budget)
        if not self.per_prompt_token:
            return low
        left = seconds - (self.decode_step or 0.0)
        return max(low, min(budget, int(left / self.per_prompt_token)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _NEWEST) * old + _NEWEST * new
