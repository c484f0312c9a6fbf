"""Tokenizer and chat template from a GGUF file's metadata.

Built on the ``tokenizers`` library from the vocabulary the file carries:

- ``gpt2`` vocabularies (byte-level BPE with merges): the text is split the way the model's
  merges were learned, chosen by ``tokenizer.ggml.pre`` (as llama.cpp does), then mapped to
  byte-level symbols;
- ``llama`` vocabularies (SentencePiece BPE with scores, byte fallback): merges are derived
  from the scores, spaces become ``▁``.

Tokens the file marks as control (``<|im_start|>``) are special: they are matched whole in
text and dropped when decoding with ``skip_special``. The chat template is the model
authors' Jinja template, rendered with the sandboxed Jinja environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from kvpool.formats.gguf_header import GGUFHeader
from kvpool.model.config import UnsupportedModel

# Split patterns by ``tokenizer.ggml.pre`` (the pre-tokenizer the vocabulary was trained
# with). The GPT-2 pattern is ByteLevel's own; others are given explicitly.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "smaug-bpe": _LLAMA3, "qwen2": _QWEN2}
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
# Control tokens that end a chat turn, stops wherever a vocabulary has them, whatever
# its end-of-sequence id (llama.cpp's end-of-generation set, by text: Gemma's files name
# <eos> their eos and end each turn with <end_of_turn>)
END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")


def _byte_level_pre(pre: str | None):
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in _DIGITS_THEN_GPT2:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


def _merges_from_scores(tokens: list[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps scores, not merges: a merge ``a b`` exists for every token
    ``ab`` whose halves are tokens, ranked by the merged token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, str, str]] = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _check_array(meta: dict[str, Any], name: str, kinds: frozenset, length: int | None) -> None:
    """``tokenizer.ggml.{name}``, where the file has it, is a list of values of the types
    ``kinds``, one for each token where ``length`` is given; else the vocabulary is damaged
    (a flipped type or count misreads every array after it)."""
    values = meta.get(f"tokenizer.ggml.{name}")
    if values is None:
        return
    if not isinstance(values, list) or not set(map(type, values)) <= kinds:
        raise UnsupportedModel(
            f"the file's vocabulary is damaged: its {name} are not all {_KINDS[kinds]}"
        )
    if length is not None and len(values) != length:
        raise UnsupportedModel(
            f"the file's vocabulary is damaged: {len(values)} {name} for {length} tokens"
        )


_STRINGS, _INTEGERS, _NUMBERS = frozenset({str}), frozenset({int}), frozenset({int, float})
_KINDS = {_STRINGS: "strings", _INTEGERS: "integers", _NUMBERS: "numbers"}


def _bpe(vocab: dict[str, int], merges: list, **options: Any) -> models.BPE:
    """The tokenizers library's BPE model; one it refuses (a damaged merge that names no
    token, a pair that is not two tokens: it raises plain Exceptions) is the file's
    fault, an ``UnsupportedModel``."""
    if any(len(pair) != 2 for pair in merges):
        raise UnsupportedModel("the file's vocabulary is damaged: a merge is not two tokens")
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as exc:  # (the Rust library's errors are plain Exceptions)
        raise UnsupportedModel(f"the file's vocabulary is damaged: {exc}") from None


@dataclass
class Tokenizer:
    backend: _HFTokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    stop_ids: frozenset[int]
    chat_template: str | None
    special_ids: frozenset[int]
    _template: Any = field(default=None, repr=False, compare=False)  # compiled, lazily

    @classmethod
    def from_gguf(cls, header: GGUFHeader) -> Tokenizer:
        meta = header.metadata
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise UnsupportedModel("the GGUF file has no vocabulary (tokenizer.ggml.tokens)")
        _check_array(meta, "tokens", _STRINGS, None)
        _check_array(meta, "token_type", _INTEGERS, len(tokens))
        _check_array(meta, "scores", _NUMBERS, len(tokens))
        _check_array(meta, "merges", _STRINGS, None)
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
            backend = _HFTokenizer(_bpe(vocab, merges, fuse_unk=False))
            backend.pre_tokenizer = _byte_level_pre(meta.get("tokenizer.ggml.pre"))
            backend.decoder = decoders.ByteLevel()
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
            if not isinstance(unk, int) or not 0 <= unk < len(tokens):
                raise UnsupportedModel(f"the file's unknown token id {unk!r} is no token")
            model = _bpe(
                vocab, _merges_from_scores(tokens, scores), unk_token=tokens[unk],
                fuse_unk=True, byte_fallback=True,
            )  # fmt: skip
            backend = _HFTokenizer(model)
            add_space = meta.get("tokenizer.ggml.add_space_prefix", True)
            backend.normalizer = normalizers.Sequence(
                ([normalizers.Prepend("▁")] if add_space else []) + [normalizers.Replace(" ", "▁")]
            )
            backend.decoder = decoders.Sequence(
                [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                + ([decoders.Strip(" ", 1, 0)] if add_space else [])
            )
        else:
            raise UnsupportedModel(f"tokenizer model {kind!r} is not supported (gpt2, llama)")
        special = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED]
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        for what, i in (("beginning", bos), ("end", eos), ("end of turn", eot)):
            if i is not None and (not isinstance(i, int) or not 0 <= i < len(tokens)):
                raise UnsupportedModel(f"the file's {what} token id {i!r} is no token")
        stops = {i for i in (eos, eot) if i is not None}
        stops |= {vocab[t] for t in END_OF_TURN if t in vocab and types[vocab[t]] == CONTROL}
        return cls(
            backend=backend,
            bos_id=bos,
            eos_id=eos,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            stop_ids=frozenset(stops),
            chat_template=meta.get("tokenizer.chat_template"),
            special_ids=frozenset(vocab[t] for t in special),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; control tokens written in the text are matched whole."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The conversation as the model's chat template writes it (``extra``: more
        template variables, such as ``tools``). A template that cannot render this
        conversation (it raises, reads what is not there, breaks the sandbox's rules, or
        does not compile) raises a ValueError saying so: a server's 400 with the reason,
        not an internal error."""
        from jinja2 import TemplateError

        token = self.token_text
        try:
            return self._compiled_template().render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=token(self.bos_id) if self.bos_id is not None else "",
                eos_token=token(self.eos_id) if self.eos_id is not None else "",
                **extra,
            )
        except (TemplateError, TypeError) as exc:  # (jinja's operators raise TypeErrors)
            raise ValueError(f"the model's chat template failed: {exc}") from None

    def _compiled_template(self) -> Any:
        """The chat template compiled once (compiling costs milliseconds per request)."""
        if self._template is not None:
            return self._template
        if not self.chat_template:
            raise UnsupportedModel("the model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(self.chat_template)
        return self._template

    def encode_chat(
        self, messages: list[dict[str, Any]], *, prefill: str = "", **kw: Any
    ) -> list[int]:
        """Token ids of a rendered conversation (the template writes BOS where it wants);
        ``prefill``: text the reply starts with, written after the rendered prompt (its
        tokens are the prompt's: the model continues from them)."""
        return self.encode(self.render_chat(messages, **kw) + prefill, add_bos=False)
