"""Where a request goes: the replica where it costs the least, counting the work already
sent there and, heavily, the prompt tokens it would have to compute there (all but its
cached prefix); a replica with many more requests in flight than the least loaded one
is passed over whatever it caches. Plain Python: the Ray Serve ``RequestRouter``
(``kvpool.cluster.router``) only adapts it.

What it knows:

- ``replay``: the cluster's index of cached blocks, copied from the replicas' KV events
  (``kvpool.cluster.event_log``): exact, a few milliseconds behind.
- ``expected``: the prefixes of requests routed whose blocks no event has shown yet. A
  request's blocks are in no event until its prefill ran (over a minute under overload),
  so without these the requests of a new system prompt sent meanwhile would not know
  where the first went. An expectation ends when the replica's events show all its
  blocks (the index then speaks for it), when the replica is dropped, or after
  ``expect_s``; not when its request completes (Ray Serve may report a stream complete
  before its prefill ran).
- ``in_flight`` and ``pending``: requests this router sent to each replica and not yet
  completed, and their work in tokens (the prompt tokens each had to compute there plus
  the tokens it may generate). A choice counts at once (``chosen``), before Ray Serve
  reports where the request went (``routed``, which moves it if Ray Serve sent it
  elsewhere): the requests of a burst are chosen before any of them is reported, and
  without this they would all see the same loads and go to the same replica (a cold
  burst of 8 system prompts then put 6 of them on one replica). A choice never reported
  is forgotten after ``UNREPORTED_S``.

The choice (``rank``): among replicas with fewer than ``imbalance`` requests in flight
more than the least loaded, the lowest ``pending + UNCACHED_WEIGHT x uncached prompt
tokens``; ties go to the replica with more free blocks. The rest follow, cheapest first,
as Ray Serve's fallback ranks.

Why an uncached token weighs 8 tokens of queued work (measured with ``kvpool bench
cluster``, two single-thread replicas, 64 clients, docs/performance.md): a miss costs its
prefill and, in a full pool, the blocks the second copy evicts, which other requests
then recompute. At weight 2 the backlogs of an overloaded cluster swing by more than a
hit is worth, and 8 system prompts' requests left the replica holding their prompt
(86% cached, 541 s for 512 requests); a router that always sticks to the longest hit
(93%, 208 s) starves a replica when every request shares one prefix (16 chats resending
one system prompt all went to one replica: 60% cached, 245 s against 156 s for
power-of-two choices). At 8 a replica's cached system prompt outweighs any backlog it
builds under that load, while new conversations, whose only hit is a short shared
prompt, go to the idle replica.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.cluster.asgi_call import HTTPRequest
from kvpool.cluster.event_log import IndexReplay

UNREPORTED_S = 30.0  # a choice Ray Serve never reported (the request was cancelled)
UNCACHED_WEIGHT = 8  # an uncached prompt token, in tokens of queued work (see above)

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
    max_tokens: int = 0  # what it may generate (its work, with the uncached prompt)


@dataclass
class _Expectation:
    replica: str
    keys: frozenset[int]
    until: float


class PrefixRouting:
    def __init__(self, block_size: int, imbalance: int = 32, expect_s: float = 300.0) -> None:
        if imbalance < 1:
            raise ValueError("imbalance must be at least 1 request")
        self.block_size = block_size
        self.imbalance = imbalance
        self.expect_s = expect_s
        self.replay = IndexReplay(block_size)
        self.in_flight: dict[str, int] = {}
        self.pending: dict[str, int] = {}  # replica -> tokens of work sent, not completed
        self._expected: dict[str, _Expectation] = {}  # request id -> its expectation
        self._work: dict[str, tuple[str, int]] = {}  # request id -> (replica, its work)
        self._unreported: dict[str, float] = {}  # request id -> when it was chosen
        self.routed_by_prefix = 0  # decisions a cached or expected prefix made
        self.routed_by_load = 0

    # -- what happens -----------------------------------------------------------------
    def routed(
        self,
        request_id: str,
        replica: str,
        keys: Sequence[int],
        prompt_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        """Ray Serve sent the request to ``replica`` (counted once, whatever ``chosen``
        counted for it before)."""
        self._unreported.pop(request_id, None)
        if self._work.get(request_id, ("",))[0] == replica:
            return  # where it was chosen: already counted (no second look-up of its hits)
        self._record(request_id, replica, keys, prompt_tokens, max_tokens)

    def chosen(
        self,
        request_id: str,
        replica: str,
        keys: Sequence[int],
        prompt_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        """``rank`` chose ``replica`` for the request: count it there now."""
        self._unreported[request_id] = time.monotonic()
        self._record(request_id, replica, keys, prompt_tokens, max_tokens)

    def _record(
        self, request_id: str, replica: str, keys: Sequence[int], prompt_tokens: int,
        max_tokens: int,
    ) -> None:  # fmt: skip
        self._forget(request_id)
        uncached = max(0, prompt_tokens - self.hits([replica], keys)[replica] * self.block_size)
        work = uncached + max_tokens
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        self.pending[replica] = self.pending.get(replica, 0) + work
        self._work[request_id] = (replica, work)
        if keys:
            until = time.monotonic() + self.expect_s
            self._expected[request_id] = _Expectation(replica, frozenset(keys), until)

    def completed(self, request_id: str, replica: str) -> None:
        self._unreported.pop(request_id, None)
        self._forget(request_id, keep_expectation=True)

    def _forget(self, request_id: str, keep_expectation: bool = False) -> None:
        """Undo what a request counted for in flight and pending (its expectation too,
        unless kept: it lasts until events confirm it)."""
        if not keep_expectation:
            self._expected.pop(request_id, None)
        replica, work = self._work.pop(request_id, ("", 0))
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1
        if replica in self.pending:
            self.pending[replica] = max(0, self.pending[replica] - work)

    def _expire_unreported(self) -> None:
        old = time.monotonic() - UNREPORTED_S
        for rid in [r for r, t in self._unreported.items() if t < old]:
            del self._unreported[rid]
            self._forget(rid)

    def drop(self, replica: str) -> None:
        """The replica is gone: nothing is expected of it, nothing is in flight there."""
        self.in_flight.pop(replica, None)
        self.pending.pop(replica, None)
        for rid in [r for r, e in self._expected.items() if e.replica == replica]:
            del self._expected[rid]
        for rid in [r for r, (where, _) in self._work.items() if where == replica]:
            del self._work[rid]
        self.replay.index.drop_replica(replica)

    # -- the choice ------------------------------------------------------------------
    def hits(self, replicas: Sequence[str], keys: Sequence[int]) -> dict[str, int]:
        """Per replica, the leading blocks of ``keys`` it holds or is about to hold."""
        now = time.monotonic()
        cached = self.replay.index
        expected: dict[str, set[int]] = {}
        for rid, e in list(self._expected.items()):
            held = cached.held_by(e.replica)
            if e.until < now or all(k in held for k in e.keys):  # expired, or confirmed
                del self._expected[rid]
            else:
                expected.setdefault(e.replica, set()).update(e.keys)
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

    def rank(
        self, replicas: Sequence[str], keys: Sequence[int], prompt_tokens: int | None = None
    ) -> list[list[str]]:
        """Ranks of the candidate replicas, the preferred one alone in the first.
        ``prompt_tokens``: the prompt's length (default: its full blocks, plus one)."""
        if not replicas:
            return []
        self._expire_unreported()
        if prompt_tokens is None:
            prompt_tokens = len(keys) * self.block_size + 1
        load = {r: self.in_flight.get(r, 0) for r in replicas}
        least = min(load.values())
        hits = self.hits(replicas, keys)
        uncached = {r: max(0, prompt_tokens - hits[r] * self.block_size) for r in replicas}
        pending = {r: self.pending.get(r, 0) for r in replicas}
        loads = self.replay.loads
        free = {r: loads[r].free_blocks if r in loads else 0 for r in replicas}
        eligible = [r for r in replicas if load[r] - least < self.imbalance]
        cost = {r: pending[r] + UNCACHED_WEIGHT * uncached[r] for r in replicas}
        best = min(eligible, key=lambda r: (cost[r], -free[r], load[r]))
        if uncached[best] < max(uncached[r] for r in eligible):
            self.routed_by_prefix += 1
        else:
            self.routed_by_load += 1
        rest = sorted(
            (r for r in replicas if r != best), key=lambda r: (uncached[r], pending[r], load[r])
        )
        return [[best], rest] if rest else [[best]]
