"""Structured output: a request's response format as a grammar, applied as a token mask.

A ``ResponseFormat`` (any JSON object, a JSON schema, or a Lark grammar) is compiled by
llguidance (chosen over xgrammar by measurement on this project's CPUs:
``kvpool bench grammar``) against the model's tokenizer. Each constrained sequence holds
a ``GrammarState``: before a token is drawn it gives the set of tokens the grammar
allows (the sampler sets every other logit to -inf, on that row only: free rows of the
batch pay nothing), and after the draw it consumes the token.

**The output is always complete.** A grammar alone cannot stop ``max_tokens`` from
cutting a document in half, so each state also knows a *closing*: a short token sequence
that completes the document from where it is (found greedily: forced tokens first, then
the tokens that close strings, objects and arrays, then the shortest token allowed). When
the tokens left (``max_tokens`` or the context) come within ``CLOSING_MARGIN`` of that
closing, the closing is forced token by token; near the end (``CLOSING_NEAR``) every
drawn token is checked, and one that would leave too little room is replaced by the
closing's first. (Far from the end the closing is measured every ``CLOSING_REFRESH``
tokens: the guarantee assumes no run of that many tokens lengthens it by more than
``CLOSING_NEAR`` tokens, which a JSON document only does inside a string whose schema
demands dozens of characters.) A format whose closing from the start is longer
than the request's budget is refused up front (``InvalidSamplingParams``, a 400), as is
a schema or grammar that llguidance cannot compile or proves unsatisfiable.

Invariants: a state only ever consumes tokens its grammar allowed (no error state);
``complete`` is true once the grammar accepts and can take nothing but a stop token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool.engine.sampling import InvalidSamplingParams

# The closing is forced once the tokens left are at most its length plus this margin (a
# drawn token that still leaves too little room is replaced, so the margin only saves
# that replacement's extra search in the common case).
CLOSING_MARGIN = 8
# A closing costs a search (a mask per token it takes, ~30 us each), so a state searches
# after every token only near the end: while the tokens left exceed its last closing's
# length by more than CLOSING_NEAR, it searches again every CLOSING_REFRESH tokens.
CLOSING_NEAR = 64
CLOSING_REFRESH = 8
MAX_CLOSING = 1024  # tokens: a closing longer than this counts as none (refused up front)
GRAMMAR_CACHE = 256  # compiled formats kept per compiler (by format)
# Tokens the closing prefers, in order: close a string, an object, an array, or end a
# value with the shortest one. (In free text, where most tokens are allowed, '"' comes
# first; elsewhere the closers do.)
_CLOSERS = tuple(s.encode() for s in ('"', "}", "]", "0", "null", "false", "true", '""', "[]"))
_STRUCTURAL_FIRST = tuple(s.encode() for s in ("}", "]", '"', "0", "null", "false", "true", '""'))


@dataclass(frozen=True)
class ResponseFormat:
    """What a constrained request's output must be. ``kind``: ``json_schema`` (``text``
    is the schema as JSON; any JSON object is ``{"type": "object"}``) or ``lark``
    (``text`` is a Lark grammar in llguidance's dialect)."""

    kind: str
    text: str = ""

    @classmethod
    def json_object(cls) -> ResponseFormat:
        return cls("json_schema", '{"type": "object"}')

    @classmethod
    def json_schema(cls, schema: Any) -> ResponseFormat:
        """A schema (a dict, or ``True``); refused unless it is a JSON Schema object."""
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise InvalidSamplingParams("a JSON schema must be an object")
        _check_schema(schema)
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def lark(cls, grammar: str) -> ResponseFormat:
        return cls("lark", grammar)


def _check_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is not valid JSON Schema (by its own ``$schema`` draft, else
    2020-12), where the ``jsonschema`` package is installed; llguidance checks the rest."""
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a server install has it
        return
    try:
        jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        where = f" (at {path})" if path else ""
        raise InvalidSamplingParams(f"invalid JSON schema{where}: {exc.message}") from None


class GrammarCompiler:
    """Compiles response formats against one tokenizer (llguidance's tokenizer built on
    first use, ~0.5 s for a 49k vocabulary) and keeps the last ``GRAMMAR_CACHE``.
    Thread-safe: the server checks formats on its own threads, the engine starts states
    on its thread."""

    def __init__(self, tokenizer: Any, vocab_rows: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_rows = vocab_rows
        self._lock = threading.Lock()
        self._ll: Any = None
        self._compiled: OrderedDict[ResponseFormat, _Compiled] = OrderedDict()

    def check(self, fmt: ResponseFormat, budget: int) -> None:
        """Raise ``InvalidSamplingParams`` unless ``fmt`` compiles and some output of at
        most ``budget`` tokens satisfies it."""
        compiled = self._compile(fmt)
        if compiled.min_tokens > budget:
            raise InvalidSamplingParams(
                f"the response format needs at least {compiled.min_tokens} tokens to "
                f"complete; the request allows {budget} (raise max_tokens)"
            )

    def start(self, fmt: ResponseFormat) -> GrammarState:
        compiled = self._compile(fmt)
        return GrammarState(self._vocab(), compiled.new_matcher())

    # -- internals -----------------------------------------------------------------------
    def _vocab(self) -> _Vocab:
        with self._lock:
            if self._ll is None:
                self._ll = _Vocab(self._tokenizer, self.vocab_rows)
            return self._ll

    def _compile(self, fmt: ResponseFormat) -> _Compiled:
        vocab = self._vocab()
        with self._lock:
            hit = self._compiled.get(fmt)
            if hit is not None:
                self._compiled.move_to_end(fmt)
                return hit
        compiled = _Compiled(vocab, fmt)  # outside the lock: compiling takes milliseconds
        with self._lock:
            self._compiled[fmt] = compiled
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return compiled


class _Vocab:
    """llguidance's view of the tokenizer, and what the closing search needs of it: each
    token's byte length and the ids of the single tokens it prefers."""

    def __init__(self, tokenizer: Any, vocab_rows: int) -> None:
        import llguidance

        self.llg = llguidance
        self.rows = vocab_rows
        self.stop_ids = sorted(tokenizer.stop_ids)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_rows, eos_token=self.stop_ids or None
        )
        special = tokenizer.special_ids
        lengths = [0] * vocab_rows
        by_bytes: dict[bytes, int] = {}
        for i in range(min(vocab_rows, tokenizer.vocab_size)):
            if i in special:
                continue
            data = self.tokenizer.decode_bytes([i])
            lengths[i] = len(data)
            by_bytes.setdefault(data, i)
        # Non-special tokens by byte length (the closing's fallback takes the first allowed).
        by_length = np.array(
            sorted((i for i, n in enumerate(lengths) if n), key=lambda i: (lengths[i], i)),
            dtype=np.int64,
        )
        self.short_first = (by_length[:512], by_length[512:])
        self.one_byte = np.array([i for i in by_length[:512] if lengths[i] == 1], dtype=np.int64)
        # What the escape search tries: punctuation and one letter or digit of each kind
        # (the others lead where these do, as far as a format or pattern cares).
        wanted = {*b"!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\"", *b"aA0 "}
        self.escape_bytes = np.array(
            [i for i in self.one_byte if self.tokenizer.decode_bytes([int(i)])[0] in wanted],
            dtype=np.int64,
        )
        # A common word: allowed only inside free text (a string), where the closing
        # ends the text first.
        self.probe = by_bytes.get(b" the", by_bytes.get(b"the"))
        self.closers = [by_bytes[c] for c in _CLOSERS if c in by_bytes]
        self.structural = [by_bytes[c] for c in _STRUCTURAL_FIRST if c in by_bytes]
        self.enders = [by_bytes[c] for c in (b'"', b"}", b"]", b",") if c in by_bytes]
        self.words = (vocab_rows + 31) // 32


