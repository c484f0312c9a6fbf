"""Typed errors for requests the engine refuses at once (the server maps them to 4xx)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be served as sent; nothing was allocated for it."""


class PromptTooLong(RequestError):
    """The prompt does not fit the model's context length."""


class InvalidTokens(RequestError):
    """A token id that is not an int in the model's vocabulary."""


class QueueFull(RequestError):
    """The waiting queue is at its limit (the server answers 503 with Retry-After)."""


class PromptExceedsPool(RequestError):
    """The request needs more KV blocks than the whole pool holds."""


class EngineStopped(RuntimeError):
    """The engine was shut down; the request was cancelled."""


class RequestFailed(RuntimeError):
    """An exception in the engine ended this request (and only it); the message names
    the id under which the log has the cause."""
