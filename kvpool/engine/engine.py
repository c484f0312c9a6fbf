"""``Engine``: the step loop joining the scheduler, the model runner and the sampler."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from kvpool.cache import KVCacheManager
from kvpool.engine.errors import (
    InvalidTokens,
    PromptExceedsPool,
    PromptTooLong,
    QueueFull,
    RequestError,
)
from kvpool.engine.request import Request, Status
from kvpool.engine.sampling import Sampler, SamplingParams, seed_bits
from kvpool.engine.scheduler import MAX_BATCH_TOKENS, Scheduler, Work
from kvpool.model.llama import LlamaModel
from kvpool.model.runner import ModelRunner, SeqChunk

log = logging.getLogger("kvpool.engine")


class Engine:
    """Continuous batching of requests on one model and one block pool.

    ``policy="static"`` is the llama.cpp/Ollama baseline: every request reserves its
    whole context (prompt + max tokens, at most the context length) up front and nothing
    is shared.

    One request never breaks the others: its token ids are checked against the
    vocabulary before it is queued, and an exception raised while a step computes is
    traced to the request(s) that cause it by running the step's work again in halves;
    those end with ``finish_reason == "error"`` (``request.error`` names a log id) and
    the rest of the batch continues with the outputs a clean step gives them.
    ``max_queue`` bounds the waiting requests (``QueueFull`` past it).
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        enable_prefix_caching: bool = True,
        policy: str = "paged",
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        max_queue: int | None = None,
    ) -> None:
        if policy not in ("paged", "static"):
            raise ValueError(f"unknown policy {policy!r} (paged, static)")
        self.policy = policy
        manager = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching and policy == "paged",
            geometry=model.config.kv_geometry(model.dtype.itemsize),
        )
        self.runner = ModelRunner(model, manager)
        self.scheduler = Scheduler(manager, max_batch_tokens=max_batch_tokens)
        self.sampler = Sampler(seed)
        self.stop_ids = frozenset(stop_ids)
        self.context_length = model.config.context_length
        self.vocab_size = model.vocab_rows
        self.max_queue = max_queue
        self.requests: dict[str, Request] = {}
        # Prefixes (pinned system prompts) that every tenant may share: a salted request
        # starting with one looks its blocks up without its salt.
        self.shared_prefixes: set[tuple[int, ...]] = set()
        self._ids = itertools.count()

    @property
    def manager(self) -> KVCacheManager:
        return self.runner.manager

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        salt: str | None = None,
    ) -> Request:
        """Queue a request. Raises a ``RequestError`` (nothing allocated): see
        ``check_request``; ``QueueFull`` past ``max_queue`` waiting requests."""
        prompt = list(prompt_ids)
        self.check_request(prompt, params)
        if self.max_queue is not None and len(self.scheduler.waiting) >= self.max_queue:
            raise self.queue_full(len(self.scheduler.waiting))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is in use")
        reserve = self._reserve(prompt, params)
        request = Request(request_id, prompt, params, salt, arrival=time.monotonic())
        request.forks_pending = params.n - 1
        request.siblings = [request]
        request.reserve_tokens = reserve
        if salt is not None:
            request.public_tokens = max(
                (len(p) for p in self.shared_prefixes if tuple(prompt[: len(p)]) == p), default=0
            )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise a ``RequestError`` for an empty prompt, a token id outside the
        vocabulary (``InvalidTokens``), a prompt that leaves no room in the context
        (``PromptTooLong``), or a request whose KV could not fit even in the empty pool
        (``PromptExceedsPool``). Reads only what never changes after construction, so
        any thread may call it (a server checks before handing the request over)."""
        if not prompt:
            raise RequestError("the prompt is empty")
        self.check_tokens(prompt)
        if len(prompt) >= self.context_length:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens; the model's context holds "
                f"{self.context_length} (prompt + output)"
            )
        reserve = self._reserve(prompt, params)
        blocks, size = self.manager.num_blocks, self.manager.block_size
        need = -(-max(len(prompt) + 1, reserve) // size)
        if need > blocks:
            raise PromptExceedsPool(
                f"the request needs {need} KV blocks ({max(len(prompt) + 1, reserve)} tokens "
                f"of {size}); the whole pool holds {blocks} blocks ({blocks * size} tokens)"
            )

    def queue_full(self, waiting: int) -> QueueFull:
        return QueueFull(
            f"the server is busy: {waiting} requests are waiting (the limit is "
            f"{self.max_queue}); retry shortly"
        )

    def _reserve(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Token slots taken at admission: the static policy's whole slot, else none."""
        if self.policy != "static":
            return 0
        return min(self.context_length, len(prompt) + params.max_tokens)

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Raise ``InvalidTokens`` unless every id is an int in ``[0, vocab_size)``."""
        vocab = self.vocab_size
        for i, token in enumerate(token_ids):
            if type(token) is not int or not 0 <= token < vocab:
                raise InvalidTokens(
                    f"token ids must be integers in [0, {vocab}); got {token!r} at position {i}"
                )

    def cancel(self, request_id: str) -> None:
        """Stop a request now; its blocks go back to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is not None and request.status is not Status.FINISHED:
            self.scheduler.finish(request, "cancelled")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a token or finished."""
        work, rejected = self.scheduler.schedule()
        for request in rejected:
            self.requests.pop(request.request_id, None)
        if self.scheduler.pending_copies:
            self.runner.copy_blocks(self.scheduler.pending_copies)
            self.scheduler.pending_copies = []
        if not work:
            return rejected
        logits, work, failed = self._forward_isolating(work)
        progressed = list(rejected) + failed
        if not work:
            return progressed
        self.scheduler.after_forward(work)
        rows: list[int] = []
        requests: list[Request] = []
        for i, w in enumerate(work):
            if w.sample:
                rows.append(i)
                requests.append(w.request)
                for child in self._fork_samples(w.request):
                    rows.append(i)  # the n samples draw from the same first logits
                    requests.append(child)
        if rows:
            # (every row once, in order, is the common case: no copy of [B, vocab])
            same = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
            tokens = self._sample_isolating(logits if same else logits[rows], requests)
            for request, token in zip(requests, tokens, strict=True):
                if token is None:  # its sampling raised: it alone ends
                    progressed.append(request)
                    continue
                request.tokens.append(token)
                reason = self._finish_reason(request, token)
                if reason:
                    self.scheduler.finish(request, reason)
                    self.requests.pop(request.request_id, None)
                progressed.append(request)
        return progressed

    # -- fault isolation ---------------------------------------------------------------
    def _forward_isolating(
        self, work: list[Work]
    ) -> tuple[torch.Tensor | None, list[Work], list[Request]]:
        """The step's forward: logits of the work that computed, that work, and the
        requests that failed (ended with ``error``). When the whole batch raises, each
        half runs alone, recursively, until the failing requests are found: a cost of
        about ``2 log2(B)`` extra forwards per failing request, on the failure path only.
        Re-running writes the same K/V to the same slots, and no block enters the prefix
        index before ``after_forward``, so a failed attempt leaves nothing behind."""
        parts: list[tuple[list[Work], torch.Tensor]] = []
        failed: list[Request] = []

        def run(items: list[Work]) -> None:
            chunks = [SeqChunk(w.request.seq_id, w.token_ids, w.start) for w in items]
            try:
                parts.append((items, self.runner.forward(chunks)))
                return
            except Exception as exc:
                if len(items) == 1:
                    failed.append(self._fail(items[0].request, exc))
                    return
            mid = len(items) // 2  # (outside the handler: no chained tracebacks)
            run(items[:mid])
            run(items[mid:])

        run(work)
        if not parts:
            return None, [], failed
        if len(parts) == 1:
            return parts[0][1], parts[0][0], failed
        return torch.cat([p[1] for p in parts]), [w for p in parts for w in p[0]], failed

    def _sample_isolating(self, logits: torch.Tensor, requests: list[Request]) -> list[int | None]:
        """One token per row; if the batched sampler raises, each row is drawn alone and
        the rows that still raise end their requests (None in their place)."""
        args = (
            [r.params for r in requests],
            [r.prompt_ids for r in requests],
            [r.output_ids for r in requests],
            [r.generator for r in requests],
        )
        try:
            return list(self.sampler.sample(logits, *args))
        except Exception:
            tokens: list[int | None] = []
            for i, request in enumerate(requests):
                try:
                    one = [a[i : i + 1] for a in args]
                    tokens.extend(self.sampler.sample(logits[i : i + 1], *one))
                except Exception as exc:
                    self._fail(request, exc)
                    tokens.append(None)
            return tokens

    def _fail(self, request: Request, exc: BaseException) -> Request:
        """End ``request`` with ``error``: its blocks are freed, the log has the cause."""
        error_id = uuid.uuid4().hex[:12]
        log.error("request %s failed (error id %s)", request.request_id, error_id, exc_info=exc)
        request.error = f"internal error (id {error_id})"
        if request.status is not Status.FINISHED:
            self.scheduler.finish(request, "error")
        self.requests.pop(request.request_id, None)
        return request

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Request]:
        """Run the prompts to completion, batched together; results in prompt order
        (with ``n > 1`` each result's ``siblings`` holds its n samples)."""
        many = params if isinstance(params, Sequence) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, many, strict=True)]
        while any(s.status is not Status.FINISHED for r in requests for s in r.siblings):
            self.step()
        return requests

    def _fork_samples(self, request: Request) -> list[Request]:
        """At a request's first token, its other ``n - 1`` samples start as forks of it:
        they share every block of the prompt (n samples cost one prompt's KV)."""
        children = []
        for j in range(1, request.forks_pending + 1):
            seed = None if request.params.seed is None else seed_bits(request.params.seed + j)
            child = Request(
                f"{request.request_id}#{j}",
                request.prompt_ids,
                replace(request.params, seed=seed),
                request.salt,
                arrival=request.arrival,
                tokens=list(request.tokens),
            )
            self.scheduler.fork(request, child)
            self.requests[child.request_id] = child
            request.siblings.append(child)
            children.append(child)
        request.forks_pending = 0
        return children

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if (token in self.stop_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if (
            len(request.output_ids) >= params.max_tokens
            or len(request.tokens) >= self.context_length
        ):
            return "length"
        return None
