"""Model names to files: the default, a path, Ollama's local store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.model_store import ModelNotFound, ollama_blob_for, resolve_model_path


def make_store(root: Path, name: str, tag: str, blob_bytes: bytes, ns: str = "library") -> Path:
    digest = "sha256:" + "ab" * 32
    blob = root / "blobs" / digest.replace(":", "-")
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(blob_bytes)
    manifest = root / "manifests" / "registry.ollama.ai" / ns / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


def test_default_model_resolves(default_model_file):
    assert resolve_model_path(None) == default_model_file
    assert resolve_model_path("default") == default_model_file


def test_path_resolves(tmp_path: Path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model_path(str(f)) == f
    assert resolve_model_path(f) == f  # a Path as the Python API's users pass one


def test_ollama_store_resolves_like_ollama(tmp_path: Path, monkeypatch):
    blob = make_store(tmp_path, "tiny", "latest", b"GGUF...")
    other = make_store(tmp_path / "o", "tiny", "q4", b"GGUF", ns="someone")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    assert resolve_model_path("tiny") == blob
    assert resolve_model_path("tiny:latest") == blob
    assert ollama_blob_for("someone/tiny:q4", tmp_path / "o") == other
    assert ollama_blob_for("registry.ollama.ai/someone/tiny:q4", tmp_path / "o") == other
    with pytest.raises(ModelNotFound, match="never downloads"):
        resolve_model_path("tiny:7b")


def test_manifest_without_blob_is_a_clear_error(tmp_path: Path):
    blob = make_store(tmp_path, "gone", "latest", b"x")
    blob.unlink()
    with pytest.raises(ModelNotFound, match="missing blob"):
        ollama_blob_for("gone", tmp_path)
