"""``AsyncLLM``: an ``Engine`` on its own thread, driven from an asyncio event loop.

The server's bridge. One thread owns the engine (it is not thread-safe): it runs steps
while there is work and otherwise sleeps on its command queue. Everything else reaches
it through that queue (submit, abort, pin, reset), and each step's ``RequestOutput``s go
back to the event loop with ``call_soon_threadsafe``, so the loop never waits on a model
step. Torch releases the GIL in its kernels, so HTTP keeps flowing while a step computes.
After every step and command the thread publishes ``snapshot`` (the engine's counters),
which any thread reads without waiting.

The thread ends after ``idle_exit`` seconds without work and a new one starts with the
next command: OpenMP (libgomp, torch's) keeps a pool of workers for every thread that
has run a parallel region until that thread ends, and while the pools hold more threads
than there are CPUs its idle workers hardly spin, so each product of a step wakes one: a
second model loaded on demand and then idle, its engine thread's pool kept, slowed the
first model's steps (measured: docs/performance.md, fifteenth session).

    llm = AsyncLLM(engine)
    llm.start()
    async for out in llm.generate(ids, SamplingParams(max_tokens=32)):
        print(out.text, end="")

A consumer that stops iterating (a client that went away) aborts its request: the
generator's ``finally`` sends the abort, and the request's blocks are freed before the
next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from kvpool.engine.engine import PIN_PARAMS, Engine
from kvpool.engine.errors import EngineStopped, RequestError, RequestFailed
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.snapshot import EngineSnapshot, TenantSnapshot
from kvpool.engine.structured import ResponseFormat

log = logging.getLogger("kvpool.engine")
T = TypeVar("T")

__all__ = ["AsyncLLM", "EngineSnapshot", "RequestStream", "TenantSnapshot"]

_STOP = object()
IDLE_EXIT_SECONDS = 2.0  # without work this long, the engine thread ends (see above)


def _nothing() -> None:
    """A command that only wakes the engine thread (it publishes a snapshot after it)."""


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop`` (from the engine thread); nothing once the loop is
    closed (the server stopped: nobody is left to read a result)."""
    with contextlib.suppress(RuntimeError):  # "Event loop is closed"
        loop.call_soon_threadsafe(fn, *args)


