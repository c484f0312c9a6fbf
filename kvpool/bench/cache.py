"""``kvpool bench cache``: the block manager's own cost, in microseconds per operation.

For 2,048-token prompts at each block size: allocate at 0%, 50% and 100% prefix hit
(100% stops one block short: the last prompt token is always computed), append of one
token, free; and the manager's cost per generated token for a request with a half-cached
2,048-token prompt and 256 output tokens: (allocate + free) / 256 + one append.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

from kvpool.cache import KVCacheManager
from kvpool.progress import Progress

PROMPT_TOKENS = 2048
OUTPUT_TOKENS = 256
SEQS_PER_ROUND = 32
ROUNDS = 5


@dataclass
class CacheBenchRow:
    block_size: int
    alloc_miss_us: float
    alloc_half_us: float
    alloc_full_us: float
    append_us: float
    free_us: float

    @property
    def per_generated_token_us(self) -> float:
        return (self.alloc_half_us + self.free_us) / OUTPUT_TOKENS + self.append_us


def _prompts(kind: str, round_no: int) -> list[list[int]]:
    """Prompts whose first ``hit`` tokens equal the shared prefix and the rest are unique."""
    hit = {"miss": 0, "half": PROMPT_TOKENS // 2, "full": PROMPT_TOKENS}[kind]
    prompts = []
    for s in range(SEQS_PER_ROUND):
        base = 1_000_000 + (round_no * SEQS_PER_ROUND + s) * PROMPT_TOKENS
        prompts.append(list(range(hit)) + list(range(base, base + PROMPT_TOKENS - hit)))
    return prompts


def _time_us(fn, items) -> float:
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for item in items:
            fn(item)
        return (time.perf_counter_ns() - start) / 1000 / len(items)
    finally:
        gc.enable()


def bench_block_size(block_size: int, progress: Progress) -> CacheBenchRow:
    blocks_per_seq = -(-(PROMPT_TOKENS + OUTPUT_TOKENS) // block_size)
    manager = KVCacheManager(blocks_per_seq * (SEQS_PER_ROUND + 2), block_size)
    shared = list(range(PROMPT_TOKENS))
    manager.allocate("prefix", shared)  # makes the shared prefix cached and keeps it
    samples: dict[str, list[float]] = {k: [] for k in ("miss", "half", "full", "append", "free")}
    for round_no in range(ROUNDS):
        for kind in ("miss", "half", "full"):
            prompts = _prompts(kind, round_no)
            ids = [f"{kind}-{round_no}-{i}" for i in range(len(prompts))]
            pairs = list(zip(ids, prompts, strict=True))
            samples[kind].append(_time_us(lambda p: manager.allocate(p[0], p[1]), pairs))
            if kind == "miss":
                appends = [(seq, [7]) for _ in range(OUTPUT_TOKENS // 8) for seq in ids]
                samples["append"].append(_time_us(lambda a: manager.append(*a), appends))
            samples["free"].append(_time_us(manager.free, ids))
            progress.advance()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return CacheBenchRow(
        block_size, med["miss"], med["half"], med["full"], med["append"], med["free"]
    )


def run(block_sizes: tuple[int, ...] = (16, 64, 256)) -> list[CacheBenchRow]:
    with Progress("bench cache", total=len(block_sizes) * ROUNDS * 3) as progress:
        return [bench_block_size(bs, progress) for bs in block_sizes]


def events_cost(
    block_size: int = 16, batch: int = 32, steps: int = 256
) -> tuple[float, float, float]:
    """The manager's time per decode step at ``batch`` sequences (each appends a token
    and marks it computed; full blocks are cached, a small pool evicts), with KV events
    off and on (their batch taken every step, as a replica publishes): ``(us off, us on,
    events per step)``."""

    def one(enabled: bool) -> tuple[float, float]:
        prompt = 512
        # room for one round (prompt and its share of the steps): later rounds evict
        m = KVCacheManager(batch * (prompt + steps // 4) // block_size + batch * 2, block_size)
        if enabled:
            m.enable_kv_events()
        events = 0
        total = 0.0
        for round_no in range(4):  # each round new prompts: earlier blocks get evicted
            seqs = range(round_no * batch, (round_no + 1) * batch)
            for seq in seqs:
                m.allocate(seq, [seq] * prompt, computed=False)
                m.mark_computed(seq, prompt)
            m.take_kv_events()
            start = time.perf_counter()
            for step in range(steps // 4):
                for seq in seqs:
                    m.append(seq, [step])
                    m.mark_computed(seq, m.num_tokens(seq))
                events += len(m.take_kv_events())
            total += time.perf_counter() - start
            for seq in seqs:
                m.free(seq)
        return total / steps * 1e6, events / steps

    off, _ = one(False)
    on, per_step = one(True)
    return off, on, per_step


def format_table(rows: list[CacheBenchRow]) -> str:
    head = (
        f"block manager cost, {PROMPT_TOKENS}-token prompts, microseconds per operation "
        f"(median of {ROUNDS} rounds x {SEQS_PER_ROUND} sequences)\n"
        "block  alloc 0%hit  alloc 50%hit  alloc 100%hit  append 1 tok    free  "
        f"per gen. token*\n"
    )
    lines = [
        f"{r.block_size:>5}  {r.alloc_miss_us:>11.1f}  {r.alloc_half_us:>12.1f}  "
        f"{r.alloc_full_us:>13.1f}  {r.append_us:>12.2f}  {r.free_us:>6.1f}  "
        f"{r.per_generated_token_us:>15.2f}"
        for r in rows
    ]
    foot = (
        f"* (allocate at 50% hit + free) / {OUTPUT_TOKENS} output tokens + one append: "
        "the manager's share of each generated token"
    )
    return head + "\n".join(lines) + "\n" + foot
