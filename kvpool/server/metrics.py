"""Prometheus metrics: the block pool and scheduler read from the engine's latest snapshot
at scrape time, and per-request counters and histograms recorded as requests end.

All series are prefixed ``kvpool_``; each app has its own registry. Per-request series
and the ``kvpool_tenant_*`` gauges carry a ``tenant`` label ("" without keys). An admin
scrape sees every series; a tenant's key sees the pool's capacity and the series of its
own tenant only, never another tenant's activity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.engine.snapshot import EngineSnapshot, TenantSnapshot
from kvpool.server.auth import Tenant, tenant_name
from kvpool.server.pool_history import Activity

# What a tenant's scrape may see besides its own series: the pool's size.
_CAPACITY = frozenset(
    {"kvpool_block_size", "kvpool_kv_capacity_blocks", "kvpool_kv_capacity_bytes"}
)
_TENANT_DOCS = {
    "running": "requests of the tenant in the batch",
    "waiting": "requests of the tenant queued",
    "admitted": "requests of the tenant admitted (first admissions)",
    "prompt_tokens": "prompt tokens of the tenant's admitted requests",
    "cached_prompt_tokens": "of those, served from the cache",
    "pinned_blocks": "blocks held by the tenant's pins",
    "pins": "the tenant's pins",
}

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, float("inf"))


class _PoolCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        c = snap.cache
        yield GaugeMetricFamily(
            "kvpool_kv_capacity_blocks", "KV blocks in the pool", c.total_blocks
        )
        yield GaugeMetricFamily("kvpool_kv_capacity_bytes", "KV bytes in the pool", c.total_bytes)
        for f in fields(TenantSnapshot):
            family = GaugeMetricFamily(
                f"kvpool_tenant_{f.name}", _TENANT_DOCS[f.name], labels=["tenant"]
            )
            for salt, tenant in snap.tenants.items():
                family.add_metric([tenant_name(salt)], getattr(tenant, f.name))
            yield family
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
        t = snap.tier
        if t is None:
            return
        yield GaugeMetricFamily("kvpool_tier_blocks", f"blocks in the {t.kind} KV tier", t.blocks)
        yield GaugeMetricFamily("kvpool_tier_bytes", "bytes in the KV tier", t.bytes)
        yield GaugeMetricFamily(
            "kvpool_tier_capacity_bytes", "the KV tier's size", t.capacity_bytes
        )
        for name, doc, value in (
            (
                "kvpool_tier_hit_tokens",
                "prompt tokens loaded from the tier",
                t.hit_tokens,
            ),
            ("kvpool_tier_loads", "blocks loaded from the tier, verified", t.loads),
            ("kvpool_tier_load_seconds", "time reading and verifying tier blocks", t.load_seconds),
            ("kvpool_tier_writes", "blocks written to the tier", t.writes),
            (
                "kvpool_tier_dropped_writes",
                "evicted blocks the tier did not keep",
                t.dropped_writes,
            ),
            ("kvpool_tier_refused", "tier blocks that failed verification", t.refused),
            ("kvpool_tier_evictions", "tier blocks removed for room", t.evictions),
        ):
            yield CounterMetricFamily(name, doc, value)


class Metrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(snapshot))
        self.activity = Activity()  # streamed tokens and recent TTFTs, for the live view
        r = self.registry
        self.ttft = Histogram(
            "kvpool_time_to_first_token_seconds",
            "arrival to first generated token",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "kvpool_request_latency_seconds",
            "arrival to last token",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvpool_prompt_tokens", "prompt tokens of finished requests", ["tenant"], registry=r
        )
        self.cached_prompt_tokens = Counter(
            "kvpool_cached_prompt_tokens",
            "prompt tokens of finished requests served from the cache",
            ["tenant"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvpool_generation_tokens", "tokens generated", ["tenant"], registry=r
        )
        self.requests = Counter(
            "kvpool_requests",
            "ended requests by API, finish reason (cancelled: the client left) and tenant",
            ["api", "finish_reason", "tenant"],
            registry=r,
        )

    def render(self, viewer: Tenant) -> bytes:
        """The exposition text ``viewer`` may see (see the module docstring)."""
        if viewer.admin:
            return generate_latest(self.registry)
        return generate_latest(_TenantView(self.registry, viewer.name))  # type: ignore[arg-type]


class _TenantView:
    """A registry's series filtered to one tenant's (and the pool's capacity)."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self._registry = registry
        self._tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.name in _CAPACITY:
                yield family
                continue
            samples = [s for s in family.samples if s.labels.get("tenant") == self._tenant]
            if samples:
                family.samples = samples
                yield family
