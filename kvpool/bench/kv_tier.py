"""``kvpool bench kv-tier``: what the second KV tier gives back.

- Time to first token of a revisited 2,000-token document: computed from scratch, loaded
  from the disk tier (its files dropped from the page cache first, where the OS allows:
  a cold read), from the disk tier warm (in the page cache), from a host-memory tier,
  and found in the pool; medians of 3.
- The engine's ``shared-prefix`` and ``chat`` workloads, and the documents workload (16
  documents of 500 tokens, all asked twice), on a pool too small for their working set,
  with the disk tier off and on, in one run.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvpool.bench import engine as engine_bench
from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.model.cpu import cpu_features
from kvpool.model.loader import LoadedModel, load_model


def _drop_page_cache(root: Path) -> bool:
    """Ask the OS to drop the tier files' pages (clean pages: no privilege needed)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in root.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def ttft(loaded: LoadedModel, tokens: int = 2000, repeats: int = 3) -> list[str]:
    rng = random.Random(3)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    bs = 16
    blocks = -(-(tokens + 16) // bs) + 8  # the document and a little more
    times: dict[str, list[float]] = {}

    def timed(engine: Engine, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        out = engine.generate([prompt], one)[0]
        return 1000 * (time.perf_counter() - start), out.cached_prompt_tokens

    cold_ok = True
    for r in range(repeats):
        doc = [rng.randrange(3, 49000) for _ in range(tokens)]
        filler = [[rng.randrange(3, 49000) for _ in range(tokens)] for _ in range(2)]
        with tempfile.TemporaryDirectory() as tmp:
            disk = Engine(loaded.model, num_blocks=blocks, kv_offload_dir=tmp)
            ms, _ = timed(disk, doc)
            times.setdefault("computed", []).append(ms)
            ms, cached = timed(disk, doc)
            times.setdefault("from the pool", []).append(ms)
            for f in filler:  # push the document out of the pool, into the tier
                disk.generate([f], one)
            disk.close()  # (its writes finished)
            disk = Engine(loaded.model, num_blocks=blocks, kv_offload_dir=tmp)
            cold_ok &= _drop_page_cache(Path(tmp))
            ms, cached = timed(disk, doc)
            times.setdefault("from the disk tier, cold", []).append(ms)
            assert cached >= tokens - 2 * bs, cached
            for f in filler:
                disk.generate([f], one)
            ms, cached = timed(disk, doc)
            times.setdefault("from the disk tier, page cache", []).append(ms)
            disk.close()
        memory = Engine(loaded.model, num_blocks=blocks, kv_offload_memory=1 << 30)
        memory.generate([doc], one)
        for f in filler:
            memory.generate([f], one)
        ms, cached = timed(memory, doc)
        times.setdefault("from the memory tier", []).append(ms)
        _progress(f"time to first token, round {r + 1} of {repeats}")
    base = statistics.median(times["computed"])
    lines = [f"time to first token of a revisited {tokens}-token document (+1 new token):"]
    lines.append(f"{'':<34}{'ms':>9}{'speedup':>9}")
    for name, values in times.items():
        ms = statistics.median(values)
        lines.append(f"{name:<34}{ms:>9.1f}{base / ms:>8.1f}x")
    if not cold_ok:
        lines.append("(the OS could not drop the page cache: 'cold' reads came from memory)")
    return lines


def workloads(loaded: LoadedModel, kv_cache_memory: int, requests: int) -> list[str]:
    chosen = engine_bench.workloads(requests)
    rng = random.Random(5)
    docs = [[rng.randrange(3, 49000) for _ in range(500)] for _ in range(16)]
    chosen["documents"] = engine_bench.Workload(
        "documents", [[d] for d in docs] * 2, SamplingParams(max_tokens=16, ignore_eos=True)
    )
    geometry = loaded.config.kv_geometry(loaded.model.dtype.itemsize)
    blocks = geometry.blocks_for_budget(kv_cache_memory, 16)
    rows = []
    for name in ("shared-prefix", "chat", "documents"):
        for label in ("tier off", "disk tier"):
            _progress(f"{name}, {label}...")
            with tempfile.TemporaryDirectory() as tmp:
                extra = {"kv_offload_dir": tmp} if label == "disk tier" else {}
                w = chosen[name]
                if name == "documents":  # one after another: the second pass revisits
                    rows.append(_sequential(loaded, w, label, blocks, extra))
                else:
                    rows.append(
                        engine_bench.run_one(loaded, w, label, "paged", True, blocks, 16, **extra)
                    )
    return [
        f"workloads on a {kv_cache_memory / 2**20:.0f} MiB pool ({blocks} blocks of 16), "
        f"disk tier of 4 GiB on or off:",
        *engine_bench._table(rows),
    ]


def _sequential(loaded: LoadedModel, w: engine_bench.Workload, label: str, blocks: int,
                extra: dict[str, object]) -> engine_bench.Row:  # fmt: skip
    """The documents, one request at a time (as a user revisits them)."""
    engine = engine_bench._engine(loaded, "paged", True, blocks, 16, **extra)
    start = time.perf_counter()
    ttfts, prompt, cached, out_tokens = [], 0, 0, 0
    for conv in w.conversations:
        t = time.perf_counter()
        out = engine.generate([conv[0]], w.params)[0]
        ttfts.append(time.perf_counter() - t)
        prompt += out.prompt_tokens
        cached += out.cached_prompt_tokens
        out_tokens += len(out.token_ids)
    wall = time.perf_counter() - start
    snap = engine.snapshot()
    engine.close()
    ttfts.sort()
    return engine_bench.Row(
        w.name, label, wall, out_tokens / wall, prompt - cached, cached,
        statistics.median(ttfts), ttfts[int(0.99 * (len(ttfts) - 1))],
        snap.cache.used_blocks, 1, snap.preemptions, 0.0,
    )  # fmt: skip


def run(kv_cache_memory: int = 16 * 2**20, requests: int = 32) -> str:
    loaded = load_model(None, progress=False)
    out = [
        f"{os.cpu_count()} CPUs: {cpu_features().summary()}; {loaded.config.name}, "
        f"{loaded.model.dtype} compute, {loaded.model.dtype} KV blocks"
    ]
    out += ttft(loaded)
    out.append("")
    out += workloads(loaded, kv_cache_memory, requests)
    return "\n".join(out)


def _progress(message: str) -> None:
    print(f"bench kv-tier: {message}", file=sys.stderr, flush=True)
