"""``create_app``: the FastAPI application for one served model.

Routes: ``ollama_api`` (``/api/...``, ``/``), ``openai_api`` and ``responses_api``
(``/v1/...``), ``anthropic_api`` (``/v1/messages``), ``admin_api``
(``/api/kvcache``, ``/metrics``), ``dashboard_api`` (``/dashboard``, the live view, and its
data). Every route but ``/``, ``/dashboard`` and ``/api/version`` needs a valid
key when keys are configured (401 otherwise); the key's tenant is on ``request.state``.
Request bodies over ``max_body_bytes`` get 413 before any route reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request

from kvpool import __version__
from kvpool.server import (
    admin_api,
    anthropic_api,
    dashboard_api,
    embed_api,
    errors,
    ollama_api,
    openai_api,
    responses_api,
)
from kvpool.server.auth import ANONYMOUS, KeyRing
from kvpool.server.errors import APIError
from kvpool.server.limits import BodyLimit
from kvpool.server.metrics import Metrics
from kvpool.server.models import Leases, ModelRegistry
from kvpool.server.pool_history import PoolHistory
from kvpool.server.response_store import ResponseStore
from kvpool.server.served_model import ServedModel
from kvpool.server.state import ServerState

PUBLIC_PATHS = frozenset({"/", "/api/version", "/dashboard"})


async def authenticate(request: Request) -> None:
    keys: KeyRing = request.app.state.kv.keys
    if request.url.path in PUBLIC_PATHS:
        request.state.tenant = ANONYMOUS if not keys.enabled else keys.tenant(None) or ANONYMOUS
        return
    tenant = keys.tenant(request.headers.get("authorization"), request.headers.get("x-api-key"))
    if tenant is None:
        raise APIError(401, "a valid API key is required (Authorization: Bearer <key>, "
                       "or x-api-key: <key>)", "authentication_error")  # fmt: skip
    request.state.tenant = tenant


def create_app(
    model: ServedModel,
    *,
    keys: KeyRing | None = None,
    max_body_bytes: int = 8 * 2**20,
    tenant_pin_share: float = 0.25,
    max_queue: int | None = None,
    models: ModelRegistry | None = None,
    response_tag: str = "",
) -> Any:
    """The ASGI application (FastAPI wrapped in the body-size limit). ``models``: the
    registry that loads other models on demand (default: ``model`` alone);
    ``response_tag``: put into the Responses API's ids (a cluster replica's id)."""
    registry = models or ModelRegistry(model, None)
    metrics = Metrics(lambda: model.snapshot)
    history = PoolHistory(lambda: model.snapshot, metrics.activity)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(registry.reap_forever()),
                 asyncio.create_task(history.run_forever())]  # fmt: skip
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await registry.close()

    app = FastAPI(
        title="kvpool", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan
    )
    app.state.kv = ServerState(
        model=model,
        models=registry,
        keys=keys or KeyRing({}),
        metrics=metrics,
        history=history,
        tenant_pin_share=tenant_pin_share,
        max_queue=max_queue,
        responses=ResponseStore(tag=response_tag),
    )
    errors.install(app)
    auth = [Depends(authenticate)]
    app.include_router(ollama_api.router, dependencies=auth)
    app.include_router(openai_api.router, dependencies=auth)
    app.include_router(responses_api.router, dependencies=auth)
    app.include_router(anthropic_api.router, dependencies=auth)
    app.include_router(admin_api.router, dependencies=auth)
    app.include_router(embed_api.router, dependencies=auth)
    app.include_router(dashboard_api.router, dependencies=auth)
    return Leases(BodyLimit(app, max_body_bytes))
