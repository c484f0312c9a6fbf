"""``Engine``: the one door into continuous batching on one model and one block pool.

Requests go in through ``add_request`` (and ``pin_prefix``), leave through ``abort`` or
by finishing, and every step returns what it produced: ``step() -> list[RequestOutput]``,
text deltas and finish reasons made inside the step by one ``OutputProcessor``. The block
manager, the scheduler and the shared-prefix set are private to this module and
``scheduler.py``; ``snapshot()`` is how anything else reads them. ``LLM`` (synchronous)
and ``AsyncLLM`` (a thread and queues) are drivers of this API and nothing more.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import torch

from kvpool.cache import CacheError, CacheStats, KVCacheManager, PinInfo, Policy
from kvpool.cache.events import KVEvent
from kvpool.cache.tier import TierStats
from kvpool.engine.config import DEFAULTS, EngineConfig
from kvpool.engine.errors import (
    InvalidTokens,
    PromptExceedsPool,
    PromptTooLong,
    QueueFull,
    RequestError,
)
from kvpool.engine.kv_tier import apply_tier_events, open_tier
from kvpool.engine.outputs import CompletionOutput, Completions, OutputProcessor, RequestOutput
from kvpool.engine.pool_view import PoolWatch, describe_block
from kvpool.engine.request import PinOrder, Request, Status
from kvpool.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprobs,
    seed_bits,
    token_logprobs,
)
from kvpool.engine.scheduler import Scheduler, Work
from kvpool.engine.snapshot import EngineSnapshot, TenantSnapshot
from kvpool.engine.step_cost import StepCost
from kvpool.engine.structured import GrammarCompiler
from kvpool.model.device_memory import CPU_KV_CACHE_MEMORY, NoRoomForKV, gpu_memory
from kvpool.model.kv_store import kv_dtype_name, kv_element_bytes, kv_torch_dtype
from kvpool.model.llama import LlamaModel
from kvpool.model.runner import ModelRunner, SeqChunk
from kvpool.model.tokenizer import Tokenizer

log = logging.getLogger("kvpool.engine")


def _scores(work: Work) -> bool:
    """Whether this chunk's logits give prompt logprobs (it predicts a prompt token)."""
    return (
        work.request.prompt_logprobs is not None and work.start < len(work.request.prompt_ids) - 1
    )


SCORE_ROWS = 64  # rows log-softmaxed at once (a [rows, vocab] float32 buffer)


def _score_prompt(request: Request, start: int, logits: torch.Tensor) -> None:
    """The logprobs of the prompt tokens a chunk's logits predict: row ``j`` (position
    ``start + j``) gives token ``start + j + 1``'s, from the raw model (no penalties)."""
    prompt, out = request.prompt_ids, request.prompt_logprobs
    assert out is not None
    k = request.params.prompt_logprobs or 0
    last = min(len(logits), len(prompt) - 1 - start)  # rows that predict prompt tokens
    for lo in range(0, last, SCORE_ROWS):
        rows = torch.log_softmax(logits[lo : min(last, lo + SCORE_ROWS)].float(), dim=-1)
        for j, row in enumerate(rows):
            target = start + lo + j + 1
            out[target] = token_logprobs(row, prompt[target], k)


# A pin request computes its prefix and one token, whatever the model says.
PIN_PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


