"""Embeddings: Ollama's ``/api/embed`` (and the older ``/api/embeddings``) and OpenAI's
``/v1/embeddings``.

A vector is the final-normed hidden state of the input's last token, L2-normalized
(last-token pooling: the pooling a decoder model's cache allows, since a cached prefix
keeps its K/V, not its hidden states). Inputs are plain text (no chat template) or
token ids; all of a request's inputs go to the engine at once and are batched with
whatever else runs, and inputs that share a prefix share its cached blocks."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from kvpool.server.errors import bad_request, read_json
from kvpool.server.served_model import ServedModel
from kvpool.server.state import State, tenant_of

router = APIRouter()

MAX_INPUTS = 256  # inputs per request


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OllamaEmbedBody(_Body):
    model: str | None = None
    input: str | list[str] = ""
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsBody(_Body):
    model: str | None = None
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OpenAIEmbeddingsBody(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def _token_inputs(
    model: ServedModel, inputs: list[str] | list[list[int]], truncate: bool
) -> list[list[int]]:
    if not inputs:
        raise bad_request("input must not be empty")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request (got {len(inputs)})")
    out = []
    for i, item in enumerate(inputs):
        ids = model.encode(item) if isinstance(item, str) else model.check_tokens(item, "input")
        if not ids:
            raise bad_request(f"input {i} is empty")
        if len(ids) > model.context_length:
            if not truncate:
                raise bad_request(
                    f"input {i} has {len(ids)} tokens; the context holds {model.context_length}"
                )
            ids = ids[: model.context_length]
        out.append(ids)
    return out


@router.post("/api/embed")
async def ollama_embed(http: Request, state: State) -> Any:
    body = await read_json(http, OllamaEmbedBody)
    model = await state.resolve(http, body.model, body.keep_alive)
    start = time.monotonic()
    inputs = [body.input] if isinstance(body.input, str) else body.input
    ids = _token_inputs(model, inputs, body.truncate)
    vectors = await model.embed(ids, salt=tenant_of(http).salt)
    return {
        "model": model.name,
        "embeddings": vectors,
        "total_duration": int((time.monotonic() - start) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": sum(len(i) for i in ids),
    }


@router.post("/api/embeddings")
async def ollama_embeddings(http: Request, state: State) -> Any:
    body = await read_json(http, OllamaEmbeddingsBody)
    model = await state.resolve(http, body.model, body.keep_alive)
    ids = _token_inputs(model, [body.prompt], True)
    (vector,) = await model.embed(ids, salt=tenant_of(http).salt)
    return {"embedding": vector}


@router.post("/v1/embeddings")
async def openai_embeddings(http: Request, state: State) -> Any:
    body = await read_json(http, OpenAIEmbeddingsBody)
    model = await state.resolve(http, body.model)
    if body.encoding_format not in ("float", "base64"):
        raise bad_request("encoding_format must be float or base64")
    raw = body.input
    if isinstance(raw, str):
        inputs: list[Any] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        inputs = [raw]  # one input as token ids
    else:
        inputs = list(raw)
    ids = _token_inputs(model, inputs, truncate=False)
    vectors = await model.embed(ids, salt=tenant_of(http).salt)
    if body.dimensions is not None:  # truncated and renormalized (a Matryoshka-style cut)
        if not 1 <= body.dimensions <= len(vectors[0]):
            raise bad_request(f"dimensions must be in [1, {len(vectors[0])}]")
        vectors = [_renormalized(v[: body.dimensions]) for v in vectors]
    tokens = sum(len(i) for i in ids)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _renormalized(v: list[float]) -> list[float]:
    norm = sum(x * x for x in v) ** 0.5 or 1.0
    return [x / norm for x in v]


def _encoded(v: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return v
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
