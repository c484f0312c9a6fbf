"""The runtime's choices follow the CPU at hand: each fast path is on exactly where the
CPU has what it needs (the tests of the paths themselves skip elsewhere), and the default
dtype is the fast one for this CPU. ``KVPOOL_CPU_FEATURES`` narrows the features, so the
choices of a lesser CPU are checked on any machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvpool.model.cpu import CpuFeatures, cpu_features  # noqa: E402


def test_features_agree_with_torch_and_with_each_other():
    cpu = cpu_features()
    assert cpu.arch
    assert cpu.avx2 == bool(torch.cpu._is_avx2_supported())
    assert cpu.avx512 == bool(torch.cpu._is_avx512_supported())
    if cpu.avx512_vnni or cpu.avx512_bf16:
        assert cpu.avx512
    if cpu.arch not in ("x86_64", "AMD64"):
        assert not (cpu.avx2 or cpu.avx512)
    assert cpu.model in cpu.summary()


def _choices(env_features: str | None) -> dict:
    """The choices a fresh process makes for the default model forced to bf16, and its
    default dtype (features narrowed)."""
    code = (
        "import json\n"
        "from kvpool.model.cpu import cpu_features\n"
        "from kvpool.model.loader import choose_device, choose_dtype, load_model\n"
        "loaded = load_model(None, dtype='bfloat16', progress=False)\n"
        "m = loaded.model\n"
        "print(json.dumps({'features': cpu_features().__dict__, 'dtype': str(m.dtype),\n"
        "  'default_dtype': str(choose_dtype(None, choose_device())),\n"
        "  'prepacked': m.layers[0].qkv.packed is not None,\n"
        "  'int4': m.layers[0].down.int4 is not None, 'q8_head': m.q8_head is not None}))\n"
    )
    env = dict(os.environ)
    if env_features is not None:
        env["KVPOOL_CPU_FEATURES"] = env_features
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected(features: dict) -> dict:
    bf16 = features["bf16_products"]
    return {
        "default_dtype": "torch.bfloat16" if bf16 else "torch.float32",
        "prepacked": bf16,
        "int4": bf16,  # the default model's FFN down weights are Q4_1
        "q8_head": bf16,  # its tied embedding is Q8_0 (and the native ops are built)
    }


@pytest.mark.parametrize("narrowed", [None, "avx2", "none"])
def test_choices_follow_the_cpu(narrowed):
    got = _choices(narrowed)
    cpu = CpuFeatures(**got["features"])
    if narrowed is not None:
        kept = set(narrowed.split(","))
        assert not any(getattr(cpu, n) for n in ("avx512", "avx512_bf16", "amx") if n not in kept)
        assert not cpu.bf16_products
    want = _expected(got["features"])
    from kvpool.model.native import native_ops

    if native_ops() is None:
        want["q8_head"] = False
    assert {k: got[k] for k in want} == want
