"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``),
the API that Claude Code, the ``anthropic`` SDK and LangChain's ``ChatAnthropic`` speak
(Ollama and llama.cpp serve it too: a client pointed at them with ``ANTHROPIC_BASE_URL``
works here unchanged), on the same engine, templates, tool parsing and grammars as chat
completions.

A request's ``system`` (a string or text blocks) and ``messages`` (text, ``tool_use`` and
``tool_result`` blocks, ``system`` turns within the conversation; ``thinking`` blocks
sent back are the turn's reasoning, ``redacted_thinking`` ones skipped) become chat messages;
a last ``assistant`` message is the start of the reply (a prefill), which the model
continues. Custom ``tools`` (``input_schema``), ``tool_choice`` (auto, any, tool, none)
and ``output_config.format`` (a JSON schema) map to their chat forms. The reply holds a
``text`` block and a ``tool_use`` block per call, after a ``thinking`` block where a thinking
model (Qwen3) reasoned first; ``stop_reason`` is ``end_turn``,
``max_tokens``, ``stop_sequence`` (``stop_sequence`` says which), ``tool_use`` or
``model_context_window_exceeded`` (the context filled before ``max_tokens``).

Claude Code's first system block, a billing header whose hash changes with each prompt,
is dropped: at the prompt's start it would give every request a prefix the cache has
never seen. ``usage.cache_read_input_tokens`` counts the prompt tokens the prefix cache served and
``input_tokens`` the rest (their sum is the prompt, as in Anthropic's usage): kvpool
caches every prompt's full blocks unasked, so ``cache_control`` marks are accepted and
need nothing, and ``cache_creation_input_tokens`` is 0. A stream sends Anthropic's
events, a ``ping`` every ``PING_SECONDS`` while nothing else goes (a long prompt being
computed), and ends in an ``error`` event if the request fails once started. Not
supported (400): image and document blocks, server tools. ``thinking`` switches a thinking
model's reasoning on (``enabled``, ``adaptive``) or off (``disabled``): a model that does
not think ignores it (Claude Code sends it to every model); ``budget_tokens`` and its
signature are not kept (``signature`` is empty). ``metadata`` and ``cache_control`` are
accepted and need nothing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kvpool.server import reasoning, tools
from kvpool.server.errors import anthropic_stream_error, bad_request, read_json, stream_error
from kvpool.server.formats import anthropic_output_format, constrained
from kvpool.server.generation import Generation, Outcome, Sample
from kvpool.server.params import anthropic_params
from kvpool.server.state import State, tenant_of

router = APIRouter(prefix="/v1")
PING_SECONDS = 10.0
T = TypeVar("T")


class MessagesBody(BaseModel):
    """A Messages request (``count_tokens`` takes the same, without ``max_tokens``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    messages: list[Any] = Field(default_factory=list)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


# -- request -> chat form ----------------------------------------------------------------


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise bad_request(f"{where}: only text blocks are supported here (got {kind!r})")
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}: a text block needs its text (a string)")
    return block["text"]


# Claude Code's first system block: a line of telemetry whose hash changes with every
# prompt; at the prompt's start it would make every request's prefix new to the cache.
BILLING_HEADER = "x-anthropic-billing-header:"


def _system_text(system: str | list[Any]) -> str:
    """``system`` without Claude Code's billing-header line (nothing for the model; vLLM
    drops it too)."""
    if isinstance(system, list):
        system = [b for b in system if not (isinstance(b, dict) and isinstance(
            b.get("text"), str) and b["text"].startswith(BILLING_HEADER))]  # fmt: skip
    elif system.startswith(BILLING_HEADER):
        system = system.partition("\n")[2]
    return _texts(system, "system")


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (``system``, a tool result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks")
    return "\n".join(_block_text(b, f"{where}[{i}]") for i, b in enumerate(content))


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant message: its text, and its ``tool_use`` blocks as the turn's calls
    (``tools.message_calls``' form)."""
    text, calls, thinking = [], [], []
    for i, block in enumerate(blocks):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_block_text(block, at))
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise bad_request(f"{at}: a tool_use block needs a name and an input object")
            calls.append({"name": name, "arguments": arguments})
        elif kind == "thinking":
            thinking.append(str(block.get("thinking") or ""))  # the template decides
        elif kind == "redacted_thinking":
            continue  # another model's encrypted reasoning: nothing to render
        else:
            raise bad_request(
                f"{at}: block type {kind!r} is not supported in an assistant message "
                "(text, tool_use, thinking)"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if any(thinking):
        message["reasoning_content"] = "".join(thinking)
    return message


def _user_turns(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user message: each ``tool_result`` a tool message, the text between them user
    messages (in the blocks' order)."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for i, block in enumerate(blocks):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_block_text(block, at))
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            result = _texts(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "content": result})
        else:
            raise bad_request(
                f"{at}: block type {kind!r} is not supported in a user message (text, "
                "tool_result; kvpool's models read text only)"
            )
    if not out and not text:
        raise bad_request(f"{where}: content must not be empty")
    if text:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def conversation(body: MessagesBody) -> tuple[list[dict[str, Any]], str]:
    """The request as chat messages, and its prefill: the text of a last assistant
    message, which the reply continues ("" where the conversation ends with the user)."""
    if not body.messages:
        raise bad_request("messages must not be empty")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.system) if body.system is not None else ""
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}: role must be user, assistant or system")
        content = message.get("content")
        if role == "system":  # a system turn within the conversation (Claude Code sends them)
            messages.append({"role": "system", "content": _texts(content, f"{where}.content")})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where}: content must be a string or a list of blocks")
        if role == "assistant":
            messages.append(_assistant_turn(blocks, where))
        else:
            messages.extend(_user_turns(blocks, where))
    prefill = ""
    if body.messages[-1].get("role") == "assistant":
        last = messages.pop()
        if last.get("tool_calls"):
            raise bad_request("the last message (the reply's start) cannot hold tool_use blocks")
        prefill = last["content"]
    return messages, prefill


