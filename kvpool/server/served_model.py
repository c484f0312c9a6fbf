"""``ServedModel``: the one model a server runs, its names, what the listing APIs say
about it (Ollama's ``/api/tags``, ``/api/show``, ``/api/ps``; OpenAI's ``/v1/models``),
and the small interface the routes use: tokenize and render chats, submit a request,
read the engine's snapshot, pin and unpin prefixes. The routes reach nothing else."""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvpool.engine.async_llm import AsyncLLM, RequestStream
from kvpool.engine.errors import InvalidTokens
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.snapshot import EngineSnapshot
from kvpool.engine.structured import ResponseFormat
from kvpool.formats.gguf_header import read_gguf_header
from kvpool.model.loader import LoadedModel
from kvpool.model_store import DEFAULT_ALIASES
from kvpool.server.errors import bad_request

DEFAULT_NAME = "smollm2:135m"

# llama.cpp's ``general.file_type`` values, as Ollama names them.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}  # fmt: skip


def _with_tag(name: str) -> str:
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


@dataclass
class ServedModel:
    name: str
    path: Path
    loaded: LoadedModel
    llm: AsyncLLM  # the engine's driver (its thread)
    aliases: frozenset[str]
    digest: str
    size: int
    modified_at: datetime
    info: dict[str, Any] = field(default_factory=dict)  # GGUF metadata, for /api/show
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    # Its life in the server (kvpool.server.models): requests holding it now, seconds
    # to stay after the last one, when it may be unloaded (time.time()), last use.
    active: int = 0
    keep_alive: float = math.inf
    expires_at: float = math.inf
    last_used: float = 0.0
    unloading: bool = False

    @classmethod
    def open(
        cls,
        requested: str | None,
        loaded: LoadedModel,
        llm: AsyncLLM,
        aliases: list[str] | None = None,
    ) -> ServedModel:
        """The loaded model as the server names it: ``requested`` (or its file's stem),
        and ``aliases``, more names it answers to (``kvpool serve --alias``; ``*`` in one
        matches any text: ``claude-*``)."""
        path = loaded.path
        if requested is None or requested.lower() in DEFAULT_ALIASES:
            name, names = DEFAULT_NAME, {*DEFAULT_ALIASES, DEFAULT_NAME}
        elif Path(requested).expanduser().is_file():
            name, names = path.stem, {path.stem, requested, str(path)}
        else:
            name, names = _with_tag(requested), {requested}
        names |= {name, _with_tag(name), *(aliases or ())}
        header = read_gguf_header(path)
        info = {k: v for k, v in header.metadata.items() if not isinstance(v, list)}
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        stat = path.stat()
        return cls(
            name=name,
            path=path,
            loaded=loaded,
            llm=llm,
            aliases=frozenset(a.lower() for a in names if a),
            digest=digest.hexdigest(),
            size=stat.st_size,
            modified_at=datetime.fromtimestamp(stat.st_mtime, UTC),
            info=info,
        )

    def release(self) -> None:
        """Drop the references to the engine and the weights (the model is unloaded)."""
        self.llm = None  # type: ignore[assignment]
        self.loaded = None  # type: ignore[assignment]

    def matches(self, requested: str) -> bool:
        """Whether a request naming ``requested`` means this model: one of its names (a
        missing tag is ``:latest``), or an alias with ``*`` (``claude-*``) that fits."""
        name = requested.lower()
        if name in self.aliases or _with_tag(name) in self.aliases:
            return True
        return any("*" in a and fnmatch.fnmatchcase(name, a) for a in self.aliases)

    # -- text ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.loaded.tokenizer.encode(text)

    def encode_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """The messages rendered by the model's chat template, as token ids (``extra``:
        more template variables, such as ``tools``). A template that refuses the
        conversation or fails (a ValueError saying why) is a 400, in every API."""
        try:
            return self.loaded.tokenizer.encode_chat(
                messages, add_generation_prompt=add_generation_prompt, **extra
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    def piece(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs name tokens by it)."""
        return self.loaded.tokenizer.decode([token_id], skip_special=False)

    def decode(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(ids)

    @property
    def chat_template(self) -> str:
        return self.loaded.tokenizer.chat_template or ""

    # -- the engine ------------------------------------------------------------------------
    async def check_format(self, fmt: ResponseFormat, budget: int) -> None:
        """Compile ``fmt`` off the event loop (cached for the engine) and check it
        completes within ``budget`` tokens; raises ``InvalidSamplingParams``."""
        await self.llm.check_format(fmt, budget)

    async def submit(
        self, ids: list[int], params: SamplingParams, *, salt: str | None
    ) -> RequestStream:
        return await self.llm.submit(ids, params, salt=salt)

    async def embed(self, inputs: list[list[int]], *, salt: str | None) -> list[list[float]]:
        """One embedding per input (token ids), all submitted at once so the engine
        batches them; inputs sharing a prefix share its cached blocks. Raises the
        engine's ``RequestError`` or ``RequestFailed`` as ``submit`` would."""
        params = SamplingParams(max_tokens=1, temperature=0.0, embedding=True)
        streams: list[RequestStream] = []

        async def vector(stream: RequestStream) -> list[float]:
            result: list[float] = []
            async for out in stream:
                if out.embedding is not None:
                    result = out.embedding
            return result

        try:
            for ids in inputs:
                streams.append(await self.submit(ids, params, salt=salt))
            return list(await asyncio.gather(*(vector(s) for s in streams)))
        finally:  # a refusal, a failure or a client gone: nothing is left running
            for stream in streams:
                stream.cancel()

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's latest counters (never waits for a step)."""
        return self.llm.snapshot

    async def pin_prefix(
        self, ids: list[int], *, salt: str | None, shared: bool, max_salt_blocks: int | None
    ) -> int:
        return await self.llm.pin_prefix(
            ids, salt=salt, shared=shared, max_salt_blocks=max_salt_blocks
        )

    async def unpin_prefix(self, ids: list[int], *, salt: str | None, shared: bool) -> None:
        await self.llm.unpin_prefix(ids, salt=salt, shared=shared)

    async def reset_prefix_cache(self, *, unpin: bool, tier: bool = False) -> int:
        return await self.llm.reset_prefix_cache(unpin=unpin, tier=tier)

    @property
    def context_length(self) -> int:
        return self.llm.engine.context_length

    @property
    def vocab_size(self) -> int:
        """Valid token ids are ``[0, vocab_size)``."""
        return self.llm.engine.vocab_size

    @property
    def on_gpu(self) -> bool:
        return self.loaded.model.device.type == "cuda"

    def check_tokens(self, ids: list[int], field: str) -> list[int]:
        """``ids`` if every one is in the vocabulary; else a 400 naming the field and the
        valid range (the engine's own check, which it runs again before it queues)."""
        try:
            self.llm.engine.check_tokens(ids)
        except InvalidTokens as exc:
            raise bad_request(f"{field}: {exc}") from None
        return ids

    def details(self) -> dict[str, Any]:
        cfg = self.loaded.config
        params = self.loaded.model.num_parameters
        size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
        return {
            "parent_model": "",
            "format": "gguf",
            "family": cfg.architecture,
            "families": [cfg.architecture],
            "parameter_size": size,
            "quantization_level": FILE_TYPES.get(int(self.info.get("general.file_type", -1)), ""),
        }

    def listing(self) -> dict[str, Any]:
        """One entry of ``/api/tags``."""
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at.isoformat(),
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        }
