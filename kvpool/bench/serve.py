"""``kvpool bench serve``: the engine's workloads replayed over HTTP by N concurrent
clients, against kvpool started for the run and/or any server given by URL (vLLM,
llama.cpp's server, Ollama: anything with OpenAI's streamed ``/v1/chat/completions``).

Workloads (text prompts, so every server tokenizes them itself; greedy, ``ignore_eos``
where the server accepts it):

- ``shared-prefix``: one ~600-token system prompt, a distinct question per request,
  64 output tokens;
- ``distinct``: ~200-token prompts sharing nothing, 128 output tokens;
- ``chat``: conversations of several turns, each turn resending the whole history
  (the answer so far included), 48 output tokens per turn; conversations run at once;
- ``system-prompts``: 8 distinct ~600-token system prompts, N questions each, interleaved,
  16 output tokens (the cluster benchmark's: a router must send each prompt's requests
  where it is cached);
- ``long-prompt``: ~60-token questions streaming 96 tokens each, and among the first of
  them one ~4,000-token document to summarize in 16 tokens: how long the streams wait
  while the document's prompt is computed (the gap columns).

Per workload and server: wall time, output tokens/s, time to first token and request
latency p50/p99, the longest wait between two pieces of one stream (median over the
requests, and the longest of all), prompt tokens and how many the server reported cached.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_WORD_TEXT = """
the of and to in is you that it he was for on are as with his they at be this have from
or one had by word but not what all were we when your can said there use an each which
she do how their if will up other about out many then them these so some her would make
like him into time has look two more write go see number no way could people my than
first water been call who oil its now find long down day did get come made may part over
new sound take only little work know place year live me back give most very after thing
our just name good sentence man think say great where help through much before line
right too mean old any same tell boy follow came want show also around form three small
set put end does another well large must big even such because turn here why ask went
men read need land different home us move try kind hand picture again change off play
spell air away animal house point page letter mother answer found study
"""
WORDS = _WORD_TEXT.split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@dataclass
class Conversation:
    """Requests sent one after another (a chat: each turn resends the history)."""

    turns: list[list[dict[str, str]]]  # the new messages of each turn
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: list[Conversation]


def workloads(requests: int = 64, seed: int = 0) -> dict[str, Workload]:
    rng = random.Random(seed)
    system = {"role": "system", "content": _text(rng, 480)}  # ~600 tokens in most tokenizers
    shared = [
        Conversation([[system, {"role": "user", "content": _text(rng, 16)}]], 64)
        for _ in range(requests)
    ]
    distinct = [
        Conversation([[{"role": "user", "content": _text(rng, 160)}]], 128) for _ in range(requests)
    ]
    short_system = {"role": "system", "content": _text(rng, 120)}
    chats = [
        Conversation(
            [[short_system, {"role": "user", "content": _text(rng, 30)}]]
            + [[{"role": "user", "content": _text(rng, 30)}] for _ in range(3)],
            48,
        )
        for _ in range(max(1, requests // 4))
    ]
    # 8 system prompts, `requests` questions each, interleaved: what a cluster's router
    # must keep apart (kvpool bench cluster)
    systems = [{"role": "system", "content": _text(rng, 480)} for _ in range(8)]
    prompts = [
        Conversation([[systems[i % 8], {"role": "user", "content": _text(rng, 12)}]], 16)
        for i in range(8 * requests)
    ]
    # The document goes second: the first clients' streams have started when it arrives.
    questions = [
        Conversation([[{"role": "user", "content": _text(rng, 48)}]], 96) for _ in range(requests)
    ]
    document = Conversation(
        [[{"role": "user", "content": "Summarize: " + _text(rng, 3200)}]], 16
    )  # ~4,000 tokens in most tokenizers
    return {
        "system-prompts": Workload("system-prompts", prompts),
        "long-prompt": Workload("long-prompt", [*questions[:1], document, *questions[1:]]),
        "shared-prefix": Workload("shared-prefix", shared),
        "distinct": Workload("distinct", distinct),
        "chat": Workload("chat", chats),
    }


@dataclass
class Result:
    ttft: float
    latency: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    gap: float = 0.0  # the longest wait between two pieces of the stream (seconds)


@dataclass
class Row:
    workload: str
    server: str
    requests: int
    wall_s: float
    results: list[Result] = field(default_factory=list)
    errors: int = 0

    def line(self) -> str:
        r = self.results
        out = sum(x.output_tokens for x in r)
        prompt = sum(x.prompt_tokens for x in r)
        cached = sum(x.cached_tokens for x in r)
        return (
            f"{self.workload:<14} {self.server:<18} {len(r):>5} {self.errors:>4} "
            f"{self.wall_s:>7.1f} {out / self.wall_s:>8.1f} "
            f"{_pct([x.ttft for x in r], 50):>7.2f} {_pct([x.ttft for x in r], 99):>7.2f} "
            f"{_pct([x.latency for x in r], 50):>7.2f} {_pct([x.latency for x in r], 99):>7.2f} "
            f"{_pct([x.gap for x in r], 50):>7.2f} {max((x.gap for x in r), default=0):>7.2f} "
            f"{prompt:>8} {100 * cached / max(prompt, 1):>6.1f}%"
        )


HEADER = (
    f"{'workload':<14} {'server':<18} {'reqs':>5} {'errs':>4} {'wall s':>7} {'out t/s':>8} "
    f"{'ttft50':>7} {'ttft99':>7} {'lat50':>7} {'lat99':>7} {'gap50':>7} {'gapmax':>7} "
    f"{'prompt':>8} {'cached':>7}"
)


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, messages: list, max_tokens: int
) -> tuple[Result, str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first = last = None
    gap = 0.0
    text, chunks, usage = "", 0, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    gap = max(gap, now - (last or now))
                    last = now
                    text += piece
                    chunks += 1
    end = time.perf_counter()
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    result = Result(
        ttft=(first or end) - start,
        latency=end - start,
        output_tokens=usage.get("completion_tokens", chunks),
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
        gap=gap,
    )
    return result, text


async def run_workload(
    url: str, model: str, workload: Workload, clients: int, server: str, api_key: str | None
) -> Row:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    gate = asyncio.Semaphore(clients)
    row = Row(workload.name, server, sum(len(c.turns) for c in workload.conversations), 0.0)
    done = 0

    async def converse(client: httpx.AsyncClient, conv: Conversation) -> None:
        nonlocal done
        history: list[dict[str, str]] = []
        for turn in conv.turns:
            history += turn
            async with gate:
                try:
                    result, text = await _one(client, url, model, history, conv.max_tokens)
                except (httpx.HTTPError, RuntimeError) as exc:
                    row.errors += 1
                    print(f"  {server} {workload.name}: {exc}", file=sys.stderr)
                    return
            row.results.append(result)
            history.append({"role": "assistant", "content": text})
            done += 1
            print(f"\r  {server} {workload.name}: {done}/{row.requests}", end="", file=sys.stderr)

    timeout = httpx.Timeout(600, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        start = time.perf_counter()
        await asyncio.gather(*(converse(client, c) for c in workload.conversations))
        row.wall_s = time.perf_counter() - start
    print(file=sys.stderr)
    return row


def _model_of(url: str, api_key: str | None) -> str:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
    return models[0]["id"]


LOCAL_CONFIGS = {
    "kvpool": [],
    "kvpool-noprefix": ["--no-prefix-caching"],
    "kvpool-static": ["--policy", "static"],
    "kvpool-whole-chunks": ["--step-target-ms", "0"],  # prompt chunks never capped
}


def run(
    *,
    urls: list[str],
    local: list[str],
    names: list[str],
    requests: int,
    clients: int,
    kv_cache_memory: int,
    model: str | None,
    api_key: str | None,
) -> str:
    chosen = workloads(requests)
    chosen = {n: w for n, w in chosen.items() if n in names}
    rows: list[Row] = []
    targets: list[tuple[str, Any]] = [(label, None) for label in local]
    for spec in urls:
        label, _, url = spec.rpartition("=")
        targets.append((label or url, url.rstrip("/")))
    for label, url in targets:
        server = None
        if url is None:
            from kvpool.bench.local_server import LocalServer

            args = ["--kv-cache-memory", str(kv_cache_memory), *LOCAL_CONFIGS[label]]
            print(f"starting {label} ({' '.join(args)})", file=sys.stderr)
            server = LocalServer(*args)
            url = server.url
        try:
            name = model or _model_of(url, api_key)
            for workload in chosen.values():
                rows.append(asyncio.run(run_workload(url, name, workload, clients, label, api_key)))
        finally:
            if server is not None:
                server.stop()
    load = os.getloadavg()
    lines = [
        f"kvpool bench serve: {clients} concurrent clients, OpenAI streamed chat completions, "
        f"greedy; local servers with {kv_cache_memory} MiB of KV; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "(ttft / lat: seconds, p50 and p99; cached: prompt tokens the server reported cached)",
        HEADER,
        *(row.line() for row in rows),
    ]
    return "\n".join(lines)
