"""Where a request goes: the replica that holds the longest cached prefix of its tokens,
unless that replica is much busier than the least loaded one. Plain Python: the Ray
Serve ``RequestRouter`` (``kvpool.cluster.router``) only adapts it.

What it knows:

- ``replay``: the cluster's index of cached blocks, copied from the replicas' KV events
  (``kvpool.cluster.event_log``): exact, a few milliseconds behind.
- ``expected``: the prefixes of requests routed but not finished. A request's blocks are
  in no event until its prefill ran, so without these the second request of a new
  system prompt, sent a moment after the first, would not know where the first went.
  Each expectation lasts until its request completes (or ``expect_s`` at most).
- ``in_flight``: requests this router sent to each replica and not yet completed (the
  load; a replica's own queue length and free blocks come with its events).

The choice (``rank``): among replicas whose load is within ``imbalance`` requests of the
least loaded, the one with the most leading prefix blocks (cached or expected); ties go
to the less loaded, then to the one with more free blocks. The rest follow, least
loaded first, as Ray Serve's fallback ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.cluster.asgi_call import HTTPRequest
from kvpool.cluster.event_log import IndexReplay

# The routers made in this process (``kvpool.cluster.router``), by deployment name.
ROUTERS: dict[str, Any] = {}


@dataclass
class RoutedRequest:
    """What the ingress sends an engine replica: the HTTP request and, for routing, its
    prompt's block keys (``keys``: chain hashes of its full blocks, with its tenant's
    salt). ``replica`` names the one replica it must go to (pins, per-replica views).
    ``prompt`` is the prompt's text, for routers that match text (Ray Serve LLM's
    ``PrefixCacheAffinityRouter``, which the benchmark compares against)."""

    http: HTTPRequest
    keys: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt: str = ""
    replica: str | None = None


@dataclass
class _Expectation:
    replica: str
    keys: frozenset[int]
    until: float


class PrefixRouting:
    def __init__(self, block_size: int, imbalance: int = 16, expect_s: float = 60.0) -> None:
        if imbalance < 1:
            raise ValueError("imbalance must be at least 1 request")
        self.block_size = block_size
        self.imbalance = imbalance
        self.expect_s = expect_s
        self.replay = IndexReplay(block_size)
        self.in_flight: dict[str, int] = {}
        self._expected: dict[str, _Expectation] = {}  # request id -> its expectation
        self.routed_by_prefix = 0  # decisions a cached or expected prefix made
        self.routed_by_load = 0

    # -- what happens -----------------------------------------------------------------
    def routed(self, request_id: str, replica: str, keys: Sequence[int]) -> None:
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        if keys:
            until = time.monotonic() + self.expect_s
            self._expected[request_id] = _Expectation(replica, frozenset(keys), until)

    def completed(self, request_id: str, replica: str) -> None:
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1
        self._expected.pop(request_id, None)

    def drop(self, replica: str) -> None:
        """The replica is gone: nothing is expected of it, nothing is in flight there."""
        self.in_flight.pop(replica, None)
        for rid in [r for r, e in self._expected.items() if e.replica == replica]:
            del self._expected[rid]
        self.replay.index.drop_replica(replica)

    # -- the choice ------------------------------------------------------------------
    def hits(self, replicas: Sequence[str], keys: Sequence[int]) -> dict[str, int]:
        """Per replica, the leading blocks of ``keys`` it holds or is about to hold."""
        now = time.monotonic()
        expected: dict[str, set[int]] = {}
        for rid, e in list(self._expected.items()):
            if e.until < now:
                del self._expected[rid]
            else:
                expected.setdefault(e.replica, set()).update(e.keys)
        cached = self.replay.index
        out: dict[str, int] = {}
        for replica in replicas:
            held = cached.held_by(replica)
            extra = expected.get(replica, set())
            n = 0
            for key in keys:
                if key not in held and key not in extra:
                    break
                n += 1
            out[replica] = n
        return out

    def rank(self, replicas: Sequence[str], keys: Sequence[int]) -> list[list[str]]:
        """Ranks of the candidate replicas, the preferred one alone in the first."""
        if not replicas:
            return []
        load = {r: self.in_flight.get(r, 0) for r in replicas}
        least = min(load.values())
        hits = self.hits(replicas, keys)
        loads = self.replay.loads
        free = {r: loads[r].free_blocks if r in loads else 0 for r in replicas}
        eligible = [r for r in replicas if load[r] - least < self.imbalance]
        best = max(eligible, key=lambda r: (hits[r], -load[r], free[r]))
        if hits[best] > 0:
            self.routed_by_prefix += 1
        else:
            self.routed_by_load += 1
        rest = sorted((r for r in replicas if r != best), key=lambda r: (load[r], -hits[r]))
        return [[best], rest] if rest else [[best]]
