"""``FairQueue``: the waiting requests, one first-come-first-served line per tenant, the
tenants served in turn.

A tenant is a request's cache salt (``None``: the anonymous tenant). Admission takes
the head of the tenant whose turn it is and then hands the turn to the next tenant, so a
burst of a hundred requests from one tenant delays another tenant's single request by at
most one admission. Without tenants there is one line: plain FIFO.

A preempted request goes back to the head of its tenant's line and its tenant to the
head of the turn order: it is resumed before anything new is admitted.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from kvpool.engine.request import Request

Tenant = str | None


class FairQueue:
    def __init__(self) -> None:
        self._lines: dict[Tenant, deque[Request]] = {}
        self._turns: deque[Tenant] = deque()  # tenants with waiting requests, next first
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, request: Request) -> bool:
        line = self._lines.get(request.salt)
        return line is not None and request in line

    def append(self, request: Request) -> None:
        """A new request: the back of its tenant's line."""
        line = self._line(request.salt, first=False)
        line.append(request)
        self._size += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request: the head of its tenant's line, its tenant's turn next."""
        line = self._line(request.salt, first=True)
        line.appendleft(request)
        self._size += 1

    def remove(self, request: Request) -> None:
        """Take ``request`` out (admitted or cancelled)."""
        line = self._lines[request.salt]
        line.remove(request)
        self._size -= 1
        if not line:
            del self._lines[request.salt]
            self._turns.remove(request.salt)

    def served(self, tenant: Tenant) -> None:
        """``tenant`` had a request admitted: its next turn comes after every other
        waiting tenant's."""
        if tenant in self._lines:
            self._turns.remove(tenant)
            self._turns.append(tenant)

    def in_turn(self, limit: int) -> Iterator[Request]:
        """Up to ``limit`` waiting requests in the order admission should consider them:
        each tenant's head in turn order, then each one's second, and so on. A snapshot:
        the queue may change while it is consumed."""
        heads = [list(itertools.islice(self._lines[t], limit)) for t in self._turns]
        yielded = 0
        for depth in range(max((len(h) for h in heads), default=0)):
            for line in heads:
                if depth < len(line):
                    yield line[depth]
                    yielded += 1
                    if yielded >= limit:
                        return

    def count_by_tenant(self) -> dict[Tenant, int]:
        return {tenant: len(line) for tenant, line in self._lines.items()}

    def __iter__(self) -> Iterator[Request]:
        for tenant in self._turns:
            yield from self._lines[tenant]

    def _line(self, tenant: Tenant, *, first: bool) -> deque[Request]:
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = deque()
            if first:
                self._turns.appendleft(tenant)
            else:
                self._turns.append(tenant)
        elif first and self._turns[0] != tenant:
            self._turns.remove(tenant)
            self._turns.appendleft(tenant)
        return line
