"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``), the API the OpenAI Agents SDK and newer clients call, on the same
engine, templates, tool parsing and grammars as chat completions.

A request's ``input`` (a string, or items: messages with text parts, ``function_call``
and ``function_call_output``) and ``instructions`` become chat messages; function
``tools``, ``tool_choice`` and ``text.format`` map to their chat forms. The reply's
``output`` holds a ``message`` (its ``output_text``) and a ``function_call`` item per
call the model made; a stream sends Responses' events, from ``response.created`` to
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it,
``response.failed`` when the request failed).

Stored responses (``store``, true by default) let ``previous_response_id`` continue a
conversation: the server rebuilds it from the chain of stored turns (each holds only its
own input and output, so a long chain costs linear memory), and the prefix cache serves
the tokens it already holds (``response_store``: the last 1,024, in memory; a tenant
sees only its own). ``namespace`` tools' functions are offered as ``namespace.name``
(their calls name both apart); tools OpenAI's servers run (web search, ...) and
freeform ``custom`` tools are left out of the prompt. Not supported (400): non-text
content, ``item_reference`` items, ``background``.

A thinking model's (Qwen3) reasoning is a ``reasoning`` item before the message (its
``reasoning_text`` content; streamed as ``response.reasoning_text.delta``); sent back,
a reasoning item's text is the next assistant turn's reasoning, as the template renders
it. ``reasoning.effort`` ``none`` switches it off, any other effort on (for a model that
does not think, its default: Codex sends an effort to every model).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvpool.engine.sampling import SamplingParams
from kvpool.server import logprobs, reasoning, tools
from kvpool.server.errors import bad_request, read_json, stream_error
from kvpool.server.formats import constrained, openai_response_format
from kvpool.server.generation import Generation, Outcome
from kvpool.server.params import openai_params
from kvpool.server.response_store import ResponseStore, StoredTurn
from kvpool.server.state import State, tenant_of

router = APIRouter(prefix="/v1")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    # the extensions the chat route takes too (vLLM's, and ignore_eos for benchmarks)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False


# -- request -> chat form ----------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's or a tool output's text: a string, or text parts (input_text,
    output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise bad_request(f"{where}: only text content parts are supported (got {kind!r})")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as chat messages: messages by role (developer as system),
    ``function_call`` items as the calls of the assistant turn they follow (its text and
    calls one message, as a stored reply is), each ``function_call_output`` a tool
    message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}: role must be user, system, developer or assistant")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where)})
            if role == "assistant" and thought:
                messages[-1]["reasoning_content"], thought = thought, ""
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise bad_request(f"{where}: a function_call needs a name and arguments (JSON)")
            if isinstance(item.get("namespace"), str):  # a namespace's function, as shown
                name = f"{item['namespace']}.{name}"
            call = tools.message_calls([{"function": {"name": name, "arguments": arguments}}])
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if thought:
                last["reasoning_content"], thought = thought, ""
            last.setdefault("tool_calls", []).extend(call)
        elif kind == "function_call_output":
            output = _text(item.get("output", ""), where)
            messages.append({"role": "tool", "content": output})
        elif kind == "reasoning":  # its text, where it has some (encrypted: nothing)
            parts = item.get("content") if isinstance(item.get("content"), list) else []
            thought += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise bad_request(
                f"{where}: item type {kind!r} is not supported (message, function_call, "
                "function_call_output)"
            )
    return messages


