"""kvpool: an LLM inference server built around a paged KV-cache memory manager.

``from kvpool import LLM, SamplingParams`` loads the runtime lazily, so that importing
``kvpool.cache`` (the block manager) never imports torch.
"""

import os
from typing import Any

# OpenMP (torch's CPU threads) reads its settings once, when torch loads, so they are set
# here, before any kvpool module imports torch, unless the user chose a wait policy.
# Between parallel regions a worker thread spins this many times before it sleeps: long
# enough to stay awake across the back-to-back products of one model step (waking a
# sleeping worker, as OMP_WAIT_POLICY=PASSIVE always does, made batch-1 decode steps
# much slower: docs/performance.md, "Threads"), short enough to sleep right after a
# step. libgomp's default (300,000) keeps spinning long enough to fight other work for
# the cores; when other work is there anyway, the runtime measures it and runs steps on one thread
# (kvpool.model.threads).
OPENMP_SPINCOUNT = "10000"
openmp_defaults_applied = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
if openmp_defaults_applied:
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput"):
        from kvpool.engine import llm

        return getattr(llm, name)
    if name == "Engine":
        from kvpool.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from kvpool.engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from kvpool.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