def chat_tools(raw: list[Any] | None) -> list[dict[str, Any]] | None:
    """Custom tools (``name``, ``description``, ``input_schema``) in chat's form; server
    tools (web search, code execution, ...) are refused: nothing here runs them."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object")
        kind = tool.get("type") or "custom"
        if kind != "custom":
            raise bad_request(
                f"tools[{i}]: only custom tools (a name and an input_schema) are supported; "
                f"{kind!r} is a server tool"
            )
        function = {"name": tool.get("name")}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema", {"type": "object", "properties": {}})
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> Any:
    """``{"type": "auto" | "any" | "none"}`` or ``{"type": "tool", "name": ...}``, as
    chat's ``auto``, ``required``, ``none`` or a named function."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be {"type": "auto" | "any" | "none"} or '
                      '{"type": "tool", "name": ...}')  # fmt: skip


def prompt(model: Any, body: MessagesBody) -> tuple[list[int], tools.ToolPlan]:
    """The request's prompt ids (its prefill included) and tool plan (``kvpool.cluster``
    tokenizes through this too, to route by prefix)."""
    messages, prefill = conversation(body)
    choice = chat_tool_choice(body.tool_choice)
    extra = reasoning.template_kwargs(model, _think(model, body.thinking))
    constrained = bool((body.output_config or {}).get("format") or body.output_format)
    return tools.prepare(model, messages, chat_tools(body.tools), choice, prefill, extra,
                         constrained)  # fmt: skip


