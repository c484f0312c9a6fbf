"""``LLM``: the offline API. Text or token prompts in, completions out, on one engine.

from kvpool import LLM, SamplingParams
llm = LLM()                                   # the built-in default model
out = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))
print(out[0].text, out[0].cached_prompt_tokens)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.cache import CacheStats
from kvpool.engine.engine import Engine
from kvpool.engine.request import Request, Status
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.scheduler import MAX_BATCH_TOKENS
from kvpool.engine.text_stream import TextStream
from kvpool.model.loader import load_model

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | None = None,
        kv_cache_memory: int = 256 * 2**20,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        policy: str = "paged",
        seed: int | None = None,
        progress: bool = True,
        max_queue: int | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.loaded = load_model(
            model, dtype=dtype, progress=progress, batch_invariant=batch_invariant
        )
        self.tokenizer = self.loaded.tokenizer
        geometry = self.loaded.config.kv_geometry(self.loaded.model.dtype.itemsize)
        self.engine = Engine(
            self.loaded.model,
            num_blocks=geometry.blocks_for_budget(kv_cache_memory, block_size),
            block_size=block_size,
            max_batch_tokens=max_batch_tokens,
            enable_prefix_caching=enable_prefix_caching,
            policy=policy,
            stop_ids=self.tokenizer.stop_ids,
            seed=seed,
            max_queue=max_queue,
        )

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[CompletionOutput]:
        """Complete each prompt (text is encoded as is, without the chat template)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(ids, params or SamplingParams())

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | None = None,
    ) -> list[CompletionOutput]:
        """Answer each conversation, rendered with the model's chat template."""
        ids = [self.tokenizer.encode_chat(list(c)) for c in conversations]
        return self._run(ids, params or SamplingParams())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """The completion of one prompt, piece by piece as tokens are generated. Stopping
        the iteration early cancels the request and frees its blocks."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request = self.engine.add_request(ids, params or SamplingParams())
        texts: dict[str, TextStream] = {}
        try:
            while request.status is not Status.FINISHED:
                for progressed in self.engine.step():
                    piece = self._advance(progressed, texts)
                    if progressed is request and piece:
                        yield piece
        finally:
            self.engine.cancel(request.request_id)

    def cache_stats(self) -> CacheStats:
        return self.engine.manager.stats()

    def pin_prefix(self, prefix: Prompt, *, salt: str | None = None) -> int:
        """Compute a prefix (a system prompt) once and pin its full blocks, so eviction
        never takes them. Returns the number of tokens pinned (whole blocks only)."""
        ids = self._encode_prefix(prefix)
        self._run([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return self.engine.manager.pin(ids, salt)

    def unpin_prefix(self, prefix: Prompt, *, salt: str | None = None) -> None:
        self.engine.manager.unpin(self._encode_prefix(prefix), salt)

    def _encode_prefix(self, prefix: Prompt) -> list[int]:
        return self.tokenizer.encode(prefix) if isinstance(prefix, str) else list(prefix)

    # -- internals ---------------------------------------------------------------------
    def _run(self, ids: list[list[int]], params: SamplingParams) -> list[CompletionOutput]:
        """Outputs in prompt order; with ``n > 1``, the n samples of each prompt in turn."""
        requests = [self.engine.add_request(p, params) for p in ids]
        texts: dict[str, TextStream] = {}
        while any(s.status is not Status.FINISHED for r in requests for s in r.siblings):
            for request in self.engine.step():
                self._advance(request, texts)
        return [self._output(s, texts) for r in requests for s in r.siblings]

    def _advance(self, request: Request, texts: dict[str, TextStream]) -> str:
        """The request's new text after a step (``TextStream``: stop strings never
        released); a stop string ends the request at once, freeing its blocks."""
        stream = texts.get(request.request_id)
        if stream is None:
            stream = texts[request.request_id] = TextStream(
                self.tokenizer.decode, request.params.stop
            )
        finished = request.status is Status.FINISHED
        piece = stream.update(request.output_ids, final=finished)
        if stream.stopped and not finished:
            self.engine.cancel(request.request_id)
            request.finish_reason = "stop"
        return piece

    def _output(self, request: Request, texts: dict[str, TextStream]) -> CompletionOutput:
        stream = texts.get(request.request_id)
        if stream is None:  # never progressed (refused before its first token)
            stream = TextStream(self.tokenizer.decode, request.params.stop)
            stream.update(request.output_ids, final=True)
        return CompletionOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_ids),
            token_ids=request.output_ids,
            text=stream.sent,
            finish_reason=request.finish_reason,
            cached_prompt_tokens=request.cached_prompt_tokens,
        )
