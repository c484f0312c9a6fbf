"""Typed errors of the block manager. A call that raises one has changed nothing."""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error that ``kvpool.cache`` raises on purpose."""


class OutOfBlocks(CacheError):
    """The pool cannot supply the blocks a call needs; the manager's state is unchanged."""

    def __init__(self, needed: int, free: int, what: str = "operation") -> None:
        self.needed = needed
        self.free = free
        super().__init__(f"{what} needs {needed} free KV blocks, only {free} available")


class UnknownSequence(CacheError, KeyError):
    def __init__(self, seq_id: object) -> None:
        self.seq_id = seq_id
        super().__init__(f"unknown sequence {seq_id!r}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class SequenceExists(CacheError, ValueError):
    def __init__(self, seq_id: object) -> None:
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id!r} already holds blocks")


class PinLimitExceeded(CacheError):
    """Pinning would exceed the share of the pool that pins may hold."""

    def __init__(self, requested: int, pinned: int, limit: int, whose: str = "the ") -> None:
        self.requested = requested
        self.pinned = pinned
        self.limit = limit
        super().__init__(
            f"pinning {requested} more blocks would exceed {whose}pin limit "
            f"({pinned} pinned, limit {limit})"
        )


class NotPinned(CacheError, KeyError):
    def __init__(self) -> None:
        super().__init__("no pin for this prefix and salt")

    def __str__(self) -> str:
        return self.args[0]


class BudgetTooSmall(CacheError, ValueError):
    """A memory budget that does not hold a single block."""
