"""A thinking model's replies over HTTP: reasoning apart from content in each API's shape
(Ollama's ``thinking``, OpenAI's ``reasoning_content``, Anthropic's thinking blocks,
Responses' reasoning items), whole and streamed; each API's switch reaches the template;
a grammar-held reply has no reasoning; a model that does not think refuses ``think``.

The default model does not think: its server here gets a thinking template (ChatML whose
generation prompt opens ``<think>`` unless ``enable_thinking`` is false, as Qwen3's
thinking variants do). What the model writes inside is its own, and it never closes the
block; where a test needs the block closed mid-reply, ``Scripted`` makes the model
write a given reply (its logits, one token at a time), cut into tokens as any reply."""

from __future__ import annotations

import contextlib
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
try:
    import ollama
except ImportError:  # the dev extra has it; the rest of the module runs without
    ollama = None

from kvpool import LLM  # noqa: E402
from kvpool.server.reasoning import ThinkSplit  # noqa: E402
from tests.inprocess_server import InProcessServer  # noqa: E402

MODEL = "smollm2:135m"
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# DeepSeek-R1's kind: the block opened whatever enable_thinking says
ALWAYS_OPEN_TEMPLATE = THINKING_TEMPLATE.split("{% if enable_thinking")[0] + "<think>\n{% endif %}"
QUESTION = [{"role": "user", "content": "What is two plus two?"}]
# a reply whose reasoning ends mid-reply (the prompt opened the block)
REPLY = "Two and two make four, I think.</think>\n\nIt is 4, as <b>bold</b> says."


class Scripted:
    """The runner's forward (the test reaches inside the engine on purpose) with every
    running request's next-token logits set so that greedy sampling writes ``text``'s
    tokens, then the end of the turn."""

    def __init__(self, llm: LLM, text: str) -> None:
        tokenizer = llm.loaded.tokenizer
        self.ids = [*tokenizer.encode(text, add_bos=False), tokenizer.eos_id]
        self.engine = llm.engine
        self.forward = llm.engine._runner.forward
        llm.engine._runner.forward = self  # type: ignore[method-assign]

    def __call__(self, chunks, **kw):
        out = self.forward(chunks, **kw)
        logits = out[0] if isinstance(out, tuple) else out
        manager = self.engine._manager
        by_table = {tuple(manager.block_table(r.seq_id)): r for r in self.engine._scheduler.running}
        for row, chunk in enumerate(chunks):
            request = by_table.get(tuple(chunk.block_table))
            if request is not None and row < logits.shape[0]:
                token = self.ids[min(len(request.output_ids), len(self.ids) - 1)]
                with torch.inference_mode():  # (the engine's tensors are inference tensors)
                    logits[row].fill_(-1e9)
                    logits[row, token] = 0.0
        return out

    def remove(self) -> None:
        self.engine._runner.forward = self.forward  # type: ignore[method-assign]


@contextlib.contextmanager
def scripted(server, text: str = REPLY):
    """The server's model writes ``text``; yields its reasoning and content."""
    script = Scripted(server.llm, text)
    written = server.llm.loaded.tokenizer.decode(script.ids[:-1])
    try:
        yield ThinkSplit.split(written, inside=True)
    finally:
        script.remove()


@contextlib.contextmanager
def template(server, text: str):
    tokenizer = server.llm.loaded.tokenizer
    before = tokenizer.chat_template
    tokenizer.chat_template, tokenizer._template = text, None
    try:
        yield
    finally:
        tokenizer.chat_template, tokenizer._template = before, None


@pytest.fixture(scope="module")
def servers():
    thinking = LLM(dtype="float32", progress=False, kv_cache_memory=16 * 2**20)
    tokenizer = thinking.loaded.tokenizer
    tokenizer.chat_template, tokenizer._template = THINKING_TEMPLATE, None
    plain = LLM(dtype="float32", progress=False, kv_cache_memory=16 * 2**20)
    both = InProcessServer(thinking), InProcessServer(plain)
    yield both
    for server in both:
        server.stop()


