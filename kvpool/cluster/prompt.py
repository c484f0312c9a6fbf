"""The ingress's view of a request's prompt: its token ids, as a replica will see them.

The router matches a request's leading blocks against what each replica caches, so the
ingress tokenizes with the model's own tokenizer and chat template, through the same
functions the replica's API routes use (``ollama_api.generate_prompt`` and
``chat_prompt``, ``openai_api.chat_prompt`` and ``completion_prompt``, ``responses_api.prompt``,
``anthropic_api.prompt``): the keys it computes are the keys the replica's block manager
will find. No weights are loaded here, only the GGUF's header.

A body the ingress cannot read (bad JSON, a field the API refuses) gets no prompt: the
request is routed by load and the replica answers it with the API's own error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpool.formats.gguf_header import read_gguf_header
from kvpool.model.tokenizer import Tokenizer
from kvpool.server import anthropic_api, ollama_api, openai_api, responses_api


class PromptReader:
    """Tokenizer-only stand-in for a served model (what the prompt functions call)."""

    def __init__(self, path: Path) -> None:
        self.tokenizer = Tokenizer.from_gguf(read_gguf_header(path))
        self.vocab_size = self.tokenizer.vocab_size

    @property
    def chat_template(self) -> str:
        return self.tokenizer.chat_template or ""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True, **extra)

    def check_tokens(self, ids: list[int], field: str) -> list[int]:
        if any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"{field}: token ids out of range")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=False)

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)

    @staticmethod
    def max_tokens(body: bytes, default: int = 128) -> int:
        """The tokens a request may generate (``max_tokens``, ``max_completion_tokens``,
        Responses' ``max_output_tokens`` or Ollama's ``num_predict``); ``default`` where
        it does not say or is unbounded."""
        try:
            data = json.loads(body)
            options = data.get("options") or {}
            for value in (data.get("max_completion_tokens"), data.get("max_tokens"),
                          data.get("max_output_tokens"), options.get("num_predict")):  # fmt: skip
                if isinstance(value, int) and value >= 0:
                    return value
        except (ValueError, AttributeError):
            pass
        return default

    def prompt_ids(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids for a generation route, None for anything else (or a
        body this cannot read)."""
        try:
            data = json.loads(body)
            if path == "/api/generate":
                gen = ollama_api.GenerateBody.model_validate(data)
                return ollama_api.generate_prompt(self, gen) if gen.prompt else None
            if path == "/api/chat":
                chat = ollama_api.ChatBody.model_validate(data)
                return ollama_api.chat_prompt(self, chat)[0] if chat.messages else None
            if path == "/v1/chat/completions":
                oai = openai_api.ChatBody.model_validate(data)
                return openai_api.chat_prompt(self, oai)[0] if oai.messages else None
            if path == "/v1/completions":
                comp = openai_api.CompletionBody.model_validate(data)
                return openai_api.completion_prompt(self, comp)[1]
            if path == "/v1/responses":  # a continuation's history is on its replica
                resp = responses_api.ResponsesBody.model_validate(data)
                own = responses_api.input_messages(resp.input)
                if resp.previous_response_id or not own:
                    return None
                return responses_api.prompt(self, resp, [], own)[0]
            if path == "/v1/messages":
                body = anthropic_api.MessagesBody.model_validate(data)
                return anthropic_api.prompt(self, body)[0]
        except Exception:  # any unreadable body: routed by load, answered by a replica
            return None
        return None
