"""Errors as each API's clients expect them: Ollama ``{"error": "..."}``, OpenAI
``{"error": {"message", "type", "param", "code"}}`` (paths under ``/v1/``), Anthropic
``{"type": "error", "error": {"type", "message"}}`` (``/v1/messages``).

Every refusal is a 4xx with a message that says what was wrong and what the limits are;
nothing is allocated for a refused request.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool.cache import CacheError, NotPinned, PinLimitExceeded
from kvpool.engine.errors import (
    EngineStopped,
    PromptExceedsPool,
    QueueFull,
    RequestError,
    RequestFailed,
)
from kvpool.engine.sampling import InvalidSamplingParams

log = logging.getLogger("kvpool.server")


class APIError(Exception):
    """A refusal; ``code``: OpenAI's error code where one names it (agents read
    ``context_length_exceeded`` to shorten a conversation), else the HTTP status."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code


def bad_request(message: str) -> APIError:
    return APIError(400, message)


# This module's error kinds (OpenAI's) that Anthropic names otherwise
_ANTHROPIC_KINDS = {"server_error": "api_error", "service_unavailable": "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """A route of Anthropic's Messages API: its errors take that API's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(status: int, message: str, kind: str = "") -> dict:
    """Anthropic's error object (``{"type": "error", "error": {"type", "message"}}``)."""
    kind = kind or _kind(status)
    kind = _ANTHROPIC_KINDS.get(kind, kind)
    if status >= 500 and kind == "invalid_request_error":
        kind = "api_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_stream_error(status: int, message: str, kind: str = "") -> bytes:
    """The ``error`` event that ends an Anthropic stream which cannot go on."""
    return f"event: error\ndata: {json.dumps(anthropic_error(status, message, kind))}\n\n".encode()


def error_body(path: str, status: int, message: str, kind: str, code: str = "") -> dict:
    if anthropic_path(path):
        return anthropic_error(status, message, kind)
    if path.startswith("/v1/"):
        return {"error": {"message": message, "type": kind, "param": None,
                          "code": code or status}}  # fmt: skip
    return {"error": message}


def error_response(
    request: Request, status: int, message: str, kind: str, code: str = ""
) -> JSONResponse:
    body = error_body(request.url.path, status, message, kind, code)
    return JSONResponse(body, status_code=status)


def _kind(status: int) -> str:
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        503: "service_unavailable",
    }.get(status, "invalid_request_error")


def _validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', 'invalid JSON')}"
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


M = TypeVar("M", bound=BaseModel)


async def read_json(http: Request, model: type[M]) -> M:
    """The request body parsed as JSON into ``model``, whatever its content type (Ollama
    accepts bodies sent without one, as curl sends them). 400 on malformed JSON or on a
    field of the wrong type."""
    raw = await http.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise bad_request(_validation_message(exc)) from None


def internal_error(exc: BaseException, where: str) -> str:
    """Log ``exc`` under a new id; the message for the client names only the id (never
    the exception's text, which may show internals)."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s on %s", error_id, where, exc_info=exc)
    return f"internal error (id {error_id}; the server log has the details)"


def stream_error(exc: BaseException, where: str) -> tuple[int, str, str]:
    """Status, message and kind for an exception that ends a response already started
    (a stream): the same mapping as the handlers below."""
    if isinstance(exc, EngineStopped):
        return 503, str(exc), "service_unavailable"
    if isinstance(exc, RequestFailed):
        return 500, str(exc), "server_error"
    return 500, internal_error(exc, where), "server_error"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc.status, exc.message, exc.kind, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, 400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(json.JSONDecodeError)
    async def json_error(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(request, 400, f"malformed JSON body: {exc}", "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, str(exc.detail), _kind(exc.status_code))

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        if isinstance(exc, QueueFull):  # as Ollama's OLLAMA_MAX_QUEUE: try again later
            response = error_response(request, 503, str(exc), "service_unavailable")
            response.headers["Retry-After"] = "1"
            return response
        status = 413 if isinstance(exc, PromptExceedsPool) else 400
        return error_response(request, status, str(exc), _kind(status))

    @app.exception_handler(RequestFailed)
    async def request_failed(request: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(request, 500, str(exc), "server_error")

    @app.exception_handler(InvalidSamplingParams)
    async def sampling_error(request: Request, exc: InvalidSamplingParams) -> JSONResponse:
        return error_response(request, 400, str(exc), "invalid_request_error")

    @app.exception_handler(CacheError)
    async def cache_error(request: Request, exc: CacheError) -> JSONResponse:
        status = 404 if isinstance(exc, NotPinned) else 409
        if isinstance(exc, PinLimitExceeded):
            status = 409
        return error_response(request, status, str(exc) or type(exc).__name__, _kind(status))

    @app.exception_handler(EngineStopped)
    async def stopped(request: Request, exc: EngineStopped) -> JSONResponse:
        return error_response(request, 503, str(exc), "service_unavailable")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        message = internal_error(exc, request.url.path)
        return error_response(request, 500, message, "server_error")