class _Route:
    """Where one request's outputs go: its event loop's queue (outputs, then None at the
    end; or an exception), and how many of its samples are still open."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.open_samples = n

    def put(self, item: Any) -> None:
        _post(self.loop, self.queue.put_nowait, item)


class RequestStream:
    """A submitted request: iterate it for its outputs (it ends when every sample has
    finished; a sample that failed in the engine raises ``RequestFailed``); ``cancel``
    ends it early from the event loop."""

    def __init__(self, llm: AsyncLLM, request_id: str, prompt_tokens: int, route: _Route):
        self.llm = llm
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._route = route
        self.done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.done:
            item = await self._route.queue.get()
            if item is None:
                self.done = True
                return
            if isinstance(item, BaseException):
                self.done = True
                raise item
            yield item

    def cancel(self) -> None:
        """End the stream now (a consumer waiting on it wakes up) and abort the request
        on the engine thread (its blocks are freed before the next step)."""
        if not self.done:
            self.done = True
            self._route.queue.put_nowait(None)
            self.llm.abort(self.request_id)


class AsyncLLM:
    def __init__(self, engine: Engine, *, idle_exit: float = IDLE_EXIT_SECONDS) -> None:
        self.engine = engine
        self.idle_exit = idle_exit
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._ids = itertools.count()
        self._adding = 0  # requests handed to the engine thread, not yet added (loop side)
        # The engine thread: one at a time, started by start() and again by a command
        # after an idle exit. ``_running`` (under ``_lock``, reentrant: stop_soon may run
        # in a signal handler) is True from a thread's start until it has found, under
        # the lock, no command left: a command sent after that starts the next thread.
        self._lock = threading.RLock()
        self._started = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.snapshot: EngineSnapshot = engine.snapshot()
        self._kv_sink: Callable[[list[Any]], None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            self._started = True
            self._spawn()

    def _spawn(self) -> None:
        """A new engine thread (under ``_lock``), unless one runs or the engine stopped."""
        if self._running or self._stopped.is_set():
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvpool-engine", daemon=True)
        self._thread.start()

    def _send(self, command: Any) -> None:
        """Queue a command for the engine thread, starting one if it ended idle."""
        self._commands.put(command)
        with self._lock:
            if self._started:
                self._spawn()

    def stop_soon(self) -> None:
        """Ask the engine thread to abort every request and stop; does not wait (safe
        from a signal handler)."""
        self._send(_STOP)

    def shutdown(self, timeout: float | None = 30) -> None:
        """Abort every request (their blocks are freed) and stop the engine thread."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_STOP)
            thread.join(timeout)
        self._stopped.set()
        self._drain_stopped()
        if thread is None or not thread.is_alive():
            self.engine.close()  # the tier's last writes

    def publish_kv_events(self, sink: Callable[[list[Any]], None]) -> None:
        """Turn the engine's KV events on and call ``sink(events)`` on the engine thread
        after every step or command that produced some, in order (call before
        ``start``; ``sink`` must not block: it hands the batch on)."""
        self.engine.enable_kv_events()
        self._kv_sink = sink

    # -- requests ------------------------------------------------------------------------
    async def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        salt: str | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        """Queue a request; raises the engine's ``RequestError`` (nothing allocated) if it
        is refused. Iterate the returned stream for its outputs."""
        ids = list(prompt_ids)
        request_id = request_id or f"r{next(self._ids)}"
        route = self._hand_over(
            request_id,
            ids,
            params,
            lambda: self.engine.add_request(ids, params, request_id=request_id, salt=salt),
        )
        return RequestStream(self, request_id, len(ids), route)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        salt: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``submit``, then the outputs of the request's samples until each has finished;
        leaving the iteration early aborts the request."""
        stream = await self.submit(prompt_ids, params, salt=salt, request_id=request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        self._send(lambda: self._abort(request_id))

    async def pin_prefix(
        self,
        prompt_ids: Sequence[int],
        *,
        salt: str | None = None,
        shared: bool = False,
        max_salt_blocks: int | None = None,
    ) -> int:
        """``Engine.pin_prefix`` through the engine thread: the number of tokens pinned,
        once the prefix is computed; raises the ``CacheError`` of a refused pin."""
        ids = list(prompt_ids)
        request_id = f"pin{next(self._ids)}"
        route = self._hand_over(
            request_id,
            ids,
            PIN_PARAMS,
            lambda: self.engine.pin_prefix(
                ids, salt=salt, shared=shared, max_salt_blocks=max_salt_blocks,
                request_id=request_id,
            ),
        )  # fmt: skip
        async for out in RequestStream(self, request_id, len(ids), route):
            if out.finished:
                if out.pin_error is not None:
                    raise out.pin_error
                return out.pinned_tokens or 0
        raise EngineStopped("the pin request was cancelled")

    async def unpin_prefix(
        self, prompt_ids: Sequence[int], *, salt: str | None = None, shared: bool = False
    ) -> None:
        ids = list(prompt_ids)
        await self._call(lambda: self.engine.unpin_prefix(ids, salt=salt, shared=shared))

    async def reset_prefix_cache(self, *, unpin: bool = False, tier: bool = False) -> int:
        """Drop every cached block that no request holds and no pin keeps; returns how
        many were dropped. ``unpin``: drop every pin first; ``tier``: empty the tier."""
        return await self._call(lambda: self.engine.reset_prefix_cache(unpin=unpin, tier=tier))

    async def check_format(self, fmt: ResponseFormat, budget: int) -> None:
        """Compile a response format on a worker thread (the compiler is thread-safe and
        keeps it for the engine, so the check at submission finds it compiled) and check
        it completes within ``budget`` tokens: ``InvalidSamplingParams`` if not."""
        grammars = self.engine.grammars
        if grammars is None:
            raise RequestError("structured output needs the model's tokenizer")
        await asyncio.to_thread(grammars.check, fmt, budget)

    async def cached_block_hashes(self) -> set[int]:
        """The chain hashes of every block a prefix lookup can find, taken between steps
        (KV events up to that moment have been handed to the sink)."""
        return await self._call(self.engine.cached_block_hashes)

    def watch_pool(self) -> None:
        """Ask for the block map and requests in the snapshots of the next seconds; an
        idle engine thread is woken to publish one (a watcher polls about once a second)."""
        self.engine.watch_pool()
        view = self.snapshot.view
        if view is None or time.time() - view.taken_at > 0.5:
            self._send(_nothing)

    async def describe_block(self, block_id: int) -> dict[str, object]:
        """One block of the pool as it is between two steps."""
        return await self._call(lambda: self.engine.describe_block(block_id))

    async def stats(self) -> EngineSnapshot:
        """A fresh snapshot, taken on the engine thread between steps."""
        return await self._call(self.engine.snapshot)

    # -- the hand-over -------------------------------------------------------------------
    def _hand_over(
        self, request_id: str, ids: list[int], params: SamplingParams, add: Callable[[], Any]
    ) -> _Route:
        """Check the request here, on the event loop (a refusal raises before any answer
        is sent), and hand ``add`` to the engine thread without waiting for it: a step in
        progress delays the request's admission, never its caller, so a client that
        leaves while the engine is inside a long step is let go (and counted) at once,
        and its abort, queued behind the add, takes it out before any step admits it.
        Returns the route its outputs will arrive on."""
        engine = self.engine
        engine.check_request(ids, params)
        if engine.max_queue is not None:
            queued = engine.num_waiting + self._adding
            if queued >= engine.max_queue:
                raise engine.queue_full(queued)
        route = _Route(asyncio.get_running_loop(), params.n)
        self._adding += 1

        def added() -> None:
            self._adding -= 1

        def command() -> None:
            self._routes[request_id] = route  # before any step can produce its outputs
            try:
                add()
            except Exception as exc:  # raced past the checks above: the stream says so
                self._routes.pop(request_id, None)
                route.put(exc)
            finally:
                _post(route.loop, added)

        command.refuse = route.put  # type: ignore[attr-defined]
        self._send(command)
        if self._stopped.is_set():  # the thread may be gone: nobody else will answer
            self._drain_stopped()
        return route

    # -- the engine thread -----------------------------------------------------------------
    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps; its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._send((fn, future))
        if self._stopped.is_set():  # the thread may be gone: nobody else will answer
            self._drain_stopped()
        return await asyncio.wrap_future(future)

    def _drain_stopped(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, tuple) and not command[1].done():
                command[1].set_exception(EngineStopped("the engine is shut down"))
            elif hasattr(command, "refuse"):  # a request handed over, never added
                command.refuse(EngineStopped("the engine is shut down"))

    def _loop(self) -> None:
        engine = self.engine
        while True:
            commands = []
            if not engine.has_work():
                try:
                    commands.append(self._commands.get(timeout=self.idle_exit))
                except queue.Empty:
                    with self._lock:  # a command sent from here on starts a new thread
                        if self._commands.empty():
                            self._running = False
                            return
                    continue
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    self._fail_all(EngineStopped("the server is shutting down"))
                    self.snapshot = engine.snapshot()
                    with self._lock:
                        self._stopped.set()
                        self._running = False
                    self._drain_stopped()
                    return
                self._run_command(command)
            if engine.has_work():
                try:
                    outputs = engine.step()
                except Exception as exc:  # the engine isolates request faults; this is
                    # a fault outside any request: end what runs, keep serving
                    log.exception("engine step failed; ending the running requests")
                    self._fail_all(exc)
                    outputs = []
                self._route_outputs(outputs)
            self.snapshot = engine.snapshot()
            if self._kv_sink is not None:
                events = engine.take_kv_events()
                if events:
                    self._kv_sink(events)

    @staticmethod
    def _run_command(command: Any) -> None:
        if not isinstance(command, tuple):  # fire and forget (an add, an abort)
            command()
            return
        fn, future = command
        try:
            future.set_result(fn())
        except Exception as exc:  # handed to the awaiting caller
            future.set_exception(exc)

    def _route_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            if out.finish_reason == "error":  # this request alone failed in the step
                self._routes.pop(out.request_id)
                self.engine.abort(out.request_id)  # its other samples end with it
                route.put(RequestFailed(out.error or "internal error"))
                continue
            route.put(out)
            if out.finished:
                route.open_samples -= 1
                if route.open_samples == 0:
                    del self._routes[out.request_id]
                    route.put(None)

    def _abort(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        self.engine.abort(request_id)
        if route is not None:
            route.put(None)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, route in list(self._routes.items()):
            self.engine.abort(request_id)
            route.put(exc)
        self._routes.clear()
