"""Sampling parameters and the batched sampler.

``Sampler.sample`` turns one row of logits per sequence into one token per sequence, each
row with its own parameters, in this order: repetition / presence / frequency penalties,
temperature (0 = greedy), top-k, top-p, min-p, then a draw. A request with a ``seed``
draws from its own generator, created once for the request and advanced once per token,
so its samples do not depend on what else is in the batch; requests without one share
the sampler's generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class InvalidSamplingParams(ValueError):
    """A sampling parameter out of its range (the server answers 400 with the message)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on prompt and output tokens, > 1 discourages
    presence_penalty: float = 0.0  # on output tokens, OpenAI's definition
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the text (not returned in it)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (1 <= self.n <= 64, "n must be in [1, 64]"),
            (all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidSamplingParams(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        """The request's own generator when it has a seed (create once per request)."""
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """One token per row of ``logits`` ``[B, vocab]`` (float32, on the CPU)."""
        logits = logits.float().clone()
        batch, vocab = logits.shape
        _apply_penalties(logits, params, prompt_ids, output_ids)
        out = [0] * batch
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        for i, p in enumerate(params):
            if p.greedy:
                out[i] = int(logits[i].argmax())
        if not sampled_rows:
            return out
        rows = torch.tensor(sampled_rows)
        x = logits[rows] / torch.tensor([params[i].temperature for i in sampled_rows])[:, None]
        x = _filter(x, [params[i] for i in sampled_rows], vocab)
        probs = torch.softmax(x, dim=-1)
        shared = [j for j, i in enumerate(sampled_rows) if generators[i] is None]
        if shared:
            picks = torch.multinomial(probs[shared], 1, generator=self.generator)[:, 0]
            for j, token in zip(shared, picks.tolist(), strict=True):
                out[sampled_rows[j]] = token
        for j, i in enumerate(sampled_rows):
            if generators[i] is not None:
                out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
        return out


def _apply_penalties(logits, params, prompt_ids, output_ids) -> None:
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt_ids[i]) | set(output_ids[i])), dtype=torch.long)
            if seen.numel():
                row = logits[i, seen]
                logits[i, seen] = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
        if (p.presence_penalty or p.frequency_penalty) and output_ids[i]:
            ids = torch.tensor(output_ids[i], dtype=torch.long)
            counts = torch.zeros(logits.shape[1]).index_add_(0, ids, torch.ones(len(ids)))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _filter(x: torch.Tensor, params: Sequence[SamplingParams], vocab: int) -> torch.Tensor:
    """Mask (-inf) what top-k, top-p and min-p exclude, row by row; keeps the best token."""
    neg = float("-inf")
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        drop = rank >= top_k[:, None]
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        drop |= before >= top_p[:, None]
        drop[:, 0] = False
        x = x.scatter(1, order, sorted_x.masked_fill(drop, neg))
    if (min_p > 0).any():
        probs = torch.softmax(x, dim=-1)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < floor, neg)
    return x
