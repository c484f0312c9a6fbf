"""``kvpool bench grammar``: the grammar engines side by side, and what a constrained row
costs a batch.

1. llguidance and xgrammar (where installed: ``pip install kvpool[grammar-bench]``) on
   the built-in model's tokenizer, for a few JSON schemas: setting up the tokenizer,
   compiling a schema the first time, and the time to compute the next-token mask along
   the same 20 valid documents per schema (token sequences made once, replayed through
   both engines, so both see identical states).
2. The engine: 16 free requests alone, then the same 16 with 4 constrained ones beside
   them, on the built-in model: the free rows' tokens must be identical (they are not
   touched), and the table gives throughput and the grammar's time per constrained token.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from kvpool.engine.sampling import SamplingParams
from kvpool.engine.structured import GrammarCompiler, GrammarState, ResponseFormat
from kvpool.model.cpu import cpu_features

SCHEMAS: dict[str, Any] = {
    "json object": None,
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "tags", "address"],
    },
    "tool call": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f"tool_{i}"},
                    "arguments": {
                        "type": "object",
                        "properties": {
                            "query": {"type": "string"},
                            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                            "mode": {"enum": ["fast", "exact", "fuzzy"]},
                        },
                        "required": ["query", "mode"],
                    },
                },
                "required": ["name", "arguments"],
            }
            for i in range(8)
        ]
    },
}
DOCUMENTS = 20


def _fmt(schema: Any) -> ResponseFormat:
    return ResponseFormat.json_object() if schema is None else ResponseFormat.json_schema(schema)


def _documents(compiler: GrammarCompiler, fmt: ResponseFormat, stops: set[int]) -> list[list[int]]:
    """``DOCUMENTS`` valid token sequences: random logits drawn through the mask."""
    g = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(DOCUMENTS):
        state, out = compiler.start(fmt), []
        while len(out) < 120 and not state.complete:
            left = 120 - len(out)
            logits = torch.randn(compiler.vocab_rows, generator=g) * 4
            logits[~state.allowed(left)] = float("-inf")
            token = state.accept(int(logits.argmax()), left)
            if token in stops:
                break
            out.append(token)
        docs.append(out)
    return docs


def _percentiles(times: list[float]) -> str:
    times = sorted(times)
    p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
    return f"{p50 * 1e6:7.0f} {p99 * 1e6:7.0f}"


def engines(tokenizer: Any) -> list[str]:
    import llguidance
    import llguidance.torch as llg_torch

    vocab = tokenizer.vocab_size
    stops = sorted(tokenizer.stop_ids)
    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=stops)
    setup = {"llguidance": time.perf_counter() - t0}
    try:
        import xgrammar
    except ImportError:
        xgrammar = None
    if xgrammar is not None:
        t0 = time.perf_counter()
        encoded = [llt.decode_bytes([i]) for i in range(vocab)]
        info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=stops
        )
        xcompiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        setup["xgrammar"] = time.perf_counter() - t0
    compiler = GrammarCompiler(tokenizer, vocab)
    lines = [
        "grammar engines on the built-in model's tokenizer (vocabulary "
        f"{vocab}); mask times over {DOCUMENTS} documents per schema, same tokens for both",
        "  tokenizer setup: "
        + ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in setup.items()),
        f"  {'schema':12} {'engine':10} {'compile ms':>10} {'mask p50 us':>11} {'p99 us':>7}"
        f" {'tokens':>6}",
    ]
    if xgrammar is None:
        lines.append("  (xgrammar is not installed: pip install 'kvpool[grammar-bench]')")
    for name, schema in SCHEMAS.items():
        fmt = _fmt(schema)
        docs = _documents(compiler, fmt, set(stops))
        text = json.dumps(schema if schema is not None else {"type": "object"})
        tokens = sum(len(d) + 1 for d in docs)
        # llguidance: compile (a new matcher parses the grammar), then masks
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False}
        )
        llguidance.LLMatcher(llt, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        bitmask = llg_torch.allocate_token_bitmask(1, vocab)
        times = []
        for doc in docs:
            matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
            for token in doc:
                t0 = time.perf_counter()
                llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)
                times.append(time.perf_counter() - t0)
                matcher.consume_token(token)
        lines.append(
            f"  {name:12} {'llguidance':10} {compile_s * 1000:10.1f} {_percentiles(times)}"
            f" {tokens:6}"
        )
        if xgrammar is None:
            continue
        t0 = time.perf_counter()
        compiled = xcompiler.compile_json_schema(text, any_whitespace=False)
        compile_s = time.perf_counter() - t0
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        times = []
        for doc in docs:
            matcher = xgrammar.GrammarMatcher(compiled)
            for token in doc:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - t0)
                matcher.accept_token(token)
        lines.append(
            f"  {name:12} {'xgrammar':10} {compile_s * 1000:10.1f} {_percentiles(times)} {tokens:6}"
        )
    return lines


class _Timed:
    """Wraps ``GrammarState``'s per-token calls to add up the grammar's time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0

    def __enter__(self) -> _Timed:
        self._saved = (GrammarState.allowed, GrammarState.accept)
        allowed, accept = self._saved

        def timed_allowed(state: GrammarState, budget: int) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return allowed(state, budget)
            finally:
                self.seconds += time.perf_counter() - t0

        def timed_accept(state: GrammarState, token: int, budget: int) -> int:
            t0 = time.perf_counter()
            try:
                return accept(state, token, budget)
            finally:
                self.seconds += time.perf_counter() - t0
                self.tokens += 1

        GrammarState.allowed, GrammarState.accept = timed_allowed, timed_accept  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        GrammarState.allowed, GrammarState.accept = self._saved  # type: ignore[method-assign]