def _think(model: Any, thinking: dict[str, Any] | None) -> bool | None:
    """The request's ``thinking`` as the template's switch (``reasoning.offered``):
    ``disabled`` is off, ``enabled`` / ``adaptive`` on."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request("thinking.type: enabled, adaptive or disabled")
    return reasoning.offered(model, kind != "disabled")


# -- reply ------------------------------------------------------------------------------


def _usage(out: Outcome) -> dict[str, int]:
    return {
        "input_tokens": out.prompt_tokens - out.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": out.cached_prompt_tokens,
        "output_tokens": out.completion_tokens,
    }


def _tool_use(call: tools.ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
            "input": call.arguments}  # fmt: skip


async def with_pings(source: AsyncIterator[T], every: float) -> AsyncIterator[T | None]:
    """``source``'s items, and None each time ``every`` seconds pass without one. The
    pending item is waited for, never cancelled, between pings; closing this closes
    ``source``."""
    items = source.__aiter__()
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            got, pending = pending, None
            try:
                item = got.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


@dataclass
class _Reply:
    """One request's reply in the making; ``message`` builds the message object."""

    model: Any
    plan: tools.ToolPlan
    max_tokens: int  # as asked (the context may allow fewer)
    thoughts: reasoning.ThinkSplit | None = None  # a thinking model's (used once)
    mid: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                usage: dict[str, int]) -> dict[str, Any]:  # fmt: skip
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model.name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}  # fmt: skip

    def stop(self, sample: Sample, calls: list[tools.ToolCall]) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence``."""
        if calls:
            return "tool_use", None
        if sample.finish_reason == "length":
            full = len(sample.token_ids) >= self.max_tokens
            return ("max_tokens" if full else "model_context_window_exceeded"), None
        if sample.stop_string is not None:
            return "stop_sequence", sample.stop_string
        return "end_turn", None

    def finish(self, out: Outcome) -> dict[str, Any]:
        """The whole reply: a thinking block where the model reasoned, a text block where
        there is text or no call, then a ``tool_use`` block per call."""
        sample = out.samples[0]
        thinking, text = "", sample.text
        if self.thoughts is not None:
            thinking, text = self.thoughts.whole(text)
        text, calls = self.plan.split(text)
        content = [_thinking(thinking)] if thinking else []
        content += [{"type": "text", "text": text}] if text or not calls else []
        content += [_tool_use(c) for c in calls]
        return self.message(content, self.stop(sample, calls), _usage(out))

    async def events(self, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        """The stream's events: ``message_start`` at once (its usage counts the whole
        prompt; the last ``message_delta`` says what the cache served), a thinking
        model's reasoning block as it comes (closed by an empty ``signature_delta``),
        the text as it comes (tool-call markup held back, as chat's stream does), each
        call's ``tool_use`` block, then ``message_delta`` and ``message_stop``."""
        start_usage = {"input_tokens": generation.outcome.prompt_tokens,
                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                       "output_tokens": 0}  # fmt: skip
        yield {"type": "message_start", "message": self.message([], (None, None), start_usage)}
        yield {"type": "ping"}
        split, thoughts = self.plan.stream(), self.thoughts
        block, index, content = "", -1, []  # the open block's type and index; the text

        def close() -> list[dict[str, Any]]:  # the open block's last events
            end = [{"type": "content_block_stop", "index": index}]
            if block == "thinking":
                end.insert(0, {"type": "content_block_delta", "index": index,
                               "delta": {"type": "signature_delta", "signature": ""}})  # fmt: skip
            return end if block else []

        async for delta in with_pings(generation.deltas(), PING_SECONDS):
            if delta is None:
                yield {"type": "ping"}
                continue
            thinking, text = reasoning.step(thoughts, delta.text, bool(delta.finish_reason))
            content.append(text)
            piece = split.feed(text) if split is not None else text
            if delta.finish_reason and split is not None:
                piece += split.finish()[0]
            for kind, part in (("thinking", thinking), ("text", piece)):
                if not part:
                    continue
                if block != kind:  # reasoning comes first: a block never opens twice
                    for event in close():
                        yield event
                    block, index = kind, index + 1
                    yield _block_start(index, _thinking("") if kind == "thinking"
                                       else {"type": "text", "text": ""})  # fmt: skip
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": f"{kind}_delta", kind: part}}  # fmt: skip
        out = generation.outcome
        sample = out.samples[0]
        calls = self.plan.split("".join(content))[1]
        for event in close():
            yield event
        if block != "text" and not calls:  # an empty reply still has its text block
            index += 1
            yield _block_start(index, {"type": "text", "text": ""})
            yield {"type": "content_block_stop", "index": index}
        index += 1
        for call in calls:
            use = _tool_use(call)
            yield _block_start(index, {**use, "input": {}})
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta",
                             "partial_json": json.dumps(use["input"])}}  # fmt: skip
            yield {"type": "content_block_stop", "index": index}
            index += 1
        reason, sequence = self.stop(sample, calls)
        yield {"type": "message_delta", "delta": {"stop_reason": reason,
               "stop_sequence": sequence}, "usage": _usage(out)}  # fmt: skip
        yield {"type": "message_stop"}

    def sse(self, generation: Generation) -> StreamingResponse:
        """The events as server-sent events; a stream that fails ends in an ``error``
        event, as Anthropic's does."""

        async def frames() -> AsyncIterator[bytes]:
            try:
                async for event in self.events(generation):
                    yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            except Exception as exc:
                status, message, kind = stream_error(exc, "an Anthropic stream")
                yield anthropic_stream_error(status, message, kind)

        return StreamingResponse(frames(), media_type="text/event-stream")


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


@router.post("/messages")
async def create_message(http: Request, state: State) -> Any:
    body = await read_json(http, MessagesBody)
    model = await state.resolve(http, body.model)
    ids, plan = prompt(model, body)
    config = body.output_config or {}
    fmt = anthropic_output_format(config.get("format") or body.output_format)
    if plan.forced is not None:
        if fmt is not None:
            raise bad_request("output_config.format cannot be combined with a tool_choice that "
                              "forces a call (any, tool)")  # fmt: skip
        fmt = plan.forced
    params = anthropic_params(body, len(ids), model.context_length)
    params = await constrained(params, fmt, model, len(ids))
    generation = await Generation.start(
        model, http, ids, params, tenant_of(http), state.metrics, "anthropic"
    )
    reply = _Reply(model, plan, body.max_tokens, reasoning.splitter(model, ids))
    if body.stream:
        return reply.sse(generation)
    return reply.finish(await generation.run())


@router.post("/messages/count_tokens")
async def count_tokens(http: Request, state: State) -> Any:
    """The prompt's tokens as ``/v1/messages`` would compute them (its template, tools
    and prefill): exact, from the model's own tokenizer."""
    body = await read_json(http, MessagesBody)
    model = await state.resolve(http, body.model)
    return {"input_tokens": len(prompt(model, body)[0])}
