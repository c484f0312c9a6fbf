"""Tool calls: the request's ``tools`` into the prompt, the model's calls out of its text.

Two formats cover the families kvpool runs, told apart by the model's chat template:

- ``hermes`` (Qwen2.5, and every template that does not render tools itself, such as the
  built-in SmolLM2's): each call is ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``. A template without tool support gets the tools in its system message
  (kvpool's wording, the Hermes tags), calls already made as ``<tool_call>`` text in the
  assistant turns, and tool results as ``<tool_response>`` user turns.
- ``llama3`` (Llama 3.1 / 3.2 templates, which mention ``<|python_tag|>``): the reply is
  one JSON object ``{"name": ..., "parameters": {...}}`` (several joined by ``;``).

Templates that render tools themselves get ``tools`` as the Jinja variable of that name
and the conversation's calls as ``tool_calls`` with dict arguments (the Hugging Face
convention). ``tool_choice`` ``required`` or a named function forces a call with a
grammar (the call's JSON matches the tool's parameter schema); ``none`` leaves the tools
out; ``auto`` (the default) lets the model choose and parses what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvpool.engine.structured import ResponseFormat
from kvpool.server import reasoning
from kvpool.server.errors import bad_request

HERMES, LLAMA3 = "hermes", "llama3"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }
        if index is not None:
            out["index"] = index
        return out

    def ollama(self) -> dict[str, Any]:
        return {"function": {"name": self.name, "arguments": self.arguments}}


def check_tools(raw: Any) -> list[dict[str, Any]]:
    """The request's tools, each ``{"type": "function", "function": {"name", ...}}``
    with a JSON-schema object as ``parameters`` (400 otherwise)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("tools must be a list")
    tools = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise bad_request(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object")
        tools.append({"type": "function", "function": {**fn, "parameters": params}})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct names")
    return tools


def message_calls(raw: list[Any]) -> list[dict[str, Any]]:
    """A conversation turn's earlier calls, from either API's shape (OpenAI's arguments
    are a JSON string, Ollama's an object), as ``[{"name", "arguments": dict}]``."""
    calls = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("tool_calls entries need function.name")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad_request("tool_calls function.arguments must be JSON") from None
        if not isinstance(args, dict):
            raise bad_request("tool_calls function.arguments must be an object")
        calls.append({"name": fn["name"], "arguments": args})
    return calls


def tool_format(template: str) -> str:
    return LLAMA3 if _PYTHON_TAG in template else HERMES


def template_takes_tools(template: str) -> bool:
    return "tools" in template


def chat_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], template: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation as the template should see it, and the extra template variables.
    ``messages``: role, content, and ``tool_calls`` (``[{"name", "arguments": dict}]``)
    on assistant turns that made calls."""
    if template_takes_tools(template):
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in m["tool_calls"]
                ]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    # A template that knows nothing of tools: the Hermes convention, written in.
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["name"], "arguments": c["arguments"]})
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        rest = {k: v for k, v in m.items() if k != "tool_calls"}  # reasoning_content...
        out.append({**rest, "role": role, "content": content})
    if tools:
        described = "\n".join(json.dumps(t) for t in tools)
        guide = (
            "# Tools\n\nYou can call functions to help answer. Their signatures, one per "
            f"line, are inside <tools></tools>:\n<tools>\n{described}\n</tools>\n\n"
            "To call one, reply with a JSON object holding its name and arguments inside "
            '<tool_call></tool_call> tags:\n<tool_call>\n{"name": "<function name>", '
            '"arguments": {<arguments as JSON>}}\n</tool_call>'
        )
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{guide}"}
        else:
            out.insert(0, {"role": "system", "content": guide})
    return out, {}


def forced_call(tools: list[dict[str, Any]], choice: Any, fmt: str) -> ResponseFormat | None:
    """The grammar ``tool_choice`` asks for: None for ``auto``/``none``; a call of any
    tool for ``required``; a call of the named one for ``{"type": "function",
    "function": {"name": ...}}``."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools")
    else:
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    if not tools:
        raise bad_request("tool_choice needs tools")
    key = "parameters" if fmt == LLAMA3 else "arguments"
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    key: t["function"]["parameters"],
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in chosen
        ]
    }
    if fmt == LLAMA3:
        return ResponseFormat.json_schema(schema)
    call = json.dumps(schema)
    return ResponseFormat.lark(
        f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {call}\n'
    )


