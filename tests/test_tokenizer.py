"""The GGUF tokenizer and chat template against transformers' reading of the same file."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from kvpool.formats.gguf_header import read_gguf_header
from kvpool.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world, it's a test!",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "Ünïcödé — émojis 🙂 and 中文 text",
    "<|im_start|>user\nHi<|im_end|>\n",
    "don't won't they're I'll we've",
    "",
]


@pytest.fixture(scope="module")
def tok(default_model_file) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf_header(default_model_file))


@pytest.fixture(scope="module")
def reference(default_model_file):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        default_model_file.parent, gguf_file=default_model_file.name
    )


def test_encode_matches_reference(tok, reference):
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False), text


def test_decode_round_trips(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special=False) == text
    assert tok.decode(tok.encode("<|im_start|>user\nHi<|im_end|>")) == "user\nHi"


def test_digits_are_split_one_by_one(tok):
    # SmolLM's pre-tokenizer (llama.cpp "smollm") isolates every digit.
    ids = tok.encode("year 2024")
    assert [tok.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]


def test_chat_template_matches_reference(tok, reference):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.render_chat(messages) == text
        assert tok.encode_chat(messages) == reference.encode(text, add_special_tokens=False)
    # SmolLM2's template inserts its default system prompt when none is given.
    assert "You are a helpful AI assistant named SmolLM" in tok.render_chat(conversations[0])


def test_special_tokens_and_stops(tok):
    assert tok.eos_id == 2 and 2 in tok.stop_ids
    assert tok.add_bos is False
    assert tok.encode("<|im_end|>") == [2]


SPM_TEXTS = ["the cat", "hello and the cat in on", "Zebra ü!", "athe", "in  two  spaces"]


def test_sentencepiece_vocabulary_matches_reference(tmp_path):
    """A llama-type vocabulary: merges from scores, byte fallback, BOS added."""
    transformers = pytest.importorskip("transformers")
    from tests.synthetic_gguf import write_spm_vocab

    path = write_spm_vocab(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf(read_gguf_header(path))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in SPM_TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("Zebra")[:2] == [1, tok.backend.token_to_id("▁")]  # BOS, dummy prefix
    # Leading blanks are kept, as llama.cpp and SentencePiece do: every space one "▁".
    assert tok.decode(tok.encode("  two")) == "  two"


def test_end_of_turn_tokens_stop_whatever_the_eos(tmp_path):
    """Gemma's files name ``<eos>`` their end of sequence and end each chat turn with the
    control token ``<end_of_turn>``: both stop a reply (llama.cpp's end-of-generation
    set, by text), and so do the other templates' turn ends."""
    from tests.synthetic_gguf import write_spm_vocab

    path = write_spm_vocab(tmp_path / "spm.gguf", controls=("<end_of_turn>", "<start_of_turn>"))
    tok = Tokenizer.from_gguf(read_gguf_header(path))
    end, start = tok.encode("<end_of_turn><start_of_turn>", add_bos=False)
    assert tok.eos_id in tok.stop_ids and end in tok.stop_ids
    assert start not in tok.stop_ids and len(tok.stop_ids) == 2
