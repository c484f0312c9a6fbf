"""Continuous batching over the block pool: what runs in each step.

Every step takes one token from each decoding request (in admission order) and a chunk
of prompt from each prefilling one (the fewest tokens left first), then admits waiting
requests under a per-step token budget: first come first served within a tenant, the
tenants in turn (``FairQueue``).
Blocks are taken by real need: a request is admitted when the pool holds its uncached
prompt plus the growth that it and the running requests are expected to need (each
request's output is expected to reach its max tokens when nothing can stop it early,
otherwise the mean length of recently finished outputs; at least one more block), not a
fixed reservation per request. Admitting on the prompt alone filled the pool and the
next steps' growth preempted what was just admitted (``distinct`` workload: 26 running,
14 preemptions, 17% slower than static slots; with the expected growth kept free: 17
running, none, on par with static). When a running request needs a block and none is
free, the most recently admitted request is preempted: its computed blocks go to the
cache, and it waits at the head of the queue to be prefilled again (mostly cache hits).

While requests are streaming (running with output) or waiting, a step's prompt chunks
get what is left of ``step_target`` seconds beside the decode rows, each chunk as many
tokens as ``StepCost`` expects to fit from its context position (at least
``MIN_PROMPT_CHUNK`` prompt tokens a step): a long prompt is then computed over several
short steps instead of holding every stream's next token for the whole chunk. While
requests wait, the running prompts take at most half of that time (and the step's floor
goes to the admitted ones), the rest admitting waiting ones: a short prompt arriving
behind a long one starts at the next step. With nobody streaming or waiting, chunks
take ``IDLE_STEP_TARGETS`` step targets (within the token budget), so that a request
arriving meanwhile is not held long.

Invariant: a running request's block table holds ``len(request.tokens)`` tokens after
``schedule`` (its pending last token included); the scheduler is the block manager's
only caller besides ``Engine`` freeing finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.cache import KVCacheManager, OutOfBlocks
from kvpool.engine.fair_queue import FairQueue
from kvpool.engine.request import Request, Status
from kvpool.engine.step_cost import MIN_PROMPT_CHUNK, StepCost

# With nobody streaming or waiting, a step's prompt chunks stop near this many step
# targets: a request that arrives during a step waits for it to end, and a whole token
# budget of prompt (2048 tokens) took 14-39 s of a 1B-class model's step on 2 cores, and
# 512 tokens 32-36 s of an 8B-class one's.
IDLE_STEP_TARGETS = 4


@dataclass
class Work:
    """Tokens of one request computed in a step; ``sample`` when the chunk ends at the
    request's last token (its logits give the next token)."""

    request: Request
    start: int
    token_ids: list[int]

    @property
    def sample(self) -> bool:
        return self.start + len(self.token_ids) == len(self.request.tokens)


