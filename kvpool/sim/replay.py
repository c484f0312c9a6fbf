"""Replay a workload in simulated time through ``kvpool.cache`` itself.

The simulator makes every memory decision with a real ``KVCacheManager``: admission
(``allocate`` must succeed), growth (``append`` when a sequence enters a new block),
eviction of cached blocks (inside the manager), preemption (``OutOfBlocks`` on growth
frees the most recently admitted sequence, which is resumed later by recomputation,
mostly from the cache when prefix caching is on) and completion (``free``).

Strategies:
- ``static``: llama.cpp / Ollama slots. Each request reserves the whole context up front
  (one block of ``context_length`` slots), nothing is shared; slots = budget / context.
- ``paged``: blocks of ``block_size`` on demand, no sharing.
- ``paged+prefix``: kvpool's manager with prefix sharing (optionally pinning the shared
  prefixes).

Speed: a sequence gains one token per step, so its next block boundary and its end are
known in advance. The loop keeps them in an event heap and touches a sequence only when
it needs a block or finishes; token-level figures (live tokens, internal fragmentation)
are kept as running sums. The block manager therefore sees exactly the block-level
traffic of a real server, at a cost independent of output length per step.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from kvpool.cache import KVCacheManager, OutOfBlocks, PinLimitExceeded, Policy
from kvpool.progress import Progress
from kvpool.sim.cost_model import StepCost
from kvpool.sim.frames import Frames
from kvpool.sim.workload import PREFIX, Request, Workload, segment_tokens


class Strategy(StrEnum):
    STATIC = "static"
    PAGED = "paged"
    PAGED_PREFIX = "paged+prefix"

    @property
    def policy(self) -> Policy:
        """The engine's policy this strategy replays (prefix caching is its other half)."""
        return Policy.STATIC if self is Strategy.STATIC else Policy.PAGED

    @property
    def prefix_caching(self) -> bool:
        return self is Strategy.PAGED_PREFIX


@dataclass(frozen=True)
class SimConfig:
    strategy: Strategy
    kv_bytes: int
    kv_bytes_per_token: int
    block_size: int = 64
    max_prefill_tokens: int = 8192  # prompt tokens computed per step (more than one prompt)
    watermark: float = 0.01  # share of blocks kept free at admission for growth
    pin_prefixes: bool = False
    max_series_points: int = 4000
    frames: int = 0  # frames for the live view's replay (kvpool simulate --html); 0: none


@dataclass
class Series:
    """Sampled over simulated time (at most ``max_series_points`` samples)."""

    t: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    reserved_bytes: list[float] = field(default_factory=list)
    stored_bytes: list[float] = field(default_factory=list)  # slots holding real tokens
    logical_bytes: list[float] = field(default_factory=list)  # what the sequences hold

    def decimate(self) -> None:
        for name in self.__dataclass_fields__:
            values = getattr(self, name)
            del values[1::2]


@dataclass
class SimResult:
    strategy: str
    block_size: int
    num_blocks: int
    kv_bytes: int
    requests: int
    completed: int
    rejected: int
    preemptions: int
    max_concurrent: int
    mean_concurrent: float
    kv_utilization: float
    waste_internal: float
    waste_over_reservation: float
    sharing_saved_fraction: float
    sharing_saved_bytes_mean: float
    sharing_saved_bytes_peak: float
    peak_reserved_bytes: float
    prefix_hit_rate: float
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    evictions: int
    queue_delay_mean: float
    queue_delay_p50: float
    queue_delay_p99: float
    ttft_p50: float
    ttft_p99: float
    makespan: float
    output_tokens_per_s: float
    steps: int
    sim_wall_s: float
    manager_wall_s: float
    series: Series = field(repr=False, default_factory=Series)
    frames: Frames | None = field(repr=False, default=None)

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("series", "frames")}
        return out


