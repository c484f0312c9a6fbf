"""Optional native ops, compiled on first use with torch's C++ extension loader.

``csrc/`` holds them, built into one module:

- ``paged_decode_attention`` computes decode attention straight from the paged KV store
  through the block tables: no gathered copy of the context and one op per layer instead
  of a dozen.
- ``add_rms_norm_`` (a residual add and the next RMSNorm) and ``rope_write_kv`` (rotary
  embedding of Q and K and the K/V writes into the store) fuse the small ops around a
  layer's matrix products, each several torch kernels with a fixed cost that dominates
  at one decoded token.
- ``quant_matmul`` multiplies by weights kept in GGUF's quantized blocks (integer
  products from int8-quantized activations, or float products from weights dequantized
  tile by tile), ``quant_dequantize`` dequantizes rows.
- ``argmax_rows``: each row's argmax as torch's gives it (greedy decoding's pick over a
  whole vocabulary, a few times faster than torch's reduction).
- ``DecodeLayers`` holds a model's layers and runs every layer of a decode step in one
  call: the ops above, called from C++ in the order and on the threads the Python loop
  uses (the same bits), without the loop's ten Python calls a layer (~1 ms of a 30-layer
  model's batch-1 step).

The kernels are compiled once per instruction set (``isa_*.cpp``: AVX-512 with AMX's
int8 tiles, AVX-512 with BF16, AVX-512 with VNNI, AVX2, aarch64 with its int8 dot
products, generic C++) into one module, and the fastest this CPU runs is chosen at run
time (``kernel_variants()`` lists them, fastest first; every op takes a ``variant`` to
force one, for tests and benchmarks).

It needs a C++ compiler and ninja (the ``ninja`` package, a runtime dependency, carries
one); the first build takes about 30 s and is cached (torch's extensions directory, one
build per sources, flags, CPU and torch install). Where it
cannot be built, or with ``KVPOOL_NATIVE=0``, the runtime uses its torch path, which
computes the same (tests compare the two).

``KVPOOL_EMULATE_AVX512=1`` builds another module, for tests: its AVX-512 variants are
compiled from SIMDe's intrinsics (the ``simde-py`` package's headers) under the AVX2
target and run on any CPU with AVX2, a few times slower than the real instructions, so
the AVX-512 code is tested on machines without AVX-512 (``tests/test_emulated_avx512.py``);
its AMX variant's tiles are plain C++ (``csrc/amx_emulation.h``), so the AMX code is
tested on machines without AMX. The runtime then counts them runnable and chooses them
like any other, but for the emulated tiles.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted([*_CSRC.glob("*.h"), *_CSRC.glob("*.inc")])
# No -march: the module is built for the architecture, and the kernels for each
# instruction set (isa_*.cpp) are chosen at run time by what the CPU has, so one build
# serves every CPU of the architecture (a home directory shared by two machines, an
# emulator). OpenMP from torch's own runtime where the compiler has it (libgomp.so.1 is
# already loaded by torch, so the extension binds to it: one thread pool, the same spin
# setting); see _openmp for where it does not.
# -ffp-contract=off: a multiply and an add are fused only where a kernel says so (an FMA
# intrinsic). GCC fuses them by its own choice otherwise (its default for GNU C++), and
# chose differently for a kernel's 4-row and 1-row forms: Q4_0's and Q5_0's offset terms
# were rounded once in one and twice in the other, and a row computed alone differed in
# its last bits from the same row in a batch (seen on an AVX-512 Xeon with GCC 13).
_FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off"]


def _openmp() -> bool:
    """Whether the native ops are built with OpenMP. Not on macOS: Apple's clang has no
    -fopenmp, so the build failed there and every step ran on torch's path; without
    OpenMP the ops share their work on a thread pool of their own (csrc/parallel.h) and
    compute the same.
    ``KVPOOL_NATIVE_OPENMP=0`` builds that way anywhere (tests; a compiler without
    OpenMP), ``=1`` insists on OpenMP."""
    setting = os.environ.get("KVPOOL_NATIVE_OPENMP")
    if setting in ("0", "1"):
        return setting == "1"
    return sys.platform != "darwin"


def emulating_avx512() -> bool:
    """Whether this process builds and runs the emulated AVX-512 variants (see above)."""
    return os.environ.get("KVPOOL_EMULATE_AVX512", "0") == "1"


def _flags(openmp: bool) -> list[str]:
    flags = [*_FLAGS, "-fopenmp"] if openmp else _FLAGS
    if not emulating_avx512():
        return flags
    import simde_py  # the dev extra's headers; only the emulation build needs them

    return [*flags, "-DKVP_SIMDE=1", f"-I{simde_py.get_include()}"]


def _build_directory(name: str) -> Path | None:
    """Where torch's loader builds ``name`` (it honours TORCH_EXTENSIONS_DIR)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except Exception:  # a private helper: if it moves, only the message and the copy go
        return None