@dataclass
class TenantCounters:
    """What one tenant (cache salt) has had admitted, first admissions only."""

    admitted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        manager: KVCacheManager,
        *,
        max_batch_tokens: int,
        max_running: int,
        watermark: float,
        step_cost: StepCost | None = None,
        step_target: float = 0.0,
    ) -> None:
        """The settings are ``EngineConfig``'s (where their defaults live);
        ``step_target`` in seconds, 0: prompt chunks never capped for streams."""
        self.manager = manager
        self.max_batch_tokens = max_batch_tokens
        self.step_cost = step_cost if step_cost is not None else StepCost()
        self.step_target = step_target
        self.max_running = max_running
        self.watermark_blocks = int(watermark * manager.num_blocks)
        self.waiting = FairQueue()
        self.running: list[Request] = []
        self.preemptions = 0
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write, for the runner
        self._next_seq = 0
        self._admissions = 0
        self.expected_output = 0.0  # mean output length of finished requests (EMA), 0: none yet
        self.tenants: dict[str | None, TenantCounters] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> tuple[list[Work], list[Request]]:
        """The step's work, and requests rejected because they cannot fit even alone."""
        budget = self.max_batch_tokens
        prompts = self._prompt_time()  # what chunks longer than one may take
        # half of it kept for admissions while requests wait (None: no limit)
        keep = max(prompts.seconds, 0.0) / 2 if self.waiting and prompts.seconds else 0.0
        work: list[Work] = []
        deferred: list[Request] = []  # prompts given no time: the step's floor may take them
        # decode rows first, in admission order, then prompts, the least left first: a
        # short prompt admitted behind a long one is not held for all of the long one
        for request in sorted(self.running, key=_running_order):
            if request.status is not Status.RUNNING or budget <= 0:
                continue
            # while requests wait the step's floor waits for the admissions: it would
            # take their half of the time where 32 prompt tokens are slow
            n = self._chunk_size(request, budget, prompts, keep, floor=not keep)
            if n == 0:
                deferred.append(request)
                continue  # its prompt goes on next step
            budget -= self._add_work(work, request, n)
        rejected: list[Request] = []
        budget = self._admit(work, budget, prompts, rejected)
        for request in deferred:  # nothing admitted took the floor: a running prompt does
            if budget <= 0 or prompts.tokens >= MIN_PROMPT_CHUNK:
                break
            if request.status is not Status.RUNNING:
                continue
            n = self._chunk_size(request, budget, prompts)
            if n:
                budget -= self._add_work(work, request, n)
        return work, rejected

    def _chunk_size(
        self,
        request: Request,
        budget: int,
        prompts: _PromptTime,
        keep: float = 0.0,
        floor: bool = True,
    ) -> int:
        """Tokens of ``request``'s next chunk within ``budget``: a decode row's one, or
        what the step's prompt time gives a prompt (``keep``, ``floor``: as in
        ``_PromptTime.take``; 0: none this step)."""
        start = request.num_computed
        want = min(len(request.tokens) - start, budget)
        return want if want <= 1 else prompts.take(start, want, keep, floor)

    def _add_work(self, work: list[Work], request: Request, n: int) -> int:
        """Appends a running request's next ``n`` tokens to ``work`` once its blocks hold
        them; returns the tokens added (0: it was preempted to make room, itself being
        the latest)."""
        if not self._hold_all_tokens(request):
            return 0
        start = request.num_computed
        work.append(Work(request, start, request.tokens[start : start + n]))
        return n

    def _admit(
        self, work: list[Work], budget: int, prompts: _PromptTime, rejected: list[Request]
    ) -> int:
        """Admits waiting requests into the step (their first chunks into ``work``, the
        ones that cannot fit even alone into ``rejected``); returns the budget left."""
        growth = sum(self._growth_blocks(r) for r in self.running) if self.waiting else 0
        for request in self.waiting.in_turn(self.max_running):
            if budget <= 0 or prompts.spent or len(self.running) >= self.max_running:
                break
            if self.manager.enable_prefix_caching and self._prefix_in_flight(request):
                continue  # it keeps its place; others go ahead this step
            # Headroom: the blocks the running requests and this one are expected to
            # take as they grow; admitting into that space only buys preemptions.
            own = self._growth_blocks(request)
            keep_free = max(self.watermark_blocks, growth + own) if self.running else 0
            try:
                alloc = self.manager.allocate(
                    self._next_seq,
                    request.tokens,
                    request.salt,
                    computed=False,
                    reserve_tokens=request.reserve_tokens,
                    keep_free=keep_free,
                    public_tokens=request.public_tokens,
                    # a prompt scored token by token computes every position
                    lookup=request.prompt_logprobs is None,
                )
            except OutOfBlocks:
                if self.running:
                    break  # the request whose turn it is waits for blocks
                # Alone and still too big: it grew past the whole pool (a prompt that
                # cannot fit is refused by the engine before it is queued). Its output
                # ends here, as at a length limit.
                self.waiting.remove(request)
                request.status = Status.FINISHED
                request.finish_reason = "length" if request.output_ids else "too_long_for_pool"
                rejected.append(request)
                continue
            self.waiting.remove(request)
            self.waiting.served(request.salt)
            request.seq_id = self._next_seq
            self._next_seq += 1
            request.admitted = self._admissions
            self._admissions += 1
            request.status = Status.RUNNING
            request.num_computed = alloc.num_cached_tokens
            if request.preemptions == 0:
                request.cached_prompt_tokens = alloc.num_cached_tokens
                counters = self.tenants.setdefault(request.salt, TenantCounters())
                counters.admitted += 1
                counters.prompt_tokens += len(request.prompt_ids)
                counters.cached_prompt_tokens += alloc.num_cached_tokens
            self.running.append(request)
            growth += own
            n = max(1, self._chunk_size(request, budget, prompts))  # its first step: 1 at least
            start = request.num_computed
            chunk = request.tokens[start : start + n]
            work.append(Work(request, start, chunk))
            budget -= len(chunk)
        return budget

    def _prompt_time(self) -> _PromptTime:
        """The step's time for prompt chunks: while requests stream (running, with
        output) or wait behind running ones, ``step_target`` less the decode step;
        otherwise ``IDLE_STEP_TARGETS`` step targets (a request that arrives meanwhile
        waits for the step in progress) once a prompt step has been measured; no limit
        with ``step_target`` 0."""
        if self.step_target <= 0:
            return _PromptTime(self.step_cost, None)
        if self.running:
            streaming = any(len(r.tokens) > len(r.prompt_ids) for r in self.running)
            if streaming or self.waiting:
                decode = (self.step_cost.decode_step or 0.0) if streaming else 0.0
                return _PromptTime(self.step_cost, self.step_target - decode)
        if not self.step_cost.measured:  # (a first step of a few tokens would tell little)
            return _PromptTime(self.step_cost, None)
        return _PromptTime(self.step_cost, IDLE_STEP_TARGETS * self.step_target)

    def fork(self, parent: Request, child: Request) -> None:
        """Start ``child`` as a copy of running ``parent``, sharing all its blocks (the
        first write into the shared partial block copies it)."""
        child.seq_id = self._next_seq
        self._next_seq += 1
        self.manager.fork(parent.seq_id, child.seq_id)
        child.admitted = self._admissions
        self._admissions += 1
        child.status = Status.RUNNING
        child.num_computed = parent.num_computed
        child.cached_prompt_tokens = parent.cached_prompt_tokens
        self.running.append(child)

    def after_forward(self, work: list[Work]) -> None:
        """The step's KV is written: full blocks become findable by other requests."""
        for w in work:
            w.request.num_computed = w.start + len(w.token_ids)
            self.manager.mark_computed(w.request.seq_id, w.request.num_computed)

    def finish(self, request: Request, reason: str) -> None:
        """Free a running or waiting request's blocks and take it out of the queues."""
        if request.status is Status.RUNNING:
            self.manager.free(request.seq_id)
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        if reason in ("stop", "length"):
            n = len(request.output_ids)
            e = self.expected_output
            self.expected_output = float(n) if e == 0 else 0.9 * e + 0.1 * n

    # -- internals ---------------------------------------------------------------------
    def _growth_blocks(self, request: Request) -> int:
        """Blocks the request is expected to add before it ends: its output is expected
        to reach the mean length of recently finished requests (before any has finished:
        its max_tokens, at most 256; exactly max_tokens when nothing can stop it early),
        at least one more block, never past max_tokens."""
        if request.reserve_tokens:  # the static policy reserved it all at admission
            return 0
        bs = self.manager.block_size
        produced = len(request.tokens) - len(request.prompt_ids)
        left = request.params.max_tokens - produced
        params = request.params
        if params.ignore_eos and not params.stop and not params.stop_token_ids:
            expected = params.max_tokens  # nothing can end it early: its length is known
        else:
            expected = self.expected_output or min(params.max_tokens, 256)
        remaining = min(left, max(int(expected) - produced, bs))
        held = -(-len(request.tokens) // bs)
        return max(0, -(-(len(request.tokens) + remaining) // bs) - held)

    def _prefix_in_flight(self, request: Request) -> bool:
        """A running request is still computing full blocks this one would share: wait
        (others go ahead) and hit them once written, instead of computing them twice.
        This is what makes a system prompt sent by many clients at once cost one
        prefill. Only the first block is compared before the common prefix is measured."""
        bs = self.manager.block_size
        head = request.tokens[:bs]
        if len(request.tokens) <= bs:
            return False
        for other in self.running:
            if other.salt != request.salt or other.tokens[:bs] != head:
                continue
            shared = min(_common_prefix(other.tokens, request.tokens), len(request.tokens) - 1)
            shared = shared // bs * bs
            if other.num_computed < shared:
                return True
        return False

    def _hold_all_tokens(self, request: Request) -> bool:
        """Give the request's block table room for all its tokens, preempting the most
        recently admitted requests if the pool is short. False if it was preempted."""
        missing = request.tokens[self.manager.num_tokens(request.seq_id) :]
        if not missing:
            return True
        while True:
            try:
                copies = self.manager.append(request.seq_id, missing, computed=False)
                self.pending_copies.extend(copies)
                return True
            except OutOfBlocks:
                victim = max(self.running, key=lambda r: r.admitted)
                self._preempt(victim)
                if victim is request:
                    return False

    def _preempt(self, request: Request) -> None:
        self.manager.free(request.seq_id)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_computed = 0
        request.seq_id = -1
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)


class _PromptTime:
    """What one step may still spend on prompt chunks: ``seconds`` (None: no limit),
    and at least ``MIN_PROMPT_CHUNK`` tokens in all."""

    def __init__(self, cost: StepCost, seconds: float | None) -> None:
        self.cost, self.seconds, self.tokens = cost, seconds, 0

    @property
    def spent(self) -> bool:
        return self.seconds is not None and self.seconds <= 0 and self.tokens >= MIN_PROMPT_CHUNK

    def take(self, start: int, want: int, keep: float = 0.0, floor: bool = True) -> int:
        """Tokens (at most ``want``) of a chunk starting at context position ``start``,
        leaving ``keep`` seconds for later chunks; with ``floor``, at least what the
        step's floor still asks for."""
        if self.seconds is None:
            return want
        n = self.cost.tokens_within(self.seconds - keep, start, want)
        if floor:
            n = max(n, min(want, MIN_PROMPT_CHUNK - self.tokens))  # the step's floor
        self.seconds -= self.cost.prompt_seconds(n, start)
        if not self.cost.measured:
            self.seconds = 0.0  # nothing known: the floor alone
        self.tokens += n
        return n


def _running_order(request: Request) -> tuple[int, int, int]:
    """Decode rows (one token left to compute) in admission order, then prompts, the
    fewest tokens left first."""
    left = len(request.tokens) - request.num_computed
    return (0, 0, request.admitted) if left <= 1 else (1, left, request.admitted)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
