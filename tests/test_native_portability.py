"""The native ops compile for the CPUs and systems this machine is not: 64-bit ARM
(aarch64: Graviton, Ampere, Apple silicon under Linux), macOS on Apple silicon (without
OpenMP: Apple's clang has none, so the ops share their work on csrc/parallel.h's own
pool), and x86-64 with clang instead of GCC.

Every source in ``kvpool/model/csrc`` is cross-compiled with zig's clang (the ``ziglang``
package, in the dev extra), against this torch's headers. On aarch64 the x86 variants
(``isa_avx2.cpp``, ``isa_avx512_*.cpp``) must compile to accessors that return null
(``isa_variant.inc``'s guard) and the generic kernels carry the module; clang on x86-64
takes the variants' other pragma (``clang attribute push``). A source that used an x86
intrinsic outside that guard, or a GCC-only construct, would fail here, where on such a
machine it would only print a warning and leave the runtime on its slower torch path.

Compile only (no link, no run): what runs there is tested by the suite on such a CPU;
``KVPOOL_CPU_FEATURES=none`` runs the suite here with the generic kernels chosen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ziglang", reason="zig's clang (the ziglang package, dev extra) cross-compiles")

CSRC = Path(__file__).resolve().parents[1] / "kvpool" / "model" / "csrc"


def _omp_include(into: Path) -> str | None:
    """A directory holding a copy of GCC's omp.h and nothing else (zig ships no OpenMP
    header; libgomp's declarations are the same on every architecture, and GCC's other
    headers there would shadow libc++'s)."""
    try:
        out = subprocess.run(
            ["c++", "-print-file-name=include"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    header = Path(out.stdout.strip()) / "omp.h"
    if not header.exists():
        return None
    into.mkdir()
    shutil.copy(header, into / "omp.h")
    return str(into)


def _compile(source: Path, target: str, omp: str | None, out_dir: Path) -> tuple[str, int, str]:
    include = Path(torch.__file__).parent / "include"
    # std, OpenMP and floating-point flags as kvpool.model.native builds with (torch's
    # loader adds -std=c++20); -O0: every intrinsic and target attribute is still checked
    openmp = ["-fopenmp", f"-I{omp}"] if omp else []
    cmd = [
        sys.executable, "-m", "ziglang", "c++", "-target", target, "-std=c++20", "-O0",
        *openmp, "-ffp-contract=off", "-fno-math-errno", "-Wno-ignored-attributes",
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}", "-DTORCH_EXTENSION_NAME=kvpool_cross",
        "-c", str(source), "-o", str(out_dir / f"{source.stem}.o"),
    ]  # fmt: skip
    env = dict(os.environ, ZIG_GLOBAL_CACHE_DIR=str(out_dir / "zig-cache"))
    env["ZIG_LOCAL_CACHE_DIR"] = env["ZIG_GLOBAL_CACHE_DIR"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return source.name, done.returncode, done.stderr


@pytest.mark.parametrize("target", ["aarch64-linux-gnu", "x86_64-linux-gnu", "aarch64-macos"])
def test_every_native_source_compiles_for(target, tmp_path):
    omp = None
    if "linux" in target:
        omp = _omp_include(tmp_path / "omp")
        if omp is None:
            pytest.skip("no GCC omp.h to compile the OpenMP sources against")
    sources = sorted(CSRC.glob("*.cpp"))
    assert len(sources) >= 10  # the module's sources, not an empty glob
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda s: _compile(s, target, omp, tmp_path), sources))
    failed = {name: err[-3000:] for name, rc, err in results if rc != 0}
    assert not failed, f"sources that do not compile for {target}: {failed}"
    for source in sources:
        assert (tmp_path / f"{source.stem}.o").stat().st_size > 0
