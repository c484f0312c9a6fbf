"""``kvpool bench kv-dtype``: what the KV block dtype costs in quality and buys in capacity.

Quality, on the built-in model computing in float32 (so the KV dtype is the only
difference), each KV dtype against float32 KV:

- greedy agreement: 16 chat prompts x 64 new tokens; the share of tokens equal to the
  reference's up to its first difference (later tokens follow another text), and how
  many of the 16 are equal throughout;
- the largest logit difference, teacher-forced on the reference's prompts and outputs
  (every position of every prompt, so divergence does not enter it);
- the perplexity of a fixed text (about 600 tokens) computed over the KV written in
  that dtype.

Capacity: the engine's ``shared-prefix`` and ``distinct`` workloads on one small KV
budget (default 32 MiB) with the compute dtype's blocks and with int8 blocks: blocks in
the pool, requests running at once, preemptions, throughput.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from kvpool.bench import engine as engine_bench
from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.model.cpu import cpu_features
from kvpool.model.kv_store import kv_element_bytes, kv_torch_dtype
from kvpool.model.loader import LoadedModel, load_model
from kvpool.model.runner import ModelRunner, SeqChunk

QUALITY_DTYPES = ("fp32", "bf16", "fp16", "int8")

TOPICS = (
    "the water cycle", "how a bicycle gear works", "the history of the printing press",
    "why the sky is blue", "how vaccines train the immune system", "the rules of chess",
    "how a compiler works", "the causes of the seasons", "what a hash table is",
    "how bread rises", "the life of a star", "how to brew tea", "what inflation is",
    "how bees make honey", "the parts of a cell", "how a refrigerator keeps things cold",
)  # fmt: skip

TEXT = (
    "The history of computing is a story of memory as much as of arithmetic. Early "
    "machines stored their programs on punched cards and paper tape, and every "
    "instruction had to be read again each time it ran. The invention of magnetic core "
    "memory made it possible to keep programs and data close to the processor, and the "
    "stored-program computer became the design that nearly every later machine followed. "
    "As processors grew faster, memory could not keep up, and designers added caches: "
    "small, fast memories that hold the data a program used most recently, on the bet "
    "that it will be used again soon. The same idea appears at every scale. An operating "
    "system keeps recently read disk pages in memory; a web browser keeps recently "
    "fetched pages on disk; a database keeps its hottest rows in a buffer pool. Each of "
    "these caches must decide what to keep and what to throw away when it is full, and "
    "the simplest good rule is to evict what was used least recently. Language models "
    "served to many users face the same question with their attention keys and values. "
    "Every token of a conversation leaves behind a small record in every layer of the "
    "model, and keeping those records avoids computing them again when the conversation "
    "continues. A server that shares the records of a common system prompt between "
    "users, and keeps the records of finished conversations until memory is needed, can "
    "serve many more people from the same machine. The records can also be stored with "
    "fewer bits: eight bits per value instead of sixteen halves their size, at a small "
    "cost in accuracy that has to be measured rather than assumed. "
) * 2


def _runner(loaded: LoadedModel, kv: str, tokens: int) -> ModelRunner:
    blocks = -(-tokens // 16) + 1
    dtype = kv_torch_dtype(kv, loaded.model.dtype)
    return ModelRunner(loaded.model, blocks, 16, threads=None, kv_dtype=dtype)


def _logits(loaded: LoadedModel, kv: str, ids: list[int]) -> torch.Tensor:
    """Every position's logits of ``ids`` in one prefill over a store of dtype ``kv``."""
    runner = _runner(loaded, kv, len(ids))
    table = list(range(runner.kv.num_blocks))
    return runner.forward([SeqChunk(ids, 0, table)], all_logits=True)


