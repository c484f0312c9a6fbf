"""``AsyncLLM``: the engine on its own thread, driven from an asyncio event loop.

The server's bridge. One thread owns the ``Engine`` (and so the block manager, which is
not thread-safe): it runs steps while there is work and otherwise sleeps on its command
queue. Everything else reaches it through that queue (submit, cancel, pin, stats), and
results come back to the event loop with ``call_soon_threadsafe``, so the loop never
waits on a model step. Torch releases the GIL in its kernels, so HTTP keeps flowing
while a step computes.

    engine = AsyncLLM(LLM())
    engine.start()
    async for delta in engine.generate(ids, SamplingParams(max_tokens=32)):
        print(delta.text, end="")

A consumer that stops iterating (a client that went away) cancels its request: the
generator's ``finally`` sends the cancel and the request's blocks are freed before the
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
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpool.cache import CacheStats, PinInfo
from kvpool.engine.errors import EngineStopped, RequestFailed
from kvpool.engine.llm import LLM
from kvpool.engine.request import Request, Status
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.text_stream import TextStream

log = logging.getLogger("kvpool.engine")
T = TypeVar("T")


@dataclass(frozen=True)
class Delta:
    """What one sample of a request produced since its last delta."""

    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the sample's last delta
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int  # this sample's output so far
    time: float  # time.monotonic() when the step that produced it ended


@dataclass(frozen=True)
class TenantSnapshot:
    """One tenant's (cache salt's) part of the engine: what it runs, waits for, was
    served from the cache and holds pinned."""

    running: int = 0
    waiting: int = 0
    admitted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    pinned_blocks: int = 0
    pins: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters after its latest step (read from any thread, never
    waiting for one: the engine thread replaces it after every step and command)."""

    cache: CacheStats
    running: int
    waiting: int
    preemptions: int
    steps: int
    max_pinned_blocks: int = 0
    tenants: dict[str | None, TenantSnapshot] = field(default_factory=dict)
    pins: tuple[PinInfo, ...] = ()


@dataclass
class _Stream:
    """Engine-thread state of one submitted request (all its samples)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]  # Deltas, then None; or an exception; a pin's token count
    texts: dict[int, TextStream] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    open_samples: int = 1
    # a pin_prefix request ("own" or "shared", the salt's cap): pin when it ends
    pin: tuple[str, int | None] | None = None

    def put(self, item: Any) -> None:
        _post(self.loop, self.queue.put_nowait, item)


_STOP = object()


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop`` (from the engine thread); nothing once the loop is
    closed (the server stopped: nobody is left to read a result)."""
    with contextlib.suppress(RuntimeError):  # "Event loop is closed"
        loop.call_soon_threadsafe(fn, *args)


class RequestStream:
    """A submitted request: iterate it for deltas (it ends when every sample has
    finished); ``cancel`` ends it early from the event loop."""

    def __init__(
        self, engine: AsyncLLM, request_id: str, prompt_tokens: int, deltas: asyncio.Queue[Any]
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._deltas = deltas
        self.done = False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delta]:
        while not self.done:
            item = await self._deltas.get()
            if item is None:
                self.done = True
                return
            if isinstance(item, BaseException):
                self.done = True
                raise item
            yield item

    def cancel(self) -> None:
        """End the stream now (a consumer waiting on it wakes up) and cancel the request
        on the engine thread (its blocks are freed before the next step)."""
        if not self.done:
            self.done = True
            self._deltas.put_nowait(None)
            self.engine.cancel(self.request_id)


