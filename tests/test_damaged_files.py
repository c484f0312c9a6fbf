"""A damaged or crafted GGUF file (a partial download, flipped bytes, a tensor of another
shape than its metadata says) is refused with a clear error: ``GGUFFormatError`` or
``UnsupportedModel`` (both ValueErrors), naming what is wrong, before any tensor data is
read or any kernel meets it; ``kvpool generate`` says so in one line, and a server that
loads models on demand answers 400 and goes on serving."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from kvpool.formats.gguf_header import GGUFFormatError, read_gguf_header
from kvpool.model.config import ModelConfig, UnsupportedModel
from tests.synthetic_gguf import write_model

REFUSED = (GGUFFormatError, UnsupportedModel)


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
    from tests.test_synthetic_models import MIXES

    path = tmp_path_factory.mktemp("damaged") / "base.gguf"
    return write_model(path, "qwen2", MIXES["k-quants"], seed=1).read_bytes()


def _written(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    return path


def _checked(path: Path) -> None:
    """What a load does before it reads any tensor data."""
    header = read_gguf_header(path)
    ModelConfig.from_gguf(header).check_tensors(header)


def _after(data: bytes, name: str) -> int:
    """The byte after a header string (a metadata key or a tensor's name)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key)


def _with_dims(data: bytes, name: str, dims: tuple[int, ...]) -> bytes:
    """``data`` with tensor ``name``'s dimensions rewritten (as many as it had)."""
    at = _after(data, name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    assert len(dims) == n_dims
    out = bytearray(data)
    struct.pack_into(f"<{n_dims}Q", out, at + 4, *dims)
    return bytes(out)


def _with_u32(data: bytes, key: str, value: int) -> bytes:
    """``data`` with the uint32 metadata value of ``key`` rewritten."""
    at = _after(data, key)
    assert struct.unpack_from("<I", data, at)[0] == 4  # (GGUF's uint32)
    out = bytearray(data)
    struct.pack_into("<I", out, at + 4, value)
    return bytes(out)


def test_the_undamaged_file_loads(tmp_path, model_bytes):
    from kvpool.model.loader import load_model

    path = _written(tmp_path, model_bytes)
    _checked(path)
    assert load_model(str(path), progress=False).model.vocab_rows > 0


def test_a_file_cut_short_anywhere_is_refused_before_its_data_is_read(tmp_path, model_bytes):
    """A partial download: cut in the header's fields, its vocabulary, its tensor
    directory or the tensor data. The load says where, without reading or allocating
    the rest (the data's end is checked against the directory first)."""
    data_offset = read_gguf_header(_written(tmp_path, model_bytes)).data_offset
    cuts = [4, 10, 30, 200, data_offset // 2, data_offset - 1, data_offset + 100]
    cuts += [len(model_bytes) // 2, len(model_bytes) - 1]
    for cut in cuts:
        path = _written(tmp_path, model_bytes[:cut])
        with pytest.raises(GGUFFormatError, match=r"end of file|past the end") as info:
            _checked(path)
        if cut > data_offset:
            assert "a partial download?" in str(info.value)


def test_random_damage_to_the_header_is_refused_or_harmless(tmp_path, model_bytes):
    """Bytes of the header overwritten at random (400 files, 1-4 bytes each): each is
    refused with a format error, or reads as a model whose tensors are all there in the
    shapes its metadata says (a damaged token string, a damaged name of a tensor the
    runtime does not read). Never another exception: no struct or overflow errors, no
    KeyError of a missing tensor, no allocation of what a damaged length claims."""
    data_offset = read_gguf_header(_written(tmp_path, model_bytes)).data_offset
    rng = random.Random(13)
    refused = 0
    for _ in range(400):
        data = bytearray(model_bytes)
        for _ in range(rng.choice((1, 2, 4))):
            data[rng.randrange(data_offset)] = rng.randrange(256)
        try:
            _checked(_written(tmp_path, bytes(data)))
        except REFUSED:
            refused += 1
    assert refused > 100  # (most damage lands in a length, a count, a shape or a type)


@pytest.mark.parametrize(
    ("name", "dims", "message"),
    [
        ("blk.0.attn_q.weight", (256, 128), "'blk.0.attn_q.weight' is \\[256, 128\\]"),
        ("blk.1.attn_k.weight", (256, 256), "needs \\[256, 128\\]"),
        ("blk.0.attn_output.weight", (512, 256), "'blk.0.attn_output.weight'"),
        ("blk.1.ffn_down.weight", (256, 256), "needs \\[512, 256\\]"),
        ("blk.0.ffn_up.weight", (512, 512), "'blk.0.ffn_up.weight'"),
        ("output_norm.weight", (128,), "needs \\[256\\]"),
        ("blk.0.attn_q.bias", (512,), "'blk.0.attn_q.bias'"),
        ("token_embd.weight", (512, 512), "needs \\[256, n\\]"),
        ("token_embd.weight", (256, 0), "needs \\[256, n\\]"),
        ("output.weight", (256, 1024), "head's 1024 rows"),
    ],
)
def test_a_tensor_of_another_shape_than_the_metadata_says_is_refused(
    tmp_path, model_bytes, name, dims, message
):
    """Checked before any data is read: a kernel never meets a matrix of another width
    than the layer's, and the head never makes ids the embedding lacks."""
    from kvpool.model.loader import load_model

    path = _written(tmp_path, _with_dims(model_bytes, name, dims))
    with pytest.raises(REFUSED, match=message):
        load_model(str(path), progress=False)


def test_a_missing_tensor_is_named(tmp_path, model_bytes):
    at = _after(model_bytes, "blk.1.ffn_norm.weight")
    data = bytearray(model_bytes)
    data[at - 1 : at] = b"X"  # (the name's last letter: the runtime finds no such tensor)
    with pytest.raises(UnsupportedModel, match=r"no tensor 'blk\.1\.ffn_norm\.weight'"):
        _checked(_written(tmp_path, bytes(data)))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("qwen2.attention.head_count", 0, "head_count is 0, not a positive integer"),
        ("qwen2.attention.head_count_kv", 3, "4 heads do not share 3 KV heads evenly"),
        ("qwen2.embedding_length", 0, "embedding_length is 0"),
        ("qwen2.block_count", 0, "block_count is 0"),
        ("qwen2.feed_forward_length", 1000, "needs \\[256, 1000\\]"),
        ("qwen2.attention.head_count", 8, "8 heads / 2 KV heads of 32"),
    ],
)
def test_metadata_that_cannot_be_a_model_is_refused(tmp_path, model_bytes, key, value, message):
    with pytest.raises(UnsupportedModel, match=message):
        _checked(_written(tmp_path, _with_u32(model_bytes, key, value)))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("qwen2.rope.freq_base", float("nan")),
        ("qwen2.rope.freq_base", -1.0),
        ("qwen2.attention.layer_norm_rms_epsilon", float("inf")),
        ("qwen2.attention.layer_norm_rms_epsilon", 0.0),
    ],
)
def test_a_norm_or_rotary_constant_that_makes_every_logit_nan_is_refused(
    tmp_path, model_bytes, key, value
):
    at = _after(model_bytes, key)
    assert struct.unpack_from("<I", model_bytes, at)[0] == 6  # (GGUF's float32)
    data = bytearray(model_bytes)
    struct.pack_into("<f", data, at + 4, value)
    with pytest.raises(UnsupportedModel, match=f"{key} is"):
        _checked(_written(tmp_path, bytes(data)))


