"""``EngineReplica``: one Ray Serve replica, one whole kvpool server in process.

Each replica builds what ``kvpool serve`` builds (``kvpool.server.main.build``: the
model, its engine and block pool, the Ollama/OpenAI app) from the same command-line
flags, and answers the ingress's ``RoutedRequest``s by running each through that app
(``kvpool.cluster.asgi_call``): the APIs, streaming, keys and tenants are the server's
own, unchanged.

It publishes its KV events to the cluster's ``KVEventLog`` actor: the engine thread
hands each step's batch to a queue (it never waits on Ray), and one task on the
replica's event loop sends the batches in order, one call at a time, with the replica's
load; at least once a second it sends its load alone (a heartbeat). The first publish
happens before the replica reports ready, so the log knows every replica that serves.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from kvpool.cluster.asgi_call import Lifespan, ResponseStart, call_app
from kvpool.cluster.event_log import ReplicaLoad
from kvpool.cluster.routing import RoutedRequest

log = logging.getLogger("kvpool.cluster")

HEARTBEAT_S = 1.0


def serve_args(argv: list[str]) -> argparse.Namespace:
    """``kvpool serve``'s flags, parsed as that command parses them."""
    from kvpool.server import main

    parser = argparse.ArgumentParser(prog="kvpool serve")
    main.add_arguments(parser)
    return parser.parse_args(argv)


class EngineReplica:
    async def __init__(self, argv: list[str], log_name: str, log_namespace: str) -> None:
        import ray
        from ray import serve

        from kvpool.server.main import build

        args = serve_args(argv)
        args.quiet = True
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        # into its Responses ids: the ingress sends their continuations back here
        built = build(args, response_tag=self.replica_id if self.replica_id.isalnum() else "")
        self.app, self.llm, self.model = built.app, built.llm, built.model
        self._log = ray.get_actor(log_name, namespace=log_namespace)
        self._batches: collections.deque[list[Any]] = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.llm.publish_kv_events(self._hand_over)
        self.llm.start()
        self._lifespan = Lifespan(self.app)
        await self._lifespan.startup()
        await self._publish()  # registered with the log before serving
        self._publisher = asyncio.create_task(self._publish_loop())

    # -- KV events ---------------------------------------------------------------------
    def _hand_over(self, events: list[Any]) -> None:
        """On the engine thread: queue the batch, wake the publisher."""
        self._batches.append(events)
        with contextlib.suppress(RuntimeError):  # the loop closed: the replica is going
            self._loop.call_soon_threadsafe(self._wake.set)

    def _load(self) -> ReplicaLoad:
        snap = self.llm.snapshot
        c = snap.cache
        return ReplicaLoad(
            running=snap.running,
            waiting=snap.waiting,
            free_blocks=c.total_blocks - c.used_blocks,
            total_blocks=c.total_blocks,
        )

    async def _publish(self) -> None:
        events: list[Any] = []
        while self._batches:
            events.extend(self._batches.popleft())
        await self._log.publish.remote(self.replica_id, events, self._load())

    async def _publish_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), HEARTBEAT_S)
            self._wake.clear()
            try:
                await self._publish()
            except Exception:  # the log is gone for now: the router routes by load
                log.warning("replica %s: publishing KV events failed", self.replica_id)
                await asyncio.sleep(HEARTBEAT_S)

    # -- requests ----------------------------------------------------------------------
    async def forward(self, request: RoutedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's response to the request: a ``ResponseStart``, then body chunks."""
        async for part in call_app(self.app, request.http):
            yield part

    def describe(self, request: RoutedRequest) -> dict[str, Any]:
        """Who this replica is (the ingress's per-replica views; tests kill by pid).
        ``request`` only names the replica, for the router."""
        return {"replica": self.replica_id, "pid": os.getpid(), "model": self.model.name}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._publisher.cancel()
            self.llm.shutdown(timeout=5)
