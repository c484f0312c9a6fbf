"""``Engine``: the step loop joining the scheduler, the model runner and the sampler."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvpool.cache import KVCacheManager
from kvpool.engine.errors import PromptExceedsPool, PromptTooLong, RequestError
from kvpool.engine.request import Request, Status
from kvpool.engine.sampling import Sampler, SamplingParams
from kvpool.engine.scheduler import MAX_BATCH_TOKENS, Scheduler
from kvpool.model.llama import LlamaModel
from kvpool.model.runner import ModelRunner, SeqChunk


class Engine:
    """Continuous batching of requests on one model and one block pool.

    ``policy="static"`` is the llama.cpp/Ollama baseline: every request reserves its
    whole context (prompt + max tokens, at most the context length) up front and nothing
    is shared.
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
        """Queue a request. Raises a ``RequestError`` (nothing allocated) for an empty
        prompt, one that leaves no room in the context (``PromptTooLong``), or one whose
        KV could not fit even in the empty pool (``PromptExceedsPool``)."""
        prompt = list(prompt_ids)
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) >= self.context_length:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens; the model's context holds "
                f"{self.context_length} (prompt + output)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is in use")
        reserve = 0
        if self.policy == "static":  # a slot for the whole request, as llama.cpp's
            reserve = min(self.context_length, len(prompt) + params.max_tokens)
        manager = self.manager
        need = manager.blocks_needed(max(len(prompt) + 1, reserve))
        if need > manager.num_blocks:
            raise PromptExceedsPool(
                f"the request needs {need} KV blocks ({max(len(prompt) + 1, reserve)} tokens "
                f"of {manager.block_size}); the whole pool holds {manager.num_blocks} blocks "
                f"({manager.num_blocks * manager.block_size} tokens)"
            )
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
        logits = self.runner.forward(
            [SeqChunk(w.request.seq_id, w.token_ids, w.start) for w in work]
        )
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
        progressed = list(rejected)
        if rows:
            # (every row once, in order, is the common case: no copy of [B, vocab])
            same = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
            tokens = self.sampler.sample(
                logits if same else logits[rows],
                [r.params for r in requests],
                [r.prompt_ids for r in requests],
                [r.output_ids for r in requests],
                [r.generator for r in requests],
            )
            for request, token in zip(requests, tokens, strict=True):
                request.tokens.append(token)
                reason = self._finish_reason(request, token)
                if reason:
                    self.scheduler.finish(request, reason)
                    self.requests.pop(request.request_id, None)
                progressed.append(request)
        return progressed

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
            seed = None if request.params.seed is None else request.params.seed + j
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
