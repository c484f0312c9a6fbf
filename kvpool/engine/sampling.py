"""Sampling parameters and the batched sampler.

``Sampler.sample`` turns one row of logits per sequence into one token per sequence, each
row with its own parameters, in this order: repetition / presence / frequency penalties,
temperature (0 = greedy), top-k, top-p, min-p, then a draw. Log-probabilities, for rows
that ask for them (``logprobs``), are those of the row after the penalties and before
the temperature (OpenAI's definition: the model's distribution as the request shaped
it, not the sampling's): a float32 log-softmax of the row, the chosen token's value and
the ``logprobs`` best. The filters look at the best
candidates (``topk``, or the tokens above a threshold for a nucleus wider than them; never
a sort of the whole vocabulary), and the draw is an exponential race over what they
keep. A request with a ``seed`` draws from its own generator, created once for the
request, and the draws it makes depend on its own row only, so its samples do not
depend on what else is in the batch; requests without one share the sampler's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvpool.engine.structured import ResponseFormat


class InvalidSamplingParams(ValueError):
    """A sampling parameter out of its range (the server answers 400 with the message)."""


# Bounds that keep one request's numbers from costing the others: a temperature or a
# penalty past these changes nothing a user can see (a temperature of 100 already draws
# near-uniformly), and stop strings are checked against the text at every token.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 512  # characters
MAX_TOP_K = 1 << 31
MAX_LOGPROBS = 20  # best alternatives per token (OpenAI's limit)
# Seeds: any value a signed or an unsigned 64-bit integer holds; negative ones are taken
# modulo 2**64 (the generator's seed is 64 bits), so -1 and 2**64 - 1 are one seed.
SEED_RANGE = (-(1 << 63), 1 << 64)


def seed_bits(seed: int) -> int:
    """The generator's 64-bit seed for a request seed in ``SEED_RANGE``."""
    return seed % (1 << 64)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the ``k`` best tokens' (best first), from
    the row after penalties, before temperature."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    logprobs: int | None = None  # None: none; k: each token's and the k best tokens'
    # The prompt's tokens' logprobs too (the raw model's: no penalties), k best each; the
    # request then computes its whole prompt (no prefix-cache hits: see Engine).
    prompt_logprobs: int | None = None
    # No generation: the request ends after its prompt with the last token's final-normed
    # hidden state, L2-normalized, as its embedding (RequestOutput.embedding).
    embedding: bool = False
    # Structured output: the output must satisfy this grammar (kvpool.engine.structured).
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        low, high = SEED_RANGE
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (
                0 <= self.temperature <= MAX_TEMPERATURE,  # False for NaN
                f"temperature must be in [0, {MAX_TEMPERATURE:g}]",
            ),
            (0 <= self.top_k <= MAX_TOP_K, f"top_k must be in [0, {MAX_TOP_K}] (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (
                0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
            ),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (1 <= self.n <= 64, "n must be in [1, 64]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                len(self.stop) <= MAX_STOP_STRINGS,
                f"at most {MAX_STOP_STRINGS} stop strings (got {len(self.stop)})",
            ),
            (
                all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
                f"stop strings must be at most {MAX_STOP_LENGTH} characters",
            ),
            (
                self.seed is None or low <= self.seed < high,
                f"seed must be a 64-bit integer, in [{low}, {high - 1}]",
            ),
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
        return torch.Generator().manual_seed(seed_bits(self.seed))


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as ``logits.argmax(-1)`` gives it (the first index of the
    largest value; a NaN counts above every number): natively for float32 rows on the
    CPU where the runtime has loaded the native ops (torch's reduction takes ~5 ms over
    32 rows of a 128,256-token vocabulary, the native one 1-2 ms; tests compare the
    two). Never a build: a GPU's rows copied back for sampling take torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        from kvpool.model.native import loaded_native_ops

        ops = loaded_native_ops()
        if ops is not None and logits.shape[1] > 0:
            return ops.argmax_rows(logits).tolist()
    return logits.argmax(dim=-1).tolist()


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def sample(self, *args: Any) -> list[int]:
        """One token per row of ``logits`` ``[B, vocab]`` (``sample_logprobs``'
        arguments), on any device: greedy rows take their argmax there; penalties and
        random draws run on the CPU (the generators are CPU generators, so a seed gives
        the same tokens whatever the device)."""
        return self.sample_logprobs(*args)[0]

    def sample_logprobs(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        allowed: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``sample``, and for each row whose params ask for ``logprobs`` its token's
        ``TokenLogprobs`` (None for the others). ``allowed``: per row, None or the tokens
        its grammar allows (bool, one per vocabulary row); the others are set to -inf
        before the draw, after the logprobs (which are the model's, not the grammar's).
        Rows without a mask are not touched."""
        logits = logits.float()
        penalties = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
                        for p in params)  # fmt: skip
        masked = allowed is not None and any(a is not None for a in allowed)
        if logits.device.type != "cpu" and (
            penalties or masked or not all(p.greedy for p in params)
        ):
            logits = logits.cpu()
        if penalties or masked:
            logits = logits.clone()
        if penalties:
            _apply_penalties(logits, params, prompt_ids, output_ids)
        rows = {
            i: torch.log_softmax(logits[i], dim=-1)
            for i, p in enumerate(params)
            if p.logprobs is not None
        }
        if masked:
            assert allowed is not None
            for i, keep in enumerate(allowed):
                if keep is not None:
                    logits[i].masked_fill_(~keep[: logits.shape[1]], float("-inf"))
        tokens = self._draw(logits, params, generators)
        out: list[TokenLogprobs | None] = [None] * len(tokens)
        for i, row in rows.items():
            out[i] = token_logprobs(row, tokens[i], params[i].logprobs or 0)
        return tokens, out

    def logprobs_of(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        token: int,
    ) -> TokenLogprobs:
        """``token``'s logprobs in one row of logits, as ``sample_logprobs`` gives them
        (for a token the engine put in place of the drawn one)."""
        row = logits.float().cpu().clone()[None]
        _apply_penalties(row, [params], [prompt_ids], [output_ids])
        return token_logprobs(torch.log_softmax(row[0], dim=-1), token, params.logprobs or 0)

    def _draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """One token per row of logits already shaped by the penalties."""
        batch = logits.shape[0]
        out = [0] * batch
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:  # one argmax for all greedy rows (ties: the first index, as per row)
            rows = logits if len(greedy) == batch else logits[greedy]
            for i, token in zip(greedy, argmax_rows(rows), strict=True):
                out[i] = token
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return out
        chosen = [params[i] for i in sampled_rows]
        temps = torch.tensor([p.temperature for p in chosen])[:, None]
        rows = logits if len(sampled_rows) == batch else logits[sampled_rows]
        probs = torch.softmax(rows / temps, dim=-1)
        vocab = probs.shape[1]
        best = _best_candidates(probs, chosen)
        for j, i in enumerate(sampled_rows):
            p = chosen[j]
            if best[j] is None:  # no filter: the whole vocabulary
                weights, ids, draws = probs[j], None, vocab
            else:
                weights, ids, draws = best[j]
                weights = _filter_sorted(weights, p)
            # Exponential race: argmax(w / E), E = -log(U) ~ Exp(1), picks token t with
            # probability w_t / sum(w). Unlike inverting the CDF it is robust to tiny
            # changes in the logits (batch vs alone), and the draws a seeded request
            # makes depend on its own row only. (-log(rand) measured faster than exponential_.)
            # A row draws as many numbers as its candidates could be (not as many as it
            # has), so a near-tie at the edge of a widened row's set, which can differ
            # between batch and alone, does not shift the draws that follow.
            g = generators[i] or self.generator
            noise = torch.rand(draws, generator=g)[: weights.shape[0]]
            race = weights / noise.log_().neg_()
            pick = int(race.argmax())
            out[i] = pick if ids is None else int(ids[pick])
        return out


def token_logprobs(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s entry in a log-softmax row, with the row's ``k`` best."""
    best: tuple[tuple[int, float], ...] = ()
    if k:
        top = row.topk(k)
        best = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprobs(token, float(row[token]), best)


def _best_candidates(
    probs: torch.Tensor, params: Sequence[SamplingParams]
) -> list[tuple[torch.Tensor, torch.Tensor, int] | None]:
    """Each row's best tokens, probabilities sorted best first, their ids, and how many
    random numbers its draw takes: all that its filters may keep (None: no filter, the
    whole vocabulary). One ``topk`` gives every row its first candidates; a row whose
    nucleus or min-p floor may reach past them takes every token above a threshold
    instead (``_above_threshold``): exact, and a few passes over the row rather than a
    wider ``topk`` (a top-p 0.9 row of a flat distribution, much faster than a full sort)."""
    vocab = probs.shape[1]
    counts = [_candidates(p, vocab) for p in params]
    out: list[tuple[torch.Tensor, torch.Tensor, int] | None] = [None] * len(params)
    width = max(counts)
    if not width:
        return out
    values, ids = probs.topk(width, dim=-1)
    for j, (p, k) in enumerate(zip(params, counts, strict=True)):
        if not k:
            continue
        out[j] = (values[j, :k], ids[j, :k], k)
        if k < vocab and p.top_k == 0 and _needs_more(values[j, :k], p):
            out[j] = (*_above_threshold(probs[j], float(values[j, k - 1]), p), vocab)
    return out


def _above_threshold(
    row: torch.Tensor, below: float, p: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of ``row`` with probability at least a threshold, sorted best first,
    the threshold lowered (from ``below / 8``, 8x at a time) until they must hold all
    that top-p and min-p keep: every token min-p keeps once it is at most the floor, or
    a mass of at least ``top_p`` (no token outside a set of that mass, all better than
    it, can be in the nucleus)."""
    threshold = below / 8
    if p.min_p > 0:
        threshold = min(threshold, p.min_p * float(row.max()))
    while True:
        ids = (row >= threshold).nonzero().squeeze(1)
        weights = row[ids]
        done = p.min_p > 0 or float(weights.sum()) >= p.top_p
        if done or ids.numel() == row.numel() or threshold == 0:
            break
        threshold /= 8
    order = weights.argsort(descending=True, stable=True)
    return weights[order], ids[order]


# Rows with top-p or min-p (and no top-k) look at this many best tokens first; a nucleus
# or min-p floor that reaches further takes the tokens above a threshold (exact).
NUCLEUS_CANDIDATES = 256


def _candidates(p: SamplingParams, vocab: int) -> int:
    """How many best tokens a row's filters may keep (0: no filter, all of them)."""
    if 0 < p.top_k < vocab:
        return p.top_k
    if p.top_p < 1 or p.min_p > 0:
        return min(NUCLEUS_CANDIDATES, vocab)
    return 0


def _needs_more(weights: torch.Tensor, p: SamplingParams) -> bool:
    """Whether the best candidates may not hold every token top-p / min-p keep."""
    nucleus_open = p.top_p < 1 and float(weights.sum()) < p.top_p
    floor_open = p.min_p > 0 and float(weights[-1]) >= p.min_p * float(weights[0])
    return nucleus_open or floor_open


def _filter_sorted(weights: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Zero what top-k, top-p and min-p exclude from probabilities sorted best first
    (the best token is always kept)."""
    keep = torch.ones_like(weights, dtype=torch.bool)
    if 0 < p.top_k < weights.shape[0]:
        keep[p.top_k :] = False
    if p.top_p < 1:  # the mass of the better tokens, in the full distribution
        keep &= weights.cumsum(0) - weights < p.top_p
    if p.min_p > 0:
        keep &= weights >= p.min_p * weights[0]
    keep[0] = True
    return weights * keep


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