def _staged_sources(build_dir: Path | None) -> list[Path]:
    """The sources, copied beside the build: the loader's build file names its sources'
    paths and rebuilds when they change, so the same sources in another checkout or
    virtual environment would be compiled again (silently, 30 s) without this."""
    if build_dir is None:
        return _SOURCES
    staged = []
    for path in [*_SOURCES, *_HEADERS]:  # headers beside them: the sources include them
        target = build_dir / "src" / path.name
        content = path.read_bytes()
        if not target.exists() or target.read_bytes() != content:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(content)
            os.replace(partial, target)  # atomic: a concurrent loader sees whole files
        staged.append(target)
    return staged[: len(_SOURCES)]


def _ninja_on_path() -> None:
    """Puts the ``ninja`` package's program on PATH where no other ninja is. torch's loader
    builds with ``ninja`` from PATH, and a fresh machine seldom has one: the package (a
    runtime dependency) installs it beside the virtual environment's other programs,
    which are on PATH only where that environment is activated (``.venv/bin/kvpool
    serve`` runs without that; without ninja the build failed and every step ran on
    torch's slower path)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:  # the failed build then says to install it
        return
    if shutil.which("ninja", path=ninja.BIN_DIR):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


# Why native_ops() returned None (one line), once it has.
_unavailable: list[str] = []


def unavailable_reason() -> str | None:
    """Why this process runs without the native ops (one line), or None where it has
    them or has not tried yet."""
    return _unavailable[0] if _unavailable else None


def _short_reason(exc: Exception) -> str:
    """The line of a failed build that says what went wrong (a compiler's first error, a
    missing program), not the build's whole log of commands."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for marker in ("not found", "error:", "Error", "No such file"):
        for line in lines:
            if marker in line and not line.startswith(("[", "FAILED:")) and len(line) < 400:
                return line
    return (lines[0] if lines else type(exc).__name__)[:300]


def _build_log(build_dir: Path | None, text: str) -> Path | None:
    """The failed build's whole message, kept beside its build (or None)."""
    if build_dir is None:
        return None
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        path = build_dir / "build-error.log"
        path.write_text(text)
        return path
    except OSError:
        return None


class _BuildFailed(Exception):
    def __init__(self, cause: Exception, build_dir: Path | None) -> None:
        super().__init__(str(cause))
        self.build_dir = build_dir


def _module_name(flags: list[str]) -> str:
    """One build per sources, flags, architecture and torch install (its headers' path is
    in the build file, and another torch needs its own build); not per CPU: the kernels
    are chosen at run time."""
    import torch

    key = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    key += " ".join(flags).encode() + platform.machine().encode()
    key += f"{torch.__version__} {Path(torch.__file__).parent}".encode()
    kind = "kvpool_native_emulated_" if emulating_avx512() else "kvpool_native_"
    return kind + hashlib.sha256(key).hexdigest()[:12]


