"""One request never hurts another, over HTTP with the real clients (fp32, in-process
servers so a test can reach into the engine): a fault tied to one request ends only it,
in its API's error shape; the admin routes answer while the engine is inside a step; a
disconnect ends a waiting request at once and is counted once; tenants are admitted in
turn, see only their own counters and pins, and share the pin budget; the waiting queue
is bounded."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

from kvpool import LLM, SamplingParams  # noqa: E402
from kvpool.server.auth import KeyRing, Tenant  # noqa: E402
from tests.inprocess_server import InProcessServer, wait_for  # noqa: E402

MODEL = "smollm2:135m"
POISON = "POISON"  # requests whose prompt holds this word fault in the model step
ADMIN = {"authorization": "Bearer key-admin"}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", progress=False, kv_cache_memory=24 * 2**20)


def metric_samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


class PoisonedForward:
    """The runner's forward (the test reaches inside the engine on purpose), raising once
    a request whose prompt holds ``POISON`` has produced ``after`` tokens (so its stream
    has started). A chunk is a request's when it carries that request's block table."""

    def __init__(self, llm: LLM, after: int = 3) -> None:
        self.engine = llm.engine
        self.decode = llm.tokenizer.decode
        self.forward = llm.engine._runner.forward
        self.after = after
        llm.engine._runner.forward = self  # type: ignore[method-assign]

    def __call__(self, chunks, **kw):
        manager = self.engine._manager
        by_table = {tuple(manager.block_table(r.seq_id)): r for r in self.engine._scheduler.running}
        for chunk in chunks:
            request = by_table.get(tuple(chunk.block_table))
            if (
                request is not None
                and len(request.output_ids) >= self.after
                and POISON in self.decode(request.prompt_ids)
            ):
                raise RuntimeError("injected fault: secret internals")
        return self.forward(chunks, **kw)

    def remove(self) -> None:
        self.engine._runner.forward = self.forward  # type: ignore[method-assign]


def test_a_fault_ends_one_request_in_its_apis_shape_and_the_others_finish_exactly(llm):
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [out.text for out in llm.generate(questions[:3], greedy)]  # OpenAI, ignore_eos
    chats = [[{"role": "user", "content": q}] for q in questions[3:]]
    want += [out.text for out in llm.chat(chats, replace(greedy, ignore_eos=False))]
    poisoned = f"{POISON}: tell me about the sea."
    fault = PoisonedForward(llm)
    server = InProcessServer(llm)
    url = server.url
    try:

        async def openai_stream(prompt: str) -> tuple[str, list[str]]:
            text, events = "", []
            async with (
                httpx.AsyncClient(timeout=120) as client,
                client.stream(
                    "POST",
                    f"{url}/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": prompt,
                        "max_tokens": 12,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ) as reply,
            ):
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            for event in events[:-1]:
                chunk = json.loads(event)
                if chunk.get("choices"):
                    text += chunk["choices"][0]["text"]
            return text, events

        async def ollama_stream(question: str) -> tuple[str, list[dict]]:
            lines = []
            async with (
                httpx.AsyncClient(timeout=120) as client,
                client.stream(
                    "POST",
                    f"{url}/api/chat",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": question}],
                        "options": {"num_predict": 12, "temperature": 0},
                    },
                ) as reply,
            ):
                async for line in reply.aiter_lines():
                    lines.append(json.loads(line))
            text = "".join(line.get("message", {}).get("content", "") for line in lines)
            return text, lines

        async def main():
            clean = [openai_stream(q) for q in questions[:3]]
            clean += [ollama_stream(q) for q in questions[3:]]
            bad = [openai_stream(poisoned), ollama_stream(poisoned)]
            return await asyncio.gather(*clean, *bad)

        results = asyncio.run(main())
        bad_plain = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": poisoned, "max_tokens": 12, "ignore_eos": True},
            timeout=120,
        )
        wait_for(lambda: server.model.snapshot.running == 0)
        after = server.model.snapshot
        metrics = metric_samples(httpx.get(f"{url}/metrics").text)
    finally:
        fault.remove()
        server.stop()
    assert [text for text, _ in results[:6]] == want
    # the poisoned OpenAI stream: tokens, then an error event, then [DONE]
    _, events = results[6]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "internal error (id " in error["message"]
    assert "secret" not in error["message"]
    assert any(json.loads(e).get("choices") for e in events[:-2])  # it had started
    # the poisoned Ollama stream ends with an {"error": ...} line, not a bare cut
    _, lines = results[7]
    assert any(line.get("message", {}).get("content") for line in lines[:-1])
    assert "internal error (id " in lines[-1]["error"] and not lines[-1].get("done")
    assert bad_plain.status_code == 500
    assert "internal error (id " in bad_plain.json()["error"]["message"]
    assert "secret" not in bad_plain.text
    assert after.cache.used_blocks == 0 and after.running == after.waiting == 0
    assert metrics['kvpool_requests_total{api="openai",finish_reason="error",tenant=""}'] == 2
    assert metrics['kvpool_requests_total{api="ollama",finish_reason="error",tenant=""}'] == 1


class HeldStep:
    """The runner's forward, blocked while ``hold`` is clear (the engine thread stays
    inside a step)."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.forward = llm.engine._runner.forward
        self.hold = threading.Event()
        self.hold.set()
        self.inside = threading.Event()
        llm.engine._runner.forward = self  # type: ignore[method-assign]

    def __call__(self, chunks, **kw):
        if not self.hold.is_set():
            self.inside.set()
            self.hold.wait()
        return self.forward(chunks, **kw)

    def remove(self) -> None:
        self.hold.set()
        self.engine._runner.forward = self.forward  # type: ignore[method-assign]


