"""``Generation``: one HTTP request's run on the engine, shared by both APIs.

It submits the request (a refusal raises before any response is started, so it becomes a
4xx), watches the connection (a client that goes away cancels the request: its blocks are
freed at once), gathers each sample's text and tokens, and records the timings and
metrics when the request ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request

from kvpool.engine.async_llm import RequestStream
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling import SamplingParams, TokenLogprobs
from kvpool.server.auth import Tenant
from kvpool.server.metrics import Metrics
from kvpool.server.served_model import ServedModel


@dataclass
class Sample:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it (None: another end)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # where asked for


@dataclass
class Outcome:
    samples: list[Sample]
    prompt_tokens: int
    cached_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # where asked for (echo)
    created: float = field(default_factory=time.time)  # wall clock, for the APIs' stamps
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    end: float | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def durations_ns(self) -> dict[str, int]:
        """Ollama's duration fields."""
        end = self.end or time.monotonic()
        first = self.first_token or end
        return {
            "total_duration": int((end - self.arrival) * 1e9),
            "load_duration": 0,
            "prompt_eval_duration": int((first - self.arrival) * 1e9),
            "eval_duration": int((end - first) * 1e9),
        }


class Generation:
    """Invariant: every submitted request is recorded in the metrics exactly once, when
    it ends, however it ends (finished, failed, or cancelled by a disconnect that may
    come before the response even started)."""

    def __init__(
        self, stream: RequestStream, n: int, metrics: Metrics, api: str, tenant: Tenant
    ) -> None:
        self.stream = stream
        self.outcome = Outcome([Sample() for _ in range(n)], stream.prompt_tokens)
        self._metrics = metrics
        self._api = api
        self._tenant = tenant.name
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def start(
        cls,
        model: ServedModel,
        http: Request,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tenant: Tenant,
        metrics: Metrics,
        api: str,
    ) -> Generation:
        arrival = time.monotonic()
        stream = await model.submit(list(prompt_ids), params, salt=tenant.salt)
        generation = cls(stream, params.n, metrics, api, tenant)
        generation.outcome.arrival = arrival
        generation._watcher = asyncio.create_task(generation._close_on_disconnect(http))
        return generation

    async def deltas(self) -> AsyncIterator[RequestOutput]:
        """The request's deltas as they come; the outcome fills in on the way."""
        out = self.outcome
        failed = False
        try:
            async for delta in self.stream:
                sample = out.samples[delta.index]
                sample.text += delta.text
                sample.token_ids += delta.token_ids
                if delta.logprobs:
                    sample.logprobs += delta.logprobs
                out.cached_prompt_tokens = delta.cached_prompt_tokens
                self._metrics.activity.streamed(len(delta.token_ids))
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.token_ids and out.first_token is None:
                    out.first_token = delta.time
                    self._metrics.ttft.labels(self._tenant).observe(delta.time - out.arrival)
                    self._metrics.activity.first_token(delta.time - out.arrival)
                if delta.finish_reason is not None:
                    sample.finish_reason = _public_reason(delta.finish_reason)
                    sample.stop_string = delta.stop_string
                yield delta
        except Exception:
            failed = True
            raise
        finally:
            self.close(failed)

    async def run(self) -> Outcome:
        async for _ in self.deltas():
            pass
        return self.outcome

    def close(self, failed: bool = False) -> None:
        """End the request (cancel it if it is still running) and record its metrics,
        once. Samples without a finish reason count as ``cancelled`` (``error`` with
        ``failed``)."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        self.stream.cancel()
        out = self.outcome
        out.end = time.monotonic()
        m, tenant = self._metrics, self._tenant
        m.latency.labels(tenant).observe(out.end - out.arrival)
        m.prompt_tokens.labels(tenant).inc(out.prompt_tokens)
        m.cached_prompt_tokens.labels(tenant).inc(out.cached_prompt_tokens)
        m.generation_tokens.labels(tenant).inc(out.completion_tokens)
        for sample in out.samples:
            reason = sample.finish_reason or ("error" if failed else "cancelled")
            m.requests.labels(self._api, reason, tenant).inc()

    async def _close_on_disconnect(self, http: Request) -> None:
        """Wait for the client to go away, then end its request at once (the body is
        already read, so the next ASGI message can only be the disconnect)."""
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                message = await http.receive()
                if message["type"] == "http.disconnect":
                    self.close()
                    return


def _public_reason(reason: str) -> str:
    return "length" if reason == "too_long_for_pool" else reason
