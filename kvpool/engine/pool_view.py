"""The pool seen from outside: the block map and the requests holding blocks, taken on
the engine thread after a step while someone is watching, and one block described.

A view costs one copy of the pool's block map (one byte a block, ``kvpool.cache.
block_map``) and one record per running or waiting request; it is taken at most every
``PoolWatch.interval`` seconds and only while a watcher has asked within ``linger``
seconds, so an engine nobody watches pays nothing. Nothing here pauses a step: views ride
on the snapshot the engine publishes after each step; ``describe_block`` runs as a command
between two steps.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvpool.cache import KVCacheManager
from kvpool.cache.block_map import code_of, state_of
from kvpool.engine.request import Request, Status


@dataclass(frozen=True)
class RequestView:
    """One sequence holding (running) or waiting for blocks."""

    request_id: str
    index: int  # which of the request's n samples
    salt: str | None
    status: str  # "running" or "waiting"
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    preemptions: int
    blocks: tuple[int, ...]  # its block table (running only), in order


@dataclass(frozen=True)
class PoolView:
    """The pool at one moment: ``states`` is the block map (one byte a block)."""

    states: bytes
    requests: tuple[RequestView, ...]
    taken_at: float  # time.time()


class PoolWatch:
    """When to take a view: only while watched, at most every ``interval`` seconds."""

    def __init__(self, interval: float = 0.25, linger: float = 5.0) -> None:
        self.interval = interval
        self.linger = linger
        self._until = 0.0  # monotonic time the last watcher's interest lasts to
        self._taken = 0.0
        self.view: PoolView | None = None

    def watch(self) -> None:
        """A watcher wants views for the next ``linger`` seconds (any thread may call:
        one float assignment)."""
        self._until = time.monotonic() + self.linger

    def refresh(self, manager: KVCacheManager, running: list[Request],
                waiting: Iterable[Request]) -> PoolView | None:  # fmt: skip
        """The view to publish now: a new one if due, else the last (None when nobody
        watches)."""
        now = time.monotonic()
        if now >= self._until:
            self.view = None
            return None
        if self.view is None or now - self._taken >= self.interval:
            self._taken = now
            self.view = take_view(manager, running, waiting)
        return self.view


def _request_view(manager: KVCacheManager, request: Request) -> RequestView:
    running = request.status is Status.RUNNING and manager.has_sequence(request.seq_id)
    return RequestView(
        request_id=request.request_id,
        index=request.index,
        salt=request.salt,
        status="running" if running else "waiting",
        prompt_tokens=len(request.prompt_ids),
        cached_prompt_tokens=request.cached_prompt_tokens,
        output_tokens=len(request.tokens) - len(request.prompt_ids),
        preemptions=request.preemptions,
        blocks=tuple(manager.block_table(request.seq_id)) if running else (),
    )


MAX_WAITING_SHOWN = 200  # a long queue is listed by its head (the snapshot counts it all)


def take_view(
    manager: KVCacheManager, running: list[Request], waiting: Iterable[Request]
) -> PoolView:
    requests = [_request_view(manager, r) for r in running]
    requests += [_request_view(manager, r) for r in itertools.islice(waiting, MAX_WAITING_SHOWN)]
    return PoolView(bytes(manager.pool.states), tuple(requests), time.time())


def describe_block(
    manager: KVCacheManager, running: list[Request], block_id: int
) -> dict[str, Any]:
    """What one block holds now: its state, holders, pins, tokens, chain position and
    salt, and which running sequences list it (and where in their tables)."""
    pool = manager.pool
    if not 0 <= block_id < pool.num_blocks:
        raise IndexError(f"block {block_id} is not in the pool (0..{pool.num_blocks - 1})")
    block = pool.blocks[block_id]
    holders = []
    position = block.position
    for request in running:
        if request.status is not Status.RUNNING or not manager.has_sequence(request.seq_id):
            continue
        table = manager.block_table(request.seq_id)
        if block_id in table:
            at = table.index(block_id)
            holders.append({"request_id": request.request_id, "index": request.index,
                            "salt": request.salt, "position": at})  # fmt: skip
            position = at if position < 0 else position
    return {
        "block": block_id,
        "state": state_of(code_of(block)),
        "ref_count": block.ref_count,
        "pins": block.pin_count,
        "tokens": len(block.token_ids),
        "position": position,
        "salt": block.salt.decode() if block.salt else None,
        "hashed": block.block_hash is not None,
        "sequences": holders,
    }
