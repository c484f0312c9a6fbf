"""What a step gives back: ``RequestOutput`` per sample that progressed, made by the one
``OutputProcessor`` (text deltas, stop strings); ``CompletionOutput``, a finished sample
whole, as ``LLM`` returns it, folded from its outputs by ``Completions``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.engine.request import Request, Status
from kvpool.engine.sampling import TokenLogprobs
from kvpool.engine.text_stream import TextStream

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class RequestOutput:
    """What one sample of a request produced in a step.

    ``text`` and ``token_ids`` are new since the sample's previous output (a stop string
    is never in ``text``; text that could begin one, or an incomplete UTF-8 character,
    waits for the next tokens). ``finish_reason`` is set on the sample's last output:
    ``stop`` (a stop token or string), ``length``, ``cancelled``, ``error`` (``error``
    then names the log id), ``too_long_for_pool``; ``stop_string`` then says which stop
    string ended it (None for a stop token). ``pinned_tokens``: a pin request's result
    (tokens pinned), on its last output.
    """

    request_id: str  # as added: every sample of the request shares it
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int  # this sample's output so far
    preemptions: int = 0
    error: str | None = None
    pinned_tokens: int | None = None
    pin_error: Exception | None = None  # a pin request refused (a CacheError)
    stop_string: str | None = None  # the stop string that ended it, on its last output
    time: float = 0.0  # time.monotonic() when the step that produced it ended
    # one per token of token_ids, where the request asked for logprobs (else None)
    logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, on its last output
    # params.prompt_logprobs: one per prompt token (None for the first), on the first
    # output after the prompt is computed
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class CompletionOutput:
    """One finished sample, whole."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    index: int = 0
    preemptions: int = 0
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # per token, where asked for
    embedding: list[float] | None = None  # an embedding request's vector
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # where asked for

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class OutputProcessor:
    """Turns the samples a step advanced into ``RequestOutput``s: each sample's text is
    released through its ``TextStream``; a stop string found there is reported to
    ``on_stop`` (the engine ends the sample in the same step, as ``stop``). Without a
    ``decode`` there is no text (token ids only) and stop strings cannot be matched."""

    def __init__(self, decode: Decode | None, on_stop: Callable[[Request], None]) -> None:
        self._decode = decode
        self._on_stop = on_stop
        # per sample (request id, index), while it runs
        self._texts: dict[tuple[str, int], TextStream] = {}
        self._sent: dict[tuple[str, int], int] = {}  # output tokens already reported

    def process(
        self, request: Request, pinned: int | None = None, now: float = 0.0
    ) -> RequestOutput:
        key = (request.request_id, request.index)
        finished = request.status is Status.FINISHED
        text, stop_string = "", None
        if self._decode is not None and request.finish_reason != "error":
            stream = self._texts.get(key)
            if stream is None:
                stream = self._texts[key] = TextStream(self._decode, request.params.stop)
            text = stream.update(request.output_ids, final=finished)
            if stream.stopped and not finished:
                self._on_stop(request)  # a stop string: it ends now, its blocks freed
                finished = True
            stop_string = stream.matched
        output = request.output_ids
        sent = self._sent.get(key, 0)
        self._sent[key] = len(output)
        if finished:
            self._texts.pop(key, None)
            self._sent.pop(key, None)
        return RequestOutput(
            request_id=request.request_id,
            index=request.index,
            text=text,
            token_ids=output[sent:],
            finish_reason=request.finish_reason if finished else None,
            prompt_tokens=len(request.prompt_ids),
            cached_prompt_tokens=request.cached_prompt_tokens,
            completion_tokens=len(output),
            preemptions=request.preemptions,
            error=request.error,
            pinned_tokens=pinned,
            pin_error=request.pin_error,
            stop_string=stop_string if finished else None,
            time=now,
            logprobs=request.logprobs[sent:] if request.params.logprobs is not None else None,
            embedding=request.embedding if finished else None,
            prompt_logprobs=request.prompt_logprobs if sent == 0 and (output or finished) else None,
        )

    def forget(self, request: Request) -> None:
        """Drop the state of a sample that ended outside a step (an abort)."""
        key = (request.request_id, request.index)
        self._texts.pop(key, None)
        self._sent.pop(key, None)


@dataclass
class _Sample:
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    last: RequestOutput | None = None


class Completions:
    """Folds ``RequestOutput``s into each sample's ``CompletionOutput`` (``LLM``'s and
    ``Engine.generate``'s results)."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        self._prompts = prompts  # request id -> prompt ids
        self._samples: dict[tuple[str, int], _Sample] = {}

    def add(self, outputs: Iterable[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id not in self._prompts:
                continue
            sample = self._samples.setdefault((out.request_id, out.index), _Sample())
            sample.text.append(out.text)
            sample.tokens.extend(out.token_ids)
            if out.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + out.logprobs
            if out.prompt_logprobs is not None:
                sample.prompt_logprobs = out.prompt_logprobs
            sample.last = out

    def finished(self, request_id: str, n: int) -> bool:
        samples = [self._samples.get((request_id, j)) for j in range(n)]
        return all(s is not None and s.last is not None and s.last.finished for s in samples)

    def result(self, request_id: str, n: int) -> list[CompletionOutput]:
        results = []
        for j in range(n):
            sample = self._samples.get((request_id, j)) or _Sample()
            last = sample.last
            results.append(
                CompletionOutput(
                    request_id=request_id,
                    prompt_token_ids=list(self._prompts[request_id]),
                    token_ids=sample.tokens,
                    text="".join(sample.text),
                    finish_reason=last.finish_reason if last else None,
                    cached_prompt_tokens=last.cached_prompt_tokens if last else 0,
                    index=j,
                    preemptions=last.preemptions if last else 0,
                    error=last.error if last else None,
                    logprobs=sample.logprobs,
                    embedding=last.embedding if last else None,
                    prompt_logprobs=sample.prompt_logprobs,
                )
            )
        return results
