"""The routers kvpool's is compared with, able to serve the cluster's per-replica views.

- ``Pow2Router``: Ray Serve's default (power of two choices: the shorter queue of two
  replicas drawn at random).
- ``PrefixAffinityRouter``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (a tree of the
  prompt *text* sent to each replica; it does not learn of evictions). Its public
  re-export (``ray.serve.llm.request_router``) needs vLLM or SGLang installed; the class
  itself does not, so it is imported from where Ray defines it.

Each only gains ``ReplicaDirectory`` (a request that names its replica goes there; the
ingress finds the router): every other request is routed by the baseline unchanged.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from kvpool.cluster.router import ReplicaDirectory, routed_request


class Pow2Router(ReplicaDirectory, PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._register()


def _prefix_affinity_base() -> type:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    return PrefixCacheAffinityRouter


class PrefixAffinityRouter(ReplicaDirectory, _prefix_affinity_base()):  # type: ignore[misc]
    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._register()

    async def choose_unnamed(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        request = routed_request(pending_request)
        if request is None or not request.prompt:  # no prompt (it divides by its length):
            return [candidate_replicas]  # the shortest queue, as Ray Serve picks in a rank
        return await super().choose_unnamed(candidate_replicas, pending_request)
