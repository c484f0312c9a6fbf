"""Anthropic's Messages API through the real ``anthropic`` client against an in-process
server (fp32, greedy): a message and its stream say what chat completions says of the
same conversation, and the usage says what the prefix cache served; tool_use and
tool_result blocks round-trip; tool_choice, stop sequences, a prefill and
output_config constrain the reply as asked; a stream's events are well formed, pings
fill long waits and a fault ends only its stream with an ``error`` event; bad requests
get Anthropic's error shape and change nothing; ``x-api-key`` names a tenant."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from kvpool import LLM  # noqa: E402
from kvpool.server.anthropic_api import with_pings  # noqa: E402
from kvpool.server.auth import KeyRing, Tenant  # noqa: E402
from tests.inprocess_server import InProcessServer, wait_for  # noqa: E402
from tests.test_isolation_server import POISON, PoisonedForward  # noqa: E402

MODEL = "smollm2:135m"
GREEDY = {"temperature": 0}  # (newer SDKs take sampling options only as extra_body)
EPHEMERAL = {"type": "ephemeral"}  # (kvpool caches every prefix: the mark needs nothing)
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6
WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", progress=False, kv_cache_memory=24 * 2**20)


@pytest.fixture(scope="module")
def server(llm):
    keys = KeyRing({"key-a": Tenant("a", admin=True), "key-b": Tenant("b", admin=False)})
    srv = InProcessServer(llm, keys=keys, aliases=["claude-*", "Sonnet"])
    yield srv
    srv.stop()


def client(server, key: str = "key-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def chat(server, messages, n=24, tools=None, **extra):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a")
    reply = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n, temperature=0, tools=tools, **extra
    )
    return reply.choices[0].message, reply.usage


def create(server, messages, n=24, key="key-a", extra=None, **kw):
    """A greedy message; ``extra``: fields sent as they are (newer than some SDKs)."""
    return client(server, key).messages.create(
        model=MODEL, max_tokens=n, messages=messages, extra_body={**GREEDY, **(extra or {})}, **kw
    )


def idle(server) -> bool:
    snapshot = server.model.snapshot
    return snapshot.cache.used_blocks == 0 and snapshot.running == snapshot.waiting == 0


def test_a_message_says_what_chat_says_and_its_usage_what_the_cache_served(server):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    asked = [{"role": "user", "content": "Name a color."}]
    first = create(server, asked, system=system)
    want, usage = chat(server, [{"role": "system", "content": SYSTEM}, *asked])
    assert first.content[0].type == "text" and first.content[0].text == want.content
    assert first.role == "assistant" and first.model == MODEL and first.id.startswith("msg_")
    assert first.stop_reason == "end_turn" and first.stop_sequence is None
    u = first.usage
    assert u.input_tokens + u.cache_read_input_tokens == usage.prompt_tokens
    assert u.output_tokens == usage.completion_tokens and u.cache_creation_input_tokens == 0
    # the same prompt again: all its full blocks come from the cache
    again = create(server, asked, system=system)
    assert again.content[0].text == want.content
    cached = again.usage.cache_read_input_tokens
    assert cached >= usage.prompt_tokens - 16 and cached % 16 == 0
    assert again.usage.input_tokens == usage.prompt_tokens - cached
    counted = client(server).messages.count_tokens(model=MODEL, messages=asked, system=system)
    assert counted.input_tokens == usage.prompt_tokens
    # names given with --alias (Claude Code sends its own model names) are this model
    for name in ("claude-sonnet-4-5", "claude-haiku-4-5-20251001", "sonnet"):
        aliased = client(server).messages.create(
            model=name, max_tokens=24, messages=asked, system=system, extra_body=GREEDY
        )
        assert aliased.content[0].text == want.content


def test_claude_codes_billing_header_does_not_cost_the_prefix(server):
    """Claude Code's first system block is a telemetry line whose hash changes with every
    prompt: dropped, two requests that differ only there share their whole prefix."""

    def system(digest: str) -> list[dict]:
        header = f"x-anthropic-billing-header: cc_version=2.1.197.{digest}; cc_entrypoint=cli;"
        marked = {"type": "text", "text": SYSTEM + " Billing.", "cache_control": EPHEMERAL}
        return [{"type": "text", "text": header}, marked]

    asked = [{"role": "user", "content": "Name a color."}]
    first = create(server, asked, n=4, system=system("7b2"))
    second = create(server, asked, n=4, system=system("0d9"))
    plain = client(server).messages.count_tokens(
        model=MODEL, messages=asked, system=SYSTEM + " Billing."
    )
    u1, u2 = first.usage, second.usage
    assert u1.input_tokens + u1.cache_read_input_tokens == plain.input_tokens
    # every full block but one that must leave a token to compute: all of the prefix
    assert u2.cache_read_input_tokens == (plain.input_tokens - 1) // 16 * 16
    assert second.content[0].text == first.content[0].text


def test_a_stream_is_well_formed_and_says_what_the_message_says(server):
    asked = [{"role": "user", "content": "Name a color."}]
    whole = create(server, asked, system=SYSTEM)
    with client(server).messages.stream(
        model=MODEL, max_tokens=24, messages=asked, system=SYSTEM, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the message_delta's figures
    # the raw events: names equal their types, in Anthropic's order
    body = {"model": MODEL, "max_tokens": 24, "messages": asked, "system": SYSTEM,
            "stream": True, **GREEDY}  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": "key-a"},
                       timeout=120)  # fmt: skip
    assert reply.status_code == 200 and reply.headers["content-type"].startswith(
        "text/event-stream"
    )
    frames = [f for f in reply.text.split("\n\n") if f]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert "".join(e["delta"]["text"] for e in events[3:-3]) == text
    assert events[0]["message"]["usage"]["input_tokens"] == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_tool_use_and_tool_result_blocks_round_trip(server):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = create(server, asked, n=40, tools=[WEATHER], tool_choice={"type": "any"})
    assert forced.stop_reason == "tool_use"
    call = forced.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    named = create(server, asked, n=40, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert named.content[-1].input == call.input  # greedy, the same grammar's call
    # streamed: the call comes as a tool_use block and its input as input_json_delta
    with client(server).messages.stream(
        model=MODEL, max_tokens=40, messages=asked, tools=[WEATHER],
        tool_choice={"type": "any"}, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == call.input
    # the result goes back in a tool_result block: the same conversation as chat's
    result = "Sunny, 21 C."
    conversation = [
        *asked,
        {"role": "assistant", "content": [block.model_dump() for block in forced.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": result}]},
    ]  # fmt: skip
    answered = create(server, conversation, n=30, tools=[WEATHER])
    function = {"name": "get_weather", "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"]}  # fmt: skip
    openai_call = {"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps(call.input)}}  # fmt: skip
    want, usage = chat(
        server,
        [*asked, {"role": "assistant", "content": forced.content[0].text
                  if forced.content[0].type == "text" else "", "tool_calls": [openai_call]},
         {"role": "tool", "tool_call_id": "c1", "content": result}],
        n=30, tools=[{"type": "function", "function": function}],
    )  # fmt: skip
    assert answered.content[0].text == (want.content or "")
    u = answered.usage
    assert u.input_tokens + u.cache_read_input_tokens == usage.prompt_tokens
    assert u.cache_read_input_tokens > 0  # the forced call's prompt was the same prefix
    # tool_choice none: the tools stay out of the prompt, no call comes back
    unused = create(server, asked, n=20, tools=[WEATHER], tool_choice={"type": "none"})
    assert all(b.type == "text" for b in unused.content) and unused.stop_reason != "tool_use"


def test_stop_sequences_max_tokens_a_prefill_and_an_output_format(server, llm):
    asked = [{"role": "user", "content": "Name a color."}]
    free = create(server, asked, n=24).content[0].text
    word = free.split()[1]
    stopped = create(server, asked, n=24, stop_sequences=["zzz", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == free[: free.index(word)]
    cut = create(server, asked, n=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    # a last assistant message is the reply's start: the model continues it, exactly as
    # it continues those tokens given as a completion's prompt
    start = "My favourite color is"
    prefilled = create(server, [*asked, {"role": "assistant", "content": start}], n=12)
    ids = llm.loaded.tokenizer.encode_chat(asked, add_generation_prompt=True, prefill=start)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a")
    completion = oai.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert prefilled.content[0].text == completion.choices[0].text
    assert prefilled.usage.input_tokens + prefilled.usage.cache_read_input_tokens == len(ids)
    schema = {"type": "object", "properties": {"color": {"type": "string"}},
              "required": ["color"], "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    shaped = create(server, [{"role": "user", "content": "A color as JSON."}], n=40,
                    extra={"output_config": fmt})  # fmt: skip
    jsonschema.validate(json.loads(shaped.content[0].text), schema)


def test_x_api_key_and_bearer_name_tenants_that_share_no_cache(server):
    asked = [{"role": "user", "content": "Tell me about tenants and caches, briefly."}]
    system = SYSTEM + " Tenant test."
    create(server, asked, n=4, system=system)  # tenant a (x-api-key) caches it
    a_again = create(server, asked, n=4, system=system)
    b_first = create(server, asked, n=4, system=system, key="key-b")
    assert a_again.usage.cache_read_input_tokens > 0
    assert b_first.usage.cache_read_input_tokens == 0  # another tenant's salt
    bearer = anthropic.Anthropic(base_url=server.url, auth_token="key-b", max_retries=0)
    b_again = bearer.messages.create(model=MODEL, max_tokens=4, messages=asked, system=system,
                                     extra_body=GREEDY)  # fmt: skip
    assert b_again.usage.cache_read_input_tokens > 0  # tenant b, by Authorization: Bearer
    with pytest.raises(anthropic.AuthenticationError) as refused:
        create(server, asked, key="wrong")
    assert refused.value.body["error"]["type"] == "authentication_error"


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens is required"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "at least 1"),
    ({"max_tokens": 5, "messages": []}, "must not be empty"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "hi"}]}, "role must be"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
     "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "'image'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "'document'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "must not be empty"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
      "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "tool_use"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "stop_sequences": "x"}, "stop_sequences"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "says"), BAD, ids=[says for _, says in BAD])
def test_bad_requests_get_anthropics_error_shape_and_change_nothing(server, body, says):
    reply = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, **body},
                       headers={"x-api-key": "key-a"}, timeout=60)  # fmt: skip
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"]
    assert idle(server)


def test_other_refusals_in_anthropics_shape(server):
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="no-such-model", max_tokens=4,
                          messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert missing.value.body["error"]["type"] == "not_found_error"
    reply = httpx.post(f"{server.url}/v1/messages", content=b"{not json",
                       headers={"x-api-key": "key-a"}, timeout=60)  # fmt: skip
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    # past the context: a 400 in Anthropic's words (Claude Code reads the two numbers)
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(anthropic.BadRequestError) as too_long:
        c.messages.create(model=MODEL, max_tokens=4, messages=long)
    said = too_long.value.body["error"]["message"]
    counted = c.messages.count_tokens(model=MODEL, messages=long).input_tokens
    assert re.match(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", said)
    assert said.startswith(f"prompt is too long: {counted} tokens > 8191 maximum")
    assert idle(server)


def test_a_fault_ends_its_stream_with_an_error_event_and_only_it(server, llm):
    fault = PoisonedForward(llm)
    url = f"{server.url}/v1/messages"

    async def stream(text: str) -> list[dict]:
        body = {"model": MODEL, "max_tokens": 12, "stream": True, **GREEDY,
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
        events = []
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream("POST", url, json=body, headers={"x-api-key": "key-a"}) as reply,
        ):
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        return events

    async def both():
        return await asyncio.gather(stream("Count to ten."), stream(f"{POISON}: the sea."))

    try:
        clean, bad = asyncio.run(both())
        wait_for(lambda: server.model.snapshot.running == 0)
    finally:
        fault.remove()
    assert clean[-1]["type"] == "message_stop"
    assert bad[-1]["type"] == "error" and bad[-1]["error"]["type"] == "api_error"
    assert any(e["type"] == "content_block_delta" for e in bad)  # it had started
    message = bad[-1]["error"]["message"]
    assert "internal error (id " in message and "secret" not in message
    assert idle(server)


def test_pings_fill_the_waits_and_closing_closes_the_source():
    closed = []

    async def slow():
        try:
            for i in range(3):
                await asyncio.sleep(0.05 if i == 1 else 0)
                yield i
            await asyncio.sleep(10)
            yield 99
        finally:
            closed.append(True)

    async def run() -> list:
        got = []
        async with contextlib.aclosing(with_pings(slow(), 0.01)) as items:
            async for item in items:
                got.append(item)
                if len([x for x in got if x is not None]) == 3:
                    break
            assert not closed  # (the source is still open here)
        return got

    got = asyncio.run(run())
    assert [x for x in got if x is not None] == [0, 1, 2] and None in got
    assert got.index(None) > got.index(0) and closed == [True]
