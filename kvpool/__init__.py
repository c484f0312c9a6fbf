"""kvpool: an LLM inference server built around a paged KV-cache memory manager.

``from kvpool import LLM, SamplingParams`` loads the runtime lazily, so that importing
``kvpool.cache`` (the block manager) never imports torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput"):
        from kvpool.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from kvpool.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
