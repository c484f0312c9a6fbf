"""Ollama's API: generate, chat (NDJSON streaming by default), tags, show, ps, version,
pull (a model kvpool can serve: ``success``, nothing downloaded); the routes that change
the model store (push, create, copy, delete, blobs) answer 501.

Replies carry the fields Ollama's clients read: ``done``, ``done_reason``,
``prompt_eval_count``, ``eval_count`` and the durations in nanoseconds; ``context`` (the
tokens of prompt and answer) on ``/api/generate``.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvpool import __version__
from kvpool.server import logprobs, reasoning, tools
from kvpool.server.dashboard_api import wants_html
from kvpool.server.errors import APIError, bad_request, read_json, stream_error
from kvpool.server.formats import constrained, ollama_format
from kvpool.server.generation import Generation, Outcome
from kvpool.server.params import ollama_params
from kvpool.server.served_model import ServedModel
from kvpool.server.state import ServerState, State, tenant_of
from kvpool.web import page

router = APIRouter()
OLLAMA_COMPAT_VERSION = "0.12.0"  # the Ollama API level these routes follow


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateBody(_Body):
    model: str | None = None
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    stream: bool = True
    raw: bool = False
    format: str | dict[str, Any] | None = None
    images: list[str] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    think: bool | str | None = None  # a thinking model thinks (None: its default)


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an assistant turn's reasoning, as a reply gave it
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_name: str | None = None  # a tool turn: which tool answered


class ChatBody(_Body):
    model: str | None = None
    messages: list[Message] = []
    stream: bool = True
    format: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    think: bool | str | None = None


def _think(value: bool | str | None) -> bool | None:
    """Ollama's ``think``: a boolean, or an effort (``low``/``medium``/``high``: on)."""
    if isinstance(value, str):
        if value not in ("low", "medium", "high"):
            raise bad_request(f"think {value!r}: true, false, low, medium or high")
        return True
    return value


class ShowBody(_Body):
    model: str | None = None
    name: str | None = None


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _unsupported(images: Any = None) -> None:
    if images:
        raise bad_request("images are not supported: kvpool serves text models")


def _load_or_unload(model: ServedModel, state: ServerState) -> str:
    """A request with nothing to generate: ``unload`` when its keep_alive is 0 (the
    model goes once this response is sent), else ``load``."""
    if model is not state.model and model.keep_alive == 0:
        return "unload"
    return "load"


def generate_prompt(model: Any, body: GenerateBody) -> list[int]:
    """A generate request's prompt ids: its ``context``, then the prompt (raw, or in the
    chat template with its ``system``)."""
    if body.raw:
        ids = model.encode(body.prompt)
    else:
        messages = [{"role": "system", "content": body.system}] if body.system else []
        messages.append({"role": "user", "content": body.prompt})
        extra = reasoning.template_kwargs(model, _think(body.think))

        def encode(more: dict[str, Any], start: str) -> list[int]:
            return model.encode_chat(messages, **more, prefill=start)

        ids = reasoning.prompt_ids(model, encode, extra, constrained=body.format not in (None, ""))
    return model.check_tokens(list(body.context or []), "context") + ids


def chat_prompt(model: Any, body: ChatBody) -> tuple[list[int], tools.ToolPlan]:
    """A chat request's prompt ids (its tools and thinking switch rendered in) and plan."""
    extra = reasoning.template_kwargs(model, _think(body.think))
    messages = [template_message(m) for m in body.messages]
    return tools.prepare(model, messages, body.tools, None, template_extra=extra,
                         constrained=body.format not in (None, ""))  # fmt: skip


def template_message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.thinking:
        out["reasoning_content"] = m.thinking
    if m.tool_calls:
        out["tool_calls"] = tools.message_calls(m.tool_calls)
    return out


def _final_stats(out: Outcome) -> dict[str, Any]:
    sample = out.samples[0]
    return {
        "done": True,
        "done_reason": sample.finish_reason or "stop",
        **out.durations_ns(),
        "prompt_eval_count": out.prompt_tokens,
        "prompt_cache_count": out.cached_prompt_tokens,
        "eval_count": len(sample.token_ids),
    }


