"""Stored Responses-API turns (``responses_api``): what ``previous_response_id`` continues.

Each stored turn holds its own input and reply only, and names the turn it continued:
a conversation is rebuilt by walking the chain, so a long one costs memory linear in its
length. The last ``KEPT_RESPONSES`` are kept, in memory, oldest dropped first; a turn is
found only by its own tenant (another's id reads as not found).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvpool.server.errors import APIError

KEPT_RESPONSES = 1024


@dataclass
class StoredTurn:
    """One stored response: its tenant, its own input as chat messages (the instructions
    apart: OpenAI does not carry them to the next turn), the reply as an assistant
    message, the turn it continued, and the response object itself."""

    tenant: str
    messages: list[dict[str, Any]]
    reply: dict[str, Any]
    previous: str | None
    response: dict[str, Any]


class ResponseStore:
    """The last ``limit`` stored responses, oldest dropped first. ``tag``: put into the
    ids of the responses this server makes (a cluster replica's id: the ingress routes a
    continuation to the replica that holds its chain)."""

    def __init__(self, limit: int = KEPT_RESPONSES, tag: str = "") -> None:
        self.limit = limit
        self.tag = tag
        self._turns: OrderedDict[str, StoredTurn] = OrderedDict()

    def put(self, rid: str, turn: StoredTurn) -> None:
        self._turns[rid] = turn
        while len(self._turns) > self.limit:
            self._turns.popitem(last=False)

    def get(self, rid: str, tenant: str) -> StoredTurn:
        turn = self._turns.get(rid)
        if turn is None or turn.tenant != tenant:
            raise APIError(
                404,
                f"response {rid!r} not found (kvpool keeps the last {self.limit} stored "
                "responses in memory, each for its own tenant)",
                "not_found_error",
            )
        return turn

    def delete(self, rid: str, tenant: str) -> None:
        self.get(rid, tenant)
        del self._turns[rid]

    def history(self, rid: str, tenant: str) -> list[dict[str, Any]]:
        """The conversation up to and including response ``rid``: every turn's input
        and reply, oldest first."""
        chain: list[StoredTurn] = []
        seen: str | None = rid
        while seen is not None:
            turn = self.get(seen, tenant)
            chain.append(turn)
            seen = turn.previous
        return [m for turn in reversed(chain) for m in (*turn.messages, turn.reply)]
