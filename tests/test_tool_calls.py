"""Tool calls: the request's tools rendered into the prompt, the model's calls parsed out
of its text (Hermes / Qwen2.5 tags and Llama 3.x JSON), streamed too; ``tool_choice``
forced by a grammar; a two-turn conversation through the real ``openai`` client that
reuses the first turn's cached prefix; bad tools refused."""

from __future__ import annotations

import json

import pytest

from kvpool.server.errors import APIError
from kvpool.server.tools import (
    HERMES,
    LLAMA3,
    CallStream,
    chat_messages,
    check_tools,
    forced_call,
    parse_calls,
    tool_format,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_hermes_calls_are_parsed_out_of_the_text():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
    )
    content, calls = parse_calls(text, HERMES)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert calls[0].openai()["function"]["arguments"] == '{"city": "Paris"}'
    assert calls[0].ollama() == {
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}
    }
    # a call cut short by the stop token still parses; broken JSON stays text
    assert parse_calls('<tool_call>{"name": "get_time", "arguments": {}}', HERMES)[1]
    assert parse_calls("<tool_call>{not json</tool_call>", HERMES) == (
        "<tool_call>{not json</tool_call>",
        [],
    )


def test_llama3_calls_are_parsed_from_a_json_reply():
    content, calls = parse_calls(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}',
        LLAMA3,
    )
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert parse_calls("The answer is {x}", LLAMA3) == ("The answer is {x}", [])
    assert tool_format("... <|python_tag|> ...") == LLAMA3
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") == HERMES


def test_a_stream_holds_back_what_may_be_a_call():
    stream = CallStream(HERMES)
    sent = [
        stream.feed(p)
        for p in [
            "Sure",
            ", one moment <to",
            'ol_call>\n{"name": ',
            '"get_time", "arguments": {}}\n</tool_call>',
        ]
    ]
    assert "".join(sent) == "Sure, one moment "
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    plain = CallStream(HERMES)
    sent = [plain.feed(p) for p in ["a <", "b> c"]]
    assert "".join(sent) + plain.finish()[0] == "a <b> c"
    llama = CallStream(LLAMA3)
    assert llama.feed('{"name": "get_time", ') == ""
    assert llama.feed('"parameters": {}}') == ""
    assert [c.name for c in llama.finish()[1]] == ["get_time"]
    words = CallStream(LLAMA3)
    assert words.feed("Hello") == "Hello"


@pytest.mark.parametrize(
    "tools, message",
    [
        ([{"type": "function", "function": {"description": "no name"}}], "name must be"),
        ([{"type": "function", "function": {"name": "a b"}}], "name must be"),
        ([{"type": "retrieval"}], "must be"),
        ([WEATHER, WEATHER], "distinct"),
        ({"name": "x"}, "must be a list"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema"),
    ],
)
def test_bad_tools_are_refused(tools, message):
    with pytest.raises(APIError, match=message):
        check_tools(tools)


def test_templates_without_tools_get_the_hermes_convention():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    out, extra = chat_messages(messages, check_tools([WEATHER]), plain)
    assert extra == {}
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tools>" in out[0]["content"]
    assert out[2]["content"].startswith("<tool_call>\n") and "Paris" in out[2]["content"]
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    # a template that renders tools itself gets them as its variable, calls as dicts
    aware = "{% for t in tools %}{{ t.function.name }}{% endfor %}{{ messages }}"
    out, extra = chat_messages(messages, check_tools([WEATHER]), aware)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_forced_calls_compile_and_complete_as_a_call_of_the_named_tool(default_tokenizer):
    pytest.importorskip("llguidance")
    from kvpool.engine.structured import GrammarCompiler

    compiler = GrammarCompiler(default_tokenizer, default_tokenizer.vocab_size)
    tools = check_tools([WEATHER, TIME])
    for fmt in (HERMES, LLAMA3):
        for choice, names in (
            ("required", {"get_weather", "get_time"}),
            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
        ):
            grammar = forced_call(tools, choice, fmt)
            state = compiler.start(grammar)
            text = default_tokenizer.decode(state.closing())
            _, calls = parse_calls(text, fmt)
            assert len(calls) == 1 and calls[0].name in names, text
    assert forced_call(tools, "auto", HERMES) is None
    with pytest.raises(APIError, match="not among"):
        forced_call(tools, {"type": "function", "function": {"name": "nope"}}, HERMES)


# -- through the real clients -------------------------------------------------------------
openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("llguidance")


def test_a_two_turn_tool_conversation_through_openai(fp32_server):
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="-")
    messages = [
        {"role": "system", "content": "You answer questions about the weather using tools."},
        {"role": "user", "content": "What is the weather in Paris right now?"},
    ]
    first = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in {"get_weather", "get_time"}
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    if call.function.name == "get_weather":
        assert isinstance(args["city"], str)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    second = client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=24
    )
    assert second.choices[0].message.content is not None or second.choices[0].message.tool_calls
    # the second turn starts with the first one's prompt: its blocks come from the cache
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (first.usage.prompt_tokens // 16) - 16 > 0
    # streamed, a named tool: the call arrives as a tool_calls delta, the reason says so
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages[:2],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    calls, reasons, content = [], [], ""
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert [c.function.name for c in calls] == ["get_time"] and "tool_calls" in reasons
    assert "<tool_call>" not in content


def test_bad_tools_get_a_400_on_both_apis(fp32_server):
    import httpx

    ask = [{"role": "user", "content": "hi"}]
    nameless = [{"type": "function", "function": {"description": "x"}}]
    r = httpx.post(
        f"{fp32_server.url}/v1/chat/completions",
        json={"model": "smollm2", "messages": ask, "tools": nameless},
    )
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    r = httpx.post(
        f"{fp32_server.url}/api/chat", json={"model": "smollm2", "messages": ask, "tools": nameless}
    )
    assert r.status_code == 400 and "name" in r.json()["error"]
    r = httpx.post(
        f"{fp32_server.url}/v1/chat/completions",
        json={
            "model": "smollm2",
            "messages": ask,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert r.status_code == 400 and "not among" in r.json()["error"]["message"]


def test_ollama_chat_with_tools_answers_in_its_shape(fp32_server):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=fp32_server.url)
    reply = client.chat(
        model="smollm2",
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 40},
    )
    calls = reply.message.tool_calls or []
    assert all(c.function.name == "get_weather" for c in calls)
    assert reply.message.content is not None
    # a tool result continues the conversation
    follow = client.chat(
        model="smollm2",
        messages=[
            {"role": "user", "content": "Weather in Rome?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
                ],
            },
            {"role": "tool", "content": "sunny, 25 C", "tool_name": "get_weather"},
        ],
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 16},
    )
    assert follow.done and follow.prompt_eval_count > 0