def _ollama(server, path: str, body: dict) -> dict:
    reply = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _ollama_stream(server, path: str, body: dict) -> list[dict]:
    body = {"model": MODEL, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        return [json.loads(line) for line in reply.iter_lines() if line]


def _raw(server, prompt: str, options: dict) -> str:
    """What the model writes after ``prompt`` (the template's rendering), unsplit."""
    body = {"prompt": prompt, "raw": True, "stream": False, "options": options}
    return _ollama(server, "/api/generate", body)["response"]


def _rendered(server, messages, **extra) -> str:
    return server.llm.loaded.tokenizer.render_chat(messages, **extra)


def _count(server, text: str) -> int:
    return len(server.llm.loaded.tokenizer.encode(text, add_bos=False))


OPTIONS = {"temperature": 0, "num_predict": 40}


@pytest.mark.parametrize("script", [None, REPLY])
def test_ollama_chat_splits_reasoning_from_content_whole_and_streamed(servers, script):
    """The model's own reply (all reasoning: it never closes the block), and one whose
    block closes mid-reply."""
    server = servers[0]
    with scripted(server, script) if script else contextlib.nullcontext() as split:
        if script is None:
            split = ThinkSplit.split(_raw(server, _rendered(server, QUESTION), OPTIONS), True)
        want_thinking, want_content = split
        assert want_thinking and (want_content or script is None)
        body = {"messages": QUESTION, "options": OPTIONS}
        whole = _ollama(server, "/api/chat", body | {"stream": False})["message"]
        assert whole.get("thinking", "") == want_thinking
        assert whole["content"] == want_content
        lines = _ollama_stream(server, "/api/chat", body)
        assert "".join(x["message"].get("thinking", "") for x in lines) == want_thinking
        assert "".join(x["message"]["content"] for x in lines) == want_content
        assert lines[-1]["done"] is True and "error" not in lines[-1]
        if ollama is not None:  # Ollama's own client, think asked for
            reply = ollama.Client(host=server.url).chat(
                model=MODEL, messages=QUESTION, options=OPTIONS, think=True
            )
            assert (reply.message.thinking, reply.message.content) == split


def test_ollama_generate_and_think_false(servers):
    server = servers[0]
    with scripted(server) as (thinking, content):
        body = {"prompt": QUESTION[0]["content"], "options": OPTIONS}
        reply = _ollama(server, "/api/generate", body | {"stream": False})
        assert (reply["thinking"], reply["response"]) == (thinking, content)
        lines = _ollama_stream(server, "/api/generate", body)
        assert "".join(x.get("thinking", "") for x in lines) == thinking
        assert "".join(x["response"] for x in lines) == content
    # think: false writes the empty block: the reply is content from its first token
    off = _raw(server, _rendered(server, QUESTION, enable_thinking=False), OPTIONS)
    reply = _ollama(server, "/api/chat", {"messages": QUESTION, "options": OPTIONS,
                                          "think": False, "stream": False})  # fmt: skip
    assert reply["message"]["content"] == off.lstrip() and "thinking" not in reply["message"]
    rendered = _rendered(server, QUESTION, enable_thinking=False)
    assert reply["prompt_eval_count"] == _count(server, rendered)


@pytest.mark.parametrize("kind", ["qwen3", "always-open"])
def test_a_reply_a_grammar_holds_has_no_reasoning(servers, kind):
    """A format's grammar holds the reply from its first token: no reasoning fits, so the
    template's ``enable_thinking`` is false, and a block the prompt still opens (R1's
    kind of template) is closed in the prompt. The reply is the format's JSON, as
    content, on every API; a forced tool call the same."""
    server = servers[0]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with template(server, THINKING_TEMPLATE if kind == "qwen3" else ALWAYS_OPEN_TEMPLATE):
        prompt = _rendered(server, QUESTION, enable_thinking=False)
        prompt += "</think>\n\n" if kind == "always-open" else ""
        body = {"messages": QUESTION, "options": OPTIONS, "format": schema, "think": True}
        reply = _ollama(server, "/api/chat", body | {"stream": False})
        assert "thinking" not in reply["message"] and json.loads(reply["message"]["content"])
        assert reply["prompt_eval_count"] == _count(server, prompt)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        tool = {"type": "function", "function": {"name": "add", "parameters": schema}}
        forced = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=60, temperature=0, tools=[tool],
            tool_choice={"type": "function", "function": {"name": "add"}},
        )  # fmt: skip
        message = forced.choices[0].message
        assert message.tool_calls and getattr(message, "reasoning_content", None) is None
        anthropic = pytest.importorskip("anthropic")
        claude = anthropic.Anthropic(base_url=server.url, api_key="none")
        fmt = {"format": {"type": "json_schema", "schema": schema}}
        message = claude.messages.create(
            model=MODEL, max_tokens=40, messages=QUESTION, thinking={"type": "adaptive"},
            extra_body={"temperature": 0, "output_config": fmt},
        )  # fmt: skip
        assert [b.type for b in message.content] == ["text"]
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == _count(
            server, prompt
        )


def test_openai_reasoning_content_and_a_resent_turn(servers):
    server = servers[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    raw = _raw(server, _rendered(server, QUESTION), OPTIONS)
    thinking, content = ThinkSplit.split(raw, inside=True)
    kw = {"model": MODEL, "messages": QUESTION, "max_tokens": 40, "temperature": 0}
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == (thinking, content)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == content
    off = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs":
                                                           {"enable_thinking": False}})  # fmt: skip
    none = client.chat.completions.create(**kw, reasoning_effort="none")
    assert off.choices[0].message.content == none.choices[0].message.content
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    # a turn sent back with its reasoning renders it (the template's reasoning_content)
    turn = {"role": "assistant", "content": "Four.", "reasoning_content": "2 + 2 = 4"}
    follow = [*QUESTION, turn, {"role": "user", "content": "And three plus three?"}]
    usage = client.chat.completions.create(**{**kw, "messages": follow, "max_tokens": 1}).usage
    rendered = _rendered(server, follow)
    assert "<think>\n2 + 2 = 4\n</think>" in rendered
    assert usage.prompt_tokens == len(server.llm.loaded.tokenizer.encode(rendered, add_bos=False))


