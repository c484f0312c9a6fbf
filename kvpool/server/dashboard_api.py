"""The live view of the pool: a page for browsers and the data it polls.

- ``GET /dashboard`` (and ``GET /`` when the client asks for HTML; Ollama's clients still
  get their plain "running" answer there): one self-contained page, no external asset.
  It needs no key itself; it asks for one when the data route answers 401.
- ``GET /api/dashboard``: what the page draws, polled about once a second: the block map
  (one byte a block, base64, ``kvpool.cache.block_map`` codes), the requests running and
  waiting with their blocks, the history of the last minutes (``?since=`` a time: only
  newer points), pins and the second tier. An admin sees everything; a tenant's key sees
  the pool's capacity, its own requests, its own blocks on the map (every other block
  reads 0) and its own pins, as ``/api/kvcache`` shows it.
- ``GET /api/dashboard/block/{id}``: one block under the pointer (its holders, chain
  position, token count, tenant: admins; a tenant only for a block its requests hold).

The data comes from the snapshot the engine publishes after each step (with the block map
in it while someone watches, ``kvpool.engine.pool_view``), never by pausing a step.
"""

from __future__ import annotations

import base64
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from kvpool.cache.block_map import count_states
from kvpool.engine.pool_view import PoolView
from kvpool.server.admin_api import capacity, listing, tenant_view, visible_pins
from kvpool.server.auth import Tenant, tenant_name
from kvpool.server.errors import APIError
from kvpool.server.state import State, tenant_of
from kvpool.web import page

router = APIRouter()


def wants_html(http: Request) -> bool:
    """A browser navigating (its Accept names text/html); API clients send */* or JSON."""
    return "text/html" in http.headers.get("accept", "")


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(page())


def _requests(view: PoolView, tenant: Tenant) -> list[dict[str, Any]]:
    return [
        {
            "id": r.request_id,
            "sample": r.index,
            "tenant": tenant_name(r.salt),
            "status": r.status,
            "prompt_tokens": r.prompt_tokens,
            "cached_prompt_tokens": r.cached_prompt_tokens,
            "output_tokens": r.output_tokens,
            "preemptions": r.preemptions,
            "blocks": list(r.blocks),
        }
        for r in view.requests
        if tenant.admin or r.salt == tenant.salt
    ]


def _block_map(view: PoolView, tenant: Tenant) -> bytes:
    if tenant.admin:
        return view.states
    mine = bytearray(len(view.states))
    for r in view.requests:
        if r.salt == tenant.salt:
            for b in r.blocks:
                mine[b] = view.states[b]
    return bytes(mine)


@router.get("/api/dashboard")
async def data(http: Request, state: State, since: float = 0.0) -> Any:
    model = state.model
    model.llm.watch_pool()
    snap = model.snapshot
    tenant = tenant_of(http)
    view = snap.view
    states = _block_map(view, tenant) if view is not None else b""
    pins = [listing(p, state) for p in visible_pins(snap, tenant)]
    out: dict[str, Any] = {
        "admin": tenant.admin,
        "tenant": tenant.name,
        "capacity": capacity(snap, state),
        "taken_at": view.taken_at if view is not None else None,
        "map": base64.b64encode(states).decode() if view is not None else None,
        "counts": count_states(states) if view is not None else None,
        "requests": _requests(view, tenant) if view is not None else [],
        "pins": pins,
    }
    if tenant.admin:
        c = snap.cache
        out["pool"] = {
            "prefix_hit_tokens": c.prefix_hit_tokens,
            "prefix_query_tokens": c.prefix_query_tokens,
            "evictions": c.evictions,
            "preemptions": snap.preemptions,
            "running": snap.running,
            "waiting": snap.waiting,
            "steps": snap.steps,
        }
        out["history"] = state.history.since(since) if state.history is not None else []
        out["tier"] = (
            {"kind": snap.tier.kind, "blocks": snap.tier.blocks, "bytes": snap.tier.bytes,
             "capacity_bytes": snap.tier.capacity_bytes, "hit_blocks": snap.tier.hit_blocks}
            if snap.tier is not None else None
        )  # fmt: skip
    else:
        out["tenant_counters"] = tenant_view(snap, tenant)
    return out


def _holder(s: dict[str, Any]) -> dict[str, Any]:
    return {"id": s["request_id"], "sample": s["index"], "tenant": tenant_name(s["salt"]),
            "position": s["position"]}  # fmt: skip


@router.get("/api/dashboard/block/{block_id}")
async def block(http: Request, state: State, block_id: int) -> Any:
    try:
        info = await state.model.llm.describe_block(block_id)
    except IndexError as exc:
        raise APIError(404, str(exc), "not_found_error") from exc
    tenant = tenant_of(http)
    sequences = info.pop("sequences")
    salt = info.pop("salt")
    if not tenant.admin:
        sequences = [s for s in sequences if s["salt"] == tenant.salt]
        if not sequences:
            raise APIError(404, f"block {block_id} is not held by your requests",
                           "not_found_error")  # fmt: skip
    info["tenant"] = tenant_name(salt) if tenant.admin else tenant.name
    info["sequences"] = [_holder(s) for s in sequences]
    return info