class _Compiled:
    """One format's llguidance grammar and the length of its closing from the start."""

    def __init__(self, vocab: _Vocab, fmt: ResponseFormat) -> None:
        llg = vocab.llg
        if fmt.kind == "json_schema":
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    fmt.text, defaults={"whitespace_flexible": False}
                )
            except ValueError as exc:
                raise InvalidSamplingParams(f"invalid JSON schema: {exc}") from None
        elif fmt.kind == "lark":
            grammar = llg.LLMatcher.grammar_from_lark(fmt.text)
        else:
            raise InvalidSamplingParams(f"unknown response format {fmt.kind!r}")
        error = llg.LLMatcher.validate_grammar(grammar, vocab.tokenizer)
        if error:
            what = "grammar" if fmt.kind == "lark" else "JSON schema"
            raise InvalidSamplingParams(f"the {what} cannot be used: {error.splitlines()[0]}")
        self.vocab = vocab
        self.grammar = grammar
        closing = _closing(vocab, self.new_matcher())
        if closing is None:
            raise InvalidSamplingParams(
                f"no output of at most {MAX_CLOSING} tokens satisfies the response format"
            )
        self.min_tokens = max(1, len(closing))

    def new_matcher(self) -> Any:
        return self.vocab.llg.LLMatcher(self.vocab.tokenizer, self.grammar, log_level=0)


