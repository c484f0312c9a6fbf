"""KV-cache administration and metrics.

- ``GET /api/kvcache``: the pool's stats. Admins see everything, with a breakdown per
  tenant; a tenant's key sees the pool's capacity and its own tenant's counters only.
- ``GET /api/kvcache/pins``: pins (admins: every tenant's; a tenant: its own).
- ``POST /api/kvcache/pin`` and ``/unpin``: a system prompt or prefix, for the caller's
  tenant, or ``shared`` for all tenants (admins only). A tenant's pins share at most
  ``tenant_pin_share`` of the pin budget. ``/unpin`` also takes a pin's ``id`` (from the
  listing): admins may unpin any pin, a tenant its own.
- ``POST /api/kvcache/reset``: drop the unpinned cache (admins only); ``{"pins": true}``
  drops the pins too.
- ``GET /metrics``: Prometheus, filtered as ``/api/kvcache`` is.

Every answer comes from the engine's latest snapshot: none waits for a model step.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict

from kvpool.cache import PinInfo
from kvpool.engine.snapshot import EngineSnapshot
from kvpool.server.auth import Tenant, tenant_name
from kvpool.server.errors import APIError, bad_request, read_json
from kvpool.server.state import ServerState, State, tenant_of

router = APIRouter()


class PinBody(BaseModel):
    """Exactly one of ``system`` (a system prompt, rendered with the chat template as the
    start of a conversation), ``prompt`` (raw text), ``tokens``, or (unpin only) ``id``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    system: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    id: str | None = None
    shared: bool = False


class ResetBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    pins: bool = False
    tier: bool = False  # empty the second KV tier too


def pin_id(pin: PinInfo) -> str:
    """A pin's stable name: a hash of its salt and tokens."""
    digest = hashlib.blake2b(pin.salt + b"\0", digest_size=8)
    digest.update(b",".join(str(t).encode() for t in pin.token_ids))
    return digest.hexdigest()


def _rate(hits: int, total: int) -> float:
    return hits / total if total else 0.0


def capacity(snap: EngineSnapshot, state: ServerState) -> dict[str, Any]:
    c = snap.cache
    return {
        "model": state.model.name,
        "block_size": c.block_size,
        "total_blocks": c.total_blocks,
        "kv_cache_dtype": snap.kv_cache_dtype,
        "bytes_per_block": c.bytes_per_block,
        "total_bytes": c.total_bytes,
        "max_pinned_blocks": snap.max_pinned_blocks,
        "tenant_pin_limit_blocks": state.tenant_pin_blocks(snap.max_pinned_blocks),
        "max_queue": state.max_queue,
    }


def tenant_view(snap: EngineSnapshot, tenant: Tenant) -> dict[str, Any]:
    mine = snap.tenants.get(tenant.salt)
    counters = asdict(mine) if mine is not None else {}
    return {
        "tenant": tenant.name,
        "running": counters.get("running", 0),
        "waiting": counters.get("waiting", 0),
        "admitted": counters.get("admitted", 0),
        "prompt_tokens": counters.get("prompt_tokens", 0),
        "cached_prompt_tokens": counters.get("cached_prompt_tokens", 0),
        "hit_rate_tokens": _rate(
            counters.get("cached_prompt_tokens", 0), counters.get("prompt_tokens", 0)
        ),
        "pinned_blocks": counters.get("pinned_blocks", 0),
        "pins": counters.get("pins", 0),
    }


@router.get("/api/kvcache")
async def kvcache(http: Request, state: State, blocks: bool = False) -> Any:
    """The pool's counters (a tenant: its own share). An admin's ``?blocks=true`` adds
    ``block_hashes``: the chain hash (16 hex digits) of every block a prefix lookup can
    find, taken between two steps (what a cluster router's index must equal)."""
    snap = state.model.snapshot  # never waits for a step
    tenant = tenant_of(http)
    if not tenant.admin:
        return {**capacity(snap, state), **tenant_view(snap, tenant)}
    hashes = None
    if blocks:
        hashes = [f"{k:016x}" for k in sorted(await state.model.llm.cached_block_hashes())]
    cache = snap.cache
    tenants = {
        tenant_name(salt): {
            **asdict(t),
            "hit_rate_tokens": _rate(t.cached_prompt_tokens, t.prompt_tokens),
        }
        for salt, t in snap.tenants.items()
    }
    return {
        **capacity(snap, state),
        **asdict(cache),
        "hit_rate_tokens": _rate(cache.prefix_hit_tokens, cache.prefix_query_tokens),
        "running": snap.running,
        "waiting": snap.waiting,
        "preemptions": snap.preemptions,
        "steps": snap.steps,
        "tenants": tenants,
        "tier": asdict(snap.tier) if snap.tier is not None else None,
        **({"block_hashes": hashes} if hashes is not None else {}),
    }


