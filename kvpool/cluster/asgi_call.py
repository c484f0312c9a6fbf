"""One HTTP request through an ASGI app in process, its response as a stream of parts.

A cluster replica runs ``kvpool serve``'s own app (``kvpool.server.app``) and the ingress
hands it each request as an ``HTTPRequest`` (plain data, sent between processes); the
response comes back as ``ResponseStart`` then the body's chunks, as the app sends them,
so a streamed generation streams through the cluster unchanged.

Invariants: the first part is always a ``ResponseStart`` (a 500 one if the app failed
before starting its response); the stream ends after the app's last body chunk; closing
the stream early tells the app the client went away (``http.disconnect``, so a running
generation is aborted and its blocks freed), and the app's task never outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

DISCONNECT_GRACE_S = 5.0  # how long an app may take to end once its client left


def _header(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    key = name.lower().encode()
    for k, v in headers:
        if k.lower() == key:
            return v.decode("latin-1")
    return None


@dataclass
class HTTPRequest:
    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        return _header(self.headers, name)


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: str) -> str | None:
        return _header(self.headers, name)


def _scope(request: HTTPRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def call_app(app: Any, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
    """The app's response to ``request``: a ``ResponseStart``, then body chunks."""
    parts: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await parts.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await parts.put(None)  # the app returned (or failed)

    task = asyncio.create_task(run())
    started = False
    try:
        while True:
            message = await parts.get()
            if message is None:
                if not started:  # failed before any response: say so as a server would
                    exc = task.exception() if task.done() and not task.cancelled() else None
                    body = json.dumps({"error": f"internal error: {exc!r}"}).encode()
                    yield ResponseStart(500, [(b"content-type", b"application/json")])
                    yield body
                return
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # the app sees the client leave and ends its response itself...
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
        if not task.done():  # ...or is stopped
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class Lifespan:
    """An app's lifespan protocol run in process (startup, then shutdown), as uvicorn
    runs it: the server's app starts its background tasks there."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        try:
            await self.app(scope, self._inbox.get, self._outbox.put)
        except Exception as exc:  # an app without lifespan support
            await self._outbox.put({"type": "lifespan.startup.failed", "message": repr(exc)})

    async def startup(self) -> None:
        self._task = asyncio.create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        reply = await self._outbox.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"app startup failed: {reply.get('message', reply)}")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.get(), 10)