class GrammarState:
    """One sequence's place in its grammar (see the module docstring)."""

    def __init__(self, vocab: _Vocab, matcher: Any) -> None:
        self._vocab = vocab
        self._matcher = matcher
        self._closing: list[int] | None = None  # for the current position, if known
        self._closing_known = False
        self._estimate = 0  # the last closing's length, less the tokens since (>= 0)
        self._since = CLOSING_REFRESH  # tokens since the last search

    def copy(self) -> GrammarState:
        """An independent state at the same position (a forked sample's)."""
        other = GrammarState(self._vocab, self._matcher.deep_copy())
        other._closing, other._closing_known = self._closing, self._closing_known
        other._estimate, other._since = self._estimate, self._since
        return other

    @property
    def complete(self) -> bool:
        """The output is a whole document and nothing but a stop token may follow."""
        return self._matcher.is_accepting() and self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    def allowed(self, budget: int) -> torch.Tensor:
        """The tokens the next draw may take (bool, one per vocabulary row), given that
        at most ``budget`` more tokens may follow (this one included)."""
        if self._near(budget):
            closing = self.closing()
            if closing and len(closing) + CLOSING_MARGIN >= budget:
                only = torch.zeros(self._vocab.rows, dtype=torch.bool)
                only[closing[0]] = True
                return only
        return _unpack(self._vocab, _mask_words(self._vocab, self._matcher))

    def accept(self, token: int, budget: int) -> int:
        """Consume the drawn ``token`` (``budget``: the tokens that may follow it, this
        one included); returns the token taken: ``token``, or, where ``token`` would
        leave too little room to complete, the closing's first (a stop token where the
        document is already whole)."""
        m = self._matcher
        if not self._near(budget):
            _consume(m, token)
            self._moved(None)
            return token
        closing = self.closing()
        _consume(m, token)
        if closing is not None and closing[:1] == [token]:
            self._moved(closing[1:])  # the greedy closing goes on from here
            return token
        after = _closing(self._vocab, m.deep_copy())
        if closing is None or (after is not None and len(after) <= budget - 1):
            self._moved(after)
            return token
        m.rollback(1)
        if not closing and not self._vocab.stop_ids:
            raise RuntimeError("the grammar is complete and the model has no stop token")
        token = closing[0] if closing else self._vocab.stop_ids[0]
        _consume(m, token)
        self._moved(closing[1:])
        return token

    def closing(self) -> list[int] | None:
        """Tokens that complete the document from here (greedy; None: none found)."""
        if not self._closing_known:
            self._closing = _closing(self._vocab, self._matcher.deep_copy())
            self._closing_known = True
            self._estimate = len(self._closing) if self._closing is not None else MAX_CLOSING
            self._since = 0
        return self._closing

    def _near(self, budget: int) -> bool:
        """Whether this step must know the closing: near the end, or due a refresh."""
        if self._since >= CLOSING_REFRESH:
            self.closing()
        return budget <= self._estimate + CLOSING_NEAR

    def _moved(self, closing: list[int] | None) -> None:
        """One token consumed; ``closing``: the closing from here where known."""
        self._closing, self._closing_known = closing, closing is not None
        if closing is not None:
            self._estimate, self._since = len(closing), 0
        else:
            self._estimate, self._since = max(0, self._estimate - 1), self._since + 1


def _consume(matcher: Any, token: int) -> None:
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused token {token}: {matcher.get_error()}")


def _mask_words(vocab: _Vocab, matcher: Any) -> np.ndarray:
    """The grammar's allowed tokens now, one bit per vocabulary row (uint32 words)."""
    words = np.empty(vocab.words, dtype=np.uint32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    return words


def _unpack(vocab: _Vocab, words: np.ndarray) -> torch.Tensor:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: vocab.rows]
    return torch.from_numpy(bits.view(np.bool_))