def test_admin_routes_answer_inside_a_step_and_disconnects_end_waiting_requests_at_once(llm):
    held = HeldStep(llm)
    server = InProcessServer(llm)
    url = server.url
    long_body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "stream": True,
        "options": {"num_predict": 2000, "temperature": 0},
    }
    try:
        with httpx.stream("POST", f"{url}/api/generate", json=long_body, timeout=120) as long:
            lines = long.iter_lines()
            next(lines)  # it runs
            held.hold.clear()
            held.inside.wait(30)  # the engine thread is now inside a step, held there
            # the admin routes answer from the latest snapshot, not from the engine
            stats = httpx.get(f"{url}/api/kvcache", timeout=5).json()
            assert stats["running"] == 1
            assert "kvpool_kv_blocks" in httpx.get(f"{url}/metrics", timeout=5).text

            async def leave_before_first_token(i: int) -> None:
                body = {
                    "model": MODEL,
                    "prompt": f"Question {i}",
                    "stream": True,
                    "options": {"num_predict": 8},
                }
                async with (
                    httpx.AsyncClient(timeout=30) as client,
                    client.stream("POST", f"{url}/api/generate", json=body) as reply,
                ):
                    assert reply.status_code == 200  # headers came; no token will

            async def twenty():
                await asyncio.gather(*(leave_before_first_token(i) for i in range(20)))

            asyncio.run(twenty())
            # each counted once as cancelled, while the engine is still held
            wait_for(
                lambda: (
                    metric_samples(httpx.get(f"{url}/metrics", timeout=5).text).get(
                        'kvpool_requests_total{api="ollama",finish_reason="cancelled",tenant=""}'
                    )
                    == 20
                ),
                timeout=30,
            )
            assert held.inside.is_set() and not held.hold.is_set()
            admitted = server.model.snapshot.tenants[None].admitted
            held.hold.set()
            # at the next step boundary the 20 leave the queue, never admitted
            wait_for(lambda: httpx.get(f"{url}/api/kvcache").json()["waiting"] == 0)
            assert server.model.snapshot.tenants[None].admitted == admitted
        wait_for(lambda: httpx.get(f"{url}/api/kvcache").json()["used_blocks"] == 0)
        counted = metric_samples(httpx.get(f"{url}/metrics").text)
        cancelled = 'kvpool_requests_total{api="ollama",finish_reason="cancelled",tenant=""}'
        assert counted[cancelled] == 21
    finally:
        held.remove()
        server.stop()