def test_a_model_that_does_not_think_refuses_think_and_says_so(servers):
    plain = servers[1]
    show = _ollama(plain, "/api/show", {})
    assert "thinking" not in show["capabilities"] and "tools" in show["capabilities"]
    assert "thinking" in _ollama(servers[0], "/api/show", {})["capabilities"]
    body = {"model": MODEL, "messages": QUESTION, "think": True, "stream": False}
    reply = httpx.post(f"{plain.url}/api/chat", json=body, timeout=60)
    assert reply.status_code == 400 and "does not support thinking" in reply.json()["error"]
    for bad in ({"think": "max"}, {"think": 3}):
        reply = httpx.post(f"{servers[0].url}/api/chat", json=body | bad, timeout=60)
        assert reply.status_code == 400, reply.text
    client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="does not support thinking"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                       reasoning_effort="high")  # fmt: skip
    # think false on a model that does not think: its default, nothing to switch off
    reply = httpx.post(f"{plain.url}/api/chat", json=body | {"think": False}, timeout=60)
    assert reply.status_code == 200 and "thinking" not in reply.json()["message"]


def test_anthropic_thinking_blocks_whole_and_streamed(servers):
    anthropic = pytest.importorskip("anthropic")
    server = servers[0]
    client = anthropic.Anthropic(base_url=server.url, api_key="none")
    kw = {"model": MODEL, "max_tokens": 40, "messages": QUESTION,
          "thinking": {"type": "enabled", "budget_tokens": 1024},
          "extra_body": {"temperature": 0}}  # (newer SDKs take it only there)  # fmt: skip
    with scripted(server) as (thinking, content):
        message = client.messages.create(**kw)
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert (message.content[0].thinking, message.content[1].text) == (thinking, content)
        with client.messages.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_message()

    def blocks(content):
        return [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in content]

    assert blocks(final.content) == blocks(message.content)
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert kinds.index("signature_delta") < kinds.index("text_delta")  # the first block closed
    # disabled: the template's empty block, the reply all text
    off = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
    # a thinking block sent back is the turn's reasoning, as the template renders it
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "2 + 2 = 4", "signature": ""},
        {"type": "text", "text": "Four."}]}  # fmt: skip
    follow = [*QUESTION, turn, {"role": "user", "content": "And three plus three?"}]
    counted = client.messages.count_tokens(model=MODEL, messages=follow).input_tokens
    as_chat = {"role": "assistant", "content": "Four.", "reasoning_content": "2 + 2 = 4"}
    rendered = _rendered(server, [*QUESTION, as_chat, follow[-1]])
    assert counted == len(server.llm.loaded.tokenizer.encode(rendered, add_bos=False))
    # a model that does not think takes thinking as Claude Code sends it, and ignores it
    plain = anthropic.Anthropic(base_url=servers[1].url, api_key="none")
    reply = plain.messages.create(model=MODEL, max_tokens=4, messages=QUESTION,
                                  thinking={"type": "adaptive"})  # fmt: skip
    assert [b.type for b in reply.content] == ["text"]


def test_responses_reasoning_items_whole_streamed_and_continued(servers):
    server = servers[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    kw = {"model": MODEL, "input": QUESTION[0]["content"], "max_output_tokens": 40,
          "temperature": 0}  # fmt: skip
    with scripted(server) as (thinking, content):
        first = client.responses.create(**kw)
        assert [item.type for item in first.output] == ["reasoning", "message"]
        assert first.output[0].content[0].text == thinking and first.output_text == content
        with client.responses.stream(**kw) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == ["reasoning", "message"]
    deltas = [e for e in events if e.type.endswith(".delta")]
    assert "".join(e.delta for e in deltas if e.type == "response.reasoning_text.delta") == thinking
    assert "".join(e.delta for e in deltas if e.type == "response.output_text.delta") == content
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    # a continuation renders the stored turn with its reasoning (the template's choice)
    follow = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="And three plus three?",
        max_output_tokens=1,
    )  # fmt: skip
    turn = {"role": "assistant", "content": content, "reasoning_content": thinking}
    again = [*QUESTION, turn, {"role": "user", "content": "And three plus three?"}]
    rendered = _rendered(server, again)
    assert follow.usage.input_tokens == len(
        server.llm.loaded.tokenizer.encode(rendered, add_bos=False)
    )
    # the same conversation sent whole, the reasoning item included, is the same prompt
    items = [{"role": "user", "content": QUESTION[0]["content"]},
             *[item.model_dump(exclude_none=True) for item in first.output],
             {"role": "user", "content": "And three plus three?"}]  # fmt: skip
    whole = client.responses.create(model=MODEL, input=items, max_output_tokens=1, store=False)
    assert whole.usage.input_tokens == follow.usage.input_tokens
    off = client.responses.create(**kw, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