def visible_pins(snap: EngineSnapshot, tenant: Tenant) -> list[PinInfo]:
    own = (tenant.salt or "").encode()
    return [p for p in snap.pins if tenant.admin or p.salt == own]


@router.get("/api/kvcache/pins")
async def pins(http: Request, state: State) -> Any:
    tenant = tenant_of(http)
    return {"pins": [listing(p, state) for p in visible_pins(state.model.snapshot, tenant)]}


def listing(pin: PinInfo, state: ServerState) -> dict[str, Any]:
    """A pin as the listings show it."""
    return {
        "id": pin_id(pin),
        "tenant": tenant_name(pin.salt),
        "shared": pin.salt == b"" and state.keys.enabled,
        "tokens": len(pin.token_ids),
        "blocks": pin.num_blocks,
        "preview": state.model.decode(list(pin.token_ids[:32])),
    }


def _prefix_ids(body: PinBody, state: ServerState) -> list[int]:
    """The prefix's ids (pins live in the started model's pool)."""
    model = state.model
    if not body.model:
        raise bad_request("model is required")
    if not model.matches(body.model):
        raise APIError(
            404,
            f"model {body.model!r} not found (pins are kept for {model.name!r}, the started model)",
            "not_found_error",
        )
    given = [x for x in (body.system, body.prompt, body.tokens) if x is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of system, prompt or tokens")
    if body.system is not None:
        system = [{"role": "system", "content": body.system}]
        ids = model.encode_chat(system, add_generation_prompt=False)
    elif body.prompt is not None:
        ids = model.encode(body.prompt)
    else:
        ids = model.check_tokens(body.tokens or [], "tokens")
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
    if body.id is not None:
        raise bad_request("pin takes system, prompt or tokens (id names an existing pin)")
    ids = _prefix_ids(body, state)
    tenant = tenant_of(http)
    model = state.model
    cap = None if tenant.admin else state.tenant_pin_blocks(model.snapshot.max_pinned_blocks)
    pinned = await model.pin_prefix(ids, salt=tenant.salt, shared=body.shared, max_salt_blocks=cap)
    return {"prefix_tokens": len(ids), "pinned_tokens": pinned, "shared": body.shared}


@router.post("/api/kvcache/unpin")
async def unpin(http: Request, state: State) -> Any:
    body = await read_json(http, PinBody)
    tenant = tenant_of(http)
    model = state.model
    if body.id is not None:
        found = [p for p in visible_pins(model.snapshot, tenant) if pin_id(p) == body.id]
        if not found:
            raise APIError(404, f"no pin with id {body.id!r}", "not_found_error")
        salt = found[0].salt.decode() or None
        ids = list(found[0].token_ids)
        await model.unpin_prefix(ids, salt=salt, shared=salt is None)
        return {"prefix_tokens": len(ids), "unpinned": True, "id": body.id}
    _check_shared(body, http)
    ids = _prefix_ids(body, state)
    await model.unpin_prefix(ids, salt=tenant.salt, shared=body.shared)
    return {"prefix_tokens": len(ids), "unpinned": True}


@router.post("/api/kvcache/reset")
async def reset(http: Request, state: State) -> Any:
    if not tenant_of(http).admin:
        raise APIError(403, "only an admin key may reset the cache")
    body = await read_json(http, ResetBody)
    dropped = await state.model.reset_prefix_cache(unpin=body.pins, tier=body.tier)
    return {"dropped_blocks": dropped, "unpinned": body.pins, "tier_cleared": body.tier}


@router.get("/metrics")
async def metrics(http: Request, state: State) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(state.metrics.render(tenant_of(http)), media_type=CONTENT_TYPE_LATEST)
