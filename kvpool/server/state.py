"""What every route needs: the served model, its engine, the key ring and the metrics.
Stored on ``app.state.kv``; routes reach it through the ``State`` dependency."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from kvpool.server.auth import KeyRing, Tenant
from kvpool.server.metrics import Metrics
from kvpool.server.models import ModelRegistry
from kvpool.server.pool_history import PoolHistory
from kvpool.server.response_store import ResponseStore
from kvpool.server.served_model import ServedModel


@dataclass
class ServerState:
    model: ServedModel  # the model the server was started with (always loaded)
    models: ModelRegistry  # it and the ones loaded on demand
    keys: KeyRing
    metrics: Metrics
    tenant_pin_share: float = 0.25  # of the pin budget, for each non-admin tenant's pins
    max_queue: int | None = None  # waiting requests (the engine refuses past it)
    history: PoolHistory | None = None  # the last minutes of the pool (the live view)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept

    def tenant_pin_blocks(self, max_pinned_blocks: int) -> int:
        """The blocks one non-admin tenant's pins may hold together."""
        return int(max_pinned_blocks * self.tenant_pin_share)

    async def resolve(
        self, http: Request, requested: str | None, keep_alive: Any = None
    ) -> ServedModel:
        """The model a request names (loaded on demand), held until its response has
        been sent (``models.Leases``): it is not unloaded under a request."""
        model = await self.models.resolve(requested, keep_alive)
        model.active += 1
        leases = getattr(http.state, "leases", None)
        if leases is None:
            leases = http.state.leases = []
        leases.append(model)
        return model


def server_state(request: Request) -> ServerState:
    return request.app.state.kv


State = Annotated[ServerState, Depends(server_state)]


def tenant_of(request: Request) -> Tenant:
    """Set by the auth middleware for every request that got past it."""
    return request.state.tenant
