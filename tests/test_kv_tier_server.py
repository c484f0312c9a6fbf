"""``kvpool serve --kv-offload DIR``: a real server with a small pool and a disk tier,
driven by the ``openai`` client: documents revisited after the pool has long forgotten
them come from the tier, across a restart too, and a kill -9 leaves nothing that could
be served wrong.

The servers compute in bf16 with int8 KV blocks and batch-invariant products (what a
user would run; int8 blocks are read by one kernel for every step, whose rows do not
depend on the rest of the batch), so a document's answer served from the tier must
equal, token for token, the answer computed the first time."""

from __future__ import annotations

import os
import random
import signal

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kvpool.bench.local_server import LocalServer  # noqa: E402
from kvpool.model.native import native_ops  # noqa: E402

# the servers here keep an int8 KV cache under bf16 compute: the native ops' stores
pytestmark = pytest.mark.skipif(native_ops() is None, reason="an int8 KV cache needs native ops")

MODEL = "smollm2:135m"
WORDS = [
    "memory",
    "block",
    "cache",
    "river",
    "stone",
    "paper",
    "signal",
    "garden",
    "engine",
    "window",
    "orbit",
    "lantern",
    "harbor",
    "pencil",
    "meadow",
    "circuit",
    "violin",
    "copper",
    "island",
    "thunder",
    "marble",
    "velvet",
    "canyon",
]


def _documents(n: int, words: int) -> list[str]:
    rng = random.Random(11)
    return [f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def _server(tier: str | None) -> LocalServer:
    args = ["--dtype", "bfloat16", "--batch-invariant", "--kv-cache-dtype", "int8"]
    args += ["--kv-cache-memory", "24"]  # ~2,000 tokens of int8 blocks: about one document
    if tier is not None:
        args += ["--kv-offload", tier, "--kv-offload-size", "512"]
    return LocalServer(*args)


def _ask(server: LocalServer, doc: str) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": doc + "\nWhich word comes first?"}],
        max_tokens=6,
        temperature=0,
    )
    usage = reply.usage
    return (
        reply.choices[0].message.content,
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
    )


def test_revisited_documents_come_from_the_tier_even_after_a_restart(tmp_path):
    docs = _documents(24, 700)  # ~750 tokens each, ~18,000 in all: 9x the pool
    tier = str(tmp_path / "tier")
    server = _server(tier)
    try:
        first = [_ask(server, d) for d in docs]
        second = [_ask(server, d) for d in docs]
        stats = httpx.get(f"{server.url}/api/kvcache").json()["tier"]
    finally:
        assert server.stop() == 0, server.logs()
    prompt = sum(p for _, p, _ in first)
    assert sum(c for _, _, c in first) <= 0.05 * prompt  # the chat template's first block
    assert sum(c for _, _, c in second) >= 0.9 * prompt, (stats, second)
    assert [a for a, _, _ in second] == [a for a, _, _ in first]
    assert stats["kind"] == "disk" and stats["refused"] == 0 and stats["bytes"] <= 512 << 20
    # a restart on the same directory: the first document asked again is a hit
    server = _server(tier)
    try:
        answer, prompt_tokens, cached = _ask(server, docs[0])
    finally:
        assert server.stop() == 0, server.logs()
    assert cached >= 0.9 * prompt_tokens and answer == first[0][0]
    # without the tier, the pool alone remembers none of them
    server = _server(None)
    try:
        for d in docs[:6]:
            _ask(server, d)
        again = [_ask(server, d) for d in docs[:3]]
    finally:
        assert server.stop() == 0, server.logs()
    assert sum(c for _, _, c in again) <= 0.05 * sum(p for _, p, _ in again)


def test_a_server_killed_while_writing_its_tier_starts_and_serves_right(tmp_path):
    docs = _documents(6, 700)
    tier = tmp_path / "tier"
    server = _server(str(tier))
    try:
        first = [_ask(server, d) for d in docs]
    finally:
        server.proc.send_signal(signal.SIGKILL)  # no flush, writes cut wherever they were
        server.proc.wait()
    files = sorted(tier.glob("*/blocks/*.kvb"))
    assert files
    # and a block damaged on disk besides
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0x55
    files[0].write_bytes(bytes(data))
    server = _server(str(tier))
    try:
        again = [_ask(server, d) for d in docs]
        stats = httpx.get(f"{server.url}/api/kvcache").json()["tier"]
    finally:
        assert server.stop() == 0, server.logs()
    assert [a for a, _, _ in again] == [a for a, _, _ in first]
    assert not any(name.endswith(".tmp") for name in os.listdir(files[0].parent))
    assert stats["refused"] <= 1 and stats["hit_blocks"] > 0