def _closing(vocab: _Vocab, matcher: Any) -> list[int] | None:
    """A short token sequence that takes ``matcher`` (consumed) to an accepting state:
    forced tokens where there are some, else the preferred closer the grammar allows,
    else the shortest allowed token. Where that would repeat a recent token (going round
    in a lexeme such as an e-mail address that no closer can end yet, or ``(ab)+c``), a
    small breadth-first search looks for the characters that let it end (``_escape``).
    None if nothing is found within ``MAX_CLOSING`` tokens."""
    out: list[int] = []
    retry_at = 0
    while len(out) <= MAX_CLOSING:
        if matcher.is_accepting():
            return out
        if matcher.is_error():
            return None
        forced = matcher.compute_ff_tokens()
        if forced:
            for t in forced:
                if not matcher.consume_token(t):
                    return None
            out.extend(forced)
            continue
        words = _mask_words(vocab, matcher)
        # Free text (a string's inside) allows common words: end it first. Elsewhere the
        # structural closers come first ('"' there would open a new key or string).
        free = _has(words, vocab.probe) if vocab.probe is not None else False
        order = vocab.closers if free else vocab.structural
        pick = next((t for t in order if _has(words, t)), None)
        if pick is None:
            pick = _shortest(vocab, words)
            if pick is None:  # only stop / special tokens are left
                return None
        if pick in out[-4:] and len(out) >= retry_at:  # maybe going round: look for a way out
            way = _escape(vocab, matcher, words, pick, vocab.escape_bytes)
            if way is None:  # a pattern may need a particular letter: try them all
                way = _escape(vocab, matcher, words, pick, vocab.one_byte)
            if way is not None:
                for t in way:
                    matcher.consume_token(t)
                out.extend(way)
                continue
            retry_at = len(out) + ESCAPE_RETRY  # none near: go on greedily for a while
        if not matcher.consume_token(pick):
            return None
        out.append(pick)
    return None


ESCAPE_DEPTH = 10  # characters
ESCAPE_STATES = 8  # distinct states kept per depth
ESCAPE_RETRY = 16  # tokens of greedy closing after a search that found no way out


def _escape(
    vocab: _Vocab, matcher: Any, stuck: np.ndarray, first: int, ids: np.ndarray
) -> list[int] | None:
    """The fewest one-byte tokens (of ``ids``) after which the grammar accepts, forces a token, or
    allows an ender (a quote, a bracket, a comma) that the stuck state (mask ``stuck``)
    did not: breadth first, the states of one depth told apart by their masks (two
    that allow the same tokens are taken for one), ``ESCAPE_STATES`` of them per depth,
    the greedy choice ``first`` tried first at the top."""
    enders = [t for t in vocab.enders if not _has(stuck, t)]
    frontier: list[tuple[Any, list[int]]] = [(matcher, [])]
    for _ in range(ESCAPE_DEPTH):
        nxt: list[tuple[Any, list[int]]] = []
        seen: set[bytes] = set()  # per depth: a counted lexeme repeats its mask
        for state, path in frontier:
            tokens = _allowed_short(vocab, _mask_words(vocab, state), ids)
            if not path:
                tokens = [first, *(t for t in tokens if t != first)]
            for t in tokens:
                child = state.deep_copy()
                if not child.consume_token(t):
                    continue
                if child.is_accepting() or child.compute_ff_tokens():
                    return [*path, t]
                child_words = _mask_words(vocab, child)
                if any(_has(child_words, e) for e in enders):
                    return [*path, t]
                key = child_words.tobytes()
                if key not in seen and len(nxt) < ESCAPE_STATES:
                    seen.add(key)
                    nxt.append((child, [*path, t]))
        if not nxt:
            return None
        frontier = nxt
    return None


def _has(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _allowed_short(vocab: _Vocab, words: np.ndarray, ids: np.ndarray | None = None) -> list[int]:
    """The allowed one-byte tokens (by id), or those of ``ids``."""
    ids = vocab.one_byte if ids is None else ids
    allowed = (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
    return ids[allowed.astype(bool)].tolist()


def _shortest(vocab: _Vocab, words: np.ndarray) -> int | None:
    """The allowed (non-special) token with the fewest bytes (the lowest id of those):
    the short tokens are tried first, the whole vocabulary only if none is allowed."""
    for ids in vocab.short_first:
        allowed = (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
        hit = int(allowed.argmax())
        if allowed[hit]:
            return int(ids[hit])
    return None
