"""What the APIs' structured-output fields mean, as ``ResponseFormat``s.

- Ollama: ``format`` is ``"json"`` (any JSON object) or a JSON schema (an object).
- OpenAI: ``response_format`` is ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
  {...}, "strict": ...}}``. The schema is always enforced exactly (``strict`` or not);
  ``strict: true`` asks nothing more of kvpool.
- Anthropic: ``output_config.format`` is ``{"type": "json_schema", "schema": {...}}``.

Compiling a format (and, the first time, the tokenizer's grammar tables: ~0.5 s) runs on
a worker thread, never on the event loop; the engine then finds it compiled.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvpool.engine.sampling import SamplingParams
from kvpool.engine.structured import ResponseFormat
from kvpool.server.errors import bad_request
from kvpool.server.served_model import ServedModel


def ollama_format(value: Any) -> ResponseFormat | None:
    if value is None or value == "":
        return None
    if value == "json":
        return ResponseFormat.json_object()
    if isinstance(value, dict):
        return ResponseFormat.json_schema(value)
    raise bad_request('format must be "json" or a JSON schema (an object)')


def openai_response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("response_format must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format json_schema needs json_schema.schema")
        name = spec.get("name", "response")
        if not isinstance(name, str) or not name:
            raise bad_request("response_format json_schema.name must be a non-empty string")
        return ResponseFormat.json_schema(spec["schema"])
    raise bad_request(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)"
    )


def anthropic_output_format(value: Any) -> ResponseFormat | None:
    """Anthropic's ``output_config.format`` (or the beta's ``output_format``):
    ``{"type": "json_schema", "schema": {...}}``."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}')
    if not isinstance(value.get("schema"), dict):
        raise bad_request("output_config.format needs a schema (an object)")
    return ResponseFormat.json_schema(value["schema"])


async def constrained(
    params: SamplingParams, fmt: ResponseFormat | None, model: ServedModel, prompt_len: int
) -> SamplingParams:
    """``params`` with ``fmt``, once it compiles and fits the request's tokens (else a
    400 from ``InvalidSamplingParams``)."""
    if fmt is None:
        return params
    budget = min(params.max_tokens, model.context_length - prompt_len)
    await model.check_format(fmt, budget)
    return replace(params, response_format=fmt)
