"""``kvpool bench dashboard``: what the live view costs the engine.

One ``kvpool serve`` decodes ``requests`` streams at once (each ``max_tokens`` tokens,
end of sequence ignored), in alternating rounds: the page closed (nobody polls), the page
open (``/api/dashboard`` polled once a second, as the page does, with one block looked up
under the pointer each time), and ten pages open (ten times that rate). The order of the
three turns around every round (closed, open, ten; ten, open, closed; ...) so a drift of
the machine's speed does not favour one. Reported: the decode throughput of each (the
median over rounds), its ratio to the closed rounds, and what one poll took to answer
(median, from the client). The browser itself is left out: it draws on the machine it
runs on, which is usually not the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time

import httpx

from kvpool.bench.local_server import LocalServer
from kvpool.model.cpu import cpu_features

MODES = {"closed": 0.0, "page open": 1.0, "10 pages": 10.0}  # polls a second


async def _round(
    url: str, model: str, requests: int, max_tokens: int, polls: float, answer_s: list[float]
) -> float:
    """Aggregate decode tokens/s of one round (while every stream decodes); each poll's
    time to answer goes into ``answer_s``."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def poll() -> None:
            since = 0.0
            while not stop.is_set():
                t0 = time.perf_counter()
                data = (await client.get("/api/dashboard", params={"since": since})).json()
                answer_s.append(time.perf_counter() - t0)
                since = data["history"][-1]["t"] if data["history"] else since
                running = [r for r in data["requests"] if r["blocks"]]
                if running:
                    await client.get(f"/api/dashboard/block/{running[0]['blocks'][0]}")
                with contextlib.suppress(TimeoutError):  # the next poll, or the round's end
                    await asyncio.wait_for(stop.wait(), 1 / polls)

        async def one(i: int) -> list[float]:
            body = {"model": model, "prompt": f"Story {i}: once upon a time", "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
            times = []
            async with client.stream("POST", "/v1/completions", json=body) as res:
                async for line in res.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
            return times

        pollers = [asyncio.create_task(poll())] if polls else []
        streams = await asyncio.gather(*(one(i) for i in range(requests)))
        stop.set()
        await asyncio.gather(*pollers)
    # The window in which every stream was decoding (the batch full): tokens in it a second.
    start = max(t[0] for t in streams)
    end = min(t[-1] for t in streams)
    tokens = sum(1 for t in streams for x in t if start < x <= end)
    return tokens / max(1e-9, end - start)


def run(requests: int = 16, max_tokens: int = 256, rounds: int = 5,
        kv_cache_memory: int = 256) -> str:  # fmt: skip
    server = LocalServer("--kv-cache-memory", str(kv_cache_memory))
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        answer_s: list[float] = []
        asyncio.run(_round(server.url, model, 2, 8, 0, answer_s))  # warm up
        measured: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rounds):
            order = list(MODES.items()) if r % 2 == 0 else list(MODES.items())[::-1]
            for mode, polls in order:
                rate = asyncio.run(_round(server.url, model, requests, max_tokens, polls, answer_s))
                measured[mode].append(rate)
                print(f"  round {r + 1}/{rounds} {mode}: {rate:.1f} tok/s", file=sys.stderr)
        blocks = server.kvcache()["total_blocks"]
    finally:
        server.stop()
    base = statistics.median(measured["closed"])
    load = os.getloadavg()
    lines = [
        f"kvpool bench dashboard: {requests} streams x {max_tokens} tokens, {blocks} blocks, "
        f"{rounds} alternating rounds ({os.cpu_count()} CPUs: {cpu_features().summary()}); "
        f"load average {load[0]:.2f}",
        f"{'view':<12} {'polls/s':>8} {'decode tok/s':>13} {'vs closed':>10}  rounds",
    ]
    for mode, polls in MODES.items():
        med = statistics.median(measured[mode])
        rounds_text = " ".join(f"{x:.1f}" for x in measured[mode])
        lines.append(f"{mode:<12} {polls:>8.0f} {med:>13.1f} {med / base:>9.3f}x  {rounds_text}")
    lines.append(
        f"one poll answered in {1e3 * statistics.median(answer_s):.1f} ms (median of "
        f"{len(answer_s)}, p90 {1e3 * sorted(answer_s)[int(0.9 * len(answer_s))]:.1f} ms)"
    )
    return "\n".join(lines)
