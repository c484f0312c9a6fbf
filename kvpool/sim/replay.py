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

from kvpool.cache import KVCacheManager, OutOfBlocks, PinLimitExceeded
from kvpool.progress import Progress
from kvpool.sim.cost_model import StepCost
from kvpool.sim.workload import PREFIX, Request, Workload, segment_tokens


class Strategy(StrEnum):
    STATIC = "static"
    PAGED = "paged"
    PAGED_PREFIX = "paged+prefix"


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

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k != "series"}
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
    def __init__(self, workload: Workload, cfg: SimConfig, cost, progress: bool) -> None:
        self.w = workload
        self.cfg = cfg
        self.cost = cost
        self.show_progress = progress
        self.ctx = workload.context_length
        self.static = cfg.strategy is Strategy.STATIC
        num_blocks, self.bs = _blocks_for(cfg.strategy, cfg, self.ctx)
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget ({cfg.kv_bytes} bytes) holds no "
                + ("context slot" if self.static else "block")
                + f" for strategy {cfg.strategy}"
            )
        self.mgr = KVCacheManager(
            num_blocks,
            self.bs,
            enable_prefix_caching=cfg.strategy is Strategy.PAGED_PREFIX,
        )
        self.watermark_blocks = 0 if self.static else int(cfg.watermark * num_blocks)
        self.followers: dict[int, list[Request]] = {}
        for r in workload.requests:
            if r.follows >= 0:
                self.followers.setdefault(r.follows, []).append(r)

    # The loop is one long function on purpose: it is the hot path of the simulator.
    def run(self) -> SimResult:
        cfg, mgr, bs, ctx, static = self.cfg, self.mgr, self.bs, self.ctx, self.static
        bpt = cfg.kv_bytes_per_token
        wall0 = time.perf_counter()
        mgr_time = 0.0

        arrivals: list[tuple[float, int, Request]] = [
            (r.arrival, r.request_id, r) for r in self.w.requests if r.follows < 0
        ]
        heapq.heapify(arrivals)
        arrival_time: dict[int, float] = {}
        waiting: deque[tuple[Request, int]] = deque()  # (request, outputs generated so far)
        running: dict[int, _Running] = {}
        events: list[tuple[int, int, int]] = []  # (step, kind, seq); kind 0 need, 1 finish
        next_seq = 0
        pinned_groups: set[int] = set()

        t = 0.0
        step = 0
        live = 0  # sum of the running sequences' KV slots (logical tokens)
        internal = 0  # unfilled slots in the running sequences' last blocks (paged)
        completed = rejected = preemptions = output_tokens = 0
        computed_prompt = cached_prompt = 0
        queue_delays: list[float] = []
        ttfts: list[float] = []
        first_admit: set[int] = set()
        max_conc = 0
        acc_dt = acc_conc = acc_reserved = acc_stored = acc_internal = acc_over = 0.0
        acc_logical = 0.0
        peak_saved = peak_reserved = 0.0
        series = Series()
        sample_every = 0.0
        next_sample = 0.0

        def remove(run: _Running, slots: int) -> None:
            nonlocal live, internal, mgr_time
            live -= slots
            if not static:
                internal -= (-slots) % bs
            t0 = time.perf_counter()
            if mgr.enable_prefix_caching and slots > run.synced:
                mgr.append(run.seq, run.tokens[run.synced : slots])  # findable when resumed
            mgr.free(run.seq)
            mgr_time += time.perf_counter() - t0
            del running[run.seq]

        def reject(req: Request) -> None:
            nonlocal rejected
            rejected += 1
            for follower in self.followers.get(req.request_id, ()):
                reject(follower)

        total = len(self.w.requests)
        prog = Progress(f"simulate {cfg.strategy} bs={bs}", total) if self.show_progress else None
        while True:
            # 1. arrivals
            if not running and not waiting:
                if not arrivals:
                    break
                t = max(t, arrivals[0][0])
            while arrivals and arrivals[0][0] <= t:
                _, _, req = heapq.heappop(arrivals)
                arrival_time[req.request_id] = t if req.follows >= 0 else req.arrival
                waiting.append((req, 0))

            # 2. growth: sequences entering a new block this step
            grown: list[int] = []
            while events and events[0][0] == step and events[0][1] == 0:
                _, _, seq = heapq.heappop(events)
                run = running.get(seq)
                if run is None:
                    continue  # preempted earlier
                k = step - run.admit_step
                upto = run.prompt_len + k
                while True:
                    try:
                        t0 = time.perf_counter()
                        mgr.append(seq, run.tokens[run.synced : upto])
                        mgr_time += time.perf_counter() - t0
                        run.synced = upto
                        grown.append(seq)
                        if step + bs <= run.finish_step:
                            heapq.heappush(events, (step + bs, 0, seq))
                        break
                    except OutOfBlocks:
                        mgr_time += time.perf_counter() - t0
                        victim = running[max(running)]  # the most recently admitted
                        vk = step - victim.admit_step
                        remove(victim, victim.prompt_len + vk - 1)
                        preemptions += 1
                        if victim is run:
                            if not running:  # cannot grow even alone
                                reject(run.req)
                            else:
                                waiting.appendleft((run.req, run.gen0 + vk))
                            break
                        waiting.appendleft((victim.req, victim.gen0 + vk))
            # Any remaining "need" events of this step belong to preempted sequences.
            while events and events[0][0] == step and events[0][1] == 0:
                heapq.heappop(events)
            grew = sum(1 for seq in grown if seq in running)  # victims grew for nothing
            n_decode = len(running)
            context_tokens = live
            first_tokens: list[int] = []

            # 3. admission, first come first served
            prefill = 0
            while waiting and prefill < cfg.max_prefill_tokens:
                req, gen = waiting[0]
                out_len = min(req.output_len, ctx - req.prompt_len)
                if out_len < 1 or (
                    not static and mgr.blocks_needed(req.prompt_len + out_len - 1) > mgr.num_blocks
                ):
                    waiting.popleft()
                    reject(req)
                    continue
                tokens = req.prompt_tokens() + req.output_tokens()[:out_len]
                plen = req.prompt_len + gen
                t0 = time.perf_counter()
                if running and not static:
                    cached = (
                        mgr.count_cached_tokens(tokens[:plen]) if mgr.enable_prefix_caching else 0
                    )
                    if (
                        mgr.num_free_blocks - mgr.blocks_needed(plen - cached)
                        < self.watermark_blocks
                    ):
                        mgr_time += time.perf_counter() - t0
                        break
                try:
                    alloc = mgr.allocate(
                        next_seq, tokens[:plen], reserve_tokens=ctx if static else 0
                    )
                except OutOfBlocks:
                    mgr_time += time.perf_counter() - t0
                    if not running:
                        waiting.popleft()
                        reject(req)
                        continue
                    break
                mgr_time += time.perf_counter() - t0
                waiting.popleft()
                seq = next_seq
                next_seq += 1
                finish = step + (out_len - gen - 1)
                run = _Running(seq, req, tokens, plen, gen, step, finish, plen)
                running[seq] = run
                heapq.heappush(events, (finish, 1, seq))
                if not static:
                    first_need = (-(plen - 1)) % bs or bs
                    if step + first_need <= finish:
                        heapq.heappush(events, (step + first_need, 0, seq))
                    internal += (-plen) % bs
                live += plen
                prefill += plen - alloc.num_cached_tokens
                computed_prompt += plen - alloc.num_cached_tokens
                cached_prompt += alloc.num_cached_tokens
                if req.request_id not in first_admit:
                    first_admit.add(req.request_id)
                    queue_delays.append(t - arrival_time[req.request_id])
                    first_tokens.append(req.request_id)
                if cfg.pin_prefixes and mgr.enable_prefix_caching:
                    for kind, group, length in req.segments[:1]:
                        if kind == PREFIX and group not in pinned_groups:
                            pinned_groups.add(group)
                            with contextlib.suppress(PinLimitExceeded):
                                mgr.pin(segment_tokens(kind, group, length))

            if not running:
                continue  # all rejected: the next iteration takes the next arrival

            # 4. the step
            dt = self.cost.step_time(StepCost(n_decode, prefill, context_tokens))
            t += dt
            live += n_decode
            if not static:
                internal += bs * grew - n_decode
            max_conc = max(max_conc, len(running))
            reserved = mgr.pool.num_used * bs
            stored = live if static else reserved - internal
            acc_dt += dt
            acc_conc += len(running) * dt
            acc_reserved += reserved * dt
            acc_stored += stored * dt
            acc_logical += live * dt
            acc_internal += (0 if static else internal) * dt
            acc_over += (reserved - live if static else 0) * dt
            peak_saved = max(peak_saved, (live - stored) * bpt)
            peak_reserved = max(peak_reserved, reserved * bpt)
            ttfts.extend(t - arrival_time[rid] for rid in first_tokens)
            if t >= next_sample:
                series.t.append(t)
                series.running.append(len(running))
                series.waiting.append(len(waiting))
                series.reserved_bytes.append(reserved * bpt)
                series.stored_bytes.append(stored * bpt)
                series.logical_bytes.append(live * bpt)
                if len(series.t) >= cfg.max_series_points:
                    series.decimate()
                    sample_every = max(sample_every * 2, (t / len(series.t)) or 1e-3)
                next_sample = t + sample_every

            # 5. completions at the end of the step
            while events and events[0][0] == step and events[0][1] == 1:
                _, _, seq = heapq.heappop(events)
                run = running.get(seq)
                if run is None:
                    continue
                remove(run, run.prompt_len + (step - run.admit_step))
                completed += 1
                output_tokens += run.req.output_len
                if prog:
                    prog.advance()
                for follower in self.followers.get(run.req.request_id, ()):
                    heapq.heappush(arrivals, (t + follower.arrival, follower.request_id, follower))
            while events and events[0][0] == step:
                heapq.heappop(events)  # stale events of preempted sequences
            step += 1

        if prog:
            prog.__exit__()
        stats = mgr.stats()
        busy = acc_dt or 1.0
        return SimResult(
            strategy=str(cfg.strategy),
            block_size=bs,
            num_blocks=mgr.num_blocks,
            kv_bytes=cfg.kv_bytes,
            requests=total,
            completed=completed,
            rejected=rejected,
            preemptions=preemptions,
            max_concurrent=max_conc,
            mean_concurrent=acc_conc / busy,
            kv_utilization=acc_stored / acc_reserved if acc_reserved else 0.0,
            waste_internal=acc_internal / acc_reserved if acc_reserved else 0.0,
            waste_over_reservation=acc_over / acc_reserved if acc_reserved else 0.0,
            sharing_saved_fraction=(acc_logical - acc_stored) / acc_logical if acc_logical else 0.0,
            sharing_saved_bytes_mean=(acc_logical - acc_stored) * bpt / busy,
            sharing_saved_bytes_peak=peak_saved,
            peak_reserved_bytes=peak_reserved,
            prefix_hit_rate=stats.prefix_hit_rate,
            prompt_tokens_computed=computed_prompt,
            prompt_tokens_cached=cached_prompt,
            evictions=stats.evictions,
            queue_delay_mean=sum(queue_delays) / len(queue_delays) if queue_delays else 0.0,
            queue_delay_p50=_percentile(queue_delays, 0.5),
            queue_delay_p99=_percentile(queue_delays, 0.99),
            ttft_p50=_percentile(ttfts, 0.5),
            ttft_p99=_percentile(ttfts, 0.99),
            makespan=t,
            output_tokens_per_s=output_tokens / t if t else 0.0,
            steps=step,
            sim_wall_s=time.perf_counter() - wall0,
            manager_wall_s=mgr_time,
            series=series,
        )
