"""``kvpool serve`` as a real process on 127.0.0.1, driven by the real ``ollama`` and
``openai`` clients and by plain HTTP (fp32, so outputs are exact and comparable)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

from kvpool import LLM, SamplingParams  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

MODEL = "smollm2:135m"
SYSTEM = (
    "You are the support assistant of a small bookshop. Answer in one short sentence, "
    "politely, and never invent opening hours or prices. " * 4
)


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--kv-cache-memory", "320", "--max-body-bytes", str(2**20))
    yield proc
    assert proc.stop() == 0, proc.logs()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(dtype="float32", progress=False)


def clients(server: ServerProcess):
    return ollama.Client(host=server.url), openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")


def test_generate_and_chat_agree_across_both_apis_streamed_or_not_and_offline(server, offline):
    oc, ai = clients(server)
    prompt = "The capital of France is"
    (want,) = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
    greedy = {"temperature": 0, "num_predict": 12}
    got = oc.generate(model=MODEL, prompt=prompt, raw=True, options=greedy)
    assert got.response == want.text and got.done and got.done_reason == "length"
    assert got.eval_count == 12 and got.prompt_eval_count == len(want.prompt_token_ids)
    assert got.total_duration > got.eval_duration > 0
    streamed = list(oc.generate(model=MODEL, prompt=prompt, raw=True, options=greedy, stream=True))
    assert "".join(c.response for c in streamed) == want.text and streamed[-1].done
    completion = ai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert completion.choices[0].text == want.text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    # the second time the prompt's full blocks come from the cache
    assert (
        completion.usage.prompt_tokens_details.cached_tokens == 0 or len(want.prompt_token_ids) < 16
    )

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    (chat_want,) = offline.chat([messages], SamplingParams(temperature=0, max_tokens=16))
    chat = oc.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 16})
    assert chat.message.content == chat_want.text and chat.message.role == "assistant"
    pieces = oc.chat(
        model=MODEL, messages=messages, stream=True, options={"temperature": 0, "num_predict": 16}
    )
    assert "".join(p.message.content for p in pieces) == chat_want.text
    reply = ai.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == chat_want.text
    assert reply.usage.prompt_tokens_details.cached_tokens >= 16 * (
        len(chat_want.prompt_token_ids) // 16 - 1
    )
    stream = ai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_want.text
    assert chunks[-1].usage.completion_tokens == len(chat_want.token_ids)

    # a fixed seed gives the same sample through both APIs and offline
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=False)
    (want_seed,) = offline.generate(prompt, seeded)
    a = ai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.9, seed=7)
    o = oc.generate(
        model=MODEL,
        prompt=prompt,
        raw=True,
        options={"temperature": 0.9, "seed": 7, "num_predict": 10, "top_k": 0, "top_p": 1},
    )
    assert a.choices[0].text == o.response == want_seed.text

    n3 = ai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=1
    )
    assert sorted(c.index for c in n3.choices) == [0, 1, 2]
    assert server.wait_idle()["used_blocks"] == 0


def test_listing_endpoints_answer_as_ollama_and_openai_clients_expect(server):
    oc, ai = clients(server)
    (listed,) = oc.list().models
    assert listed.model == MODEL and listed.details.quantization_level == "Q4_1"
    assert listed.size > 50_000_000 and len(listed.digest) == 64
    shown = oc.show(MODEL)
    assert shown.details.family == "llama" and "im_start" in shown.template
    assert shown.modelinfo["general.architecture"] == "llama"
    (running,) = oc.ps().models
    assert running.context_length == 8192
    assert [m.id for m in ai.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/api/version").json()["version"]
    assert httpx.get(f"{server.url}/").text.startswith("Ollama is running")


def test_64_concurrent_streaming_clients_share_the_system_prompt(server):
    before = server.kvcache()

    async def ollama_client(i: int) -> str:
        client = ollama.AsyncClient(host=server.url)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Do you sell book number {i}?"},
        ]
        text = ""
        async for part in await client.chat(
            model=MODEL, messages=messages, stream=True, options={"num_predict": 8, "seed": i}
        ):
            text += part.message.content
            done = part.done
        assert done
        return text

    async def openai_client(i: int) -> str:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-")
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Is book {i} in stock?"},
        ]
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True, seed=i
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert finish in ("stop", "length")
        await client.close()
        return text

    async def main():
        jobs = [ollama_client(i) for i in range(32)] + [openai_client(i) for i in range(32)]
        return await asyncio.gather(*jobs)

    texts = asyncio.run(main())
    assert len(texts) == 64 and all(isinstance(t, str) for t in texts)
    after = server.wait_idle()
    assert after["used_blocks"] == 0 and after["num_sequences"] == 0
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    system_blocks = 16 * (len(SYSTEM) // 6 // 16)  # at least this many system tokens per hit
    assert hits >= 60 * system_blocks
    metrics = httpx.get(f"{server.url}/metrics").text
    sample = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    assert sample["kvpool_prefix_hit_tokens_total"] >= hits
    assert sample['kvpool_kv_blocks{state="used"}'] == 0
    assert sample['kvpool_time_to_first_token_seconds_count{tenant=""}'] >= 64
    assert sample["kvpool_requests_running"] == 0


BAD = [
    ("/api/generate", b"{not json", 400, "malformed JSON"),
    ("/v1/chat/completions", b"[1, 2", 400, "malformed JSON"),
    ("/api/generate", {"model": MODEL, "prompt": 42}, 400, "prompt"),
    ("/api/chat", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/api/generate", {"model": "llama9:999b", "prompt": "x"}, 404, "not found"),
    (
        "/v1/chat/completions",
        {"model": "gpt-7", "messages": [{"role": "user", "content": "x"}]},
        404,
        "not found",
    ),
    (
        "/api/generate",
        {"model": MODEL, "prompt": "x", "options": {"temperature": -1}},
        400,
        "temperature",
    ),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"top_p": "high"}}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 100}, 400, "n must"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "token ids"),
    ("/api/generate", {"model": MODEL, "prompt": "hi " * 9000, "raw": True}, 400, "context"),
    ("/api/generate", {"model": MODEL, "prompt": "hi " * 7700, "raw": True}, 413, "pool"),
    ("/api/generate", {"model": MODEL, "prompt": "x" * (2**20 + 10)}, 413, "limit"),
    ("/api/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "says"), BAD, ids=[b[3] for b in BAD])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(
    server, path, body, status, says
):
    if isinstance(body, bytes):
        reply = httpx.post(f"{server.url}{path}", content=body, timeout=60)
    else:
        reply = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert says.lower() in message.lower()
    ok = httpx.post(
        f"{server.url}/api/generate",
        timeout=60,
        json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
    )
    assert ok.status_code == 200 and ok.json()["done"]
    assert server.wait_idle()["used_blocks"] == 0


def test_the_real_clients_raise_on_errors(server):
    oc, ai = clients(server)
    with pytest.raises(ollama.ResponseError) as err:
        oc.generate(model="nope:1b", prompt="x")
    assert err.value.status_code == 404 and "not found" in err.value.error
    with pytest.raises(openai.BadRequestError, match="temperature"):
        ai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3
        )


def test_a_client_leaving_mid_stream_frees_its_blocks(server):
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story about a lighthouse.",
        "options": {"num_predict": 4000, "temperature": 0},
    }
    with httpx.stream("POST", f"{server.url}/api/generate", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        for _ in range(3):
            assert not json.loads(next(lines))["done"]
        assert server.kvcache()["used_blocks"] > 0
    # the connection is closed: the request is cancelled and its blocks freed
    after = server.wait_idle()
    assert after["running"] == 0 and after["used_blocks"] == 0


def test_api_keys_separate_tenants_and_a_shared_pin_serves_all(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenant key\nalice key-alice\nbob key-bob\n")
    proc = ServerProcess("--api-key", "key-admin", "--keys-file", str(keys))
    try:
        url = proc.url
        with pytest.raises(ollama.ResponseError) as err:
            ollama.Client(host=url).generate(model=MODEL, prompt="x")
        assert err.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()
        assert httpx.get(f"{url}/").status_code == 200

        def ask(key: str, system: str) -> int:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
            reply = client.chat.completions.create(
                model=MODEL,
                max_tokens=2,
                temperature=0,
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": "Hello"},
                ],
            )
            return reply.usage.prompt_tokens_details.cached_tokens

        secret = "Alice's private instructions: " + "be brief and exact. " * 12
        assert ask("key-alice", secret) == 0
        assert ask("key-bob", secret) == 0  # same prompt, other tenant: no shared block
        assert ask("key-alice", secret) >= 64  # alice's own cache
        admin = {"authorization": "Bearer key-admin"}
        assert proc.kvcache(**admin)["used_blocks"] == 0

        shop = SYSTEM
        forbidden = httpx.post(
            f"{url}/api/kvcache/pin",
            json={"model": MODEL, "system": shop, "shared": True},
            headers={"authorization": "Bearer key-bob"},
        )
        assert forbidden.status_code == 403
        pinned = httpx.post(
            f"{url}/api/kvcache/pin",
            json={"model": MODEL, "system": shop, "shared": True},
            headers=admin,
            timeout=60,
        ).json()
        assert pinned["pinned_tokens"] >= 64
        assert ask("key-alice", shop) >= pinned["pinned_tokens"]
        assert ask("key-bob", shop) >= pinned["pinned_tokens"]
        stats = proc.kvcache(**admin)
        assert stats["pinned_blocks"] == pinned["pinned_tokens"] // 16
        reset = httpx.post(f"{url}/api/kvcache/reset", headers=admin).json()
        assert reset["dropped_blocks"] > 0
        assert proc.kvcache(**admin)["pinned_blocks"] == pinned["pinned_tokens"] // 16
    finally:
        assert proc.stop() == 0, proc.logs()
