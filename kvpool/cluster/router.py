"""``KVPrefixRouter``: a Ray Serve ``RequestRouter`` that sends each request to the replica
holding the longest cached prefix of it (the policy: ``kvpool.cluster.routing``).

Ray Serve makes one router per deployment handle, in the process that holds the handle
(the ingress). This one keeps its copy of the cluster's KV index by long-polling the
``KVEventLog`` actor on a task of its own (a pull returns as soon as a replica published
something, or after a second), so choosing a replica never waits on the network.

Replicas that leave (``update_replicas`` no longer lists them, or Ray Serve reports the
actor dead) are dropped from the index at once, and the log forgets them, so a request
is never routed by blocks of a replica the router has lost.

Configure it on the engine deployment with ``RequestRouterConfig(request_router_class=
"kvpool.cluster.router:KVPrefixRouter", request_router_kwargs={...})`` (``routing``'s
settings plus the log actor's name and namespace).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from kvpool.cluster import routing as routing_module
from kvpool.cluster.routing import PrefixRouting, RoutedRequest

log = logging.getLogger("kvpool.cluster")


class ReplicaDirectory:
    """Mixed into every router the cluster runs (kvpool's and the baselines it is
    compared with): registers the router where the ingress finds it, lists the live
    replicas, and sends a request that names a replica there (per-replica views, pins)."""

    def _register(self) -> None:
        # Found by the ingress in this process's registry; Ray Serve ships router
        # modules by value, so the registry lives in ``routing``, imported by reference.
        routing_module.ROUTERS[self._deployment_id.name] = self  # type: ignore[attr-defined]

    def live_replicas(self) -> dict[str, RunningReplica]:
        return {r.replica_id.unique_id: r for r in self._replicas.values()}  # type: ignore[attr-defined]

    async def synced(self) -> None:
        """Routers without a KV index have nothing to catch up with."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = routed_request(pending_request)
        if request is not None and request.replica is not None:  # a named replica only
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            return [[by_id[request.replica]]] if request.replica in by_id else []
        return await self.choose_unnamed(candidate_replicas, pending_request)

    async def choose_unnamed(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        return await super().choose_replicas(candidate_replicas, pending_request)  # type: ignore[misc]


class KVPrefixRouter(ReplicaDirectory, RequestRouter):
    def initialize_state(
        self,
        block_size: int = 16,
        imbalance: int = 32,
        log_name: str = "",
        log_namespace: str = "",
        **_: Any,
    ) -> None:
        self.routing = PrefixRouting(block_size, imbalance)
        self._log_name, self._log_namespace = log_name, log_namespace
        self._log: Any = None
        self._puller: asyncio.Task[None] | None = None
        self._by_request: dict[str, str] = {}  # internal request id -> replica
        self._register()

    # -- the index -----------------------------------------------------------------------
    def _ensure_puller(self) -> None:
        if self._puller is None or self._puller.done():
            self._puller = asyncio.get_running_loop().create_task(self._pull_loop())

    async def _pull_loop(self) -> None:
        while True:
            try:
                if self._log is None:
                    self._log = ray.get_actor(self._log_name, namespace=self._log_namespace)
                pulled = await self._log.pull.remote(self.routing.replay.cursor, 1.0)
                self.routing.replay.apply(pulled)
            except Exception:
                log.warning("KV index: pulling events failed; retrying", exc_info=True)
                self._log = None
                await asyncio.sleep(1.0)

    async def synced(self) -> None:
        """Wait until the local index has everything the log had when this was called."""
        self._ensure_puller()
        if self._log is None:
            self._log = ray.get_actor(self._log_name, namespace=self._log_namespace)
        target = (await self._log.pull.remote(None, 0))["cursor"]
        for _ in range(1000):  # 10 s at most: the puller is stuck, the caller sees stale
            cursor = self.routing.replay.cursor
            if cursor is not None and cursor >= target:
                return
            await asyncio.sleep(0.01)

    # -- Ray Serve's hooks -------------------------------------------------------------
    async def choose_unnamed(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        self._ensure_puller()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request = routed_request(pending_request)
        keys = request.keys if request is not None else []
        tokens = request.prompt_tokens if request is not None and request.keys else None
        ranks = self.routing.rank(list(by_id), keys, tokens)
        if ranks and pending_request is not None:  # counted now: see routing's docstring
            self.routing.chosen(
                pending_request.metadata.internal_request_id, ranks[0][0], keys,
                request.prompt_tokens if request is not None else 0,
                request.max_tokens if request is not None else 0,
            )  # fmt: skip
        return [[by_id[r] for r in rank] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request = routed_request(pending_request)
        rid = pending_request.metadata.internal_request_id
        self._by_request[rid] = replica_id.unique_id
        if request is None:
            self.routing.routed(rid, replica_id.unique_id, [])
        else:
            self.routing.routed(rid, replica_id.unique_id, request.keys, request.prompt_tokens,
                                request.max_tokens)  # fmt: skip

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._by_request.pop(internal_request_id, None)
        self.routing.completed(internal_request_id, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self.live_replicas())
        super().update_replicas(replicas)
        for gone in before - set(self.live_replicas()):
            self._lost(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._lost(replica_id.unique_id)

    def _lost(self, replica: str) -> None:
        self.routing.drop(replica)
        self.routing.replay.gone.add(replica)
        if self._log is not None:
            self._log.forget.remote(replica)


def routed_request(pending: PendingRequest | None) -> RoutedRequest | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, RoutedRequest) else None
