"""Optional native kernels, compiled on first use with torch's C++ extension loader.

``paged_decode_attention`` (``csrc/paged_decode_attention.cpp``) computes decode
attention straight from the paged KV store through the block tables: no gathered copy of
the context and one op per layer instead of a dozen. It needs a C++ compiler; the first
build takes about 25 s and is cached (torch's extensions directory, one build per source,
flags and CPU). Where it cannot be built, or with ``KVPOOL_NATIVE=0``, the runtime uses
its torch path, which computes the same attention (tests compare the two).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"
# OpenMP from torch's own runtime (libgomp.so.1 is already loaded by torch, so the
# extension binds to it: one thread pool, the same spin setting).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def _built(name: str) -> bool:
    """Whether torch's loader has a build of ``name`` (it honours TORCH_EXTENSIONS_DIR)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a private helper: if it moves, only the message is affected
        return False


@functools.cache
def paged_decode_attention() -> Callable | None:
    """The native op, or None where it is disabled or cannot be built."""
    if os.environ.get("KVPOOL_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        key = _SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_signature().encode()
        name = "kvpool_paged_attention_" + hashlib.sha256(key).hexdigest()[:12]
        if not _built(name):
            print("kvpool: compiling the native decode attention kernel (once, ~25 s)...",
                  file=sys.stderr, flush=True)  # fmt: skip
        module = load(
            name=name, sources=[str(_SOURCE)], extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"], verbose=False,
        )  # fmt: skip
        return module.paged_decode_attention
    except Exception as exc:  # no compiler, no headers, an unsupported platform
        warnings.warn(
            f"native decode attention unavailable, using the torch path: {exc}", stacklevel=2
        )
        return None
