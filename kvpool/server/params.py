"""Each API's request options to ``SamplingParams``, with the API's own defaults.

Ollama: ``options`` (num_predict, temperature, top_k, top_p, min_p, seed, stop,
repeat_penalty, presence_penalty, frequency_penalty, num_ctx); its defaults are Ollama's
(temperature 0.8, top_k 40, top_p 0.9), except that ``repeat_penalty`` defaults to 1.0:
kvpool applies it to every prompt and output token, not to a last-64-token window, so
Ollama's 1.1 would penalise long prompts far more than Ollama does. ``num_predict`` -1
(the default: no limit) and -2 (fill the context) both generate until a stop or the
context is full (kvpool does not shift the context); other negatives and 0 are a 400,
and a limit past the context is capped by it.

OpenAI: ``max_tokens`` / ``max_completion_tokens`` (default: until the context is full),
temperature and top_p (default 1), n, stop, seed, presence / frequency penalties,
logprobs / top_logprobs, and vLLM's extensions: ``top_k`` (0 or -1: off), ``min_p``,
``repetition_penalty`` and ``ignore_eos`` (also llama.cpp's, for benchmarks).

Anthropic: ``max_tokens`` (required), ``temperature`` (in [0, 1]), ``top_p``,
``top_k``, ``stop_sequences``.

A wrong type or value is a 400 naming the option and its range (``SamplingParams``
holds the bounds both APIs share: temperature, penalties, top-k, stop strings, seeds of
64 bits); a prompt that leaves no room for output in the context (or ``num_ctx``) is a
400 naming both lengths.
"""

from __future__ import annotations

import math
from typing import Any

from kvpool.engine.sampling import SamplingParams
from kvpool.server.errors import APIError, bad_request

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
_FLOAT = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty")
_FLOAT += ("frequency_penalty", "typical_p", "tfs_z", "mirostat_tau", "mirostat_eta")
_INT = ("num_predict", "top_k", "seed", "num_ctx", "repeat_last_n", "num_keep", "num_batch")
_INT += ("num_gpu", "num_thread", "mirostat", "main_gpu", "num_gqa")


_INT_LIMIT = (1 << 31) - 1  # integer options but the seed: a 32-bit int, as Ollama's


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"option {name} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"option {name} must be a finite number")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise bad_request(f"option {name} must be an integer, got {value}")
        value = int(value)
        if name != "seed" and not -_INT_LIMIT <= value <= _INT_LIMIT:
            raise bad_request(f"option {name} must be in [{-_INT_LIMIT}, {_INT_LIMIT}]")
        return value
    return float(value)


def stop_strings(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise bad_request(f"{name} must be a string or a list of strings")


def max_new_tokens(requested: int | None, prompt_len: int, context: int) -> int:
    """Output tokens allowed: ``requested`` (None: all the context leaves), capped by the
    context. Raises 400 if the prompt leaves no room."""
    room = context - prompt_len
    if room < 1:  # (in the words clients match: "maximum context length", OpenAI's code)
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; the model's maximum context length is "
            f"{context} tokens (prompt + output), so no room is left for output",
            code="context_length_exceeded",
        )
    return room if requested is None else min(requested, room)


def ollama_params(
    options: dict[str, Any] | None, prompt_len: int, context: int, logprobs: int | None = None
) -> SamplingParams:
    opts = dict(options or {})
    for name in list(opts):
        if opts[name] is None:
            del opts[name]
        elif name in _FLOAT:
            opts[name] = _number(name, opts[name], float)
        elif name in _INT:
            opts[name] = _number(name, opts[name], int)
    num_ctx = opts.get("num_ctx")
    if num_ctx is not None:
        if num_ctx < 1:
            raise bad_request("option num_ctx must be positive")
        context = min(context, num_ctx)
    num_predict = opts.get("num_predict", -1)
    if num_predict == 0 or num_predict < -2:
        raise bad_request(
            "option num_predict must be positive, -1 (no limit) or -2 (fill the context)"
        )
    values = {**OLLAMA_DEFAULTS, **opts}
    return SamplingParams(
        max_tokens=max_new_tokens(num_predict if num_predict > 0 else None, prompt_len, context),
        temperature=values["temperature"],
        top_k=values["top_k"],
        top_p=values["top_p"],
        min_p=values.get("min_p", 0.0),
        repetition_penalty=values.get("repeat_penalty", 1.0),
        presence_penalty=values.get("presence_penalty", 0.0),
        frequency_penalty=values.get("frequency_penalty", 0.0),
        seed=values.get("seed"),
        stop=stop_strings("option stop", values.get("stop")),
        logprobs=logprobs,
    )


def openai_params(
    body: Any, prompt_len: int, context: int, logprobs: int | None = None
) -> SamplingParams:
    """``body``: the validated request model (chat or completions); ``logprobs``: the
    ``SamplingParams.logprobs`` its logprob fields asked for."""
    requested = getattr(body, "max_completion_tokens", None)
    if requested is None:
        requested = body.max_tokens
    if requested is not None and requested < 1:
        raise bad_request("max_tokens must be at least 1")
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise bad_request("temperature must be in [0, 2]")
    return SamplingParams(
        max_tokens=max_new_tokens(requested, prompt_len, context),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=stop_strings("stop", body.stop),
        n=body.n or 1,
        ignore_eos=body.ignore_eos,
        top_k=_optional("top_k", body.top_k, int, 0, -1),
        min_p=_optional("min_p", body.min_p, float, 0.0),
        repetition_penalty=_optional("repetition_penalty", body.repetition_penalty, float, 1.0),
        logprobs=logprobs,
    )


def anthropic_params(body: Any, prompt_len: int, context: int) -> SamplingParams:
    """Anthropic's Messages options: ``max_tokens`` (required, at least 1; capped by the
    context), ``temperature`` in [0, 1] (default 1), ``top_p``, ``top_k``,
    ``stop_sequences``. A prompt that fills the context is refused in Anthropic's words,
    which clients parse (Claude Code reads the two numbers)."""
    if body.max_tokens is None:
        raise bad_request("max_tokens is required")
    if body.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1")
    if prompt_len >= context:
        raise bad_request(f"prompt is too long: {prompt_len} tokens > {context - 1} maximum "
                          f"(the model's context: {context} tokens, the prompt and at least "
                          "one of output)")  # fmt: skip
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise bad_request("temperature must be in [0, 1]")
    if body.top_k is not None and body.top_k < 0:
        raise bad_request("top_k must not be negative")
    return SamplingParams(
        max_tokens=max_new_tokens(body.max_tokens, prompt_len, context),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=stop_strings("stop_sequences", body.stop_sequences),
    )


def _optional(name: str, value: Any, kind: type, default: Any, off: Any = None) -> Any:
    """A vLLM extension field: its default when absent (or ``off``: vLLM's top_k -1)."""
    if value is None or value == off:
        return default
    return _number(name, value, kind)