class Engine:
    """Continuous batching of requests on one model and one block pool.

    ``config`` (``EngineConfig``; keyword ``changes`` replace its fields) sizes the pool
    and the steps. ``tokenizer`` gives outputs their text, stop strings, and the stop
    tokens; without one, outputs carry token ids only.

    One request never breaks the others: its token ids are checked against the
    vocabulary before it is queued, and an exception raised while a step computes is
    traced to the request(s) that cause it by running the step's work again in halves;
    those end with ``finish_reason == "error"`` (``error`` names a log id) and the rest
    of the batch continues with the outputs a clean step gives them.

    Not thread-safe: one thread drives it (``check_request`` excepted).
    """

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        **changes: object,
    ) -> None:
        config = config or DEFAULTS
        if changes:
            config = config.replace(**changes)
        self.config = config
        kv_dtype = kv_torch_dtype(config.kv_cache_dtype, model.dtype)
        self.kv_cache_dtype = kv_dtype_name(kv_dtype)  # "auto" resolved
        geometry = model.config.kv_geometry(kv_element_bytes(kv_dtype, model.config.head_dim))
        # how the pool was sized, where it was measured (a GPU without a given size)
        self.kv_sizing: str | None = None
        num_blocks = config.num_blocks or geometry.blocks_for_budget(
            self._kv_budget(model, config), config.block_size
        )
        self.kv_bytes_per_block = geometry.bytes_per_block(config.block_size)
        self._tier = open_tier(config, model, self.kv_cache_dtype, self.kv_bytes_per_block)
        self._manager = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.prefix_caching,
            geometry=geometry,
            tier=self._tier,
        )
        self._runner = ModelRunner(model, num_blocks, config.block_size, kv_dtype=kv_dtype)
        self.step_cost = StepCost()  # learned from the steps, sizes prompt chunks
        self._scheduler = Scheduler(
            self._manager,
            max_batch_tokens=config.max_batch_tokens,
            max_running=config.max_running,
            watermark=config.watermark,
            step_cost=self.step_cost,
            # Off for a batch-invariant model whose attention is not the native one (no
            # native ops): chunks sized by what else runs would move where a prompt's
            # chunks end, and SDPA's rows change with that in the last bits.
            step_target=(
                0.0
                if model.products.fixed and not self._runner.varlen
                else config.step_target_ms / 1000
            ),
        )
        self._sampler = Sampler(config.seed)
        self._outputs = OutputProcessor(
            tokenizer.decode if tokenizer is not None else None, self._end_at_stop_string
        )
        self.stop_ids = frozenset(tokenizer.stop_ids if tokenizer is not None else ())
        self.context_length = model.config.context_length
        self.vocab_size = model.vocab_rows
        # response formats compiled against the tokenizer (on first use)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size) if tokenizer else None
        # samples of each request in flight, by request id (sample 0 first)
        self._requests: dict[str, list[Request]] = {}
        # Prefixes (pinned system prompts) that every tenant may share: a salted request
        # starting with one looks its blocks up without its salt.
        self._shared_prefixes: set[tuple[int, ...]] = set()
        # What snapshots say of pins, refreshed when a pin changes (not every step).
        self._pins: tuple[PinInfo, ...] = ()
        self._pins_by_salt: dict[str | None, tuple[int, int]] = {}  # pins, pinned blocks
        self._ids = itertools.count()
        self._steps = 0
        self._watch = PoolWatch()  # block map views in snapshots, while someone watches
        if self._tier is not None:  # the pins of the last run, pinned again (from the tier)
            for pin in self._tier.load_pins():
                try:
                    self.pin_prefix(
                        [int(t) for t in pin["tokens"]],  # type: ignore[union-attr]
                        salt=pin.get("salt"),  # type: ignore[arg-type]
                        shared=bool(pin.get("shared")),
                    )
                except (KeyError, TypeError, ValueError, RequestError) as exc:
                    log.warning("KV tier: a saved pin was not pinned again: %s", exc)

    def _kv_budget(self, model: LlamaModel, config: EngineConfig) -> int:
        """The pool's bytes: as given; else on the CPU ``CPU_KV_CACHE_MEMORY``, on a GPU
        what the model and its steps leave of ``gpu_memory_utilization`` of it
        (measured: two steps run first; ``NoRoomForKV`` where nothing is left)."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        if model.device.type != "cuda":
            return CPU_KV_CACHE_MEMORY
        memory = gpu_memory(model, config.block_size, config.max_batch_tokens, config.max_running)
        share = config.gpu_memory_utilization
        budget = memory.kv_budget(share)
        self.kv_sizing = memory.describe(share)
        if budget <= 0:
            raise NoRoomForKV(
                f"no room for a KV pool on the GPU: {self.kv_sizing}; give "
                "--kv-cache-memory, or a higher --gpu-memory-utilization"
            )
        return budget

    # -- what it is ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._manager.num_blocks

    @property
    def block_size(self) -> int:
        return self._manager.block_size

    @property
    def max_queue(self) -> int | None:
        return self.config.max_queue

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    def has_work(self) -> bool:
        """Requests are waiting or running: ``step`` has something to do."""
        return self._scheduler.has_work()

    def cache_stats(self) -> CacheStats:
        return self._manager.stats()

    def tier_stats(self) -> TierStats | None:
        """The second tier's counters (None without one); ``hit_blocks`` filled in."""
        if self._tier is None:
            return None
        stats = self._tier.stats()
        stats.hit_tokens = self._manager.tier_hit_tokens
        stats.hit_blocks = stats.hit_tokens // self.block_size
        return stats

    def enable_kv_events(self) -> None:
        """Record what the prefix cache gains and loses (``kvpool.cache.events``), for a
        router that keeps a copy of it (``take_kv_events`` hands them over)."""
        self._manager.enable_kv_events()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call, in order (empty unless enabled)."""
        return self._manager.take_kv_events()

    def cached_block_hashes(self) -> set[int]:
        """The chain hashes of every block a prefix lookup can find now."""
        return self._manager.cached_block_hashes()

    def close(self) -> None:
        """Hand every block the pool holds to the tier, finish its writes and close it
        (the engine takes no more steps)."""
        if self._tier is not None:
            self._manager.offer_all_to_tier()
            apply_tier_events(self._manager, self._tier, self._runner.kv)
            self._tier.close()
            self._tier = None
            self._manager.detach_tier()

    # -- requests in -------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id (``request_id`` or a new one). Raises a
        ``RequestError`` (nothing allocated): see ``check_request``; ``QueueFull`` past
        ``max_queue`` waiting requests."""
        return self._add(list(prompt_ids), params, request_id, salt, None).request_id

    def pin_prefix(
        self,
        prefix_ids: Sequence[int],
        *,
        salt: str | None = None,
        shared: bool = False,
        max_salt_blocks: int | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a pin request: the prefix (a system prompt) is computed once, if it is
        not cached, and its full blocks are pinned when it ends, in the same step, so
        eviction never takes them. Its last ``RequestOutput`` carries ``pinned_tokens``
        (or ``error`` where pinning was refused: ``pin_error`` has the ``CacheError``).
        ``shared``: pinned without a salt, and salted requests that start with it share
        its blocks. ``max_salt_blocks``: the blocks this salt's pins may hold together."""
        order = PinOrder(shared=shared, max_salt_blocks=max_salt_blocks)
        ids = list(prefix_ids)
        return self._add(ids, PIN_PARAMS, request_id, None if shared else salt, order).request_id

    def _add(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None,
        salt: str | None,
        pin: PinOrder | None,
    ) -> Request:
        self.check_request(prompt, params)
        waiting = len(self._scheduler.waiting)
        if self.config.max_queue is not None and waiting >= self.config.max_queue:
            raise self.queue_full(waiting)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is in use")
        request = Request(request_id, prompt, params, salt, arrival=time.monotonic(), pin=pin)
        request.forks_pending = params.n - 1
        request.reserve_tokens = self._reserve(prompt, params)
        if params.response_format is not None:
            assert self.grammars is not None  # (check_request)
            request.grammar = self.grammars.start(params.response_format)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt)
        if salt is not None:
            request.public_tokens = max(
                (len(p) for p in self._shared_prefixes if tuple(prompt[: len(p)]) == p),
                default=0,
            )
        self._requests[request_id] = [request]
        self._scheduler.add(request)
        return request

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise a ``RequestError`` for an empty prompt, a token id outside the
        vocabulary (``InvalidTokens``), a prompt that leaves no room in the context
        (``PromptTooLong``), or a request whose KV could not fit even in the empty pool
        (``PromptExceedsPool``); ``InvalidSamplingParams`` for a response format that
        does not compile or cannot complete within the request's tokens. Reads only what
        never changes after construction (and a thread-safe grammar cache), so any thread
        may call it (a server checks before handing the request over)."""
        if not prompt:
            raise RequestError("the prompt is empty")
        self.check_tokens(prompt)
        if len(prompt) >= self.context_length:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens; the model's context holds "
                f"{self.context_length} (prompt + output)"
            )
        if params.response_format is not None:
            if self.grammars is None:
                raise RequestError("structured output needs the model's tokenizer")
            budget = min(params.max_tokens, self.context_length - len(prompt))
            self.grammars.check(params.response_format, budget)
        reserve = self._reserve(prompt, params)
        blocks, size = self._manager.num_blocks, self._manager.block_size
        need = -(-max(len(prompt) + 1, reserve) // size)
        if need > blocks:
            raise PromptExceedsPool(
                f"the request needs {need} KV blocks ({max(len(prompt) + 1, reserve)} tokens "
                f"of {size}); the whole pool holds {blocks} blocks ({blocks * size} tokens)"
            )

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Raise ``InvalidTokens`` unless every id is an int in ``[0, vocab_size)``."""
        vocab = self.vocab_size
        for i, token in enumerate(token_ids):
            if type(token) is not int or not 0 <= token < vocab:
                raise InvalidTokens(
                    f"token ids must be integers in [0, {vocab}); got {token!r} at position {i}"
                )

    def queue_full(self, waiting: int) -> QueueFull:
        return QueueFull(
            f"the server is busy: {waiting} requests are waiting (the limit is "
            f"{self.config.max_queue}); retry shortly"
        )

    def _reserve(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Token slots taken at admission: the static policy's whole slot, else none."""
        if self.config.policy is not Policy.STATIC:
            return 0
        return min(self.context_length, len(prompt) + params.max_tokens)

    def abort(self, request_id: str) -> None:
        """End every sample of a request now (``cancelled``); their blocks go back to the
        pool at once. Unknown or finished ids are ignored."""
        for sample in self._requests.pop(request_id, ()):
            if sample.status is not Status.FINISHED:
                self._scheduler.finish(sample, "cancelled")
            self._outputs.forget(sample)

    # -- prefixes ------------------------------------------------------------------------
    def unpin_prefix(
        self, prefix_ids: Sequence[int], *, salt: str | None = None, shared: bool = False
    ) -> None:
        """Undo ``pin_prefix`` of the same tokens (the blocks stay cached, evictable);
        ``NotPinned`` if there is no such pin."""
        ids = list(prefix_ids)
        self._manager.unpin(ids, None if shared else salt)
        if shared:
            self._shared_prefixes.discard(tuple(ids))
        self._pins_changed()

    def reset_prefix_cache(self, *, unpin: bool = False, tier: bool = False) -> int:
        """Drop every cached block that no request holds and no pin keeps; returns how
        many were dropped. ``unpin``: drop every pin first. ``tier``: empty the second
        tier too (its blocks count in the return)."""
        dropped = self._manager.reset_prefix_cache(unpin=unpin)
        if tier and self._tier is not None:
            dropped += self._tier.clear()
        if unpin:
            self._shared_prefixes.clear()
            self._pins_changed()
        return dropped

    def _pins_changed(self) -> None:
        """Refresh what snapshots say of pins (only pin commands change them); a tier
        keeps them for the next start."""
        self._pins = tuple(self._manager.pins())
        if self._tier is not None:
            self._tier.save_pins(
                [
                    {
                        "tokens": list(pin.token_ids),
                        "salt": pin.salt.decode() or None,
                        "shared": pin.token_ids in self._shared_prefixes,
                    }
                    for pin in self._pins
                ]
            )
        self._pins_by_salt = {}
        for pin in self._pins:
            salt = pin.salt.decode() or None
            count, _ = self._pins_by_salt.get(salt, (0, 0))
            self._pins_by_salt[salt] = (count + 1, self._manager.pinned_blocks_of(salt))

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; an output for every sample that got a token or finished."""
        progressed = self._step()
        self._steps += 1
        now = time.monotonic()
        outputs = []
        for request in self._with_unforked(progressed):
            pinned = self._pin_on_finish(request) if request.pin is not None else None
            outputs.append(self._outputs.process(request, pinned, now))
            if request.status is Status.FINISHED:
                self._forget_if_done(request)
        return outputs

    def _step(self) -> list[Request]:
        work, rejected = self._scheduler.schedule()
        if self._tier is not None:
            apply_tier_events(self._manager, self._tier, self._runner.kv)
        if self._scheduler.pending_copies:
            self._runner.copy_blocks(self._scheduler.pending_copies)
            self._scheduler.pending_copies = []
        if not work:
            return rejected
        started = time.perf_counter()
        logits, states, work, failed, scored = self._forward_isolating(work)
        progressed = list(rejected) + failed
        if not work:
            return progressed
        self._scheduler.after_forward(work)
        for w, rows in scored:
            try:
                _score_prompt(w.request, w.start, rows)
            except Exception as exc:  # this request's scoring alone
                self._fail(w.request, exc)
                progressed.append(w.request)
        rows: list[int] = []
        requests: list[Request] = []
        for i, w in enumerate(work):
            if w.request.status is Status.FINISHED:  # (its prompt's scoring failed)
                continue
            if w.sample and w.request.params.embedding:  # its prompt is done: no token
                assert states is not None
                vector = torch.nn.functional.normalize(states[i].float(), dim=0)
                w.request.embedding = vector.tolist()
                self._scheduler.finish(w.request, "stop")
                progressed.append(w.request)
                continue
            if w.sample:
                rows.append(i)
                requests.append(w.request)
                for child in self._fork_samples(w.request):
                    rows.append(i)  # the n samples draw from the same first logits
                    requests.append(child)
        if rows:
            # (every row once, in order, is the common case: no copy of [B, vocab])
            same = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
            tokens, logprobs = self._sample_isolating(logits if same else logits[rows], requests)
            for request, token, lp in zip(requests, tokens, logprobs, strict=True):
                if token is not None:  # (None: its sampling raised, it alone ended)
                    request.tokens.append(token)
                    if lp is not None:
                        request.logprobs.append(lp)
                    reason = self._finish_reason(request, token)
                    grammar = request.grammar
                    if grammar is not None and (grammar.complete or (reason and grammar.accepting)):
                        reason = "stop"  # the document is whole (the closing saw to it)
                    if reason:
                        self._scheduler.finish(request, reason)
                progressed.append(request)
        if not failed:  # (a failed batch ran again in parts: its time says nothing)
            decode_rows = sum(1 for w in work if len(w.token_ids) == 1)
            chunks = [(w.start, len(w.token_ids)) for w in work if len(w.token_ids) > 1]
            self.step_cost.observe(decode_rows, chunks, time.perf_counter() - started)
        return progressed

    def _end_at_stop_string(self, request: Request) -> None:
        """The output processor found a stop string: the sample ends now, as ``stop``
        (its blocks freed, its length counted in the scheduler's expected output)."""
        self._scheduler.finish(request, "stop")

    def _forget_if_done(self, request: Request) -> None:
        samples = self._requests.get(request.request_id)
        if samples is not None and all(s.status is Status.FINISHED for s in samples):
            del self._requests[request.request_id]

    def _with_unforked(self, progressed: list[Request]) -> list[Request]:
        """``progressed``, and for a request with ``n > 1`` that ended before its first
        token (refused by the pool, failed), its other samples, ended the same way: a
        driver waits for an output of every sample."""
        extra = []
        for request in progressed:
            if request.status is Status.FINISHED and request.forks_pending:
                for j in range(1, request.forks_pending + 1):
                    child = self._new_sample(request, j)
                    child.status, child.finish_reason = Status.FINISHED, request.finish_reason
                    child.error = request.error
                    extra.append(child)
                request.forks_pending = 0
        return progressed + extra if extra else progressed

    def _pin_on_finish(self, request: Request) -> int | None:
        """A pin request that ended: pin its prompt's blocks now (no step has run since
        they were freed, so nothing can have evicted them). The count, or None where
        the request failed or pinning was refused (``request.pin_error``)."""
        if request.status is not Status.FINISHED or request.finish_reason == "error":
            return None
        order = request.pin
        assert order is not None
        try:
            pinned = self._manager.pin(
                request.prompt_ids, request.salt, max_salt_blocks=order.max_salt_blocks
            )
        except CacheError as exc:
            request.pin_error = exc
            request.error = str(exc)
            return None
        if order.shared and pinned:
            self._shared_prefixes.add(tuple(request.prompt_ids))
        self._pins_changed()
        return pinned

    # -- fault isolation ---------------------------------------------------------------
    def _forward_isolating(
        self, work: list[Work]
    ) -> tuple[
        torch.Tensor | None,
        torch.Tensor | None,
        list[Work],
        list[Request],
        list[tuple[Work, torch.Tensor]],
    ]:
        """The step's forward: logits of the work that computed (and its final hidden
        states where an embedding request is in it), that work, the requests that
        failed (ended with ``error``), and the logits of every token of the prompt chunks
        whose requests score their prompt. When the whole batch raises, each
        half runs alone, recursively, until the failing requests are found: a cost of
        about ``2 log2(B)`` extra forwards per failing request, on the failure path only.
        Re-running writes the same K/V to the same slots, and no block enters the prefix
        index before ``after_forward``, so a failed attempt leaves nothing behind."""
        parts: list[tuple[list[Work], torch.Tensor, torch.Tensor | None]] = []
        scored: list[tuple[Work, torch.Tensor]] = []
        failed: list[Request] = []
        hidden = any(w.request.params.embedding for w in work)

        def run(items: list[Work]) -> None:
            chunks = [self._chunk(w) for w in items]
            score = [i for i, w in enumerate(items) if _scores(w)]
            try:
                if score:
                    logits, states, rows = self._runner.forward_scored(
                        chunks, score, return_hidden=hidden
                    )
                    scored.extend(zip([items[i] for i in score], rows, strict=True))
                else:
                    out = self._runner.forward(chunks, return_hidden=hidden)
                    logits, states = out if hidden else (out, None)
                parts.append((items, logits, states))
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
            return None, None, [], failed, []
        items = [w for p in parts for w in p[0]]
        logits = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
        states = None
        if hidden:
            states = torch.cat([p[2] for p in parts])  # type: ignore[misc]
        return logits, states, items, failed, scored

    def _sample_isolating(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """One token per row (and its logprobs where asked), each within its grammar
        where it has one; if the batched sampler raises, each row is drawn alone, and a
        row whose drawing (or grammar) still raises ends its request alone (None in its
        place)."""
        args = (
            [r.params for r in requests],
            [r.prompt_ids for r in requests],
            [r.output_ids for r in requests],
            [r.generator for r in requests],
        )
        allowed: list[torch.Tensor | None] = [None] * len(requests)
        broken: set[int] = set()
        for i, request in enumerate(requests):
            if request.grammar is not None:
                try:
                    allowed[i] = request.grammar.allowed(self._budget(request))
                except Exception as exc:
                    self._fail(request, exc)
                    broken.add(i)
        tokens: list[int | None] = []
        logprobs: list[TokenLogprobs | None] = []
        if not broken:  # the common case: one batched draw
            try:
                sampled, lps = self._sampler.sample_logprobs(logits, *args, allowed)
                tokens, logprobs = list(sampled), list(lps)
            except Exception:
                pass
        if not tokens:  # a row's grammar failed, or the batched draw raised: row by row
            for i, request in enumerate(requests):
                if i in broken:
                    tokens.append(None)
                    logprobs.append(None)
                    continue
                try:
                    one = [a[i : i + 1] for a in (*args, allowed)]
                    token, lp = self._sampler.sample_logprobs(logits[i : i + 1], *one)
                    tokens.extend(token)
                    logprobs.extend(lp)
                except Exception as exc:
                    self._fail(request, exc)
                    tokens.append(None)
                    logprobs.append(None)
        for i, request in enumerate(requests):
            token = tokens[i]
            if request.grammar is None or token is None:
                continue
            try:
                taken = request.grammar.accept(token, self._budget(request))
            except Exception as exc:
                self._fail(request, exc)
                tokens[i] = logprobs[i] = None
                continue
            if taken != token:  # the closing's token in place of the drawn one
                tokens[i] = taken
                if logprobs[i] is not None:
                    logprobs[i] = self._sampler.logprobs_of(
                        logits[i], request.params, request.prompt_ids, request.output_ids, taken
                    )
        return tokens, logprobs

    def _budget(self, request: Request) -> int:
        """The tokens ``request`` may still produce (its next one included)."""
        left = request.params.max_tokens - len(request.output_ids)
        return max(1, min(left, self.context_length - len(request.tokens)))

    def _fail(self, request: Request, exc: BaseException) -> Request:
        """End ``request`` with ``error``: its blocks are freed, the log has the cause."""
        error_id = uuid.uuid4().hex[:12]
        log.error("request %s failed (error id %s)", request.request_id, error_id, exc_info=exc)
        request.error = f"internal error (id {error_id})"
        if request.status is not Status.FINISHED:
            self._scheduler.finish(request, "error")
        return request

    def _chunk(self, work: Work) -> SeqChunk:
        table = self._manager.block_table(work.request.seq_id)
        return SeqChunk(work.token_ids, work.start, table)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[CompletionOutput]:
        """Run the prompts to completion, batched together; the outputs in prompt order
        (with ``n > 1``, the n samples of each prompt in turn)."""
        many = params if isinstance(params, Sequence) else [params] * len(prompts)
        added = [
            (self.add_request(p, sp), sp.n, list(p)) for p, sp in zip(prompts, many, strict=True)
        ]
        results = Completions({rid: prompt for rid, _, prompt in added})
        while not all(results.finished(rid, n) for rid, n, _ in added):
            results.add(self.step())
        return [out for rid, n, _ in added for out in results.result(rid, n)]

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters now: the pool, the queues, each tenant, the pins."""
        scheduler, manager = self._scheduler, self._manager
        running: dict[str | None, int] = {}
        for request in scheduler.running:
            running[request.salt] = running.get(request.salt, 0) + 1
        waiting = scheduler.waiting.count_by_tenant()
        pins = self._pins_by_salt
        tenants = {}
        for salt in {*running, *waiting, *scheduler.tenants, *pins}:
            counters = scheduler.tenants.get(salt)
            tenants[salt] = TenantSnapshot(
                running=running.get(salt, 0),
                waiting=waiting.get(salt, 0),
                admitted=counters.admitted if counters else 0,
                prompt_tokens=counters.prompt_tokens if counters else 0,
                cached_prompt_tokens=counters.cached_prompt_tokens if counters else 0,
                pins=pins.get(salt, (0, 0))[0],
                pinned_blocks=pins.get(salt, (0, 0))[1],
            )
        return EngineSnapshot(
            cache=manager.stats(),
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            preemptions=scheduler.preemptions,
            steps=self._steps,
            max_pinned_blocks=manager.pool.max_pinned_blocks,
            expected_output=scheduler.expected_output,
            tenants=tenants,
            pins=self._pins,
            kv_cache_dtype=self.kv_cache_dtype,
            tier=self.tier_stats(),
            view=self._watch.refresh(manager, scheduler.running, scheduler.waiting),
        )

    def watch_pool(self) -> None:
        """Put the block map and the requests in snapshots for the next few seconds
        (``PoolWatch``). Safe from any thread."""
        self._watch.watch()

    def describe_block(self, block_id: int) -> dict[str, object]:
        """One block as it is now (``pool_view.describe_block``); between steps only."""
        return describe_block(self._manager, self._scheduler.running, block_id)

    def _new_sample(self, request: Request, index: int) -> Request:
        seed = request.params.seed
        sample = Request(
            request.request_id,
            request.prompt_ids,
            replace(request.params, seed=None if seed is None else seed_bits(seed + index)),
            request.salt,
            arrival=request.arrival,
            tokens=list(request.tokens),
            index=index,
            parent=request,
            grammar=request.grammar.copy() if request.grammar is not None else None,
        )
        self._requests.setdefault(request.request_id, [request]).append(sample)
        return sample

    def _fork_samples(self, request: Request) -> list[Request]:
        """At a request's first token, its other ``n - 1`` samples start as forks of it:
        they share every block of the prompt (n samples cost one prompt's KV)."""
        children = []
        for j in range(1, request.forks_pending + 1):
            child = self._new_sample(request, j)
            self._scheduler.fork(request, child)
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
