"""A request's state as the engine moves it through the queue, the batch and the pool."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvpool.engine.sampling import SamplingParams, TokenLogprobs
from kvpool.engine.structured import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class PinOrder:
    """What a pin request pins when it ends: its prompt, under its salt (``shared``: no
    salt, for every tenant), within ``max_salt_blocks`` for that salt."""

    shared: bool = False
    max_salt_blocks: int | None = None


@dataclass(eq=False)
class Request:
    """One sequence (one sample of a request: the n samples share ``request_id`` and
    differ in ``index``). While running it holds blocks under ``seq_id`` in the block
    manager.

    ``tokens`` is the prompt followed by the output so far; ``num_computed`` counts the
    leading tokens whose KV is in the pool. A preempted request keeps ``tokens`` and
    restarts with ``num_computed = 0``: it is prefilled again (mostly from the cache).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    arrival: float = 0.0
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    seq_id: int = -1  # the block manager's id for the current admission
    admitted: int = -1  # admission order, for choosing preemption victims
    cached_prompt_tokens: int = 0  # prompt tokens served from the cache (first admission)
    preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None  # finish_reason "error": what to tell the client (a log id)
    generator: torch.Generator | None = None
    reserve_tokens: int = 0  # the static policy: token slots taken up front at admission
    public_tokens: int = 0  # leading prompt tokens of a prefix shared across tenants
    index: int = 0  # which of the request's n samples (0: the one added)
    parent: Request | None = None  # n > 1: the sample 0 this one was forked from
    forks_pending: int = 0  # n > 1: samples to fork from this one at its first token
    pin: PinOrder | None = None  # a pin request: what to pin once its prompt is computed
    pin_error: Exception | None = None  # pinning was refused (a CacheError)
    # one per output token when params.logprobs asks for them
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    embedding: list[float] | None = None  # params.embedding: set when the prompt is done
    grammar: GrammarState | None = None  # params.response_format: where the output is in it
    # params.prompt_logprobs: one per prompt token (None for the first), filled as computed
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        if self.generator is None:
            self.generator = self.params.make_generator()

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]
