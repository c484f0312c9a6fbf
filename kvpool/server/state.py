"""What every route needs: the served model, its engine, the key ring and the metrics.
Stored on ``app.state.kv``; routes reach it through the ``State`` dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from kvpool.server.auth import KeyRing, Tenant
from kvpool.server.errors import APIError
from kvpool.server.metrics import Metrics
from kvpool.server.served_model import ServedModel


@dataclass
class ServerState:
    model: ServedModel
    keys: KeyRing
    metrics: Metrics
    tenant_pin_share: float = 0.25  # of the pin budget, for each non-admin tenant's pins
    max_queue: int | None = None  # waiting requests (the engine refuses past it)

    def tenant_pin_blocks(self, max_pinned_blocks: int) -> int:
        """The blocks one non-admin tenant's pins may hold together."""
        return int(max_pinned_blocks * self.tenant_pin_share)

    def check_model(self, requested: str | None) -> ServedModel:
        if not requested:
            raise APIError(400, "model is required")
        if not self.model.matches(requested):
            raise APIError(
                404,
                f"model {requested!r} not found; this server serves {self.model.name!r}",
                "not_found_error",
            )
        return self.model


def server_state(request: Request) -> ServerState:
    return request.app.state.kv


State = Annotated[ServerState, Depends(server_state)]


def tenant_of(request: Request) -> Tenant:
    """Set by the auth middleware for every request that got past it."""
    return request.state.tenant