def _function(tool: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    if prefix and isinstance(function.get("name"), str):
        function["name"] = f"{prefix}.{function['name']}"
    return {"type": "function", "function": function}


def chat_tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools (``name`` and ``parameters`` at the top) in chat's
    form, a ``namespace``'s functions named ``namespace.name``. Tools that OpenAI's
    servers run (web and file search, code interpreter, ...) and freeform ``custom``
    tools are left out of the prompt: nothing here runs them, and the model calls only
    what it is shown (Codex sends ``web_search`` with every request)."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object")
        if tool.get("type") == "function":
            out.append(_function(tool))
        elif tool.get("type") == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not isinstance(tool.get("name"), str):
                raise bad_request(f"tools[{i}]: a namespace needs a name and its tools (a list)")
            out += [_function(t, tool["name"]) for t in inner
                    if isinstance(t, dict) and t.get("type") == "function"]  # fmt: skip
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "auto", "none", "required" or a function')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a type")
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def prompt(
    model: Any, body: ResponsesBody, history: list[dict[str, Any]], own: list[dict[str, Any]]
) -> tuple[list[int], tools.ToolPlan]:
    """The request's prompt ids and tool plan: its instructions as the system message,
    the stored conversation it continues, its own input (``kvpool.cluster`` tokenizes
    stateless requests through this too, to route them by prefix)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    choice = chat_tool_choice(body.tool_choice)
    extra = reasoning.template_kwargs(model, _think(model, body.reasoning))
    messages = [*system, *history, *own]
    constrained = (chat_response_format(body.text) or {}).get("type", "text") != "text"
    return tools.prepare(model, messages, chat_tools(body.tools), choice, template_extra=extra,
                         constrained=constrained)  # fmt: skip


def _think(model: Any, asked: dict[str, Any] | None) -> bool | None:
    """``reasoning.effort`` as the template's switch (``reasoning.offered``): ``none`` is
    off, any other effort on."""
    effort = (asked or {}).get("effort")
    return None if effort is None else reasoning.offered(model, effort != "none")


def new_response_id(tag: str) -> str:
    """A response id; ``tag`` (a cluster replica's id) goes into it, so that the ingress
    sends a request continuing it to the replica that stored it (``replica_of``)."""
    return f"resp_{tag}_{uuid.uuid4().hex}" if tag else f"resp_{uuid.uuid4().hex}"


def replica_of(response_id: str) -> str | None:
    """The tag ``new_response_id`` put into an id, if any."""
    parts = response_id.split("_")
    return parts[1] if len(parts) == 3 and parts[0] == "resp" and parts[1] else None


def _params_body(body: ResponsesBody) -> SimpleNamespace:
    """The fields ``openai_params`` reads (it takes chat's and completions' bodies as
    they are), from a Responses request: no stop strings, n, seed or penalties in this
    API."""
    return SimpleNamespace(
        max_completion_tokens=body.max_output_tokens,
        max_tokens=None,
        temperature=body.temperature,
        top_p=body.top_p,
        presence_penalty=None,
        frequency_penalty=None,
        seed=None,
        stop=None,
        n=1,
        ignore_eos=body.ignore_eos,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
    )


# -- reply ------------------------------------------------------------------------------


def _usage(out: Outcome) -> dict[str, Any]:
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.cached_prompt_tokens},
        "output_tokens": out.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def _message_item(mid: str, text: str, status: str, lps: list | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if lps is not None:
        part["logprobs"] = lps
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


def _namespaces(raw: list[dict[str, Any]] | None) -> frozenset[str]:
    spaces = [t for t in raw or () if isinstance(t, dict) and t.get("type") == "namespace"]
    return frozenset(t["name"] for t in spaces if isinstance(t.get("name"), str))


def _call_item(call: tools.ToolCall, namespaces: frozenset[str]) -> dict[str, Any]:
    """A ``function_call`` item; a call of ``namespace.name`` (``chat_tools``' naming)
    names its function and its namespace apart, as OpenAI's do."""
    item = {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": json.dumps(call.arguments),
        "status": "completed",
    }
    space, dot, name = call.name.partition(".")
    if dot and space in namespaces:
        item["name"], item["namespace"] = name, space
    return item


def _reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"id": rid, "type": "reasoning", "summary": [], "content": content, "status": status}


def _reply_message(content: str, calls: list[tools.ToolCall], thinking: str) -> dict[str, Any]:
    """The reply as the assistant turn of the next request's conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = thinking
    if calls:  # (message_calls' form: a name and its arguments as an object)
        message["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
    return message


@dataclass
class _Reply:
    """One request's reply in the making: its ids, what it echoes back, where it is
    stored; ``response`` builds the response object at any stage of it."""

    body: ResponsesBody
    model: Any
    params: SamplingParams
    plan: tools.ToolPlan
    store: ResponseStore
    tenant: str
    own: list[dict[str, Any]]  # the request's own input, as chat messages (stored)
    want_logprobs: bool
    rid: str  # new_response_id's, with the server's tag
    thinks_inside: bool | None = None  # None: the model does not think; else the prompt opened
    mid: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], out: Outcome | None) -> dict:
        body = self.body
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status != "in_progress" else None,
            "model": self.model.name,
            "output": output,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": True if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "truncation": "disabled",
            "usage": _usage(out) if out is not None else None,
        }  # fmt: skip

    def token_logprobs(self, items: Any) -> list[dict[str, Any]]:
        return logprobs.openai_chat(items, self.model.piece)["content"]

    def split(self, text: str) -> tuple[str, str]:
        """A whole reply's reasoning and the rest."""
        if self.thinks_inside is None:
            return "", text
        return reasoning.ThinkSplit.split(text, self.thinks_inside)

    def finish(self, out: Outcome, streamed: bool = False) -> dict[str, Any]:
        """The finished response (stored where asked): a reasoning item where the model
        reasoned; a message where there is text, no call, or a streamed message; then a
        ``function_call`` item per call."""
        sample = out.samples[0]
        thinking, text = self.split(sample.text)
        content, calls = self.plan.split(text)
        lps = self.token_logprobs(sample.logprobs) if self.want_logprobs else None
        status = "incomplete" if sample.finish_reason == "length" else "completed"
        items = [_reasoning_item(self.reasoning_id, thinking, "completed")] if thinking else []
        if content or not calls or streamed:
            items.append(_message_item(self.mid, content, status, lps))
        items += [_call_item(c, _namespaces(self.body.tools)) for c in calls]
        final = self.response(status, items, out)
        if self.body.store:
            turn = StoredTurn(self.tenant, self.own, _reply_message(content, calls, thinking),
                              self.body.previous_response_id, final)  # fmt: skip
            self.store.put(self.rid, turn)
        return final

    def _message_start(self, index: int) -> list[dict[str, Any]]:
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": {**_message_item(self.mid, "", "in_progress", None), "content": []}},
            {"type": "response.content_part.added", "item_id": self.mid, "output_index": index,
             "content_index": 0, "part": part},
        ]  # fmt: skip

    def _reasoning_events(self, text: str, done: bool) -> list[dict[str, Any]]:
        """The reasoning item's opening events (``done``: its closing ones, ``text`` whole)."""
        rid, part = self.reasoning_id, {"type": "reasoning_text", "text": text}
        where = {"item_id": rid, "output_index": 0, "content_index": 0}
        if not done:
            return [{"type": "response.output_item.added", "output_index": 0,
                     "item": _reasoning_item(rid, "", "in_progress")},
                    {"type": "response.content_part.added", **where, "part": part}]  # fmt: skip
        return [{"type": "response.reasoning_text.done", **where, "text": text},
                {"type": "response.content_part.done", **where, "part": part},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": _reasoning_item(rid, text, "completed")}]  # fmt: skip

    async def events(self, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        """Responses' stream events (without their sequence numbers): a thinking model's
        reasoning as it comes (its item closed when the text begins), the text as it
        comes (tool-call markup held back, as chat's stream does), then each item's
        closing events, then ``response.completed`` (or ``.incomplete``)."""
        mid, started, split = self.mid, False, self.plan.stream()
        thoughts = None
        if self.thinks_inside is not None:
            thoughts = reasoning.ThinkSplit(self.thinks_inside)
        thought, held = "", []  # the reasoning so far; logprobs held while it goes on
        yield {"type": "response.created", "response": self.response("in_progress", [], None)}
        yield {"type": "response.in_progress", "response": self.response("in_progress", [], None)}
        async for delta in generation.deltas():
            thinking, text = reasoning.step(thoughts, delta.text, bool(delta.finish_reason))
            if thinking:
                if not thought:
                    for event in self._reasoning_events("", done=False):
                        yield event
                thought += thinking
                yield {"type": "response.reasoning_text.delta", "item_id": self.reasoning_id,
                       "output_index": 0, "content_index": 0, "delta": thinking}  # fmt: skip
            piece = split.feed(text) if split is not None else text
            if delta.finish_reason and split is not None:
                piece += split.finish()[0]
            lps = (
                self.token_logprobs(delta.logprobs) if self.want_logprobs and delta.logprobs else []
            )
            if thoughts is not None and not started and not piece:
                held, lps = held + lps, []  # (the message opens after the reasoning)
            if piece or lps:
                if not started:
                    started, lps, held = True, held + lps, []
                    for event in self._reasoning_events(thought, done=True) if thought else []:
                        yield event
                    for event in self._message_start(1 if thought else 0):
                        yield event
                yield {"type": "response.output_text.delta", "item_id": mid,
                       "output_index": 1 if thought else 0, "content_index": 0, "delta": piece,
                       "logprobs": lps}  # fmt: skip
        final = self.finish(generation.outcome, started)
        items = final["output"]
        if thought and not started:  # all reasoning (cut by max_output_tokens, or a call)
            for event in self._reasoning_events(thought, done=True):
                yield event
        at = 1 if thought else 0
        if at < len(items) and items[at]["type"] == "message":
            if not started:
                for event in self._message_start(at):
                    yield event
            part = items[at]["content"][0]
            yield {"type": "response.output_text.done", "item_id": mid, "output_index": at,
                   "content_index": 0, "text": part["text"],
                   "logprobs": part.get("logprobs") or []}  # fmt: skip
            yield {"type": "response.content_part.done", "item_id": mid, "output_index": at,
                   "content_index": 0, "part": part}  # fmt: skip
            yield {"type": "response.output_item.done", "output_index": at, "item": items[at]}
        for index, item in enumerate(items):
            if item["type"] != "function_call":
                continue
            fid = item["id"]
            yield {"type": "response.output_item.added", "output_index": index,
                   "item": {**item, "arguments": "", "status": "in_progress"}}  # fmt: skip
            yield {"type": "response.function_call_arguments.delta", "item_id": fid,
                   "output_index": index, "delta": item["arguments"]}  # fmt: skip
            yield {"type": "response.function_call_arguments.done", "item_id": fid,
                   "output_index": index, "name": item["name"],
                   "arguments": item["arguments"]}  # fmt: skip
            yield {"type": "response.output_item.done", "output_index": index, "item": item}
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield {"type": kind, "response": final}

    def sse(self, generation: Generation) -> StreamingResponse:
        """The events as server-sent events, numbered; a stream that fails ends with
        ``response.failed`` (its error in the response), as OpenAI's does."""

        async def frames() -> AsyncIterator[bytes]:
            sequence = 0
            try:
                async for event in self.events(generation):
                    event["sequence_number"] = sequence
                    sequence += 1
                    yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            except Exception as exc:
                status, message, kind = stream_error(exc, "a Responses stream")
                failed = self.response("failed", [], None)
                code = "server_error" if status >= 500 else kind
                failed["error"] = {"code": code, "message": message}
                event = {"type": "response.failed", "response": failed,
                         "sequence_number": sequence}  # fmt: skip
                yield f"event: response.failed\ndata: {json.dumps(event)}\n\n".encode()

        return StreamingResponse(frames(), media_type="text/event-stream")


@router.post("/responses")
async def create_response(http: Request, state: State) -> Any:
    body = await read_json(http, ResponsesBody)
    model = await state.resolve(http, body.model)
    tenant = tenant_of(http)
    store = state.responses
    if body.background:
        raise bad_request("background responses are not supported by kvpool")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request("max_output_tokens must be at least 1")
    own = input_messages(body.input)
    if not own:
        raise bad_request("input must not be empty")
    history = store.history(body.previous_response_id, tenant.name) if (
        body.previous_response_id
    ) else []  # fmt: skip
    ids, plan = prompt(model, body, history, own)
    fmt = openai_response_format(chat_response_format(body.text))
    if plan.forced is not None:
        if fmt is not None:
            raise bad_request("text.format cannot be combined with a forced tool_choice")
        fmt = plan.forced
    asked = None
    if LOGPROBS_INCLUDE in (body.include or []) or body.top_logprobs:
        asked = logprobs.requested(True, body.top_logprobs or 0, "responses")
    params = openai_params(_params_body(body), len(ids), model.context_length, asked)
    params = await constrained(params, fmt, model, len(ids))
    thoughts = reasoning.splitter(model, ids)
    inside = None if thoughts is None else thoughts.inside
    reply = _Reply(body, model, params, plan, store, tenant.name, own, asked is not None,
                   new_response_id(store.tag), inside)  # fmt: skip
    generation = await Generation.start(model, http, ids, params, tenant, state.metrics, "openai")
    if body.stream:
        return reply.sse(generation)
    return reply.finish(await generation.run())


@router.get("/responses/{rid}")
async def get_response(rid: str, http: Request, state: State) -> Any:
    return state.responses.get(rid, tenant_of(http).name).response


@router.delete("/responses/{rid}")
async def delete_response(rid: str, http: Request, state: State) -> Any:
    state.responses.delete(rid, tenant_of(http).name)
    return {"id": rid, "object": "response.deleted", "deleted": True}
