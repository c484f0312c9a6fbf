"""OpenAI's Responses API through the real ``openai`` client against an in-process
server (fp32, greedy): a response and its stream say the same as chat completions of the
same conversation; ``previous_response_id`` continues a stored conversation from the
cache; function calls come out as ``function_call`` items and their outputs continue the
conversation; ``text.format`` constrains; a stream's events are well formed and a fault
ends one with ``response.failed``; stored responses are per tenant, bounded, and linear
in a conversation's length."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from kvpool import LLM  # noqa: E402
from kvpool.server.auth import KeyRing, Tenant  # noqa: E402
from kvpool.server.errors import APIError  # noqa: E402
from kvpool.server.response_store import ResponseStore, StoredTurn  # noqa: E402
from kvpool.server.responses_api import input_messages  # noqa: E402
from tests.inprocess_server import InProcessServer, wait_for  # noqa: E402
from tests.test_isolation_server import POISON, PoisonedForward  # noqa: E402

MODEL = "smollm2:135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
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
    srv = InProcessServer(llm, keys=keys)
    yield srv
    srv.stop()


def clients(server) -> tuple[openai.OpenAI, openai.OpenAI]:
    url = f"{server.url}/v1"
    return openai.OpenAI(base_url=url, api_key="key-a"), openai.OpenAI(
        base_url=url, api_key="key-b"
    )


def chat(client, messages, n=16):
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n, temperature=0
    )
    return reply.choices[0].message.content, reply.usage


def test_a_conversation_continues_from_the_cache_as_chat_completions_would(server):
    a, _ = clients(server)
    first = a.responses.create(
        model=MODEL, input="Name a color.", instructions="Answer briefly.",
        max_output_tokens=16, temperature=0,
    )  # fmt: skip
    system = {"role": "system", "content": "Answer briefly."}
    turn1 = [system, {"role": "user", "content": "Name a color."}]
    text, usage = chat(a, turn1)
    assert first.output_text == text and first.usage.input_tokens == usage.prompt_tokens
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.status in ("completed", "incomplete")
    # the next turn names the first: its input and reply come back from the store (the
    # instructions are the new request's own, as OpenAI does), served from the cache
    second = a.responses.create(
        model=MODEL, input="And another?", previous_response_id=first.id,
        instructions="Answer briefly.", max_output_tokens=16, temperature=0,
    )  # fmt: skip
    turn2 = [*turn1, {"role": "assistant", "content": text}]
    turn2.append({"role": "user", "content": "And another?"})
    text2, usage2 = chat(a, turn2)
    assert second.output_text == text2 and second.usage.input_tokens == usage2.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert second.previous_response_id == first.id
    assert a.responses.retrieve(first.id).output_text == first.output_text


def test_a_stream_is_well_formed_and_says_what_the_response_says(server):
    a, _ = clients(server)
    whole = a.responses.create(model=MODEL, input="Say yes.", max_output_tokens=200, temperature=0)
    with a.responses.stream(
        model=MODEL, input="Say yes.", max_output_tokens=200, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == whole.status == "completed"
    # cut by max_output_tokens: the last event says incomplete, and why
    with a.responses.stream(
        model=MODEL, input="Tell me a long story.", max_output_tokens=5, temperature=0
    ) as stream:
        cut = list(stream)
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_function_calls_and_their_outputs(server):
    a, _ = clients(server)
    asked = a.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice="required", max_output_tokens=60, temperature=0,
    )  # fmt: skip
    calls = [o for o in asked.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    assert all("city" in json.loads(c.arguments) for c in calls)
    # streamed: the same call, as Responses' function-call events
    with a.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    got = [(o.name, o.arguments) for o in streamed.output if o.type == "function_call"]
    assert got == [(c.name, c.arguments) for c in calls]
    # the tool's answer continues it: from the store, or the whole conversation sent
    output = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"}
        for c in calls
    ]
    stored, resent = _continued(a, asked, calls, output, [WEATHER], 16)
    assert stored.output_text == resent.output_text
    assert stored.usage.input_tokens == resent.usage.input_tokens
    assert resent.usage.input_tokens_details.cached_tokens > asked.usage.input_tokens // 2
    with pytest.raises(openai.NotFoundError):  # store=False: not kept
        a.responses.retrieve(resent.id)


def _continued(client, asked, calls, output, tools, n, namespaced=False):
    """A conversation's next turn (the tool's ``output`` for ``asked``'s ``calls``) from
    the store, and the same conversation sent whole (not stored)."""
    stored = client.responses.create(
        model=MODEL, input=output, previous_response_id=asked.id, tools=tools,
        max_output_tokens=n, temperature=0,
    )  # fmt: skip
    made = [{"type": "function_call", "call_id": c.call_id, "name": c.name,
             "arguments": c.arguments, **({"namespace": c.namespace} if namespaced else {})}
            for c in calls]  # fmt: skip
    resent = client.responses.create(
        model=MODEL, tools=tools, max_output_tokens=n, temperature=0, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, *made, *output],
    )  # fmt: skip
    return stored, resent


def test_namespaced_functions_and_tools_the_server_would_run(server):
    """Codex sends its sub-agent functions in a ``namespace`` and ``web_search`` with
    every request: the namespace's functions are offered as ``namespace.name`` (a call
    names the two apart, and comes back the same way), hosted tools are left out of the
    prompt (the same tokens as without them)."""
    a, _ = clients(server)
    space = {"type": "namespace", "name": "weather", "description": "Weather tools",
             "tools": [{**WEATHER, "name": "now"}]}  # fmt: skip
    asked = a.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[space],
        tool_choice="required", max_output_tokens=60, temperature=0,
    )  # fmt: skip
    calls = [o for o in asked.output if o.type == "function_call"]
    assert calls and all(c.name == "now" and c.namespace == "weather" for c in calls)
    hosted = a.responses.create(
        model=MODEL, input="What is the weather in Paris?", tool_choice="required",
        tools=[{"type": "web_search", "external_web_access": False}, space,
               {"type": "custom", "name": "apply_patch"}],
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    assert hosted.usage.input_tokens == asked.usage.input_tokens
    assert [(c.name, c.arguments) for c in hosted.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    # the call sent back with its namespace renders as the stored turn did
    output = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
              for c in calls]  # fmt: skip
    stored, resent = _continued(a, asked, calls, output, [space], 8, namespaced=True)
    assert stored.usage.input_tokens == resent.usage.input_tokens
    assert stored.output_text == resent.output_text


def test_text_format_constrains_and_logprobs_come_with_the_text(server):
    a, _ = clients(server)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    reply = a.responses.create(
        model=MODEL, input="Describe a person.", text={"format": fmt}, max_output_tokens=60,
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.output_text), schema)
    scored = a.responses.create(
        model=MODEL, input=[{"role": "developer", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    lps = scored.output[0].content[0].logprobs
    assert len(lps) == scored.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in lps)
    assert "".join(t.token for t in lps) == scored.output_text
    assert lps[0].top_logprobs[0].logprob == lps[0].logprob  # greedy: the best one


def test_tenants_see_only_their_own_responses(server):
    a, b = clients(server)
    mine = a.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model=MODEL, input="Hi", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(mine.id)
    a.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(mine.id)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "text content"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"input": "x", "tools": [{"type": "namespace", "name": "n"}]}, "namespace"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "previous_response_id": "resp_none"}, "not found"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": "json"}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "schema"),
        ({"input": "x", "background": True}, "background"),
        ({"input": []}, "empty"),
        ({"input": "x", "top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(server, body, says):
    reply = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": MODEL, **body},
        headers={"authorization": "Bearer key-a"},
        timeout=60,
    )
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and error["code"] == reply.status_code
    snapshot = server.model.snapshot
    assert snapshot.cache.used_blocks == 0 and snapshot.running == snapshot.waiting == 0


def test_a_fault_ends_its_stream_with_response_failed_and_only_it(server, llm):
    fault = PoisonedForward(llm)
    url = f"{server.url}/v1/responses"
    headers = {"authorization": "Bearer key-a"}

    async def stream(text: str) -> list[dict]:
        events = []
        body = {"model": MODEL, "input": text, "max_output_tokens": 12, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", url, json=body, headers=headers) as reply,
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
    assert clean[-1]["type"] == "response.incomplete"  # 12 tokens, ignore_eos
    assert bad[-1]["type"] == "response.failed"
    assert any(e["type"] == "response.output_text.delta" for e in bad)  # it had started
    error = bad[-1]["response"]["error"]
    assert "internal error (id " in error["message"] and "secret" not in error["message"]
    assert [e["sequence_number"] for e in bad] == list(range(len(bad)))
    assert server.model.snapshot.cache.used_blocks == 0


def test_the_store_keeps_the_last_turns_and_a_chain_costs_linear_memory():
    store = ResponseStore(limit=3)

    def turn(i: int, previous: str | None) -> StoredTurn:
        asked = [{"role": "user", "content": f"q{i}"}]
        reply = {"role": "assistant", "content": f"a{i}"}
        return StoredTurn("t", asked, reply, previous, {"id": f"r{i}"})

    store.put("r0", turn(0, None))
    store.put("r1", turn(1, "r0"))
    store.put("r2", turn(2, "r1"))
    assert [m["content"] for m in store.history("r2", "t")] == ["q0", "a0", "q1", "a1", "q2", "a2"]
    assert all(len(t.messages) == 1 for t in store._turns.values())  # each its own input only
    with pytest.raises(APIError, match="not found"):
        store.history("r2", "someone else")
    store.put("r3", turn(3, "r2"))  # r0 dropped: the chain through it is gone
    with pytest.raises(APIError, match="r0"):
        store.history("r3", "t")


def test_input_items_become_chat_messages():
    got = input_messages(
        [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "reasoning", "summary": []},
            {"role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
        ]
    )
    assert [m["role"] for m in got] == ["system", "user", "assistant", "tool", "tool"]
    assert got[2]["content"] == "calling"  # the text and its calls: one turn
    assert got[2]["tool_calls"] == [
        {"name": "f", "arguments": {"x": 1}},
        {"name": "g", "arguments": {}},
    ]
    assert [m["content"] for m in got[3:]] == ["one", "two"]


def test_a_prompt_past_the_context_is_named_in_openais_code(server):
    """Agents (Codex, LangChain's trimmers) tell a conversation past the context by the
    error's ``code`` or its words ("maximum context length"), to compact it and retry."""
    a, _ = clients(server)
    long = "word " * 9000
    calls = (
        lambda: a.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4
        ),
        lambda: a.completions.create(model=MODEL, prompt=long, max_tokens=4),
        lambda: a.responses.create(model=MODEL, input=long, max_output_tokens=4),
    )
    for call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.code == "context_length_exceeded"
        assert "maximum context length is 8192 tokens" in refused.value.message
    other = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL},
                       headers={"authorization": "Bearer key-a"}, timeout=60)  # fmt: skip
    assert other.status_code == 400 and other.json()["error"]["code"] == 400  # the others
    snapshot = server.model.snapshot
    assert snapshot.cache.used_blocks == 0 and snapshot.running == snapshot.waiting == 0
