"""Prometheus metrics: the block pool and scheduler read from the engine's latest snapshot
at scrape time, and per-request counters and histograms recorded as requests end.

All series are prefixed ``kvpool_``; each app has its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.engine.async_llm import EngineSnapshot

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, float("inf"))


class _PoolCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        c = snap.cache
        blocks = GaugeMetricFamily("kvpool_kv_blocks", "KV blocks by state", labels=["state"])
        for state, value in (
            ("total", c.total_blocks),
            ("used", c.used_blocks),
            ("cached", c.cached_blocks),
            ("free", c.free_blocks),
            ("pinned", c.pinned_blocks),
            ("shared", c.shared_blocks),
        ):
            blocks.add_metric([state], value)
        yield blocks
        kv_bytes = GaugeMetricFamily("kvpool_kv_bytes", "KV bytes by state", labels=["state"])
        for state, value in (
            ("total", c.total_bytes),
            ("used", c.used_bytes),
            ("cached", c.cached_bytes),
        ):
            kv_bytes.add_metric([state], value)
        yield kv_bytes
        usage = c.used_blocks / c.total_blocks if c.total_blocks else 0.0
        yield GaugeMetricFamily("kvpool_kv_usage_ratio", "used blocks / total blocks", usage)
        yield GaugeMetricFamily("kvpool_block_size", "token slots per block", c.block_size)
        for name, doc, value in (
            ("kvpool_prefix_lookups", "prefix cache lookups (admissions)", c.prefix_lookups),
            ("kvpool_prefix_query_tokens", "prompt tokens looked up", c.prefix_query_tokens),
            ("kvpool_prefix_hit_tokens", "prompt tokens served from cache", c.prefix_hit_tokens),
            ("kvpool_evictions", "cached blocks evicted for reuse", c.evictions),
            ("kvpool_cow_copies", "copy-on-write block copies", c.cow_copies),
            ("kvpool_preemptions", "requests preempted for blocks", snap.preemptions),
            ("kvpool_engine_steps", "engine steps run", snap.steps),
        ):
            yield CounterMetricFamily(name, doc, value)
        yield GaugeMetricFamily("kvpool_requests_running", "requests in the batch", snap.running)
        yield GaugeMetricFamily("kvpool_requests_waiting", "requests queued", snap.waiting)


class Metrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(snapshot))
        self.ttft = Histogram(
            "kvpool_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvpool_request_latency_seconds",
            "arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvpool_prompt_tokens", "prompt tokens of finished requests", registry=self.registry
        )
        self.cached_prompt_tokens = Counter(
            "kvpool_cached_prompt_tokens",
            "prompt tokens of finished requests served from the cache",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "kvpool_generation_tokens", "tokens generated", registry=self.registry
        )
        self.requests = Counter(
            "kvpool_requests",
            "finished requests by API and finish reason",
            ["api", "finish_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
