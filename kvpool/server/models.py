"""The models a server holds: the one it was started with, and others loaded on demand.

``kvpool serve MODEL --max-models N`` splits its KV budget (``--kv-cache-memory``) into N
equal pools: the started model takes one; a request that names another model kvpool can
resolve (a GGUF path, the built-in model, a name in the local Ollama store) loads it
into a free one, on a worker thread (the event loop keeps serving). With every pool
taken, the loaded model idle the longest is unloaded first; with all of them busy, the
request gets a 503. ``N = 1`` (the default) serves the started model only.

``keep_alive`` (Ollama's field: a duration such as ``"5m"``, seconds, ``0`` to unload
now, ``-1`` to keep; the default from ``--keep-alive`` or ``OLLAMA_KEEP_ALIVE``) sets
when a model loaded on demand is unloaded: that long after its last request ends. The
started model stays loaded whatever ``keep_alive`` says: its block pool is the cache the
server exists to keep. Unloading stops the model's engine thread, drops its pool and its
weights, and hands the memory back to the system (resident memory drops).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

from kvpool.model_store import ModelNotFound, resolve_model_path
from kvpool.server.errors import APIError
from kvpool.server.served_model import ServedModel

log = logging.getLogger("kvpool.server")

FOREVER = math.inf
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def keep_alive_seconds(value: Any, default: float) -> float:
    """Seconds from a ``keep_alive`` value (``None``: ``default``; negative: forever);
    400 for anything else than a number or a duration like ``"1h30m"``."""
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise APIError(400, "keep_alive must be a duration (e.g. '5m'), seconds, 0 or -1")
    if isinstance(value, int | float):
        if math.isnan(value):
            raise APIError(400, "keep_alive must be a number")
        return FOREVER if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        with contextlib.suppress(ValueError):
            return keep_alive_seconds(float(text), default)
        parts = re.findall(r"(-?\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
        if parts and "".join(n + u for n, u in parts) == text:
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
            return FOREVER if seconds < 0 else seconds
    raise APIError(400, f"keep_alive {value!r} is not a duration (e.g. '5m', 30, 0, -1)")


class ModelRegistry:
    """The primary model and the ones loaded on demand (see the module docstring).
    ``load(requested, kv_bytes)`` builds a started ``ServedModel`` (slow: a worker
    thread runs it) or raises ``LookupError`` for a name it cannot resolve."""

    def __init__(
        self,
        primary: ServedModel,
        load: Callable[[str, int | None], ServedModel] | None,
        *,
        max_models: int = 1,
        kv_bytes: int | None = None,
        default_keep_alive: float = FOREVER,
    ) -> None:
        self.primary = primary
        self._load = load
        self.max_models = max_models
        self.kv_bytes = kv_bytes  # each pool's (None: sized from the GPU's memory)
        self.default_keep_alive = default_keep_alive
        self.extras: list[ServedModel] = []
        self._lock = asyncio.Lock()
        primary.keep_alive = FOREVER

    def loaded(self) -> list[ServedModel]:
        return [self.primary, *self.extras]

    async def resolve(self, requested: str | None, keep_alive: Any = None) -> ServedModel:
        """The model a request names, loaded if need be; its expiry set from
        ``keep_alive``. 400 without a name, 404 for one that resolves to no model."""
        if not requested:
            raise APIError(400, "model is required")
        ttl = keep_alive_seconds(keep_alive, self.default_keep_alive)
        model = self._find(requested)
        if model is None:
            async with self._lock:
                model = self._find(requested) or await self._load_new(requested)
        if model is not self.primary:
            model.keep_alive = ttl
            model.expires_at = time.time() + ttl
        return model

    def check(self, requested: str | None) -> ServedModel | None:
        """Whether a request for ``requested`` would be served, without loading anything:
        the loaded model it names, or None for one that would be loaded on demand (its
        file found). Raises as ``resolve`` would: 400 without a name, 404 for a name that
        names no model this server can serve. (The load itself may still fail: a file
        that is no model kvpool runs, every slot busy.)"""
        if not requested:
            raise APIError(400, "model is required")
        model = self._find(requested)
        if model is not None:
            return model
        self._can_load(requested)
        return None

    def _can_load(self, requested: str) -> None:
        """404 unless this server loads models on demand and ``requested`` resolves to a
        model file: whatever the slots hold (a name of no model was a 503 while every slot
        was busy, or made room by unloading an idle model for nothing)."""
        if self._load is None or self.max_models <= 1:
            raise APIError(
                404,
                f"model {requested!r} not found; this server serves {self.primary.name!r} "
                "(start it with --max-models N to load others on demand)",
                "not_found_error",
            )
        try:
            resolve_model_path(requested)
        except ModelNotFound as exc:
            raise APIError(404, str(exc), "not_found_error") from None

    def _find(self, requested: str) -> ServedModel | None:
        return next((m for m in self.loaded() if m.matches(requested) and not m.unloading), None)

    async def _load_new(self, requested: str) -> ServedModel:
        self._can_load(requested)
        assert self._load is not None
        while len(self.loaded()) >= self.max_models:
            idle = [m for m in self.extras if m.active == 0 and not m.unloading]
            if not idle:
                raise APIError(
                    503, "every model slot is busy; try again shortly", "service_unavailable"
                )
            await self.unload(min(idle, key=lambda m: m.last_used))
        try:
            model = await asyncio.to_thread(self._load, requested, self.kv_bytes)
        except LookupError as exc:
            raise APIError(
                404, f"model {requested!r} not found: {exc}", "not_found_error"
            ) from None
        except (ValueError, OSError) as exc:  # not a model kvpool can run
            raise APIError(400, f"model {requested!r} cannot be loaded: {exc}") from None
        self.extras.append(model)
        log.info("loaded %s on demand (%d of %d models)", model.name, len(self.loaded()),
                 self.max_models)  # fmt: skip
        return model

    async def unload(self, model: ServedModel) -> None:
        """Stop a model loaded on demand and free its pool and weights."""
        if model is self.primary or model not in self.extras or model.unloading:
            return
        model.unloading = True  # no longer found; listed until its memory is given back
        await asyncio.to_thread(_release, model)
        self.extras.remove(model)
        log.info("unloaded %s", model.name)

    async def unload_expired(self) -> None:
        now = time.time()
        for model in list(self.extras):
            if model.active == 0 and model.expires_at <= now and not model.unloading:
                await self.unload(model)

    async def reap_forever(self, every: float = 0.5) -> None:
        """Unload expired idle models until cancelled (the server's lifespan task)."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.unload_expired()
            except Exception:  # never let the reaper die
                log.exception("unloading an expired model failed")

    async def close(self) -> None:
        for model in list(self.extras):
            await self.unload(model)


def _release(model: ServedModel) -> None:
    model.llm.shutdown()
    model.llm.engine.close()
    model.release()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc: return freed heap pages
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Leases:
    """ASGI wrapper: a request's models (``ServerState.resolve`` holds each one) are let
    go when its response has been sent whole (a stream's last byte included): their
    idle time, and so their ``keep_alive``, counts from then."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            state = scope.get("state") or {}
            now = time.time()
            for model in state.get("leases", ()):
                model.active -= 1
                model.last_used = now
                model.expires_at = now + model.keep_alive
