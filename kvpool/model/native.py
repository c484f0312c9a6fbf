"""Optional native ops, compiled on first use with torch's C++ extension loader.

``csrc/`` holds them, built into one module:

- ``paged_decode_attention`` computes decode attention straight from the paged KV store
  through the block tables: no gathered copy of the context and one op per layer instead
  of a dozen.
- ``add_rms_norm_`` (a residual add and the next RMSNorm) and ``rope_write_kv`` (rotary
  embedding of Q and K and the K/V writes into the store) fuse the small ops around a
  layer's matrix products, each several torch kernels with a fixed cost that dominates
  at one decoded token.

It needs a C++ compiler; the first build takes about 30 s and is cached (torch's
extensions directory, one build per sources, flags and CPU). Where it cannot be built, or
with ``KVPOOL_NATIVE=0``, the runtime uses its torch path, which computes the same
(tests compare the two).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))
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
def native_ops() -> ModuleType | None:
    """The module of native ops, or None where it is disabled or cannot be built."""
    if os.environ.get("KVPOOL_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        key = b"".join(path.read_bytes() for path in _SOURCES)
        key += " ".join(_FLAGS).encode() + _cpu_signature().encode()
        name = "kvpool_native_" + hashlib.sha256(key).hexdigest()[:12]
        if not _built(name):
            print("kvpool: compiling the native ops (once, ~30 s)...", file=sys.stderr, flush=True)
        return load(
            name=name, sources=[str(path) for path in _SOURCES], extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"], verbose=False,
        )  # fmt: skip
    except Exception as exc:  # no compiler, no headers, an unsupported platform
        warnings.warn(f"native ops unavailable, using the torch path: {exc}", stacklevel=2)
        return None


def paged_decode_attention() -> Callable | None:
    """The native decode attention op, or None (see ``native_ops``)."""
    ops = native_ops()
    return None if ops is None else ops.paged_decode_attention