@dataclass(slots=True)
class _Running:
    seq: int
    req: Request
    tokens: list[int]  # prompt + every output token of the request
    prompt_len: int  # tokens prefilled at this admission (original prompt + resumed output)
    gen0: int  # outputs generated before this admission
    admit_step: int
    finish_step: int
    synced: int  # tokens recorded in the manager
    cached: int = 0  # prompt tokens found cached at this admission


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _blocks_for(strategy: Strategy, cfg: SimConfig, context_length: int) -> tuple[int, int]:
    """(num_blocks, block_size) of the pool for a strategy."""
    if strategy is Strategy.STATIC:
        slot_bytes = context_length * cfg.kv_bytes_per_token
        return cfg.kv_bytes // slot_bytes, context_length
    return cfg.kv_bytes // (cfg.block_size * cfg.kv_bytes_per_token), cfg.block_size


def simulate(workload: Workload, cfg: SimConfig, cost, *, progress: bool = False) -> SimResult:
    """Replay ``workload`` under ``cfg`` and the step-time model ``cost``."""
    return _Replay(workload, cfg, cost, progress).run()


class _Replay:
    """One replay. State lives in attributes; ``run`` is the step loop.

    Per step: arrivals join the queue; sequences entering a new block grow (preempting
    the most recently admitted on ``OutOfBlocks``); waiting requests are admitted first
    come first served; the step's time is charged; finished sequences are freed. Between
    events (a block boundary, a completion, an arrival that could be admitted) steps are
    pure decode and ``_quiet_steps`` runs them in a tight loop without the manager.
    """

    def __init__(self, workload: Workload, cfg: SimConfig, cost, progress: bool) -> None:
        self.w = workload
        self.cfg = cfg
        self.cost = cost
        self.ctx = workload.context_length
        self.static = cfg.strategy.policy is Policy.STATIC
        num_blocks, self.bs = _blocks_for(cfg.strategy, cfg, self.ctx)
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget ({cfg.kv_bytes} bytes) holds no "
                + ("context slot" if self.static else "block")
                + f" for strategy {cfg.strategy}"
            )
        self.mgr = KVCacheManager(
            num_blocks, self.bs, enable_prefix_caching=cfg.strategy.prefix_caching
        )
        self.prefix = self.mgr.enable_prefix_caching
        self.watermark_blocks = 0 if self.static else int(cfg.watermark * num_blocks)
        self.followers: dict[int, list[Request]] = {}
        for r in workload.requests:
            if r.follows >= 0:
                self.followers.setdefault(r.follows, []).append(r)
        self.progress = (
            Progress(f"simulate {cfg.strategy} block {self.bs}", len(workload.requests))
            if progress
            else None
        )

        self.arrivals: list[tuple[float, int, Request]] = [
            (r.arrival, r.request_id, r) for r in workload.requests if r.follows < 0
        ]
        heapq.heapify(self.arrivals)
        self.arrival_time: dict[int, float] = {}
        self.waiting: deque[tuple[Request, int]] = deque()  # (request, outputs so far)
        self.running: dict[int, _Running] = {}
        self.events: list[tuple[int, int, int]] = []  # (step, kind 0 grow / 1 finish, seq)
        # The head of the queue did not fit: admission is not retried until as many
        # blocks are available as it lacked (or the head changes).
        self.admission_blocked = False
        self.unblock_at_free = 0
        self.next_seq = 0
        self.pinned_groups: set[int] = set()
        self.t = 0.0
        self.step = 0
        self.live = 0  # the running sequences' KV slots (logical tokens)
        self.internal = 0  # unfilled slots in their last blocks (paged strategies)
        self.completed = self.rejected = self.preemptions = self.output_tokens = 0
        self.computed_prompt = self.cached_prompt = 0
        self.queue_delays: list[float] = []
        self.ttfts: list[float] = []
        self.first_admitted: set[int] = set()
        self.max_conc = 0
        self.acc = [0.0] * 7  # dt, running, reserved, stored, logical, internal, over
        self.peak_saved = self.peak_reserved = 0.0
        self.series = Series()
        self.sample_every = 0.0
        self.next_sample = 0.0
        self.mgr_time = 0.0
        self.frames = Frames(cfg.frames) if cfg.frames else None

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        while True:
            if not self.running and not self.waiting:
                if not self.arrivals:
                    break
                self.t = max(self.t, self.arrivals[0][0])
            self._arrive()
            grew = self._grow()
            n_decode, context = len(self.running), self.live
            first = self._admit() if self.waiting and not self.admission_blocked else (0, [])
            if not self.running:
                continue  # everything waiting was rejected
            prefill, first_ids = first
            self._tick(n_decode, prefill, context, grew)
            self.ttfts.extend(self.t - self.arrival_time[rid] for rid in first_ids)
            self._complete()
            self.step += 1
            self._quiet_steps()
        if self.progress:
            self.progress.__exit__()
        if self.frames is not None:
            self._frame()  # the end: everything finished
        return self._result(time.perf_counter() - wall0)

    def _arrive(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.t:
            at, _, req = heapq.heappop(self.arrivals)
            self.arrival_time[req.request_id] = at
            self.waiting.append((req, 0))

    def _grow(self) -> int:
        """Sequences whose next token starts a block take one; returns how many did."""
        mgr, events, running = self.mgr, self.events, self.running
        grown: list[int] = []
        while events and events[0][0] == self.step and events[0][1] == 0:
            seq = heapq.heappop(events)[2]
            run = running.get(seq)
            if run is None:
                continue  # preempted
            upto = run.prompt_len + self.step - run.admit_step
            while True:
                t0 = time.perf_counter()
                try:
                    mgr.append(seq, run.tokens[run.synced : upto])
                except OutOfBlocks:
                    self.mgr_time += time.perf_counter() - t0
                    victim = running[max(running)]  # the most recently admitted
                    self._preempt(victim)
                    if victim is run:
                        break
                    continue
                self.mgr_time += time.perf_counter() - t0
                run.synced = upto
                grown.append(seq)
                if self.step + self.bs <= run.finish_step:
                    heapq.heappush(events, (self.step + self.bs, 0, seq))
                break
        return sum(1 for seq in grown if seq in running)  # a victim grew for nothing

    def _preempt(self, victim: _Running) -> None:
        done = self.step - victim.admit_step  # steps run since admission
        self._remove(victim, victim.prompt_len + done - 1)
        self.preemptions += 1
        if not self.running:
            self._reject(victim.req)  # cannot grow even alone (pins hold the rest)
        else:
            self.waiting.appendleft((victim.req, victim.gen0 + done))
            self.admission_blocked = False

    def _remove(self, run: _Running, slots: int) -> None:
        self.live -= slots
        if not self.static:
            self.internal -= (-slots) % self.bs
        t0 = time.perf_counter()
        if self.prefix and slots > run.synced:
            self.mgr.append(run.seq, run.tokens[run.synced : slots])  # full blocks findable
        self.mgr.free(run.seq)
        self.mgr_time += time.perf_counter() - t0
        del self.running[run.seq]
        if self.mgr.num_free_blocks >= self.unblock_at_free:
            self.admission_blocked = False

    def _reject(self, req: Request) -> None:
        self.rejected += 1
        if self.progress:
            self.progress.advance()
        for follower in self.followers.get(req.request_id, ()):
            self._reject(follower)

    def _admit(self) -> tuple[int, list[int]]:
        """Admit waiting requests in order while memory and the prefill budget allow.
        Returns the prompt tokens to compute and the requests getting their first token."""
        mgr, bs, ctx, static = self.mgr, self.bs, self.ctx, self.static
        prefill = 0
        first_ids: list[int] = []
        while self.waiting and prefill < self.cfg.max_prefill_tokens:
            req, gen = self.waiting[0]
            out_len = min(req.output_len, ctx - req.prompt_len)
            if out_len < 1 or (
                not static and mgr.blocks_needed(req.prompt_len + out_len - 1) > mgr.num_blocks
            ):
                self.waiting.popleft()
                self._reject(req)
                continue
            plen = req.prompt_len + gen
            tokens = req.prompt_tokens() + req.output_tokens()[:out_len]
            keep_free = self.watermark_blocks if self.running else 0
            t0 = time.perf_counter()
            try:
                alloc = mgr.allocate(
                    self.next_seq,
                    tokens[:plen],
                    reserve_tokens=ctx if static else 0,
                    keep_free=keep_free,
                )
            except OutOfBlocks as short:
                self.mgr_time += time.perf_counter() - t0
                if not self.running:
                    self.waiting.popleft()
                    self._reject(req)
                    continue
                self.admission_blocked = True
                self.unblock_at_free = mgr.num_free_blocks + short.needed - short.free
                break
            self.mgr_time += time.perf_counter() - t0
            self.waiting.popleft()
            seq = self.next_seq
            self.next_seq += 1
            finish = self.step + (out_len - gen - 1)
            self.running[seq] = _Running(
                seq, req, tokens, plen, gen, self.step, finish, plen, alloc.num_cached_tokens
            )
            heapq.heappush(self.events, (finish, 1, seq))
            if not static:
                first_growth = (-(plen - 1)) % bs or bs
                if self.step + first_growth <= finish:
                    heapq.heappush(self.events, (self.step + first_growth, 0, seq))
                self.internal += (-plen) % bs
            self.live += plen
            computed = plen - alloc.num_cached_tokens
            prefill += computed
            self.computed_prompt += computed
            self.cached_prompt += alloc.num_cached_tokens
            if req.request_id not in self.first_admitted:
                self.first_admitted.add(req.request_id)
                self.queue_delays.append(self.t - self.arrival_time[req.request_id])
                first_ids.append(req.request_id)
            if self.cfg.pin_prefixes and self.prefix:
                self._pin_prefix_of(req)
        return prefill, first_ids

    def _pin_prefix_of(self, req: Request) -> None:
        for kind, group, length in req.segments[:1]:
            if kind == PREFIX and group not in self.pinned_groups:
                self.pinned_groups.add(group)
                with contextlib.suppress(PinLimitExceeded):
                    self.mgr.pin(segment_tokens(kind, group, length))

    def _tick(self, n_decode: int, prefill: int, context: int, grew: int) -> None:
        """Charge one step's time and account its memory figures."""
        dt = self.cost.step_time(StepCost(n_decode, prefill, context))
        self.t += dt
        self.live += n_decode
        if not self.static:
            self.internal += self.bs * grew - n_decode
        self._account(dt)

    def _account(self, dt: float) -> None:
        running = len(self.running)
        self.max_conc = max(self.max_conc, running)
        reserved = self.mgr.pool.num_used * self.bs
        live, internal = self.live, self.internal
        if self.static:
            stored, internal, over = live, 0, reserved - live
        else:
            stored, over = reserved - internal, 0
        acc = self.acc
        acc[0] += dt
        acc[1] += running * dt
        acc[2] += reserved * dt
        acc[3] += stored * dt
        acc[4] += live * dt
        acc[5] += internal * dt
        acc[6] += over * dt
        bpt = self.cfg.kv_bytes_per_token
        self.peak_saved = max(self.peak_saved, (live - stored) * bpt)
        self.peak_reserved = max(self.peak_reserved, reserved * bpt)
        self._sample(reserved)
        if self.frames is not None and self.frames.due(self.t):
            self._frame()

    def _frame(self) -> None:
        assert self.frames is not None
        running = []
        generated = self.output_tokens  # of the finished, plus what the running have so far
        for seq, run in self.running.items():
            out = run.gen0 + self.step - run.admit_step
            generated += out
            running.append({
                "seq": seq, "id": str(run.req.request_id), "sample": 0, "tenant": "",
                "status": "running", "prompt_tokens": run.prompt_len,
                "cached_prompt_tokens": run.cached, "output_tokens": out, "preemptions": 0,
            })  # fmt: skip
        self.frames.record(self.t, self.mgr, running, len(self.waiting), self.preemptions,
                           generated)  # fmt: skip

    def _sample(self, reserved: int) -> None:
        if self.t < self.next_sample:
            return
        bpt = self.cfg.kv_bytes_per_token
        live = self.live
        stored = live if self.static else reserved - self.internal
        s = self.series
        s.t.append(self.t)
        s.running.append(len(self.running))
        s.waiting.append(len(self.waiting))
        s.reserved_bytes.append(reserved * bpt)
        s.stored_bytes.append(stored * bpt)
        s.logical_bytes.append(live * bpt)
        if len(s.t) >= self.cfg.max_series_points:
            s.decimate()
            self.sample_every = max(self.sample_every * 2, self.t / len(s.t))
        self.next_sample = self.t + self.sample_every

    def _complete(self) -> None:
        events = self.events
        while events and events[0][0] == self.step:
            _, kind, seq = heapq.heappop(events)
            run = self.running.get(seq)
            if kind != 1 or run is None:
                continue  # a stale event of a preempted sequence
            self._remove(run, run.prompt_len + (self.step - run.admit_step))
            self.completed += 1
            self.output_tokens += run.req.output_len
            if self.progress:
                self.progress.advance()
            for follower in self.followers.get(run.req.request_id, ()):
                arrival = self.t + follower.arrival
                heapq.heappush(self.arrivals, (arrival, follower.request_id, follower))

    def _quiet_steps(self) -> None:
        """Run the pure decode steps up to the next event in one tight loop.

        Up to the next event nothing grows, finishes or can be admitted (nothing waits,
        or what waits is blocked on memory and no block is freed before the next event;
        when nothing waits the segment also ends at the next arrival). The number of
        decoding sequences ``n`` and the reserved slots stay fixed, and every token-level
        figure moves by ``n`` a step, so each time-weighted sum is ``a * S0 + b * S1``
        with ``S0 = sum(dt_i)`` and ``S1 = sum(dt_i * (i + 1))``.
        """
        if not self.running or (self.waiting and not self.admission_blocked):
            return
        horizon = self.events[0][0] if self.events else self.step
        t_limit = self.arrivals[0][0] if (self.arrivals and not self.waiting) else float("inf")
        n = len(self.running)
        step_time = self.cost.decode_step_time
        t, context, i, s0, s1 = self.t, self.live, 0, 0.0, 0.0
        k_max = horizon - self.step
        while i < k_max and t < t_limit:
            dt = step_time(n, context)
            t += dt
            i += 1
            s0 += dt
            s1 += dt * i
            context += n
        if i == 0:
            return
        live0, int0 = self.live, self.internal
        reserved = self.mgr.pool.num_used * self.bs
        acc = self.acc
        acc[0] += s0
        acc[1] += n * s0
        acc[2] += reserved * s0
        acc[4] += live0 * s0 + n * s1
        if self.static:
            acc[3] += live0 * s0 + n * s1
            acc[6] += (reserved - live0) * s0 - n * s1
        else:
            acc[3] += (reserved - int0) * s0 + n * s1
            acc[5] += int0 * s0 - n * s1
            self.internal = int0 - i * n
        self.t = t
        self.step += i
        self.live = live0 + i * n
        self.max_conc = max(self.max_conc, n)
        self._sample(reserved)

    # -- results ---------------------------------------------------------------------------
    def _result(self, wall: float) -> SimResult:
        stats = self.mgr.stats()
        dt, conc, reserved, stored, logical, internal, over = self.acc
        busy = dt or 1.0
        bpt = self.cfg.kv_bytes_per_token
        delays = self.queue_delays
        return SimResult(
            strategy=str(self.cfg.strategy),
            block_size=self.bs,
            num_blocks=self.mgr.num_blocks,
            kv_bytes=self.cfg.kv_bytes,
            requests=len(self.w.requests),
            completed=self.completed,
            rejected=self.rejected,
            preemptions=self.preemptions,
            max_concurrent=self.max_conc,
            mean_concurrent=conc / busy,
            kv_utilization=stored / reserved if reserved else 0.0,
            waste_internal=internal / reserved if reserved else 0.0,
            waste_over_reservation=over / reserved if reserved else 0.0,
            sharing_saved_fraction=(logical - stored) / logical if logical else 0.0,
            sharing_saved_bytes_mean=(logical - stored) * bpt / busy,
            sharing_saved_bytes_peak=self.peak_saved,
            peak_reserved_bytes=self.peak_reserved,
            prefix_hit_rate=stats.prefix_hit_rate,
            prompt_tokens_computed=self.computed_prompt,
            prompt_tokens_cached=self.cached_prompt,
            evictions=stats.evictions,
            queue_delay_mean=sum(delays) / len(delays) if delays else 0.0,
            queue_delay_p50=_percentile(delays, 0.5),
            queue_delay_p99=_percentile(delays, 0.99),
            ttft_p50=_percentile(self.ttfts, 0.5),
            ttft_p99=_percentile(self.ttfts, 0.99),
            makespan=self.t,
            output_tokens_per_s=self.output_tokens / self.t if self.t else 0.0,
            steps=self.step,
            sim_wall_s=wall,
            manager_wall_s=self.mgr_time,
            series=self.series,
            frames=self.frames,
        )
