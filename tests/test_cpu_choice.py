"""The runtime's choices follow the CPU at hand: each fast path is on exactly where the
CPU has what it needs (the tests of the paths themselves skip elsewhere), and the default
dtype is the fast one for this CPU. ``KVPOOL_CPU_FEATURES`` narrows the features, so the
choices of a lesser CPU are checked on any machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvpool.model.cpu import CpuFeatures, cpu_features  # noqa: E402


def _narrowed() -> None:
    """Skips a test of the CPU's own features where KVPOOL_CPU_FEATURES narrows them (the
    suite then runs as on a lesser CPU, whose features these tests cannot see)."""
    if os.environ.get("KVPOOL_CPU_FEATURES") is not None:
        pytest.skip("KVPOOL_CPU_FEATURES narrows the features: this test reads the CPU's own")


def test_features_agree_with_torch_and_with_each_other():
    _narrowed()
    cpu = cpu_features()
    assert cpu.arch
    assert cpu.avx2 == bool(torch.cpu._is_avx2_supported())
    assert cpu.avx512 == bool(torch.cpu._is_avx512_supported())
    if cpu.avx512_vnni or cpu.avx512_bf16:
        assert cpu.avx512
    if cpu.arch not in ("x86_64", "AMD64"):
        assert not (cpu.avx2 or cpu.avx512)
    if cpu.arch not in ("aarch64", "arm64"):
        assert not cpu.dotprod
    assert cpu.model in cpu.summary()


def _choices(env_features: str | None) -> dict:
    """The choices a fresh process makes for the default model (features narrowed)."""
    code = (
        "import json\n"
        "from kvpool.model.cpu import cpu_features\n"
        "from kvpool.model.loader import choose_device, choose_dtype, load_model\n"
        "from kvpool.model.native import kernel_variant\n"
        "from kvpool.model.products import QuantLinear\n"
        "loaded = load_model(None, progress=False)\n"
        "m = loaded.model\n"
        "print(json.dumps({'features': cpu_features().__dict__, 'dtype': str(m.dtype),\n"
        "  'seconds': loaded.dtype_seconds, 'line': loaded.compute_line(),\n"
        "  'variant': kernel_variant(), 'quantized': isinstance(m.layers[0].qkv, QuantLinear),\n"
        "  'policy_variant': m.products.variant, 'exact': m.products.exact,\n"
        "  'one_row': m.products.one_row, 'one_row_ms': m.products.one_row_ms,\n"
        "  'far_ahead': m.products.far_ahead, 'ahead_ms': m.products.ahead_ms}))\n"
    )
    env = dict(os.environ)
    if env_features is not None:
        env["KVPOOL_CPU_FEATURES"] = env_features
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best_variant(cpu: CpuFeatures) -> str:
    """The kernels a CPU with these features should get."""
    if cpu.avx512 and cpu.avx512_vnni and cpu.avx512_bf16:
        return "avx512-amx" if cpu.amx else "avx512-bf16"
    if cpu.avx512 and cpu.avx512_vnni:
        return "avx512-vnni"
    if cpu.dotprod:
        return "aarch64-dotprod"
    return "avx2" if cpu.avx2 else "generic"


@pytest.mark.parametrize(
    "narrowed", [None, "avx2,avx512,avx512_vnni,avx512_bf16,bf16_products", "avx2", "none"]
)
def test_choices_follow_the_cpu(narrowed):
    from kvpool.model.native import emulating_avx512, native_ops

    if emulating_avx512():
        pytest.skip("under emulation the runtime takes the emulated AVX-512 kernels anywhere")
    got = _choices(narrowed)
    cpu = CpuFeatures(**got["features"])
    if narrowed is not None:
        kept = set(narrowed.split(","))
        assert not any(getattr(cpu, n) for n in ("avx512", "avx512_bf16", "amx") if n not in kept)
        assert not cpu.bf16_products or "avx512_bf16" in kept
    if native_ops() is None:
        assert got["dtype"] == ("torch.bfloat16" if cpu.bf16_products else "torch.float32")
        assert not got["quantized"] and got["variant"] == ""
        return
    assert got["quantized"] and not got["exact"]  # the default: weights in their blocks
    assert got["variant"] == got["policy_variant"] == _best_variant(cpu)
    # dtype=None: measured, bf16 unless float32 decodes clearly faster (bf16 halves the KV)
    from kvpool.model.loader import BF16_MARGIN

    seconds = got["seconds"]
    fp32_faster = seconds["float32"] < seconds["bfloat16"] / BF16_MARGIN
    assert got["dtype"] == ("torch.float32" if fp32_faster else "torch.bfloat16")
    assert "measured" in got["line"] and got["variant"] in got["line"]
    # a single row's packed kernel: measured where the variant has two (AVX-512's)
    from kvpool.model.products import ONE_ROW_NARROW, ONE_ROW_OWN, ONE_ROW_WIDE

    if got["variant"].startswith("avx512"):
        wide, narrow = got["one_row_ms"]
        assert got["one_row"] == (ONE_ROW_WIDE if wide <= narrow else ONE_ROW_NARROW)
        assert f"batch-1 products {wide:.1f} ms in 512-bit" in got["line"]
    else:
        assert got["one_row"] == ONE_ROW_OWN and got["one_row_ms"] is None
    # how far ahead passes of few rows ask for their weights: measured where they ask (x86)
    if got["variant"].startswith(("avx512", "avx2")):
        near, far = got["ahead_ms"]
        assert got["far_ahead"] == (far < near)
        assert f"KiB ahead (batch-1 products {near:.1f} ms at 2 KiB" in got["line"]
    else:
        assert not got["far_ahead"] and got["ahead_ms"] is None


def test_the_module_runs_what_the_cpu_has():
    """The native module's own CPUID checks agree with torch's cpuinfo."""
    from kvpool.model.native import emulating_avx512, native_ops

    _narrowed()
    ops = native_ops()
    if ops is None:
        pytest.skip("native ops not built here")
    cpu = cpu_features()
    variants = ops.kernel_variants()
    assert variants[-1] == "generic"
    assert ("avx2" in variants) == cpu.avx2
    assert ("aarch64-dotprod" in variants) == cpu.dotprod
    if emulating_avx512():  # the AVX-512 variants are SIMDe's, run on AVX2
        assert ("avx512-bf16" in variants) == ("avx512-vnni" in variants) == cpu.avx2
        assert ("avx512-amx" in variants) == cpu.avx2  # its tiles amx_emulation.h's
        return
    assert ("avx512-vnni" in variants) == (cpu.avx512 and cpu.avx512_vnni)
    assert ("avx512-bf16" in variants) == (cpu.avx512 and cpu.avx512_vnni and cpu.avx512_bf16)
    # AMX: the tiles' CPUID bits and Linux's permission for the process to use them, where
    # the compiler had the tiles' intrinsics (GCC 11, clang 12: an older one builds the rest)
    built = ops.kernel_variants(built=True)
    assert [v for v in built if v in variants] == variants  # the same order
    assert ("avx512-amx" in variants) == (
        "avx512-bf16" in variants and cpu.amx and "avx512-amx" in built
    )


def test_the_native_ops_build_where_a_compiler_is():
    """Where the native ops are not disabled and a C++ compiler is present, they build:
    the tests of every kernel skip without them, so a compile error (in any variant, the
    AVX-512 ones included: every variant is compiled on every x86-64 CPU) would
    otherwise pass as skips."""
    import shutil

    from kvpool.model.native import native_ops

    if os.environ.get("KVPOOL_NATIVE", "1") == "0":
        pytest.skip("the native ops are disabled here (KVPOOL_NATIVE=0)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    assert native_ops() is not None, "the native ops did not build: see the warning"


def test_without_native_kernels_the_load_says_why_and_what_to_do(tmp_path):
    """A machine without a C++ compiler (a slim container) cannot build the native ops:
    the load still serves, on torch's path, and says so in a few lines, not the build's
    log of commands: the failing line, where the whole log is, what it costs (weights
    dequantized) and what to install; the compute line names the reason too."""
    code = (
        "from kvpool.model.loader import load_model\n"
        "print(load_model(None, progress=False).compute_line())\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("KVPOOL_NATIVE", None)
    env.pop("KVPOOL_EMULATE_AVX512", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    (warning,) = [line for line in out.stderr.splitlines() if "did not build" in line]
    assert "no-such-c++" in warning and "not found" in warning and "g++" in warning
    assert "dequantized at load" in warning and len(warning) < 800
    log = warning.split("the whole log: ")[1].split(")")[0]
    assert "no-such-c++" in Path(log).read_text()  # the build's whole message, kept
    line = out.stdout.strip().splitlines()[-1]
    assert "no native kernels (their build failed:" in line and "dequantized" in line

    env["KVPOOL_NATIVE"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert "disabled by KVPOOL_NATIVE=0" in out.stdout and "did not build" not in out.stderr


def test_the_build_finds_ninja_where_the_environment_is_not_activated(monkeypatch, tmp_path):
    """torch's loader builds with ``ninja`` from PATH. A fresh machine seldom has one,
    and the ``ninja`` package's program is on PATH only where its virtual environment is
    activated (``.venv/bin/kvpool serve`` is not): the build must still find it (it
    failed there, and every step ran on torch's slower path)."""
    ninja = pytest.importorskip("ninja")
    from torch.utils.cpp_extension import verify_ninja_availability

    from kvpool.model import native

    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja on it
    with pytest.raises(RuntimeError, match="Ninja is required"):
        verify_ninja_availability()
    native._ninja_on_path()
    verify_ninja_availability()
    assert Path(ninja.BIN_DIR) in [Path(d) for d in os.environ["PATH"].split(os.pathsep)]


def test_a_build_killed_midway_does_not_stop_later_starts(tmp_path):
    """torch's loader locks a build directory with a file whose existence is the lock; a
    build killed midway (Ctrl-C during the first start) left it, and every later start
    waited for it for ever. kvpool's own lock (flock, released with its process) makes
    such a file a known leftover: the next start removes it and loads."""
    from kvpool.model import native

    if native.native_ops() is None:
        pytest.skip(f"no native ops here: {native.unavailable_reason()}")
    build_dir = native._build_directory(native._module_name(native._flags(native._openmp())))
    assert build_dir is not None and build_dir.is_dir()
    leftover = build_dir / "lock"
    leftover.touch()
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from kvpool.model import native; assert native.native_ops()"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        existed = leftover.exists()
        leftover.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not existed and "left by a build that did not finish" in done.stderr


def _timings(*values: float):
    """A probe returning these times in turn, counting its calls."""
    it = iter(values)

    def probe() -> float:
        probe.calls += 1  # type: ignore[attr-defined]
        return next(it)

    probe.calls = 0  # type: ignore[attr-defined]
    return probe


def test_the_dtype_measure_meets_each_phase_alike():
    """The dtype is decided by decode steps alternating one by one, each dtype's median
    (the first round uncounted): a fast moment that falls on one dtype's step, or a
    slow one, does not decide it; a CPU where bf16 is 3x slower (no bf16 products) is
    clear after a few rounds; a close pair runs every round."""
    from kvpool.model.loader import (
        BF16_MARGIN,
        DTYPE_CLEAR_AFTER,
        DTYPE_ROUNDS,
        median_of_alternating,
    )

    n = DTYPE_ROUNDS + 1
    # bf16 1.0 a step, float32 1.03; float32 hits two fast moments (0.8), bf16 a slow one
    bf16 = _timings(*([5.0, 1.0, 1.5] + [1.0] * n))
    fp32 = _timings(*([5.0, 0.8, 0.8] + [1.03] * n))
    times = median_of_alternating({"bf16": bf16, "fp32": fp32})
    assert times == {"bf16": 1.0, "fp32": 1.03}
    assert not times["fp32"] < times["bf16"] / BF16_MARGIN  # bf16 kept
    assert bf16.calls == fp32.calls == n  # close: every round

    bf16, fp32 = _timings(*[3.0] * n), _timings(*[1.0] * n)
    assert median_of_alternating({"bf16": bf16, "fp32": fp32}) == {"bf16": 3.0, "fp32": 1.0}
    assert bf16.calls == fp32.calls == DTYPE_CLEAR_AFTER + 1


def test_the_cpu_is_named_on_aarch64_too():
    """Benchmarks name the CPU their figures come from. aarch64 Linux's /proc/cpuinfo has
    no model name, only the implementer and part numbers: Arm's own cores are named by
    them, others by the numbers; x86's model name is taken as it is."""
    from kvpool.model.cpu import model_name_from

    graviton2 = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd asimddp\n"
    graviton2 += "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: 0xd0c\n\n" * 2
    assert model_name_from(graviton2) == "Neoverse-N1"
    other = "CPU implementer\t: 0xc0\nCPU part\t: 0xac3\n"
    assert model_name_from(other) == "Arm implementer 0xc0 part 0xac3"
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    assert model_name_from(x86) == "AMD EPYC"
    assert model_name_from("processor\t: 0\n") is None
