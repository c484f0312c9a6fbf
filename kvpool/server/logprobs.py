"""Log-probabilities in each API's shape, from the engine's ``TokenLogprobs`` (the row
after penalties and before temperature: see ``kvpool.engine.sampling``).

A token's text is the model's piece for it alone (special tokens included); its
``bytes`` are that text's UTF-8 bytes (a token holding part of a character shows the
replacement character there, as the text does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpool.engine.sampling import MAX_LOGPROBS, TokenLogprobs
from kvpool.server.errors import bad_request

Piece = Callable[[int], str]


def requested(logprobs: bool | int | None, top: int | None, api: str) -> int | None:
    """``SamplingParams.logprobs`` for a request: None when it asks for none, else how
    many best alternatives (``top``, 0 by default). A bad value is a 400."""
    if top is not None and (isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]")
    if not logprobs:
        if top:
            raise bad_request(f"top_logprobs needs logprobs set ({api})")
        return None
    return top or 0


def _entry(piece: Piece, token_id: int, logprob: float) -> dict[str, Any]:
    text = piece(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def openai_chat(items: Sequence[TokenLogprobs], piece: Piece) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk)."""
    return {
        "content": [
            {
                **_entry(piece, lp.token_id, lp.logprob),
                "top_logprobs": [_entry(piece, t, v) for t, v in lp.top],
            }
            for lp in items
        ],
        "refusal": None,
    }


def openai_completion(
    items: Sequence[TokenLogprobs], piece: Piece, offset: int = 0
) -> dict[str, Any]:
    """``choices[i].logprobs`` of a (legacy) completion: parallel lists; ``text_offset``
    counts characters from ``offset`` (the text before these tokens)."""
    tokens, offsets = [], []
    for lp in items:
        offsets.append(offset)
        text = piece(lp.token_id)
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{piece(t): v for t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }


def openai_echo(
    prompt_ids: Sequence[int],
    scored: Sequence[TokenLogprobs | None],
    piece: Piece,
    completion: dict[str, Any] | None,
) -> dict[str, Any]:
    """``choices[i].logprobs`` of an ``echo`` completion: the prompt's tokens first (the
    first has no logprob: nothing predicts it), then ``completion``'s (None: none)."""
    tokens, offsets, values, tops = [], [], [], []
    offset = 0
    for token, lp in zip(prompt_ids, scored, strict=True):
        text = piece(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(lp.logprob if lp is not None else None)
        tops.append({piece(t): v for t, v in lp.top} if lp is not None else None)
    if completion:
        tokens += completion["tokens"]
        values += completion["token_logprobs"]
        tops += completion["top_logprobs"]
        offsets += [offset + o for o in completion["text_offset"]]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def ollama(items: Sequence[TokenLogprobs], piece: Piece) -> list[dict[str, Any]]:
    """Ollama's ``logprobs`` list (``/api/generate`` and ``/api/chat``)."""
    return [
        {
            **_entry(piece, lp.token_id, lp.logprob),
            "top_logprobs": [_entry(piece, t, v) for t, v in lp.top],
        }
        for lp in items
    ]
