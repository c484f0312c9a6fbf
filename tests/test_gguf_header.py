"""The standard-library GGUF header reader, checked against the ``gguf`` package."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvpool.formats.gguf_header import GGML_TYPES, GGUFFormatError, read_gguf_header
from kvpool.model_store import default_model_path
from kvpool.sim import model_from_gguf, resolve_model

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return default_model_path()


def test_type_table_matches_ggml():
    for type_id, (name, block, size) in GGML_TYPES.items():
        quant = gguf.GGMLQuantizationType(type_id)
        assert quant.name == name
        assert gguf.GGML_QUANT_SIZES[quant] == (block, size)


def test_header_matches_the_gguf_package(smollm2: Path):
    ours = read_gguf_header(smollm2)
    ref = gguf.GGUFReader(smollm2)
    assert ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.name == theirs.name
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.ggml_type == int(theirs.tensor_type)
        assert ours.data_offset + mine.offset == theirs.data_offset
        assert mine.num_bytes == int(theirs.n_bytes)
    assert ours.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
    assert ours.metadata["llama.rope.freq_base"] == pytest.approx(100000.0)
    assert ours.metadata["tokenizer.chat_template"].startswith("{% for message in messages %}")


def test_default_model_geometry(smollm2: Path):
    m = model_from_gguf(smollm2)
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.context_length) == (30, 3, 64, 8192)
    assert m.weight_bytes("fp16") == 96_576_768  # the file's real size, whatever is asked
    assert resolve_model(str(smollm2)).num_parameters == m.num_parameters == 134_515_008


def test_not_a_gguf_file(tmp_path: Path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + struct.pack("<I", 3))
    with pytest.raises(GGUFFormatError, match="bad magic"):
        read_gguf_header(bad)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1))
    with pytest.raises(GGUFFormatError):
        read_gguf_header(truncated)