def parse_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """The reply's text without its calls, and the calls (none if it made none or they
    do not parse: then the text is left whole)."""
    if fmt == LLAMA3:
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call(part) for part in body.split(";") if part.strip()]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", [c for c in calls if c is not None]
    found = [_call(m.group(1)) for m in _CALL.finditer(text)]
    calls = [c for c in found if c is not None]
    if not calls:
        return text, []
    return _CALL.sub("", text).strip(), calls


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], args, f"call_{uuid.uuid4().hex[:24]}")


class CallStream:
    """Splits a streamed reply into content to send now and calls to send at the end:
    text is held back from where a call may begin (``<tool_call>``, or for ``llama3`` a
    reply that opens with ``{`` or the python tag) until the end decides."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        """The part of the text so far that can be sent as content now."""
        self.text += delta
        if self.fmt == LLAMA3:
            head = self.text.lstrip()
            # (a head that the tag starts with, or that starts with the tag, is held)
            if not head or head.startswith("{") or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]):
                return ""
            safe = len(self.text)
        else:
            start = self.text.find("<tool_call>", self.sent)
            if start >= 0:
                safe = start
            else:  # hold back a tail that may be the tag's beginning
                safe = len(self.text)
                for k in range(min(len("<tool_call>") - 1, len(self.text)), 0, -1):
                    if "<tool_call>".startswith(self.text[-k:]):
                        safe = len(self.text) - k
                        break
        out = self.text[self.sent : max(self.sent, safe)]
        self.sent = max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the content not yet sent, and the calls."""
        content, calls = parse_calls(self.text, self.fmt)
        if not calls:
            return self.text[self.sent :], []
        rest = content[self.sent :] if content.startswith(self.text[: self.sent]) else ""
        return rest, calls


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its run: the tools in its prompt (none for
    ``tool_choice: none``), the model's call format, and the grammar that forces a call."""

    tools: list[dict[str, Any]]
    fmt: str
    forced: ResponseFormat | None

    def stream(self) -> CallStream | None:
        return CallStream(self.fmt) if self.tools else None

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_calls(text, self.fmt) if self.tools else (text, [])


def prepare(
    model: Any,
    messages: list[dict[str, Any]],
    raw_tools: Any,
    choice: Any,
    prefill: str = "",
    template_extra: dict[str, Any] | None = None,
    constrained: bool = False,
) -> tuple[list[int], ToolPlan]:
    """The prompt's token ids with the tools rendered in, and the plan (400s for bad
    tools or a ``tool_choice`` that names none of them). ``prefill``: the start of the
    reply, written for the model to continue (Anthropic's last assistant turn);
    ``template_extra``: more template variables (``enable_thinking``); ``constrained``:
    a response format's grammar holds the reply from its first token, as a forced call's
    does, so a thinking model answers without reasoning (``reasoning.prompt_ids``)."""
    tools = check_tools(raw_tools)
    template = model.chat_template
    fmt = tool_format(template)
    forced = (
        forced_call(tools, choice, fmt) if tools or choice not in (None, "auto", "none") else None
    )
    shown = [] if choice == "none" else tools
    rendered, extra = chat_messages(messages, shown, template)

    def encode(more: dict[str, Any], start: str) -> list[int]:
        return model.encode_chat(rendered, **{**extra, **more}, prefill=start)

    constrained = constrained or forced is not None
    ids = reasoning.prompt_ids(model, encode, template_extra or {}, prefill, constrained)
    return ids, ToolPlan(shown, fmt, forced)