@contextlib.contextmanager
def _building_alone(build_dir: Path | None) -> Iterator[None]:
    """Holds a lock on the build directory while torch's loader builds or loads there.
    The loader's own lock is a file whose existence is the lock: a build killed midway
    (Ctrl-C during the first start) left it, and every later start, a cached build's
    too, waited for it for ever without a word. This lock (flock) the system releases
    when its process ends; while this process holds it no other kvpool process is in
    the loader here, so a loader's lock file found is a leftover, and is removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    if build_dir is None:
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kvpool-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes or the process ends
        leftover = build_dir / "lock"
        if leftover.exists():
            print(
                f"kvpool: removing {leftover}, left by a build that did not finish",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            leftover.unlink(missing_ok=True)
        yield


def _build(openmp: bool) -> ModuleType:
    """The module built with or without OpenMP (torch's loader: compiled once, then
    loaded from its cache). Raises _BuildFailed."""
    build_dir = None
    try:
        from torch.utils.cpp_extension import load

        flags = _flags(openmp)
        name = _module_name(flags)
        build_dir = _build_directory(name)
        sources = _staged_sources(build_dir)
        _ninja_on_path()
        with _building_alone(build_dir):
            if build_dir is None or not (build_dir / f"{name}.so").exists():
                print("kvpool: compiling the native ops (once, ~30 s)...", file=sys.stderr)
            ops = load(
                name=name, sources=[str(path) for path in sources], extra_cflags=flags,
                extra_ldflags=["-fopenmp"] if openmp else [], verbose=False,
            )  # fmt: skip
    except Exception as exc:  # no compiler, no headers, an unsupported platform
        raise _BuildFailed(exc, build_dir) from exc
    ops.set_iq_grids(iq_grids())
    return ops


def iq_grids() -> list:
    """The grid formats' tables (ggml's iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid,
    iq3s_grid, iq1s_grid; IQ1_M shares IQ1_S's), as the gguf package decodes them: what
    the native module's ``set_iq_grids`` takes (uint8 rows of values; int8 for IQ1's -1,
    0, 1). The module's source holds no tables of its own: it takes (and converts) the
    ones the package's dequantizers read, which the tests compare the native ones with."""
    import numpy as np
    import torch
    from gguf import quants

    grids = []
    for kind in (quants.IQ2_XXS, quants.IQ2_XS, quants.IQ2_S, quants.IQ3_XXS, quants.IQ3_S):
        kind.init_grid()
        grids.append(torch.from_numpy(kind.grid.reshape(kind.grid_shape).astype(np.uint8)))
    quants.IQ1_S.init_grid()
    grid = quants.IQ1_S.grid.reshape(quants.IQ1_S.grid_shape)
    grids.append(torch.from_numpy(grid.astype(np.int8)))
    return grids


def _lacks_openmp(log: str) -> bool:
    """Whether a failed build's messages say the compiler has no OpenMP (no omp.h, no
    -fopenmp, no OpenMP library to link), not some other failure. Only the messages: the
    compile commands themselves all name -fopenmp."""
    for line in log.splitlines():
        if len(line) >= 400 or line.lstrip().startswith(("[", "FAILED:")):
            continue
        lower = line.lower()
        if ("error" in lower or "cannot find" in lower or "not found" in lower) and any(
            word in lower for word in ("omp.h", "openmp", "-lomp", "-lgomp", "-liomp")
        ):
            return True
    return False


def _openmp_failed_before() -> Path | None:
    """The log of an earlier OpenMP build of these sources that failed for want of
    OpenMP (so this process builds without it at once), or None."""
    try:
        build_dir = _build_directory(_module_name(_flags(True)))
    except Exception:
        return None
    log = build_dir / "build-error.log" if build_dir is not None else None
    try:
        return log if log is not None and _lacks_openmp(log.read_text()) else None
    except OSError:
        return None


