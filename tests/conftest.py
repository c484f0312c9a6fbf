"""Shared fixtures: the default model, loaded once per session, and its reference."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Tests run servers and clients side by side on few cores: OpenMP workers that never spin
# cost the least there (set before torch is imported anywhere; kvpool then keeps it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# What loads measured (kvpool.model.measured) is kept in a store of the test run's own,
# shared by its processes: no test reads or writes the user's.
_store = tempfile.mkdtemp(prefix="kvpool-tests-measured-")
os.environ["KVPOOL_CACHE_DIR"] = _store
atexit.register(shutil.rmtree, _store, ignore_errors=True)


@pytest.fixture(scope="session")
def default_model_file():
    from kvpool.model_store import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def fp32_model(default_model_file):
    """The default model as the CPU runtime holds it (weights in their GGUF blocks where
    the native ops are built), float32 with float products: the exact path."""
    torch = pytest.importorskip("torch")
    from kvpool.model.gguf_weights import load_gguf_weights
    from kvpool.model.llama import LlamaModel
    from kvpool.model.native import native_ops

    quantized = native_ops() is not None
    config, weights = load_gguf_weights(default_model_file, quantized=quantized)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    model.source_path = default_model_file  # as load_model sets it (a disk KV tier's key)
    return model


@pytest.fixture(scope="session")
def default_tokenizer(default_model_file):
    from kvpool.formats.gguf_header import read_gguf_header
    from kvpool.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf_header(default_model_file))


@pytest.fixture(scope="session")
def reference_model(default_model_file):
    """transformers loading the same GGUF file, fp32: the reference for exact tests."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_file.parent, gguf_file=default_model_file.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def fp32_server():
    """A ``kvpool serve`` child at fp32 (64 MiB of KV) shared by the tests of the routes
    that do not change server state (logprobs, embeddings)."""
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from tests.server_process import ServerProcess

    proc = ServerProcess("--kv-cache-memory", "64")
    yield proc
    assert proc.stop() == 0, proc.logs()
