"""OpenAI's API: chat completions and completions (SSE streaming ending with ``[DONE]``),
models (the Responses API: ``responses_api``). Usage includes
``prompt_tokens_details.cached_tokens``: the prompt tokens served from the prefix cache."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvpool.server import logprobs, reasoning, tools
from kvpool.server.errors import APIError, bad_request, read_json, stream_error
from kvpool.server.formats import constrained, openai_response_format
from kvpool.server.generation import Generation, Outcome
from kvpool.server.params import openai_params
from kvpool.server.served_model import ServedModel
from kvpool.server.state import State, tenant_of

router = APIRouter(prefix="/v1")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    user: str | None = None
    ignore_eos: bool = False  # an extension vLLM and llama.cpp accept too (benchmarks)
    # vLLM's sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, as replies give it


class ChatBody(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: enable_thinking is read
    reasoning_effort: str | None = None


class CompletionBody(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A chat message for the template: system for developer, calls with dict arguments."""
    out: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": _text_content(m),
    }
    if m.tool_calls:
        out["tool_calls"] = tools.message_calls(m.tool_calls)
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def chat_prompt(model: Any, body: ChatBody) -> tuple[list[int], tools.ToolPlan]:
    """A chat request's prompt ids (its tools and thinking switch rendered in) and plan."""
    extra = reasoning.template_kwargs(model, reasoning.openai_think(body))
    messages = [template_message(m) for m in body.messages]
    constrained = (body.response_format or {}).get("type", "text") != "text"
    return tools.prepare(model, messages, body.tools, body.tool_choice, template_extra=extra,
                         constrained=constrained)  # fmt: skip