@functools.cache
def native_ops() -> ModuleType | None:
    """The module of native ops, or None where it is disabled or cannot be built
    (``unavailable_reason`` then says why; a failed build warns once, in a few lines:
    its reason, where its log is, and what to install). A compiler without OpenMP (where
    KVPOOL_NATIVE_OPENMP does not insist on it) gets the build without it; the failed
    build's log, kept, makes later processes skip straight to that one."""
    _unavailable.clear()  # (a test may clear the cache and try again)
    if os.environ.get("KVPOOL_NATIVE", "1") == "0":
        _unavailable.append("disabled by KVPOOL_NATIVE=0")
        return None
    openmp = _openmp()
    may_fall_back = openmp and "KVPOOL_NATIVE_OPENMP" not in os.environ
    if may_fall_back and _openmp_failed_before() is not None:
        openmp = False
    try:
        try:
            return _build(openmp)
        except _BuildFailed as failed:
            if not (openmp and may_fall_back and _lacks_openmp(str(failed))):
                raise
            log = _build_log(failed.build_dir, str(failed))
            print(
                f"kvpool: the compiler has no OpenMP ({_short_reason(failed)}); building "
                "the native ops without it, on a thread pool of their own (once; remove "
                f"{log or 'the failed build'} after installing OpenMP to use it)",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            return _build(False)
    except _BuildFailed as failed:
        reason = _short_reason(failed)
        _unavailable.append(f"their build failed: {reason}")
        log = _build_log(failed.build_dir, str(failed))
        where = f"; the whole log: {log}" if log else ""
        advice = (
            "Without them only 4-bit matrices stay quantized (torch's int4 kernels, in "
            "bf16), the others are dequantized at load (2-4 times their memory), and "
            "every step runs on torch's slower path. Install a C++ compiler (g++; on macOS "
            "Xcode's command line tools) and start again: the build runs once."
        )
        warnings.warn(
            f"kvpool's native kernels did not build ({reason}{where}). {advice}", stacklevel=2
        )
        return None


# What each kernel variant needs of the CPU (kvpool.model.cpu's feature names).
VARIANT_NEEDS = {
    "avx512-amx": ("avx512", "avx512_vnni", "avx512_bf16", "amx"),
    "avx512-bf16": ("avx512", "avx512_vnni", "avx512_bf16"),
    "avx512-vnni": ("avx512", "avx512_vnni"),
    "avx2": ("avx2",),
    "aarch64-dotprod": ("dotprod",),
    "generic": (),
}


def loaded_native_ops() -> ModuleType | None:
    """The native ops where this process has them already, never building them: for
    helpers that only speed up what torch also does (a GPU machine's runtime never
    loads them, and a build there would stall a step for tens of seconds)."""
    return native_ops() if native_ops.cache_info().currsize else None


@functools.cache
def kernel_variant() -> str:
    """The kernel variant the runtime uses: the fastest the module runs on this CPU
    whose needs the CPU's features meet (``KVPOOL_CPU_FEATURES`` narrows those, so a
    lesser CPU's choice can be exercised on any machine); "" without native ops."""
    from kvpool.model.cpu import cpu_features

    ops = native_ops()
    if ops is None:
        return ""
    if emulating_avx512():  # every variant the module lists runs, the CPU's or emulated,
        # AMX's tiles in plain C++ (for the kernels' tests: the runtime takes the next)
        return next(v for v in ops.kernel_variants() if v != "avx512-amx")
    cpu = cpu_features()
    for name in ops.kernel_variants():
        if all(getattr(cpu, need) for need in VARIANT_NEEDS.get(name, ("unknown",))):
            return name
    return "generic"


def paged_decode_attention() -> Callable | None:
    """The native decode attention op, or None (see ``native_ops``)."""
    ops = native_ops()
    return None if ops is None else ops.paged_decode_attention