def batch(max_tokens: int = 64) -> list[str]:
    from kvpool.engine.llm import LLM

    llm = LLM()
    engine, tok = llm.engine, llm.tokenizer
    topics = ["rivers", "bread", "stars", "trains", "chess", "tea", "maps", "bees"]
    free_prompts = [
        tok.encode_chat([{"role": "user", "content": f"Write two sentences about {t}."}])
        for t in topics * 2
    ]
    ask = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    free = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(free_prompts[:2], free)  # warm up
    steps0 = engine.snapshot().steps
    t0 = time.perf_counter()
    alone = engine.generate(free_prompts, free)
    alone_s = time.perf_counter() - t0
    steps1 = engine.snapshot().steps
    fmt = ResponseFormat.json_schema(SCHEMAS["person"])
    llm.engine.grammars.check(fmt, 4 * max_tokens)  # compiled before the clock starts
    constrained = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=4 * max_tokens, response_format=fmt)
        for s in range(4)
    ]
    with _Timed() as timed:
        t0 = time.perf_counter()
        mixed = engine.generate([*free_prompts, *[ask] * 4], [free] * 16 + constrained)
        mixed_s = time.perf_counter() - t0
    steps2 = engine.snapshot().steps
    same = all(a.token_ids == b.token_ids for a, b in zip(alone, mixed[:16], strict=False))
    valid = 0
    for out in mixed[16:]:
        try:
            json.loads(tok.decode(out.token_ids))
            valid += 1
        except ValueError:
            pass
    free_tokens = sum(len(o.token_ids) for o in alone)
    extra = sum(len(o.token_ids) for o in mixed[16:])
    per_token = timed.seconds / max(1, timed.tokens)
    return [
        f"engine ({engine.kv_cache_dtype} KV, built-in model): 16 free requests x "
        f"{max_tokens} tokens, alone and with 4 constrained (person schema, max_tokens "
        f"{4 * max_tokens}) beside them",
        f"  free alone:        {alone_s:6.2f} s  {free_tokens / alone_s:6.1f} tok/s",
        f"  free + 4 grammar:  {mixed_s:6.2f} s  {(free_tokens + extra) / mixed_s:6.1f} tok/s"
        f"  (+{extra} constrained tokens)",
        f"  free rows' tokens identical in both runs: {same}; constrained outputs that parse:"
        f" {valid}/4",
        f"  grammar time per constrained token (mask + accept + closing): "
        f"{per_token * 1e6:.0f} us, {timed.seconds * 1000:.0f} ms in all "
        f"({100 * timed.seconds / mixed_s:.1f}% of the mixed run)",
        f"  mean step time: alone {1000 * alone_s / (steps1 - steps0):.0f} ms, mixed "
        f"{1000 * mixed_s / (steps2 - steps1):.0f} ms ({steps2 - steps1} steps, the "
        f"constrained rows running on after the free ones end)",
    ]


def run() -> str:
    from kvpool.formats.gguf_header import read_gguf_header
    from kvpool.model.tokenizer import Tokenizer
    from kvpool.model_store import default_model_path

    tokenizer = Tokenizer.from_gguf(read_gguf_header(default_model_path()))
    lines = [f"{os.cpu_count()} CPUs: {cpu_features().summary()}", *engines(tokenizer), ""]
    lines += batch()
    return "\n".join(lines)
