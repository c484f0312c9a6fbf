"""``Policy``: how a pool gives blocks to requests (the engine's and the simulator's)."""

from __future__ import annotations

from enum import StrEnum


class Policy(StrEnum):
    """``PAGED``: blocks on demand as a sequence grows (kvpool). ``STATIC``: the
    llama.cpp/Ollama baseline, every request reserving its whole context (prompt + max
    tokens, at most the context length) at admission, nothing shared."""

    PAGED = "paged"
    STATIC = "static"
