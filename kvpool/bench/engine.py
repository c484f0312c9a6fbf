"""``kvpool bench engine``: named workloads through the engine, one table, one run.

Each request workload runs with prefix caching on, off, and under the ``static`` policy
(every request reserves prompt + max tokens up front, nothing shared: llama.cpp/Ollama
slots), all on the same model and the same KV memory budget. Requests are sent at once
(chat turns as soon as the previous turn of their conversation ends); times are
wall-clock on this machine.

- ``shared-prefix``: 64 requests, one ~600-token system prompt plus a distinct 20-token
  question each, 64 output tokens (EOS ignored);
- ``distinct``: 64 requests of 200 distinct prompt tokens, 128 output tokens;
- ``chat``: 16 conversations of 4 turns, each turn resending the whole history (a
  120-token system prompt per conversation, 30 new tokens a turn, 48 output tokens);
- ``prefix-length``: time to first token of one request whose first 32 / 128 / 512 /
  2,048 tokens are cached, against the same request computed from scratch;
- ``block-size``: ``shared-prefix`` and ``distinct`` with prefix caching at block sizes
  16, 64 and 256 on the same budget: throughput and the share of used slots wasted.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from kvpool.cache import Policy
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.model.loader import LoadedModel, load_model

ALL = ("shared-prefix", "distinct", "chat", "prefix-length", "block-size")


@dataclass(frozen=True)
class Workload:
    """Conversations: each is a list of turns (the tokens each turn adds); a turn's prompt
    is the conversation so far, answers included. One-turn conversations are plain
    requests."""

    name: str
    conversations: list[list[list[int]]]
    params: SamplingParams


def workloads(requests: int = 64, seed: int = 0) -> dict[str, Workload]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    system = ids(600)
    shared = [[system + ids(20)] for _ in range(requests)]
    distinct = [[ids(200)] for _ in range(requests)]
    chats = [[ids(120) + ids(30)] + [ids(30) for _ in range(3)] for _ in range(requests // 4)]

    def upto(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True)

    return {
        "shared-prefix": Workload("shared-prefix", shared, upto(64)),
        "distinct": Workload("distinct", distinct, upto(128)),
        "chat": Workload("chat", chats, upto(48)),
    }


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
    waste: float  # mean share of used slots holding no token (internal fragmentation)
    # per step: (seconds since start, requests running, blocks in use, blocks cached)
    series: list[tuple[float, int, int, int]] = field(default_factory=list, repr=False)


CONFIGS = (
    ("prefix on", "paged", True),
    ("prefix off", "paged", False),
    ("static", "static", False),
)


def _engine(loaded: LoadedModel, policy: str, prefix: bool, num_blocks: int, bs: int,
            kv_cache_dtype: str = "auto", **settings: object) -> Engine:  # fmt: skip
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=bs,
        enable_prefix_caching=prefix,
        policy=Policy(policy),
        seed=0,
        kv_cache_dtype=kv_cache_dtype,
        **settings,  # type: ignore[arg-type]
    )
    return Engine(loaded.model, config, tokenizer=loaded.tokenizer)


def run_one(loaded: LoadedModel, w: Workload, label: str, policy: str, prefix: bool,
            num_blocks: int, block_size: int, kv_cache_dtype: str = "auto",
            **settings: object) -> Row:  # fmt: skip
    engine = _engine(loaded, policy, prefix, num_blocks, block_size, kv_cache_dtype, **settings)
    start = time.perf_counter()
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}  # request id -> prompt, then its output so far
    prompt_tokens = output_tokens = cached = 0
    next_turn: dict[str, tuple[int, int]] = {}  # request id -> (conversation, turn)

    def send(conv: int, turn: int, history: list[int]) -> None:
        prompt = history + w.conversations[conv][turn]
        rid = engine.add_request(prompt, w.params)
        sent[rid] = time.perf_counter()
        tokens[rid] = prompt
        next_turn[rid] = (conv, turn + 1)

    for c in range(len(w.conversations)):
        send(c, 0, [])
    peak = max_running = steps = 0
    waste = 0.0
    series: list[tuple[float, int, int, int]] = []
    while engine.has_work():
        for out in engine.step():
            rid = out.request_id
            if out.token_ids and rid not in first:
                first[rid] = time.perf_counter() - sent[rid]
            tokens[rid] += out.token_ids
            if out.finished:
                prompt_tokens += out.prompt_tokens
                output_tokens += out.completion_tokens
                cached += out.cached_prompt_tokens
                conv, turn = next_turn.pop(rid)
                history = tokens.pop(rid)
                if turn < len(w.conversations[conv]):
                    send(conv, turn, history)
        snap = engine.snapshot()
        stats = snap.cache
        series.append(
            (time.perf_counter() - start, snap.running, stats.used_blocks, stats.cached_blocks)
        )
        peak = max(peak, stats.used_blocks)
        max_running = max(max_running, snap.running)
        if stats.used_blocks:
            waste += stats.waste_slots_internal / (stats.used_blocks * block_size)
            steps += 1
    wall = time.perf_counter() - start
    engine.close()
    ttft = sorted(first.values())
    return Row(
        w.name, label, wall, output_tokens / wall, prompt_tokens - cached, cached,
        statistics.median(ttft), ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        peak, max_running, engine.snapshot().preemptions, waste / max(steps, 1), series,
    )  # fmt: skip


def _table(rows: list[Row]) -> list[str]:
    lines = [
        f"{'workload':<14}{'config':<12}{'wall s':>8}{'out tok/s':>10}{'prompt computed':>16}"
        f"{'cached':>8}{'TTFT p50':>9}{'p99':>8}{'peak blk':>9}{'max run':>8}{'preempt':>8}"
        f"{'waste':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r.workload:<14}{r.config:<12}{r.wall_s:>8.1f}{r.output_tok_s:>10.1f}"
            f"{r.prompt_computed:>16}{r.prompt_cached:>8}{r.ttft_p50:>8.2f}s{r.ttft_p99:>7.2f}s"
            f"{r.peak_blocks:>9}{r.max_running:>8}{r.preemptions:>8}{100 * r.waste:>6.1f}%"
        )
    return lines


def prefix_length(
    loaded: LoadedModel,
    num_blocks: int,
    block_size: int,
    lengths: tuple[int, ...] = (32, 128, 512, 2048),
    repeats: int = 3,
) -> list[str]:
    """TTFT of a prompt of ``L`` + 16 tokens whose first ``L`` tokens are cached, against
    the same prompt computed from scratch (medians of ``repeats``)."""
    rng = random.Random(1)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    lines = [f"{'cached prefix':>14}{'uncached ms':>13}{'cached ms':>11}{'speedup':>9}"]

    def ttft(engine: Engine, prompt: list[int]) -> float:
        start = time.perf_counter()
        engine.generate([prompt], one)
        return 1000 * (time.perf_counter() - start)

    for length in lengths:
        cold, warm = [], []
        for _ in range(repeats):
            prefix = [rng.randrange(3, 49000) for _ in range(length)]
            prompt = prefix + [rng.randrange(3, 49000) for _ in range(16)]
            engine = _engine(loaded, "paged", True, num_blocks, block_size)
            cold.append(ttft(engine, prompt))  # nothing cached yet
            engine.generate([prefix + [7] * 16], one)  # another request with the prefix
            warm.append(ttft(engine, prompt))
        c, w = statistics.median(cold), statistics.median(warm)
        lines.append(f"{length:>14}{c:>13.1f}{w:>11.1f}{c / w:>8.2f}x")
        progress(f"prefix-length {length} done")
    return lines


def progress(message: str) -> None:
    print(f"bench engine: {message}", file=sys.stderr, flush=True)


def run(
    kv_cache_memory: int = 128 * 2**20,
    block_size: int = 16,
    requests: int = 64,
    names: tuple[str, ...] = ALL,
    block_sizes: tuple[int, ...] = (16, 64, 256),
    plot: str | None = None,
) -> str:
    loaded = load_model(None, progress=False)
    geometry = loaded.config.kv_geometry(loaded.model.dtype.itemsize)
    num_blocks = geometry.blocks_for_budget(kv_cache_memory, block_size)
    load = os.getloadavg()
    out = [
        f"{loaded.config.name}, {loaded.model.dtype}, KV {kv_cache_memory / 2**20:.0f} MiB = "
        f"{num_blocks} blocks of {block_size}; {requests} requests sent at once; "
        f"load average at start {load[0]:.2f}"
    ]
    chosen = workloads(requests)
    rows = []
    for name in ("shared-prefix", "distinct", "chat"):
        if name not in names:
            continue
        for label, policy, prefix in CONFIGS:
            progress(f"{name}, {label}...")
            rows.append(
                run_one(loaded, chosen[name], label, policy, prefix, num_blocks, block_size)
            )
    if rows:
        out += _table(rows)
        if plot:
            out.append(f"plot: {plot_occupancy(rows, plot, num_blocks)}")
    if "block-size" in names:
        sweep = []
        for name in ("shared-prefix", "distinct"):
            for bs in block_sizes:
                progress(f"{name}, block size {bs}...")
                blocks = geometry.blocks_for_budget(kv_cache_memory, bs)
                sweep.append(run_one(loaded, chosen[name], f"bs {bs}", "paged", True, blocks, bs))
        out += ["", "block sizes, prefix caching on, same KV budget:", *_table(sweep)]
    if "prefix-length" in names:
        big = geometry.blocks_for_budget(max(kv_cache_memory, 256 * 2**20), block_size)
        out += ["", "time to first token with a cached prefix (+16 new tokens):"]
        out += prefix_length(loaded, big, block_size)
    load = os.getloadavg()
    out.append(f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return "\n".join(out)


def plot_occupancy(rows: list[Row], path: str, num_blocks: int) -> str:
    """Requests running and blocks in use over time, one panel per workload, one line
    per configuration: where paged blocks and sharing let more requests run at once."""
    from kvpool.sim.report import _pyplot

    plt = _pyplot()
    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for col, name in enumerate(workloads):
        top, bottom = axes[0][col], axes[1][col]
        for r in (r for r in rows if r.workload == name):
            t = [p[0] for p in r.series]
            top.plot(t, [p[1] for p in r.series], label=r.config, linewidth=1)
            bottom.plot(t, [p[2] for p in r.series], label=r.config, linewidth=1)
        bottom.axhline(num_blocks, color="black", linewidth=0.8, label="pool")
        top.set_title(name)
        top.set_ylabel("requests running")
        bottom.set_ylabel("blocks in use")
        bottom.set_xlabel("seconds")
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