def quality(prompts: int = 16, new_tokens: int = 64) -> list[str]:
    loaded = load_model(None, dtype="float32", progress=False)
    tok = loaded.tokenizer
    chats = [
        tok.encode_chat([{"role": "user", "content": f"Explain {t} in a few sentences."}])
        for t in TOPICS[:prompts]
    ]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    for kv in QUALITY_DTYPES:
        engine = Engine(loaded.model, num_blocks=2048, kv_cache_dtype=kv, seed=0)
        outputs[kv] = [o.token_ids for o in engine.generate(chats, greedy)]
        _progress(f"greedy outputs with {kv} KV done")
    text = tok.encode(TEXT)
    ref_logits = [
        _logits(loaded, "fp32", c + o) for c, o in zip(chats, outputs["fp32"], strict=True)
    ]
    lines = [
        f"{loaded.config.name}, float32 compute; each KV dtype against float32 KV: "
        f"{prompts} chat prompts x {new_tokens} greedy tokens; perplexity of a fixed "
        f"{len(text)}-token text",
        f"{'KV dtype':<10}{'bytes/token':>12}{'tokens agreeing':>17}{'equal outputs':>15}"
        f"{'max |logit diff|':>18}{'perplexity':>12}",
    ]
    for kv in QUALITY_DTYPES:
        agree = total = same = 0
        for ref, got in zip(outputs["fp32"], outputs[kv], strict=True):
            n = next(
                (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), len(ref)
            )
            agree += n
            total += len(ref)
            same += n == len(ref) == len(got)
        diff = 0.0
        if kv != "fp32":
            for c, o, ref in zip(chats, outputs["fp32"], ref_logits, strict=True):
                diff = max(diff, float((_logits(loaded, kv, c + o) - ref).abs().max()))
        logits = _logits(loaded, kv, text)[:-1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(text[1:]))
        bpt = loaded.config.kv_geometry(
            kv_element_bytes(kv_torch_dtype(kv, torch.float32), loaded.config.head_dim)
        ).bytes_per_token
        lines.append(
            f"{kv:<10}{bpt:>12,}{100 * agree / total:>16.1f}%{same:>10}/{len(chats):<4}"
            f"{diff:>18.4f}{math.exp(float(nll)):>12.3f}"
        )
        _progress(f"{kv} measured")
    return lines


def capacity(kv_cache_memory: int = 32 * 2**20, requests: int = 32) -> list[str]:
    loaded = load_model(None, progress=False)
    chosen = engine_bench.workloads(requests)
    rows, blocks = [], {}
    for kv in ("auto", "int8"):
        dtype = kv_torch_dtype(kv, loaded.model.dtype)
        geometry = loaded.config.kv_geometry(kv_element_bytes(dtype, loaded.config.head_dim))
        n = blocks[kv] = geometry.blocks_for_budget(kv_cache_memory, 16)
        for name in ("shared-prefix", "distinct"):
            _progress(f"{name} with {kv} KV ({n} blocks)...")
            label = f"{str(dtype).removeprefix('torch.')} KV"
            rows.append(engine_bench.run_one(loaded, chosen[name], label, "paged", True, n, 16, kv))
    return [
        f"{loaded.config.name}, {loaded.model.dtype} compute, KV budget "
        f"{kv_cache_memory / 2**20:.0f} MiB: {blocks['auto']} blocks of 16 in the compute "
        f"dtype, {blocks['int8']} in int8 ({blocks['int8'] / blocks['auto']:.2f}x); "
        f"{requests} requests sent at once, prefix caching on",
        *engine_bench._table(rows),
    ]


def run(kv_cache_memory: int = 32 * 2**20, requests: int = 32, skip_quality: bool = False) -> str:
    out = [f"{os.cpu_count()} CPUs: {cpu_features().summary()}"]
    if not skip_quality:
        out += [*quality(), ""]
    out += capacity(kv_cache_memory, requests)
    return "\n".join(out)


def _progress(message: str) -> None:
    print(f"bench kv-dtype: {message}", file=sys.stderr, flush=True)