def keyring() -> KeyRing:
    return KeyRing(
        {
            "key-admin": Tenant("root", admin=True),
            "key-a": Tenant("a", admin=False),
            "key-b": Tenant("b", admin=False),
        }
    )


def test_tenants_are_admitted_in_turn_over_http(llm):
    """Tenant a sends a burst of 30 requests; tenant b, one: of a's requests still
    waiting when b's arrived, at most one is admitted before b's."""
    added = []
    engine = llm.engine
    add = engine.add_request

    def recording_add(*args, **kw):  # (reads the engine's requests: a test's look inside)
        request_id = add(*args, **kw)
        request = engine._requests[request_id][0]
        waiting_a = [r for r, _ in added if r.salt == "tenant:a" and r.admitted < 0]
        added.append((request, waiting_a))
        return request_id

    engine.add_request = recording_add  # type: ignore[method-assign]
    server = InProcessServer(llm, keys=keyring())
    url = server.url
    try:

        async def ask(key: str, i: int) -> str:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key)
            reply = await client.completions.create(
                model=MODEL,
                prompt=f"Item {i}: " * 12,
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            await client.close()
            return reply.choices[0].text

        async def main():
            burst = [asyncio.create_task(ask("key-a", i)) for i in range(30)]
            await asyncio.to_thread(
                wait_for,
                lambda: (
                    server.model.snapshot.tenants.get("tenant:a") is not None
                    and server.model.snapshot.tenants["tenant:a"].waiting >= 20
                ),
            )
            single = await ask("key-b", 99)
            return single, await asyncio.gather(*burst)

        asyncio.run(main())
    finally:
        engine.add_request = add  # type: ignore[method-assign]
        server.stop()
    (b_request, a_waiting), *_ = [(r, w) for r, w in added if r.salt == "tenant:b"]
    assert len(a_waiting) >= 20
    ahead = [r for r in a_waiting if r.admitted < b_request.admitted]
    assert len(ahead) <= 1, len(ahead)


def test_tenants_see_their_own_counters_and_pins_and_share_the_pin_budget(llm):
    llm.engine.reset_prefix_cache(unpin=True)
    server = InProcessServer(llm, keys=keyring(), tenant_pin_share=0.25)
    url = server.url
    key = {name: {"authorization": f"Bearer key-{name}"} for name in ("a", "b", "admin")}
    try:
        a = openai.OpenAI(base_url=f"{url}/v1", api_key="key-a")
        system = "You are tenant a's assistant. " * 10
        a_before = httpx.get(f"{url}/api/kvcache", headers=key["a"]).json()
        b_before = httpx.get(f"{url}/api/kvcache", headers=key["b"]).json()
        for _ in range(2):
            a.chat.completions.create(
                model=MODEL,
                max_tokens=2,
                temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            )
        seen_by_a = httpx.get(f"{url}/api/kvcache", headers=key["a"]).json()
        seen_by_b = httpx.get(f"{url}/api/kvcache", headers=key["b"]).json()
        seen_by_admin = httpx.get(f"{url}/api/kvcache", headers=key["admin"]).json()
        assert seen_by_a["tenant"] == "a"
        assert seen_by_a["cached_prompt_tokens"] - a_before["cached_prompt_tokens"] >= 48
        assert seen_by_b["tenant"] == "b" and seen_by_b == b_before  # a's activity: unseen
        for hidden in ("used_blocks", "cached_blocks", "prefix_hit_tokens", "tenants"):
            assert hidden not in seen_by_a and hidden not in seen_by_b
        assert seen_by_b["total_blocks"] == seen_by_admin["total_blocks"]  # capacity
        assert seen_by_admin["tenants"]["a"]["cached_prompt_tokens"] >= 48
        assert seen_by_admin["prefix_hit_tokens"] >= 48
        metrics_b = httpx.get(f"{url}/metrics", headers=key["b"]).text
        assert 'tenant="a"' not in metrics_b and "kvpool_kv_capacity_blocks" in metrics_b
        assert "kvpool_prefix_hit_tokens" not in metrics_b
        assert 'tenant="a"' in httpx.get(f"{url}/metrics", headers=key["admin"]).text

        # pins: a tenant holds at most its share of the pin budget
        limit = seen_by_a["tenant_pin_limit_blocks"]
        assert limit == int(seen_by_a["max_pinned_blocks"] * 0.25) > 0
        pinned = httpx.post(
            f"{url}/api/kvcache/pin",
            headers=key["a"],
            timeout=60,
            json={"model": MODEL, "system": system},
        ).json()
        assert 0 < pinned["pinned_tokens"] <= limit * 16
        too_much = httpx.post(
            f"{url}/api/kvcache/pin",
            headers=key["a"],
            timeout=60,
            json={"model": MODEL, "tokens": list(range(100, 116 + 16 * limit))},
        )
        assert too_much.status_code == 409 and "tenant's pin limit" in too_much.json()["error"]
        b_pin = httpx.post(
            f"{url}/api/kvcache/pin",
            headers=key["b"],
            timeout=60,
            json={"model": MODEL, "prompt": "Tenant b's prompt. " * 8},
        ).json()
        assert b_pin["pinned_tokens"] > 0
        # listing: a tenant its own pins, the admin every pin
        own = httpx.get(f"{url}/api/kvcache/pins", headers=key["a"]).json()["pins"]
        assert [p["tenant"] for p in own] == ["a"]
        every = httpx.get(f"{url}/api/kvcache/pins", headers=key["admin"]).json()["pins"]
        assert sorted(p["tenant"] for p in every) == ["a", "b"]
        # b cannot unpin a's pin; the admin can, by id
        a_id = own[0]["id"]
        assert (
            httpx.post(
                f"{url}/api/kvcache/unpin", headers=key["b"], json={"model": MODEL, "id": a_id}
            ).status_code
            == 404
        )
        reset = httpx.post(f"{url}/api/kvcache/reset", headers=key["admin"]).json()
        assert reset["unpinned"] is False
        assert len(httpx.get(f"{url}/api/kvcache/pins", headers=key["admin"]).json()["pins"]) == 2
        unpinned = httpx.post(
            f"{url}/api/kvcache/unpin", headers=key["admin"], json={"model": MODEL, "id": a_id}
        )
        assert unpinned.status_code == 200
        left = httpx.get(f"{url}/api/kvcache/pins", headers=key["admin"]).json()["pins"]
        assert [p["tenant"] for p in left] == ["b"]
        httpx.post(f"{url}/api/kvcache/reset", headers=key["admin"], json={"pins": True})
        assert httpx.get(f"{url}/api/kvcache/pins", headers=key["admin"]).json()["pins"] == []
        assert httpx.get(f"{url}/api/kvcache", headers=key["admin"]).json()["pinned_blocks"] == 0
    finally:
        server.stop()


def test_a_full_queue_answers_503_with_retry_after(llm):
    held = HeldStep(llm)
    config = llm.engine.config
    llm.engine.config = config.replace(max_queue=2)  # the bound is read per request
    server = InProcessServer(llm, max_queue=2)
    url = server.url
    body = {"model": MODEL, "prompt": "Hello", "stream": True, "options": {"num_predict": 4}}
    try:
        held.hold.clear()
        with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=60) as first:
            assert first.status_code == 200
            held.inside.wait(30)  # the first is inside a step; the next two wait
            with (
                httpx.stream("POST", f"{url}/api/generate", json=body, timeout=60),
                httpx.stream("POST", f"{url}/api/generate", json=body, timeout=60),
            ):
                full = httpx.post(
                    f"{url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "x"}
                )
                assert full.status_code == 503 and full.headers["retry-after"] == "1"
                assert "2 requests are waiting" in full.json()["error"]["message"]
                held.hold.set()
    finally:
        llm.engine.config = config
        held.remove()
        server.stop()
