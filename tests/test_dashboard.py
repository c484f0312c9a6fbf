"""The live view's page and data, against a real ``kvpool serve`` (no browser here:
tests/test_dashboard_browser.py drives Chromium).

- ``/`` answers Ollama's clients as before and browsers with the page; ``/dashboard``
  needs no key, its data does.
- While streams that share a system prompt run, the data's block map shows their shared
  blocks, each request lists its blocks (and what its prompt found cached), and a block
  under the pointer names the sequences holding it at its place in their chains; when
  the clients leave, the blocks turn cached and the history has counted the tokens.
- A tenant's key sees its own requests and blocks only, and no pool-wide history.
- The block map, kept on every transition, equals a scan of the blocks
  (tests/cache_invariants.py checks it after every random operation of the cache tests).
"""

from __future__ import annotations

import base64
import contextlib
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

from kvpool.cache.block_map import count_states, state_of  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

MODEL = "smollm2:135m"
SYSTEM = "You answer questions about the shop's opening hours. " * 10


def _poll(fetch, done, timeout=120.0):
    """Call ``fetch`` until ``done(result)`` holds; the last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = fetch()
        if done(result):
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached; last: {str(result)[:2000]}")
        time.sleep(0.05)


def _streams(url: str, key: str, n: int, system: str = SYSTEM):
    """``n`` chat streams sharing ``system``, each read to its first token and left
    running (max_tokens far away); the caller closes them."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
    streams = []
    for i in range(n):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: when do you open?"},
            ],
            max_tokens=3000,  # room for four at once: 4 x 188 blocks in the pool's 1456
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        streams.append(stream)
    return streams


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("alice key-alice\nbob key-bob\n")
    proc = ServerProcess("--api-key", "key-admin", "--keys-file", str(keys),
                         "--kv-cache-memory", "1024")  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.logs()


def _data(url: str, key: str) -> dict:
    res = httpx.get(f"{url}/api/dashboard", headers={"authorization": f"Bearer {key}"})
    assert res.status_code == 200, res.text
    return res.json()


def test_the_page_for_browsers_and_the_old_answer_for_ollama_clients(server):
    url = server.url
    assert httpx.get(f"{url}/").text.startswith("Ollama is running")
    ollama.Client(host=url, headers={"authorization": "Bearer key-admin"}).list()
    page = httpx.get(f"{url}/", headers={"accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="blockmap"' in page.text and "http://" not in page.text.replace(
        "http://www.w3.org", ""
    )  # every asset is the page's own
    assert httpx.get(f"{url}/dashboard").text == page.text
    denied = httpx.get(f"{url}/api/dashboard")
    assert denied.status_code == 401 and "error" in denied.json()


def test_running_streams_show_as_shared_blocks_then_cached(server):
    url = server.url
    streams = _streams(url, "key-admin", 4)
    try:

        def shared_and_listed(d):
            running = [r for r in d["requests"] if r["status"] == "running"]
            return d["counts"] and d["counts"]["shared"] > 0 and len(running) == 4

        d = _poll(lambda: _data(url, "key-admin"), shared_and_listed)
        states = base64.b64decode(d["map"])
        assert len(states) == d["capacity"]["total_blocks"]
        assert count_states(states) == d["counts"]
        running = [r for r in d["requests"] if r["status"] == "running"]
        assert sum(r["cached_prompt_tokens"] > 0 for r in running) >= 3  # the later three
        first = running[0]["blocks"][0]
        assert all(r["blocks"][0] == first for r in running)  # one copy of the prompt
        assert state_of(states[first]) == "shared" and states[first] & 0x3F == 4
        block = httpx.get(
            f"{url}/api/dashboard/block/{first}", headers={"authorization": "Bearer key-admin"}
        ).json()
        assert block["state"] == "shared" and block["position"] == 0
        assert block["tokens"] == d["capacity"]["block_size"]
        assert sorted(s["position"] for s in block["sequences"]) == [0, 0, 0, 0]
        missing = httpx.get(
            f"{url}/api/dashboard/block/999999", headers={"authorization": "Bearer key-admin"}
        )
        assert missing.status_code == 404 and "error" in missing.json()
    finally:
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.close()
    d = _poll(
        lambda: _data(url, "key-admin"),
        lambda d: d["counts"]["in_use"] == d["counts"]["shared"] == 0 and not d["requests"],
    )
    assert d["counts"]["cached"] > 0
    assert state_of(base64.b64decode(d["map"])[first]) == "cached"
    history = _poll(
        lambda: _data(url, "key-admin")["history"],
        lambda h: any(p["tokens_per_s"] > 0 for p in h) and any(p["hit_rate"] for p in h),
    )
    assert all(
        p["free"] + p["cached"] + p["used"] == d["capacity"]["total_blocks"] for p in history
    )
    assert any(p["ttft_p50"] is not None for p in history)
    newer = _data(url, "key-admin")
    later = httpx.get(
        f"{url}/api/dashboard", params={"since": history[-1]["t"]},
        headers={"authorization": "Bearer key-admin"},
    ).json()["history"]  # fmt: skip
    assert all(p["t"] > history[-1]["t"] for p in later) and newer["history"]


def test_a_tenant_sees_its_own_requests_and_blocks_only(server):
    url = server.url
    mine = _streams(url, "key-alice", 2, system="Alice's assistant. " * 20)
    theirs = _streams(url, "key-bob", 2, system="Bob's assistant. " * 20)
    try:

        def both_running(d):
            return len([r for r in d["requests"] if r["status"] == "running"]) == 4

        admin = _poll(lambda: _data(url, "key-admin"), both_running)
        alice = _data(url, "key-alice")
        assert "history" not in alice and "pool" not in alice
        assert {r["tenant"] for r in alice["requests"]} == {"alice"}
        assert alice["capacity"]["total_blocks"] == admin["capacity"]["total_blocks"]
        states = base64.b64decode(alice["map"])
        hers = {b for r in alice["requests"] for b in r["blocks"]}
        assert hers and all(states[b] for b in hers)
        assert not any(states[b] for b in range(len(states)) if b not in hers)
        bobs = [r for r in admin["requests"] if r["tenant"] == "bob"]
        auth = {"authorization": "Bearer key-alice"}
        refused = httpx.get(f"{url}/api/dashboard/block/{bobs[0]['blocks'][0]}", headers=auth)
        assert refused.status_code == 404
        own = httpx.get(f"{url}/api/dashboard/block/{min(hers)}", headers=auth).json()
        assert own["tenant"] == "alice" and {s["tenant"] for s in own["sequences"]} == {"alice"}
    finally:
        for stream in mine + theirs:
            with contextlib.suppress(Exception):
                stream.close()
    _poll(lambda: _data(url, "key-admin"), lambda d: not d["requests"])
