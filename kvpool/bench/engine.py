"""``kvpool bench engine``: named workloads through the engine, one table, one run.

Each workload runs with prefix caching on, off, and under the ``static`` policy (every
request reserves prompt + max tokens up front, nothing shared: llama.cpp/Ollama slots),
all on the same model and the same KV memory budget. All requests are sent at once;
times are wall-clock on this machine.

- ``shared-prefix``: 64 requests, one ~600-token system prompt plus a distinct 20-token
  question each, 64 output tokens (EOS ignored);
- ``distinct``: 64 requests of 200 distinct prompt tokens, 128 output tokens.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass

from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.model.loader import LoadedModel, load_model


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    params: SamplingParams


def workloads(requests: int = 64, seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    system = ids(600)
    shared = [system + ids(20) for _ in range(requests)]
    distinct = [ids(200) for _ in range(requests)]
    return [
        Workload("shared-prefix", shared, SamplingParams(max_tokens=64, ignore_eos=True)),
        Workload("distinct", distinct, SamplingParams(max_tokens=128, ignore_eos=True)),
    ]


@dataclass
class Row:
    workload: str
    config: str
    wall_s: float
    output_tok_s: float
    prompt_computed: int
    prompt_cached: int
    ttft_p50: float
    ttft_p99: float
    peak_blocks: int
    max_running: int
    preemptions: int


CONFIGS = (
    ("prefix on", "paged", True),
    ("prefix off", "paged", False),
    ("static", "static", False),
)


def run_one(loaded: LoadedModel, w: Workload, label: str, policy: str, prefix: bool,
            num_blocks: int, block_size: int) -> Row:  # fmt: skip
    engine = Engine(
        loaded.model,
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=prefix,
        policy=policy,
        stop_ids=loaded.tokenizer.stop_ids,
        seed=0,
    )
    start = time.perf_counter()
    requests = [engine.add_request(p, w.params) for p in w.prompts]
    first: dict[str, float] = {}
    peak = max_running = 0
    while engine.has_work():
        for r in engine.step():
            if r.output_ids and r.request_id not in first:
                first[r.request_id] = time.perf_counter() - start
        peak = max(peak, engine.manager.stats().used_blocks)
        max_running = max(max_running, len(engine.scheduler.running))
    wall = time.perf_counter() - start
    ttft = sorted(first.values())
    cached = sum(r.cached_prompt_tokens for r in requests)
    return Row(
        w.name, label, wall, sum(len(r.output_ids) for r in requests) / wall,
        sum(len(r.prompt_ids) for r in requests) - cached, cached,
        statistics.median(ttft), ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        peak, max_running, engine.scheduler.preemptions,
    )  # fmt: skip


def run(kv_cache_memory: int = 128 * 2**20, block_size: int = 16, requests: int = 64) -> str:
    loaded = load_model(None, progress=False)
    geometry = loaded.config.kv_geometry(loaded.model.dtype.itemsize)
    num_blocks = geometry.blocks_for_budget(kv_cache_memory, block_size)
    rows = []
    for w in workloads(requests):
        for label, policy, prefix in CONFIGS:
            print(f"bench engine: {w.name}, {label}...", file=sys.stderr, flush=True)
            rows.append(run_one(loaded, w, label, policy, prefix, num_blocks, block_size))
    head = (
        f"{loaded.config.name}, {loaded.model.dtype}, KV {kv_cache_memory / 2**20:.0f} MiB = "
        f"{num_blocks} blocks of {block_size}; {requests} requests sent at once\n"
        f"{'workload':<14}{'config':<12}{'wall s':>8}{'out tok/s':>10}{'prompt computed':>16}"
        f"{'cached':>8}{'TTFT p50':>9}{'p99':>7}{'peak blk':>9}{'max run':>8}{'preempt':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.workload:<14}{r.config:<12}{r.wall_s:>8.1f}{r.output_tok_s:>10.1f}"
            f"{r.prompt_computed:>16}{r.prompt_cached:>8}{r.ttft_p50:>8.2f}s{r.ttft_p99:>6.2f}s"
            f"{r.peak_blocks:>9}{r.max_running:>8}{r.preemptions:>8}"
        )
    return "\n".join(lines)