def completion_prompt(model: Any, body: CompletionBody) -> tuple[str | list[int], list[int]]:
    """A completion request's prompt (its text, or the ids it was given) and its ids."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad_request("send one prompt per request (a list of prompts is not supported)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, model.encode(prompt)
    return prompt, model.check_tokens(list(prompt), "prompt")


def _chat_choice(
    text: str, reason: str | None, plan: tools.ToolPlan, thoughts: reasoning.ThinkSplit | None
) -> dict[str, Any]:
    """A whole reply's message and finish reason, its reasoning (a thinking model's) and
    its tool calls parsed out."""
    thinking = ""
    if thoughts is not None:
        thinking, text = thoughts.whole(text)
    content, calls = plan.split(text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["reasoning_content"] = thinking
    if not calls:
        return {"message": message, "finish_reason": reason}
    message["content"] = content or None
    message["tool_calls"] = [c.openai() for c in calls]
    return {"message": message, "finish_reason": "tool_calls"}


def _text_content(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request("only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _usage(out: Outcome, scored_only: bool = False) -> dict[str, Any]:
    """``usage``; ``scored_only``: an echo of the prompt alone (its one token dropped)."""
    completion = 0 if scored_only else out.completion_tokens
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": out.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": out.cached_prompt_tokens},
    }


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events ending in ``[DONE]``; a stream that ends early (shutdown, a
    failure) says why in an error event first, as OpenAI's does."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except Exception as exc:
            status, message, kind = stream_error(exc, "an OpenAI stream")
            error = {"message": message, "type": kind, "param": None, "code": status}
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _check_common(body: _Common) -> None:
    if body.n is not None and not 1 <= body.n <= 64:
        raise bad_request("n must be in [1, 64]")


def _chat_logprobs(body: ChatBody) -> int | None:
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
        raise bad_request("logprobs must be true or false (top_logprobs: how many)")
    return logprobs.requested(body.logprobs, body.top_logprobs, "chat completions")


def _completion_logprobs(body: CompletionBody) -> int | None:
    """Completions take ``logprobs: N`` (the best N alongside each token)."""
    if body.logprobs is None or body.logprobs is False:
        return logprobs.requested(None, body.top_logprobs, "completions")
    top = 0 if body.logprobs is True else body.logprobs
    return logprobs.requested(True, top, "completions")


@router.post("/chat/completions")
async def chat_completions(http: Request, state: State) -> Any:
    body = await read_json(http, ChatBody)
    model = await state.resolve(http, body.model)
    _check_common(body)
    fmt = openai_response_format(body.response_format)
    if not body.messages:
        raise bad_request("messages must not be empty")
    ids, plan = chat_prompt(model, body)
    if plan.forced is not None:
        if fmt is not None:
            raise bad_request("response_format cannot be combined with a forced tool_choice")
        fmt = plan.forced
    params = openai_params(body, len(ids), model.context_length, _chat_logprobs(body))
    params = await constrained(params, fmt, model, len(ids))
    generation = await Generation.start(
        model, http, ids, params, tenant_of(http), state.metrics, "openai"
    )
    want_logprobs = params.logprobs is not None
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": model.name, "system_fingerprint": "kvpool"}

    if body.stream:

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            base = {**head, "object": "chat.completion.chunk"}
            splits = [plan.stream() for _ in range(params.n)]
            thoughts = [reasoning.splitter(model, ids) for _ in range(params.n)]
            for i in range(params.n):
                yield {**base, "choices": [{"index": i, "finish_reason": None,
                       "delta": {"role": "assistant", "content": ""}}]}  # fmt: skip
            async for delta in generation.deltas():
                if delta.text or delta.finish_reason or (want_logprobs and delta.logprobs):
                    text, reason, message = delta.text, _reason(delta.finish_reason), {}
                    split, thought = splits[delta.index], thoughts[delta.index]
                    thinking, text = reasoning.step(thought, text, bool(delta.finish_reason))
                    if thinking:
                        message["reasoning_content"] = thinking
                    if split is not None:
                        text = split.feed(text)
                        if delta.finish_reason:
                            rest, calls = split.finish()
                            text += rest
                            if calls:
                                message["tool_calls"] = [c.openai(k) for k, c in enumerate(calls)]
                                reason = "tool_calls"
                    if text:
                        message["content"] = text
                    choice = {
                        "index": delta.index,
                        "delta": message,
                        "finish_reason": reason,
                        "logprobs": logprobs.openai_chat(delta.logprobs, model.piece)
                        if want_logprobs and delta.logprobs
                        else None,
                    }
                    yield {**base, "choices": [choice]}
            if body.stream_options and body.stream_options.include_usage:
                yield {**base, "choices": [], "usage": _usage(generation.outcome)}

        return _sse(chunks())
    out = await generation.run()
    return {
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                **_chat_choice(
                    s.text, _reason(s.finish_reason), plan, reasoning.splitter(model, ids)
                ),
                "logprobs": logprobs.openai_chat(s.logprobs, model.piece)
                if want_logprobs
                else None,
            }
            for i, s in enumerate(out.samples)
        ],
        "usage": _usage(out),
    }


@router.post("/completions")
async def completions(http: Request, state: State) -> Any:
    body = await read_json(http, CompletionBody)
    model = await state.resolve(http, body.model)
    _check_common(body)
    if body.suffix:
        raise bad_request("suffix is not supported by kvpool")
    prompt, ids = completion_prompt(model, body)
    if not ids:
        raise bad_request("the prompt is empty")
    # echo with max_tokens 0 scores the prompt alone (lm-eval's loglikelihood requests):
    # one token is generated and dropped.
    score_only = body.echo and body.max_tokens == 0
    if score_only:
        body = body.model_copy(update={"max_tokens": 1})
    params = openai_params(body, len(ids), model.context_length, _completion_logprobs(body))
    want_logprobs = params.logprobs is not None
    if body.echo and want_logprobs:
        params = replace(params, prompt_logprobs=params.logprobs)
    generation = await Generation.start(
        model, http, ids, params, tenant_of(http), state.metrics, "openai"
    )
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": model.name}
    echoed = (prompt if isinstance(prompt, str) else model.decode(ids)) if body.echo else ""

    def echo_logprobs(completion: dict[str, Any] | None) -> dict[str, Any] | None:
        scored = generation.outcome.prompt_logprobs or [None] * len(ids)
        return logprobs.openai_echo(ids, scored, model.piece, completion)

    if body.stream:

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            offsets = [len(echoed)] * params.n  # characters sent per sample (text_offset)
            started = [False] * params.n
            async for delta in generation.deltas():
                i = delta.index
                text, lp, reason = delta.text, None, _reason(delta.finish_reason)
                if score_only:  # the prompt, once, then the end
                    text, reason = "", "length" if delta.finish_reason else None
                    if delta.finish_reason is None:
                        continue
                if want_logprobs and delta.logprobs and not score_only:
                    lp = logprobs.openai_completion(delta.logprobs, model.piece, offsets[i])
                    offsets[i] += sum(len(t) for t in lp["tokens"])
                if body.echo and not started[i]:
                    started[i] = True
                    text = echoed + text
                    if want_logprobs:
                        rest = {k: [*v] for k, v in lp.items()} if lp else None
                        if rest:
                            rest["text_offset"] = [o - len(echoed) for o in rest["text_offset"]]
                        lp = echo_logprobs(rest)
                if text or reason or lp:
                    choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
                    yield {**head, "choices": [choice]}
            if body.stream_options and body.stream_options.include_usage:
                yield {**head, "choices": [], "usage": _usage(generation.outcome, score_only)}

        return _sse(chunks())
    out = await generation.run()
    choices = []
    for i, s in enumerate(out.samples):
        text = "" if score_only else s.text
        lp = None
        if want_logprobs:
            lp = logprobs.openai_completion([] if score_only else s.logprobs, model.piece)
            if body.echo:
                lp = echo_logprobs(lp)
        reason = "length" if score_only else _reason(s.finish_reason)
        choices.append({"index": i, "text": echoed + text, "logprobs": lp, "finish_reason": reason})
    return {**head, "choices": choices, "usage": _usage(out, score_only)}


@router.get("/models")
async def models(state: State) -> Any:
    return {"object": "list", "data": [_model_entry(m) for m in state.models.loaded()]}


@router.get("/models/{name:path}")
async def model(name: str, state: State) -> Any:
    found = next((m for m in state.models.loaded() if m.matches(name)), None)
    if found is None:
        raise APIError(404, f"model {name!r} not found", "not_found_error")
    return _model_entry(found)


def _model_entry(model: ServedModel) -> dict[str, Any]:
    created = int(model.modified_at.timestamp())
    return {"id": model.name, "object": "model", "created": created, "owned_by": "kvpool"}


def _reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"
