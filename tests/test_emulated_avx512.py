"""The AVX-512 kernels' tests, run on CPUs without AVX-512 under emulation.

This project's machines (CI's included) are drawn from several CPU kinds. On one with AVX2
alone the AVX-512 variants' tests skip, so the code that users' AVX-512 CPUs run would go
untested there. This test runs them in a child process whose native module is built
with ``KVPOOL_EMULATE_AVX512=1``: the same kernel sources, each AVX-512 intrinsic SIMDe's
sequence of AVX2 ones (``kvpool.model.native``, ``csrc/simd_emulation.h``), and asserts
that every one of them ran and passed. Where the CPU has AVX-512 they run natively in
the suite itself, and this test skips.

AMX's kernels likewise: the emulation build's avx512-amx variant has its tiles in plain
C++ (``csrc/amx_emulation.h``), and its cases run emulated on every CPU without AMX
(AVX-512 ones included), natively on AMX CPUs.

What emulation cannot show: speed, and instructions whose rounding SIMDe composes
differently from the hardware (none of the kernels' tests has told them apart so far;
their assertions are against references and between variants, bit for bit where the
kernels promise it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvpool.model.cpu import cpu_features

ROOT = Path(__file__).resolve().parent.parent
# The test files whose tests take a kernel variant (their AVX-512 cases carry "avx512" in
# their ids), and how many AVX-512 cases they held when this was written: fewer ran means
# the selection or the emulation broke, not that the kernels pass.
KERNEL_TESTS = [
    "tests/test_quant_products.py",
    "tests/test_kv_dtype.py",
    "tests/test_native_ops.py",
    "tests/test_sliding_window.py",
]
AT_LEAST = 460  # 468 at the forty-second session (AMX's cases apart)
AT_LEAST_AMX = 120  # AMX's cases in the same files at the forty-fourth session
# Whole-model tests, each on the kernels the runtime chooses (~100 s emulated, 2 cores).
MODEL_TESTS = [
    "tests/test_model_reference.py::test_logits_match_reference",
    "tests/test_model_reference.py::test_greedy_tokens_match_reference_alone",
    "tests/test_model_reference.py::test_batch_of_mixed_lengths_matches_alone",
    "tests/test_native_ops.py::test_bf16_steps_are_as_close_to_fp32_as_the_unfused_ones",
]


def _why_not(amx: bool = False) -> str | None:
    """Why the AVX-512 kernels' tests (``amx``: AMX's) are not run emulated here."""
    from kvpool.model.native import native_ops

    cpu = cpu_features()
    if os.environ.get("KVPOOL_NATIVE", "1") == "0":
        return "the native ops are disabled here (KVPOOL_NATIVE=0)"
    if amx:
        ops = native_ops()
        if ops is not None and "avx512-amx" in ops.kernel_variants():
            return "this CPU runs the AMX kernels' tests natively"
    elif cpu.avx512 and cpu.avx512_vnni and cpu.avx512_bf16:
        return "this CPU runs the AVX-512 kernels' tests natively"
    if not cpu.avx2:
        return f"the emulation composes AVX-512 from AVX2, which this CPU lacks ({cpu.summary()})"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler here"
    try:
        import simde_py  # noqa: F401
    except ImportError:
        return "simde-py (the dev extra's SIMDe headers) is not installed"
    return None


def _emulated(args: list[str], timeout: float = 3000, amx: bool = False) -> tuple[int, str, str]:
    """Runs ``python args`` in a child with the emulated AVX-512 variants: return code,
    the last line of its output, its last 40 lines."""
    reason = _why_not(amx)
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "KVPOOL_EMULATE_AVX512": "1"}
    env.pop("KVPOOL_CPU_FEATURES", None)
    run = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    lines = run.stdout.strip().splitlines() or [""]
    return run.returncode, lines[-1], "\n".join((run.stdout + run.stderr).splitlines()[-40:])


def _pytest(args: list[str]) -> list[str]:
    return ["-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def test_the_avx512_kernels_pass_their_tests_under_emulation():
    """Every AVX-512 case but AMX's (the next test's, which also run on AVX-512 CPUs)."""
    rc, summary, tail = _emulated(_pytest(["-k", "avx512 and not amx", *KERNEL_TESTS]))
    assert rc == 0, f"the emulated AVX-512 kernels failed their tests:\n{tail}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= AT_LEAST, f"too few ran:\n{tail}"
    assert not re.search(r"\d+ (skipped|xfailed|failed|error)", summary), tail


def test_the_amx_kernels_pass_their_tests_under_emulation():
    """AMX's cases, its tiles emulated (bit for bit against the dot instructions, and
    the rest of each test), on any CPU without AMX: its code would otherwise run only on
    the AMX machines this project draws now and then."""
    rc, summary, tail = _emulated(_pytest(["-k", "amx", *KERNEL_TESTS]), amx=True)
    assert rc == 0, f"the emulated AMX kernels failed their tests:\n{tail}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= AT_LEAST_AMX, f"too few ran:\n{tail}"
    assert not re.search(r"\d+ (skipped|xfailed|failed|error)", summary), tail


def test_the_default_model_on_the_emulated_avx512_kernels():
    """A whole model on them: float32's logits and greedy tokens against transformers',
    bf16 steps against float32 (each model loaded as the runtime chooses, so with the
    emulated AVX-512 BF16 kernels)."""
    code = "from kvpool.model.native import kernel_variant; print(kernel_variant())"
    rc, chosen, tail = _emulated(["-c", code])
    assert rc == 0 and chosen == "avx512-bf16", tail
    rc, summary, tail = _emulated(_pytest(MODEL_TESTS))
    assert rc == 0, f"the default model failed on the emulated AVX-512 kernels:\n{tail}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) == len(MODEL_TESTS), tail
    assert not re.search(r"\d+ (skipped|xfailed|failed|error)", summary), tail
