"""KV-cache administration and metrics: ``GET /api/kvcache`` (the pool's stats),
``POST /api/kvcache/pin`` and ``/unpin`` (a system prompt or prefix, for the caller's
tenant, or ``shared`` for all tenants: admins only), ``POST /api/kvcache/reset`` (drop the
unpinned cache: admins only), and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict

from kvpool.server.errors import APIError, bad_request, read_json
from kvpool.server.state import ServerState, State, tenant_of

router = APIRouter()


class PinBody(BaseModel):
    """Exactly one of ``system`` (a system prompt, rendered with the chat template as the
    start of a conversation), ``prompt`` (raw text) or ``tokens``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    system: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    shared: bool = False


@router.get("/api/kvcache")
async def kvcache(state: State) -> Any:
    snap = await state.model.engine.stats()
    cache = snap.cache
    return {
        "model": state.model.name,
        **asdict(cache),
        "hit_rate_tokens": cache.prefix_hit_tokens / cache.prefix_query_tokens
        if cache.prefix_query_tokens
        else 0.0,
        "running": snap.running,
        "waiting": snap.waiting,
        "preemptions": snap.preemptions,
    }


def _prefix_ids(body: PinBody, state: ServerState) -> list[int]:
    model = state.check_model(body.model)
    given = [x for x in (body.system, body.prompt, body.tokens) if x is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of system, prompt or tokens")
    tokenizer = model.llm.tokenizer
    if body.system is not None:
        system = [{"role": "system", "content": body.system}]
        ids = tokenizer.encode_chat(system, add_generation_prompt=False)
    elif body.prompt is not None:
        ids = tokenizer.encode(body.prompt)
    else:
        ids = list(body.tokens or [])
    if not ids:
        raise bad_request("the prefix is empty")
    if len(ids) >= model.context_length:
        raise bad_request(f"the prefix has {len(ids)} tokens; the context holds "
                          f"{model.context_length}")  # fmt: skip
    return ids


def _check_shared(body: PinBody, http: Request) -> None:
    if body.shared and not tenant_of(http).admin:
        raise APIError(403, "only an admin key may pin or unpin a shared prefix")


@router.post("/api/kvcache/pin")
async def pin(http: Request, state: State) -> Any:
    body = await read_json(http, PinBody)
    _check_shared(body, http)
    ids = _prefix_ids(body, state)
    salt = tenant_of(http).salt
    pinned = await state.model.engine.pin_prefix(ids, salt=salt, shared=body.shared)
    return {"prefix_tokens": len(ids), "pinned_tokens": pinned, "shared": body.shared}


@router.post("/api/kvcache/unpin")
async def unpin(http: Request, state: State) -> Any:
    body = await read_json(http, PinBody)
    _check_shared(body, http)
    ids = _prefix_ids(body, state)
    await state.model.engine.unpin_prefix(ids, salt=tenant_of(http).salt, shared=body.shared)
    return {"prefix_tokens": len(ids), "unpinned": True}


@router.post("/api/kvcache/reset")
async def reset(http: Request, state: State) -> Any:
    if not tenant_of(http).admin:
        raise APIError(403, "only an admin key may reset the cache")
    return {"dropped_blocks": await state.model.engine.reset_prefix_cache()}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
