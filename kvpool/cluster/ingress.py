"""The cluster's one HTTP door: the same Ollama and OpenAI APIs as ``kvpool serve``.

Every generation request is tokenized here (``kvpool.cluster.prompt``: the model's own
tokenizer and chat template, the tenant's salt from its key), turned into its prefix's
block keys, and sent to an engine replica through the deployment handle, whose router
(``kvpool.cluster.router``) picks the replica by those keys. The replica answers with
its own server's response, streamed back unchanged. A Responses request that names a
stored response (``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``) goes
to the replica that stored it: its id names the replica.

What spans the replicas is answered here:

- ``GET /api/kvcache``: the pool counters summed over replicas, with ``replicas``: each
  replica's own answer (``?blocks=true``, admin: with its block hashes).
- ``POST /api/kvcache/pin`` / ``unpin`` / ``reset``: done on every replica (or on the one
  ``?replica=ID`` names); the answer is the first replica's with ``replicas`` added.
- ``GET /metrics``: every replica's series, labelled ``replica``, and the router's.
- ``GET /api/cluster``: the router's view: replicas (pid, load, blocks indexed), how
  requests were routed; ``?blocks=true`` (admin): the index's block hashes per replica.
- ``/api/dashboard`` (the live view's data): one replica's pool, the one ``?replica=ID``
  names (the page passes its own query on: ``/dashboard?replica=ID``), else the first;
  never a different replica from one poll to the next.

Faults: a replica that fails before its response started is retried once on another
replica (nothing reached the client); one that dies mid-stream ends the stream the way
the API ends a failed stream (an ``error`` event then ``[DONE]`` for OpenAI's SSE, an
``{"error": ...}`` line for Ollama's NDJSON), never a hang: each part must arrive within
``part_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.cache.kv_index import prefix_keys
from kvpool.cluster.asgi_call import HTTPRequest, ResponseStart
from kvpool.cluster.prompt import PromptReader
from kvpool.cluster.routing import ROUTERS, RoutedRequest
from kvpool.server import responses_api
from kvpool.server.auth import KeyRing
from kvpool.server.errors import anthropic_path, anthropic_stream_error, error_body

log = logging.getLogger("kvpool.cluster")

BROADCAST = {"/api/kvcache/pin", "/api/kvcache/unpin", "/api/kvcache/reset"}
# Counters of /api/kvcache that add up over replicas (the rest are per replica).
SUMMED = (
    "total_blocks", "free_blocks", "cached_blocks", "used_blocks", "shared_blocks",
    "pinned_blocks", "num_sequences", "total_bytes", "used_bytes", "cached_bytes",
    "prefix_lookups", "prefix_query_tokens", "prefix_hit_tokens", "evictions",
    "cow_copies", "running", "waiting", "preemptions", "steps", "prompt_tokens",
    "cached_prompt_tokens", "admitted", "pins",
)  # fmt: skip


class ReplicaGone(Exception):
    """The replica failed or vanished before its response started."""


def _failure_tail(path: str, start: ResponseStart, message: str) -> bytes:
    """How a stream that its replica can no longer finish ends, in the API's shape."""
    kind = (start.header("content-type") or "").split(";")[0].strip()
    if kind == "text/event-stream" and anthropic_path(path):
        return anthropic_stream_error(503, message)
    if kind == "text/event-stream":
        error = {"message": message, "type": "service_unavailable", "param": None, "code": 503}
        return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
    if kind == "application/x-ndjson":
        return (json.dumps({"error": message}) + "\n").encode()
    return b""