def test_the_alignment_and_dimension_count_are_checked(tmp_path, model_bytes):
    at = _after(model_bytes, "output_norm.weight")
    data = bytearray(model_bytes)
    struct.pack_into("<I", data, at, 9)  # dimensions: ggml has at most 4
    with pytest.raises(GGUFFormatError, match=r"'output_norm\.weight' has 9 dimensions"):
        _checked(_written(tmp_path, bytes(data)))


def test_a_type_this_reader_does_not_know_is_refused_where_it_is_read(tmp_path, model_bytes):
    """A newer ggml's type: the header (a model's geometry, as the simulator reads it)
    still reads; loading that tensor is refused, naming it."""
    from kvpool.model.loader import load_model

    at = _after(model_bytes, "blk.1.ffn_down.weight")
    data = bytearray(model_bytes)
    struct.pack_into("<I", data, at + 4 + 2 * 8, 99)  # (after its 2 dimensions: its type)
    path = _written(tmp_path, bytes(data))
    _checked(path)
    with pytest.raises(GGUFFormatError, match=r"blk\.1\.ffn_down\.weight: unknown ggml type 99"):
        load_model(str(path), progress=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.merges": ["a c"]}, "vocabulary is damaged: .*out of vocabulary"),
        ({"tokenizer.ggml.merges": ["ab"]}, "a merge is not two tokens"),
        ({"tokenizer.ggml.bos_token_id": 70000}, "beginning token id 70000 is no token"),
        ({"tokenizer.ggml.eos_token_id": -1}, "end token id -1 is no token"),
        ({"tokenizer.ggml.scores": [0.0, 1.0]}, "2 scores for 3 tokens"),
        ({"tokenizer.ggml.token_type": [1, 1, 1, 1]}, "4 token_type for 3 tokens"),
        ({"tokenizer.ggml.scores": ["a", "b", "c"]}, "its scores are not all numbers"),
        ({"tokenizer.ggml.tokens": [1, 2, 3]}, "its tokens are not all strings"),
        ({"tokenizer.ggml.tokens": 3}, "its tokens are not all strings"),
        ({"tokenizer.ggml.merges": [7]}, "its merges are not all strings"),
        ({"tokenizer.ggml.token_type": [True, 1, 1]}, "its token_type are not all integers"),
    ],
)
def test_a_damaged_vocabulary_is_refused(change, message):
    """The tokenizers library raises plain Exceptions for a merge that names no token
    (seen in header-damaged copies of the default model): the load's error is the file's."""
    from kvpool.formats.gguf_header import GGUFHeader
    from kvpool.model.tokenizer import Tokenizer

    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    Tokenizer.from_gguf(GGUFHeader(Path("v.gguf"), 3, metadata, [], 0))  # (as written)
    header = GGUFHeader(Path("v.gguf"), 3, metadata | change, [], 0)
    with pytest.raises(UnsupportedModel, match=message):
        Tokenizer.from_gguf(header)