def _ndjson(
    generation: Generation, piece: Any, final: Any, model: ServedModel, want_logprobs: bool
) -> StreamingResponse:
    """Ollama's stream: a line per piece (with its tokens' logprobs where asked), then the
    final line; a stream that ends early (shutdown, a failure) ends with an ``{"error":
    ...}`` line, as Ollama's does."""

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for delta in generation.deltas():
                if delta.text or (want_logprobs and delta.logprobs):
                    line = piece(delta.text)
                    if want_logprobs:
                        line["logprobs"] = logprobs.ollama(delta.logprobs or [], model.piece)
                    yield (json.dumps(line) + "\n").encode()
            last = final(generation.outcome)
        except Exception as exc:
            _, message, _ = stream_error(exc, "an Ollama stream")
            last = {"error": message}
        yield (json.dumps(last) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/api/generate")
async def generate(http: Request, state: State) -> Any:
    body = await read_json(http, GenerateBody)
    model = await state.resolve(http, body.model, body.keep_alive)
    _unsupported(body.images)
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported by kvpool")
    if not body.prompt and not body.context:
        # Ollama's way to load a model (or, with keep_alive 0, to unload it)
        return {"model": model.name, "created_at": _now(), "response": "", "done": True,
                "done_reason": _load_or_unload(model, state)}  # fmt: skip
    ids = generate_prompt(model, body)
    asked = logprobs.requested(body.logprobs, body.top_logprobs, "/api/generate")
    params = ollama_params(body.options, len(ids), model.context_length, asked)
    params = await constrained(params, ollama_format(body.format), model, len(ids))
    generation = await Generation.start(
        model, http, ids, params, tenant_of(http), state.metrics, "ollama"
    )
    thoughts = None if body.raw else reasoning.splitter(model, ids)

    def piece(text: str) -> dict[str, Any]:
        line = {"model": model.name, "created_at": _now(), "response": text, "done": False}
        if thoughts is not None:
            thinking, line["response"] = thoughts.feed(text)
            if thinking:
                line["thinking"] = thinking
        return line

    def final(out: Outcome, text: str = "") -> dict[str, Any]:  # text: a whole reply's
        line = {
            "model": model.name,
            "created_at": _now(),
            "response": text,
            **_final_stats(out),
            "context": ids + out.samples[0].token_ids,
        }
        if thoughts is not None:  # (a stream's splitter has the text already)
            thinking, line["response"] = thoughts.whole(text)
            if thinking:
                line["thinking"] = thinking
        return line

    if body.stream:
        return _ndjson(generation, piece, final, model, asked is not None)
    out = await generation.run()
    reply = final(out, out.samples[0].text)
    if asked is not None:
        reply["logprobs"] = logprobs.ollama(out.samples[0].logprobs, model.piece)
    return reply


@router.post("/api/chat")
async def chat(http: Request, state: State) -> Any:
    body = await read_json(http, ChatBody)
    model = await state.resolve(http, body.model, body.keep_alive)
    _unsupported(any(m.images for m in body.messages))
    if not body.messages:
        return {"model": model.name, "created_at": _now(),
                "message": {"role": "assistant", "content": ""}, "done": True,
                "done_reason": _load_or_unload(model, state)}  # fmt: skip
    ids, plan = chat_prompt(model, body)
    asked = logprobs.requested(body.logprobs, body.top_logprobs, "/api/chat")
    params = ollama_params(body.options, len(ids), model.context_length, asked)
    params = await constrained(params, ollama_format(body.format), model, len(ids))
    generation = await Generation.start(
        model, http, ids, params, tenant_of(http), state.metrics, "ollama"
    )

    split = plan.stream()
    thoughts = reasoning.splitter(model, ids)

    def piece(text: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": ""}
        if thoughts is not None:
            thinking, text = thoughts.feed(text)
            if thinking:
                message["thinking"] = thinking
        message["content"] = split.feed(text) if split is not None else text
        return {"model": model.name, "created_at": _now(), "message": message, "done": False}

    def reply(
        out: Outcome, thinking: str, content: str, calls: list[tools.ToolCall]
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [c.ollama() for c in calls]
        return {"model": model.name, "created_at": _now(), "message": message,
                **_final_stats(out)}  # fmt: skip

    def final(out: Outcome) -> dict[str, Any]:  # a stream's last line
        thinking, rest = thoughts.finish() if thoughts is not None else ("", "")
        if split is None:
            return reply(out, thinking, rest, [])
        content = split.feed(rest)
        more, calls = split.finish()
        return reply(out, thinking, content + more, calls)

    if body.stream:
        return _ndjson(generation, piece, final, model, asked is not None)
    out = await generation.run()
    text, thinking = out.samples[0].text, ""
    if thoughts is not None:
        thinking, text = thoughts.whole(text)
    answer = reply(out, thinking, *plan.split(text))
    if asked is not None:
        answer["logprobs"] = logprobs.ollama(out.samples[0].logprobs, model.piece)
    return answer


@router.get("/api/tags")
async def tags(state: State) -> Any:
    return {"models": [m.listing() for m in state.models.loaded()]}


@router.post("/api/show")
async def show(http: Request, state: State) -> Any:
    body = await read_json(http, ShowBody)
    model = await state.resolve(http, body.model or body.name)
    params = "\n".join(f"{k} {v}" for k, v in (("temperature", 0.8), ("top_k", 40), ("top_p", 0.9)))
    return {
        "license": str(model.info.get("general.license", "")),
        "modelfile": f"FROM {model.path}\n",
        "parameters": params,
        "template": model.chat_template,
        "details": model.details(),
        "model_info": model.info,
        "capabilities": ["completion", "tools"]
        + (["thinking"] if reasoning.thinks(model.chat_template) else []),
        "modified_at": model.modified_at.isoformat(),
    }


class PullBody(_Body):
    model: str | None = None
    name: str | None = None  # (older clients' field)
    stream: bool = True
    insecure: bool = False


@router.post("/api/pull")
async def pull(http: Request, state: State) -> Any:
    """Ollama's pull, for clients that pull before they use a model (the ``ollama`` CLI's
    ``run``, scripts that call ``ollama.pull`` first): kvpool downloads nothing, so a
    model it can serve (loaded, or a file it would load on demand) answers ``success``
    at once, as Ollama does for a model it already has; any other name is a 404 that
    says where kvpool looks. Nothing is loaded."""
    body = await read_json(http, PullBody)
    state.models.check(body.model or body.name)
    if body.stream:  # Ollama's progress stream, its last line
        return StreamingResponse(
            iter([b'{"status": "success"}\n']), media_type="application/x-ndjson"
        )
    return {"status": "success"}


_STORE_ROUTES = [
    ("/api/push", ["POST"]),
    ("/api/create", ["POST"]),
    ("/api/copy", ["POST"]),
    ("/api/delete", ["DELETE"]),
    ("/api/blobs/{digest}", ["HEAD", "POST"]),
]


async def _store_unsupported(http: Request) -> Any:
    """The Ollama routes that change the model store: kvpool serves the files and the
    local Ollama store as they are, and changes neither (Ollama's own CLI does)."""
    raise APIError(
        501,
        f"{http.url.path} is not supported: kvpool serves GGUF files and the local Ollama "
        "store as they are and never changes them; manage models with Ollama itself",
        "not_implemented",
    )


for _path, _methods in _STORE_ROUTES:
    router.add_api_route(_path, _store_unsupported, methods=_methods)


@router.get("/api/ps")
async def ps(state: State) -> Any:
    """The loaded models: size (file + KV pool), when each expires (far ahead for the
    started model and ``keep_alive`` -1), and kvpool's own ``kv_cache`` use."""
    entries = []
    for model in state.models.loaded():
        llm = model.llm
        if llm is None:  # released a moment ago (unloading)
            continue
        stats = llm.snapshot.cache
        size = model.size + stats.total_bytes
        expires = model.expires_at if model is not state.model else math.inf
        when = (
            datetime.now(UTC) + timedelta(days=3650)
            if math.isinf(expires)
            else datetime.fromtimestamp(expires, UTC)
        )
        entries.append({
            **model.listing(),
            "expires_at": when.isoformat(),
            "size": size,
            "size_vram": size if model.on_gpu else 0,
            "context_length": model.context_length,
            "kv_cache": {"total_blocks": stats.total_blocks, "used_blocks": stats.used_blocks,
                         "cached_blocks": stats.cached_blocks, "bytes": stats.total_bytes},
        })  # fmt: skip
    return {"models": entries}


@router.get("/api/version")
async def version() -> Any:
    return {"version": OLLAMA_COMPAT_VERSION, "kvpool": __version__}


@router.api_route("/", methods=["GET", "HEAD"])
async def root(http: Request) -> Response:
    """Ollama's liveness answer; a browser (asking for HTML) gets the live view."""
    if wants_html(http):
        return HTMLResponse(page())
    return PlainTextResponse("Ollama is running (kvpool)")