class AsyncLLM:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._adding = 0  # requests handed to the engine thread, not yet added (loop side)
        self._steps = 0
        self._thread = threading.Thread(target=self._loop, name="kvpool-engine", daemon=True)
        self._stopped = threading.Event()
        self._pins: tuple[PinInfo, ...] = ()  # refreshed when a pin command runs
        self._pins_by_salt: dict[str | None, tuple[int, int]] = {}  # pins, pinned blocks
        self.snapshot = self._snapshot()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop_soon(self) -> None:
        """Ask the engine thread to cancel every request and stop; does not wait (safe
        from a signal handler)."""
        self._commands.put(_STOP)

    def shutdown(self, timeout: float | None = 30) -> None:
        """Cancel every request (their blocks are freed) and stop the engine thread."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)
        self._stopped.set()
        self._drain_stopped()

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
        is refused. Iterate the returned stream for its deltas."""
        request_id = request_id or f"r{next(self._ids)}"
        deltas = await self._enqueue(list(prompt_ids), params, salt, request_id)
        return RequestStream(self, request_id, len(prompt_ids), deltas)

    async def _enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        salt: str | None,
        request_id: str,
        pin: tuple[str, int | None] | None = None,
    ) -> asyncio.Queue[Any]:
        """Check the request here, on the event loop (a refusal raises before any answer
        is sent), and hand it to the engine thread without waiting for it: a step in
        progress delays the request's admission, never its caller, so a client that
        leaves while the engine is inside a long step is let go (and counted) at once,
        and its cancel, queued behind the add, takes it out before any step admits it.
        The queue its results will arrive on."""
        engine = self.engine
        engine.check_request(ids, params)
        if engine.max_queue is not None:
            queued = len(engine.scheduler.waiting) + self._adding
            if queued >= engine.max_queue:
                raise engine.queue_full(queued)
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[Any] = asyncio.Queue()
        self._adding += 1

        def added() -> None:
            self._adding -= 1

        def add() -> None:
            try:
                request = engine.add_request(ids, params, request_id=request_id, salt=salt)
                self._streams[request_id] = _Stream(
                    request, loop, results, open_samples=params.n, pin=pin
                )
            except Exception as exc:  # raced past the checks above: the stream says so
                _post(loop, results.put_nowait, exc)
            finally:
                _post(loop, added)

        add.refuse = lambda exc: _post(loop, results.put_nowait, exc)  # type: ignore[attr-defined]
        self._commands.put(add)
        if self._stopped.is_set():  # the thread may be gone: nobody else will answer
            self._drain_stopped()
        return results

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        salt: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Delta]:
        """``submit``, then the deltas of the request's samples until each has finished;
        leaving the iteration early cancels the request."""
        stream = await self.submit(prompt_ids, params, salt=salt, request_id=request_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.cancel()

    def cancel(self, request_id: str) -> None:
        """Cancel a request from any thread; its blocks are freed before the next step."""
        self._commands.put(lambda: self._cancel(request_id))

    async def pin_prefix(
        self,
        prompt_ids: Sequence[int],
        *,
        salt: str | None = None,
        shared: bool = False,
        max_salt_blocks: int | None = None,
    ) -> int:
        """Compute a prefix once (if it is not cached) and pin its full blocks; returns
        the number of tokens pinned. ``shared``: pinned for every tenant (no salt), and
        salted requests that start with it share its blocks. ``max_salt_blocks``: the
        blocks this salt's pins may hold together (a tenant's share of the budget)."""
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        done = await self._enqueue(
            list(prompt_ids),
            params,
            None if shared else salt,
            f"pin{next(self._ids)}",
            pin=("shared" if shared else "own", max_salt_blocks),
        )
        item = await done.get()  # the pinned token count, or the error
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise EngineStopped("the pin request was cancelled")
        return item

    async def unpin_prefix(
        self, prompt_ids: Sequence[int], *, salt: str | None = None, shared: bool = False
    ) -> None:
        ids = list(prompt_ids)

        def unpin() -> None:
            self.engine.manager.unpin(ids, None if shared else salt)
            if shared:
                self.engine.shared_prefixes.discard(tuple(ids))
            self._pins_changed()

        await self._call(unpin)

    async def reset_prefix_cache(self, *, unpin: bool = False) -> int:
        """Drop every cached block that no request holds and no pin keeps; returns how
        many were dropped. ``unpin``: drop every pin first."""

        def reset() -> int:
            dropped = self.engine.manager.reset_prefix_cache(unpin=unpin)
            if unpin:
                self.engine.shared_prefixes.clear()
                self._pins_changed()
            return dropped

        return await self._call(reset)

    async def stats(self) -> EngineSnapshot:
        """A fresh snapshot, taken on the engine thread between steps."""
        return await self._call(self._snapshot)

    # -- the engine thread -----------------------------------------------------------------
    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps; its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
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
        while True:
            commands = [self._commands.get()] if not self.engine.has_work() else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    self._fail_all(EngineStopped("the server is shutting down"))
                    self.snapshot = self._snapshot()
                    self._stopped.set()
                    self._drain_stopped()
                    return
                self._run_command(command)
            if self.engine.has_work():
                try:
                    progressed = self.engine.step()
                except Exception as exc:  # a model failure ends the step's requests, not the server
                    log.exception("engine step failed; cancelling the running requests")
                    self._fail_all(exc)
                    progressed = []
                self._steps += 1
                self._publish(progressed, time.monotonic())
            self.snapshot = self._snapshot()

    @staticmethod
    def _run_command(command: Any) -> None:
        if not isinstance(command, tuple):  # fire and forget (a cancel)
            command()
            return
        fn, future = command
        try:
            future.set_result(fn())
        except Exception as exc:  # handed to the awaiting caller
            future.set_exception(exc)

    def _publish(self, progressed: list[Request], now: float) -> None:
        for request in progressed:
            base, _, index = request.request_id.partition("#")
            stream = self._streams.get(base)
            if stream is None:
                continue
            i = int(index or 0)
            if i not in stream.texts:
                stream.texts[i] = TextStream(self.tokenizer.decode, request.params.stop)
                stream.sent_tokens[i] = 0
            text = stream.texts[i]
            finished = request.status is Status.FINISHED
            if request.finish_reason == "error":  # this request alone failed in the step
                self._end_stream(base, stream, RequestFailed(request.error or "internal error"))
                continue
            delta_text = text.update(request.output_ids, final=finished)
            if text.stopped and not finished:  # a stop string: end it now, free its blocks
                self.engine.cancel(request.request_id)
                request.finish_reason, finished = "stop", True
            output = request.output_ids
            new_tokens = output[stream.sent_tokens[i] :]
            stream.sent_tokens[i] = len(output)
            if stream.pin:
                if finished:
                    self._finish_pin(stream, request)
                continue
            stream.put(
                Delta(
                    index=i,
                    text=delta_text,
                    token_ids=new_tokens,
                    finish_reason=request.finish_reason if finished else None,
                    prompt_tokens=len(request.prompt_ids),
                    cached_prompt_tokens=request.cached_prompt_tokens,
                    completion_tokens=len(output),
                    time=now,
                )
            )
            if finished:
                stream.open_samples -= 1
                if stream.open_samples == 0:
                    del self._streams[base]
                    stream.put(None)

    def _finish_pin(self, stream: _Stream, request: Request) -> None:
        """Pin the prompt's blocks right after the request freed them (same thread, no
        step in between, so nothing can have evicted them)."""
        del self._streams[request.request_id]
        assert stream.pin is not None
        kind, cap = stream.pin
        try:
            pinned = self.engine.manager.pin(request.prompt_ids, request.salt, max_salt_blocks=cap)
            if kind == "shared" and pinned:
                self.engine.shared_prefixes.add(tuple(request.prompt_ids))
            self._pins_changed()
            stream.put(pinned)
        except Exception as exc:
            stream.put(exc)

    def _pins_changed(self) -> None:
        """Refresh what snapshots say of pins (only pin commands change them)."""
        manager = self.engine.manager
        self._pins = tuple(manager.pins())
        self._pins_by_salt = {}
        for pin in self._pins:
            salt = pin.salt.decode() or None
            count, _ = self._pins_by_salt.get(salt, (0, 0))
            self._pins_by_salt[salt] = (count + 1, manager.pinned_blocks_of(salt))

    def _end_stream(self, request_id: str, stream: _Stream, exc: BaseException) -> None:
        """End every sample of a request with ``exc`` (the stream's consumer raises it)."""
        self._streams.pop(request_id, None)
        for sample in stream.request.siblings:
            self.engine.cancel(sample.request_id)
        stream.put(exc)

    def _cancel(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        for sample in stream.request.siblings:
            self.engine.cancel(sample.request_id)
        stream.put(None)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self._end_stream(request_id, stream, exc)

    def _snapshot(self) -> EngineSnapshot:
        scheduler = self.engine.scheduler
        manager = self.engine.manager
        running: dict[str | None, int] = {}
        for request in scheduler.running:
            running[request.salt] = running.get(request.salt, 0) + 1
        waiting = scheduler.waiting.count_by_tenant()
        pins = self._pins_by_salt
        tenants = {}
        for salt in {*running, *waiting, *scheduler.tenants, *pins}:
            counters = scheduler.tenants.get(salt)
            tenants[salt] = TenantSnapshot(
                running=running.get(salt, 0),
                waiting=waiting.get(salt, 0),
                admitted=counters.admitted if counters else 0,
                prompt_tokens=counters.prompt_tokens if counters else 0,
                cached_prompt_tokens=counters.cached_prompt_tokens if counters else 0,
                pins=pins.get(salt, (0, 0))[0],
                pinned_blocks=pins.get(salt, (0, 0))[1],
            )
        return EngineSnapshot(
            cache=manager.stats(),
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            preemptions=scheduler.preemptions,
            steps=self._steps,
            max_pinned_blocks=manager.pool.max_pinned_blocks,
            tenants=tenants,
            pins=self._pins,
        )
