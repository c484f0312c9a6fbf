"""Thinking models (Qwen3, QwQ, DeepSeek-R1 distills): their reasoning apart from the reply.

Such a model writes ``<think>`` reasoning ``</think>`` before its answer; its chat template
shows it (the tags appear in the template) and takes ``enable_thinking`` (Qwen3: false
writes an empty think block, so the model answers at once). Some templates open the
block in the generation prompt itself (the reply then starts inside it).

- ``thinks(template)``: whether a model thinks.
- ``template_kwargs``: a request's switch (Ollama's ``think``, OpenAI clients'
  ``chat_template_kwargs.enable_thinking`` or ``reasoning_effort``) as the template's
  variable; asking a model that does not think to think is a 400, as Ollama answers
  (Anthropic's ``thinking`` and Responses' ``reasoning.effort``, which Claude Code and
  Codex send to every model, are the model's default there: their routes decide).
- ``ThinkSplit``: a reply's text, whole or streamed, into reasoning and content. Only a
  block at the start of the reply is reasoning (one written later is content, as the
  model wrote it). The tags are not part of either; the whitespace that follows each
  tag is dropped. A stream holds back a tail that may be the start of a tag, so the
  pieces it gives equal the whole text's split for any cut of the text (tested).

A reply that a grammar holds from its first token (a response format, a forced tool call)
has no room for reasoning: ``prompt_ids`` writes its prompt without it.

Ollama returns the reasoning as ``thinking`` (``message.thinking`` in chat), chat
completions as ``reasoning_content`` (the field llama.cpp's server and vLLM use),
Anthropic's Messages as a ``thinking`` block, Responses as a ``reasoning`` item; sent
back in a conversation, each becomes the template's ``reasoning_content``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.server.errors import bad_request

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str) -> bool:
    """Whether a chat template is a thinking model's (it writes the think tags)."""
    return OPEN in template and CLOSE in template


def template_kwargs(model: Any, think: bool | None) -> dict[str, Any]:
    """The template variables for a request's thinking switch (None: the model's default)."""
    if think is None:
        return {}
    if think and not thinks(model.chat_template):
        raise bad_request(f'"{getattr(model, "name", "the model")}" does not support thinking')
    return {"enable_thinking": bool(think)}


def openai_think(body: Any) -> bool | None:
    """An OpenAI-shaped request's switch: ``chat_template_kwargs.enable_thinking`` (vLLM's
    and llama.cpp's), else ``reasoning_effort`` (``none`` is off, any other effort on)."""
    kwargs = getattr(body, "chat_template_kwargs", None) or {}
    if "enable_thinking" in kwargs:
        value = kwargs["enable_thinking"]
        if not isinstance(value, bool):
            raise bad_request("chat_template_kwargs.enable_thinking must be true or false")
        return value
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad_request(f"reasoning_effort {effort!r}: none, minimal, low, medium or high")
    return effort != "none"


def opens_thinking(model: Any, ids: list[int]) -> bool:
    """Whether the prompt's last tokens open a think block (the reply starts inside)."""
    tail = "".join(model.piece(i) for i in ids[-8:])
    return tail.rstrip().endswith(OPEN)


def prompt_ids(
    model: Any,
    encode: Callable[[dict[str, Any], str], list[int]],
    extra: dict[str, Any],
    prefill: str = "",
    constrained: bool = False,
) -> list[int]:
    """A chat prompt's ids, ``encode(template variables, prefill)``. A thinking model's
    reply that a grammar holds from its first token (``constrained``: a response format,
    a forced call) has no room for reasoning, so there is none: the template's
    ``enable_thinking`` is false (Qwen3 writes an empty block), and a prompt that still
    opens a block gets it closed."""
    if not (constrained and thinks(model.chat_template)):
        return encode(extra, prefill)
    extra = {**extra, "enable_thinking": False}
    ids = encode(extra, prefill)
    if opens_thinking(model, ids):
        ids = encode(extra, CLOSE + "\n\n" + prefill)
    return ids


def offered(model: Any, on: bool) -> bool | None:
    """A switch some clients send to every model (Anthropic's ``thinking``, Responses'
    ``reasoning.effort``): off is off; on is on for a model that thinks and that model's
    default for one that does not (no 400: Claude Code and Codex send it unasked)."""
    if not on:
        return False
    return True if thinks(model.chat_template) else None


def splitter(model: Any, ids: list[int]) -> ThinkSplit | None:
    """A splitter for one reply to the chat prompt ``ids``; None where the model does not
    think (its replies are content as written)."""
    if not thinks(model.chat_template):
        return None
    return ThinkSplit(opens_thinking(model, ids))


def step(thoughts: ThinkSplit | None, text: str, last: bool) -> tuple[str, str]:
    """A streamed piece's reasoning and content (``last``: the stream's last piece, the
    held tail given out too); no splitter: all content."""
    if thoughts is None:
        return "", text
    thinking, content = thoughts.feed(text)
    if last:
        more_thinking, more = thoughts.finish()
        thinking, content = thinking + more_thinking, content + more
    return thinking, content


class ThinkSplit:
    """A reply's text into (reasoning, content), fed piece by piece (``feed``, then
    ``finish``) or whole (``split``). ``inside``: the prompt opened the block."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside
        self.text = ""
        self.state = "thinking" if inside else "start"
        self.sent = 0  # text[:sent] is decided (given out, or a tag)
        self.strip = True  # whitespace at the start of the current part is dropped

    def feed(self, delta: str) -> tuple[str, str]:
        """Reasoning and content decided by the text so far, not given out before."""
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end: the rest (an unclosed block is all reasoning)."""
        return self._advance(final=True)

    def whole(self, text: str) -> tuple[str, str]:
        """A whole reply's split (this splitter is then used up)."""
        thinking, content = self.feed(text)
        more_thinking, more_content = self.finish()
        return thinking + more_thinking, content + more_content

    @classmethod
    def split(cls, text: str, inside: bool = False) -> tuple[str, str]:
        return cls(inside).whole(text)

    def _advance(self, final: bool) -> tuple[str, str]:
        thinking, content = [], []
        while True:
            rest = self.text[self.sent :]
            if self.strip:
                stripped = rest.lstrip()
                self.sent += len(rest) - len(stripped)
                rest = stripped
                if not rest:
                    break
                self.strip = False
            if self.state == "start":
                if rest.startswith(OPEN):
                    self.sent += len(OPEN)
                    self.state, self.strip = "thinking", True
                    continue
                if OPEN.startswith(rest) and not final:
                    break  # may still become the tag
                self.state = "content"
            if self.state == "content":
                content.append(rest)
                self.sent = len(self.text)
                break
            end = rest.find(CLOSE)
            if end >= 0:
                thinking.append(rest[:end])
                self.sent += end + len(CLOSE)
                self.state, self.strip = "content", True
                continue
            keep = 0 if final else _partial_tail(rest, CLOSE)
            thinking.append(rest[: len(rest) - keep])
            self.sent += len(rest) - keep
            break
        return "".join(thinking), "".join(content)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that ``tag`` starts with (held back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
