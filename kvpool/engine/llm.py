"""``LLM``: the offline API, a synchronous driver of one ``Engine``.

from kvpool import LLM, SamplingParams
llm = LLM()                                   # the built-in default model
out = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))
print(out[0].text, out[0].cached_prompt_tokens)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from kvpool.cache import CacheStats
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.outputs import CompletionOutput, RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.model.loader import load_model

Prompt = str | Sequence[int]

__all__ = ["LLM", "CompletionOutput", "Prompt"]


class LLM:
    """A model and its engine. ``config`` (``EngineConfig``; keyword ``changes`` replace
    its fields, e.g. ``LLM(kv_cache_memory=128 * 2**20)``) sizes the pool and the steps;
    ``dtype`` and ``batch_invariant`` choose how the model computes (see ``load_model``).

    It computes on the thread that calls it: call it from one thread. OpenMP keeps a
    pool of workers for every thread that has computed, and more pools than CPUs make
    each of a step's products wake a sleeping worker (docs/performance.md, fifteenth
    session; the server's ``AsyncLLM`` keeps one engine thread for this reason)."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        config: EngineConfig | None = None,
        dtype: str | None = None,
        device: str | None = None,
        progress: bool = True,
        batch_invariant: bool = False,
        **changes: Any,
    ) -> None:
        self.loaded = load_model(
            model, dtype=dtype, device=device, progress=progress, batch_invariant=batch_invariant
        )
        self.tokenizer = self.loaded.tokenizer
        self.engine = Engine(self.loaded.model, config, tokenizer=self.tokenizer, **changes)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[CompletionOutput]:
        """Complete each prompt (text is encoded as is, without the chat template).
        Outputs in prompt order; with ``n > 1``, the n samples of each prompt in turn."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self._encode(p) for p in prompts]  # type: ignore[union-attr]
        return self.engine.generate(ids, params or SamplingParams())

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | None = None,
    ) -> list[CompletionOutput]:
        """Answer each conversation, rendered with the model's chat template."""
        ids = [self.tokenizer.encode_chat(list(c)) for c in conversations]
        return self.engine.generate(ids, params or SamplingParams())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """The completion of one prompt, piece by piece as tokens are generated. Stopping
        the iteration early aborts the request and frees its blocks."""
        request_id = self.engine.add_request(self._encode(prompt), params or SamplingParams())
        try:
            for out in self._until_finished(request_id):
                if out.index == 0 and out.text:
                    yield out.text
        finally:
            self.engine.abort(request_id)

    def cache_stats(self) -> CacheStats:
        return self.engine.cache_stats()

    def pin_prefix(self, prefix: Prompt, *, salt: str | None = None) -> int:
        """Compute a prefix (a system prompt) once and pin its full blocks, so eviction
        never takes them. Returns the number of tokens pinned (whole blocks only)."""
        request_id = self.engine.pin_prefix(self._encode(prefix), salt=salt)
        for out in self._until_finished(request_id):
            if out.finished:
                if out.pin_error is not None:
                    raise out.pin_error
                return out.pinned_tokens or 0
        return 0

    def unpin_prefix(self, prefix: Prompt, *, salt: str | None = None) -> None:
        self.engine.unpin_prefix(self._encode(prefix), salt=salt)

    def _encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _until_finished(self, request_id: str) -> Iterator[RequestOutput]:
        """Step the engine; the outputs of ``request_id`` until its sample 0 finishes."""
        while self.engine.has_work():
            outputs = [o for o in self.engine.step() if o.request_id == request_id]
            yield from outputs
            if any(o.index == 0 and o.finished for o in outputs):
                return