class Ingress:
    """The ingress deployment's logic (``kvpool.cluster.app`` wraps it for Ray Serve)."""

    def __init__(
        self,
        engine: Any,
        model_path: str,
        block_size: int,
        api_keys: list[str] | None,
        keys_file: str | None,
        deployment: str,
        part_timeout_s: float = 300.0,
    ) -> None:
        self.engine = engine  # a DeploymentHandle of the engine replicas
        self.prompts = PromptReader(Path(model_path))
        self.block_size = block_size
        self.keys = KeyRing.load(api_keys, Path(keys_file) if keys_file else None)
        self.deployment = deployment
        self.part_timeout_s = part_timeout_s
        self.retried = 0
        self.failed_streams = 0

    # -- the router, this process's ------------------------------------------------------
    async def _router(self) -> Any:
        router = ROUTERS.get(self.deployment)
        if router is None:  # made on the handle's first call: make one
            await self.engine.describe.remote(RoutedRequest(HTTPRequest("GET", "/")))
            router = ROUTERS[self.deployment]
        return router

    async def replicas(self) -> list[str]:
        return sorted((await self._router()).live_replicas())

    # -- one request ---------------------------------------------------------------------
    def _routed(self, http: HTTPRequest) -> RoutedRequest:
        ids = self.prompts.prompt_ids(http.path, http.body)
        if ids is None:
            return RoutedRequest(http)
        tenant = self.keys.tenant(http.header("authorization"), http.header("x-api-key"))
        salt = tenant.salt if tenant is not None else None
        keys = prefix_keys(ids, self.block_size, salt)
        routed = RoutedRequest(http, keys, len(ids), self.prompts.decode(ids))
        routed.max_tokens = self.prompts.max_tokens(http.body)
        return routed

    async def _holder(self, http: HTTPRequest) -> str | None:
        """The replica holding the stored response a Responses request names (a
        continuation's ``previous_response_id``; the id in ``GET`` / ``DELETE
        /v1/responses/{id}``): the id says which (``responses_api.new_response_id``).
        None where none does or that replica is gone: any replica then answers (a 404
        for a response it never held)."""
        route = http.path.rstrip("/")
        named: Any = None
        if route == "/v1/responses" and http.method == "POST":
            try:
                named = json.loads(http.body).get("previous_response_id")
            except (ValueError, AttributeError):
                return None
        elif route.startswith("/v1/responses/"):
            named = route.removeprefix("/v1/responses/")
        tag = responses_api.replica_of(named) if isinstance(named, str) else None
        return tag if tag is not None and tag in await self.replicas() else None

    async def _start(self, routed: RoutedRequest) -> tuple[ResponseStart, Any]:
        """Send to a replica; its ``ResponseStart`` and the stream of the rest."""
        stream = self.engine.options(stream=True).forward.remote(routed)
        try:
            first = await asyncio.wait_for(stream.__anext__(), self.part_timeout_s)
        except Exception as exc:
            stream.cancel()
            raise ReplicaGone(repr(exc)) from exc
        return first, stream

    async def forward(self, http: HTTPRequest, replica: str | None = None) -> Response:
        routed = self._routed(http)
        routed.replica = replica or await self._holder(http)
        try:
            start, stream = await self._start(routed)
        except ReplicaGone as exc:
            if replica is not None:
                return self._error(http.path, 503, f"replica {replica} failed: {exc}")
            self.retried += 1
            log.warning("a replica failed before answering (%s); retrying once", exc)
            try:
                start, stream = await self._start(routed)
            except ReplicaGone as again:
                return self._error(http.path, 503, f"no replica could answer: {again}")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers}
        headers.pop("content-length", None)
        media = headers.pop("content-type", None)
        return StreamingResponse(
            self._rest(http.path, start, stream), status_code=start.status,
            headers=headers, media_type=media,
        )  # fmt: skip

    async def _rest(self, path: str, start: ResponseStart, stream: Any) -> AsyncIterator[bytes]:
        try:
            while True:
                try:
                    part = await asyncio.wait_for(stream.__anext__(), self.part_timeout_s)
                except StopAsyncIteration:
                    return
                yield part
        except Exception as exc:  # the replica died (or went silent) mid-response
            self.failed_streams += 1
            log.warning("a replica failed mid-response: %r", exc)
            yield _failure_tail(path, start, f"the replica serving this request failed: {exc!r}")
        finally:
            stream.cancel()

    def _error(self, path: str, status: int, message: str) -> JSONResponse:
        kind = "service_unavailable" if status == 503 else "invalid_request_error"
        return JSONResponse(error_body(path, status, message, kind), status_code=status)

    # -- every replica ------------------------------------------------------------------
    async def collect(self, http: HTTPRequest, only: str | None = None) -> dict[str, Any]:
        """Each replica's answer to ``http`` (parsed JSON, or text), by replica id.

        The calls start one after another (each is routed before the next is made: calls
        made while serving one HTTP request share its request id, by which Ray Serve
        matches a routing decision to its call) and finish together."""
        names = [only] if only else await self.replicas()

        async def rest(start: ResponseStart, stream: Any) -> tuple[int, Any]:
            body = b""
            async for part in stream:
                body += part
            try:
                return start.status, json.loads(body)
            except ValueError:
                return start.status, body.decode()

        pending: list[Any] = []
        for name in names:
            try:
                start, stream = await self._start(RoutedRequest(http, replica=name))
                pending.append(rest(start, stream))
            except ReplicaGone as exc:
                pending.append(_raise(exc))
        results = await asyncio.gather(*pending, return_exceptions=True)
        out: dict[str, Any] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                out[name] = (503, {"error": f"replica {name} failed: {result!r}"})
            else:
                out[name] = result
        return out

    async def kvcache(self, http: HTTPRequest) -> Response:
        answers = await self.collect(http)
        ok = {n: body for n, (status, body) in answers.items() if status == 200}
        if not ok:
            status, body = next(iter(answers.values()), (503, {"error": "no replicas"}))
            return JSONResponse(body, status_code=status)
        first = next(iter(ok.values()))
        total = {k: v for k, v in first.items() if k not in ("block_hashes", "tenants")}
        for key in SUMMED:
            if key in first:
                total[key] = sum(body.get(key, 0) for body in ok.values())
        if "prefix_query_tokens" in total:
            q = total["prefix_query_tokens"]
            total["hit_rate_tokens"] = total["prefix_hit_tokens"] / q if q else 0.0
        elif "prompt_tokens" in total:
            p = total["prompt_tokens"]
            total["hit_rate_tokens"] = total["cached_prompt_tokens"] / p if p else 0.0
        total["replicas"] = {n: body for n, (_, body) in answers.items()}
        return JSONResponse(total)

    async def broadcast(self, http: HTTPRequest, only: str | None) -> Response:
        if only is not None and only not in await self.replicas():
            return self._error(http.path, 404, f"no replica {only!r}")
        answers = await self.collect(http, only)
        _, body = next(iter(answers.values()))
        worst = max(s for s, _ in answers.values())
        merged = {**body, "replicas": {n: b for n, (_, b) in answers.items()}}
        return JSONResponse(merged if isinstance(body, dict) else body, status_code=worst)

    async def metrics(self, http: HTTPRequest) -> Response:
        from prometheus_client.parser import text_string_to_metric_families

        answers = await self.collect(http)
        families: dict[str, Any] = {}
        for name, (status, text) in sorted(answers.items()):
            if status != 200 or not isinstance(text, str):
                continue
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, family)
                if merged is not family:
                    merged.samples.extend(_labelled(family.samples, name))
                else:
                    family.samples = _labelled(family.samples, name)
        router = await self._router()
        lines = []
        for family in families.values():
            lines.append(f"# HELP {family.name} {family.documentation}")
            lines.append(f"# TYPE {family.name} {family.type}")
            lines += [_sample_line(s) for s in family.samples]
        r = getattr(router, "routing", None)
        if r is not None:
            lines += [
                "# HELP kvpool_cluster_routed_total Requests routed, by what decided",
                "# TYPE kvpool_cluster_routed_total counter",
                f'kvpool_cluster_routed_total{{by="prefix"}} {r.routed_by_prefix}',
                f'kvpool_cluster_routed_total{{by="load"}} {r.routed_by_load}',
            ]
        lines += [
            "# HELP kvpool_cluster_replicas Engine replicas the router can send to",
            "# TYPE kvpool_cluster_replicas gauge",
            f"kvpool_cluster_replicas {len(router.live_replicas())}",
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def cluster(self, http: HTTPRequest, blocks: bool) -> Response:
        tenant = self.keys.tenant(http.header("authorization"), http.header("x-api-key"))
        if tenant is None:
            return self._error(http.path, 401, "a valid API key is required")
        if not tenant.admin:
            return self._error(http.path, 403, "only an admin key may see the cluster's index")
        router = await self._router()
        await router.synced()
        r = getattr(router, "routing", None)  # kvpool's router; the baselines keep no index
        described = {}
        for name in router.live_replicas():
            try:
                info = await self.engine.describe.remote(RoutedRequest(http, replica=name))
            except Exception as exc:
                info = {"error": repr(exc)}
            if r is not None:
                index, load = r.replay.index, r.replay.loads.get(name)
                info = {
                    **info,
                    "in_flight": r.in_flight.get(name, 0),
                    "load": load.__dict__ if load is not None else None,
                    "indexed_blocks": len(index.blocks_of(name)),
                    "pinned_blocks": len(index.pinned_of(name)),
                }
                if blocks:
                    info["block_hashes"] = [f"{k:016x}" for k in sorted(index.blocks_of(name))]
            described[name] = info
        view: dict[str, Any] = {
            "router": type(router).__name__,
            "replicas": described,
            "retried": self.retried,
            "failed_streams": self.failed_streams,
            "block_size": self.block_size,
        }
        if r is not None:
            view.update(routed_by_prefix=r.routed_by_prefix, routed_by_load=r.routed_by_load,
                        imbalance=r.imbalance)  # fmt: skip
        return JSONResponse(view)


async def _raise(exc: BaseException) -> Any:
    raise exc


def _labelled(samples: list[Any], replica: str) -> list[Any]:
    return [s._replace(labels={**s.labels, "replica": replica}) for s in samples]


def _sample_line(sample: Any) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    labels = ",".join(f'{k}="{escape(str(v))}"' for k, v in sample.labels.items())
    return f"{sample.name}{{{labels}}} {sample.value}"


async def dispatch(ingress: Ingress, request: Request) -> Response:
    """Answer one HTTP request at the ingress (the deployment's catch-all route)."""
    http = HTTPRequest(
        request.method,
        request.url.path,
        request.url.query.encode(),
        [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
        await request.body(),
    )
    route = http.path.rstrip("/") or "/"
    replica = request.query_params.get("replica")
    blocks = request.query_params.get("blocks", "").lower() in ("1", "true", "yes")
    if route == "/api/kvcache" and request.method == "GET":
        return await ingress.kvcache(http)
    if route in BROADCAST and request.method == "POST":
        return await ingress.broadcast(http, replica)
    if route == "/metrics" and request.method == "GET":
        return await ingress.metrics(http)
    if route == "/api/cluster" and request.method == "GET":
        return await ingress.cluster(http, blocks)
    if route.startswith("/api/dashboard"):
        names = await ingress.replicas()
        if not names:
            return ingress._error(http.path, 503, "no replica is running")
        return await ingress.forward(http, replica if replica in names else names[0])
    return await ingress.forward(http)