def test_arrays_nested_deeper_than_any_model_writes_are_refused(tmp_path):
    """ggml's reader takes no array of arrays; this one reads 8 deep, and refuses a
    crafted file's thousands (which would exhaust Python's recursion) as damaged."""

    def gguf(depth: int) -> bytes:
        key = b"nested"
        value = struct.pack("<I", 9)  # an array ...
        for _ in range(depth - 1):
            value += struct.pack("<IQ", 9, 1)  # ... of one array ...
        value += struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)  # ... of one uint32
        head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
        return head + struct.pack("<Q", len(key)) + key + value

    value = read_gguf_header(_written(tmp_path, gguf(8))).metadata["nested"]
    for _ in range(8):
        value = value[0]
    assert value == 7
    with pytest.raises(GGUFFormatError, match="arrays nested more than 8 deep"):
        read_gguf_header(_written(tmp_path, gguf(9)))
    with pytest.raises(GGUFFormatError, match="arrays nested more than 8 deep"):
        read_gguf_header(_written(tmp_path, gguf(5000)))


def test_generate_says_what_is_wrong_in_one_line(tmp_path, model_bytes, capsys):
    from kvpool.cli import main

    path = _written(tmp_path, model_bytes[: len(model_bytes) // 2])
    assert main(["generate", "hi", "--model", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("kvpool: ") and "past the end of the file" in line
    assert "a partial download?" in line


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}{{ m.content }}", "(?i)unexpected end of template"),
        ("{{ messages[0].content + 1 }}", "can only concatenate"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ],
)
def test_a_chat_template_that_fails_is_a_value_error_saying_why(template, message):
    from kvpool.formats.gguf_header import GGUFHeader
    from kvpool.model.tokenizer import Tokenizer

    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.chat_template": template,
    }
    tokenizer = Tokenizer.from_gguf(GGUFHeader(Path("v.gguf"), 3, metadata, [], 0))
    with pytest.raises(ValueError, match=message):
        tokenizer.render_chat([{"role": "user", "content": "ab"}])


def test_a_model_whose_chat_template_fails_answers_400s_and_serves_raw_prompts():
    """A broken template (a file's, or one a conversation trips) fails each chat request
    with a 400 in the API's own shape saying why (it was a 500 "internal error"), and
    the model still serves raw prompts."""
    import httpx

    from kvpool import LLM
    from tests.inprocess_server import InProcessServer

    llm = LLM(progress=False, kv_cache_memory=64 << 20)
    llm.loaded.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}"
    llm.loaded.tokenizer._template = None
    server = InProcessServer(llm)
    try:
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}
        r = httpx.post(f"{server.url}/api/chat", json=chat | {"stream": False}, timeout=60)
        assert r.status_code == 400 and "chat template failed" in r.json()["error"], r.text
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400, r.text
        assert "chat template failed" in r.json()["error"]["message"]
        body = {"model": "smollm2", "prompt": "Hi", "stream": False}
        r = httpx.post(f"{server.url}/api/generate", json=body, timeout=60)
        assert r.status_code == 400 and "chat template failed" in r.json()["error"], r.text
        raw = body | {"raw": True, "options": {"num_predict": 2}}
        r = httpx.post(f"{server.url}/api/generate", json=raw, timeout=60)
        assert r.status_code == 200 and r.json()["done"], r.text
    finally:
        server.stop()
