"""Quantized products, this tree's native kernels beside another tree's, in one process
(``kvpool bench products --base DIR``).

What a kernel change is worth. Two builds timed in separate processes each meet a
different moment of a virtual machine whose speed moves by up to 1.4x within minutes
(docs/performance.md, forty-ninth session), and their ratio carries that. Here both
builds' native modules are loaded side by side (``DIR``: another kvpool source tree, e.g.
a ``git worktree`` of the commit before the change; its native ops are built there as
usual, in a subprocess, and cached by their sources' hash), and each measurement calls
them alternately on the same weights and activations: the fastest of ``calls`` calls of
each counts. Every line also says whether the two builds' outputs are equal bit for bit.

Weights: random blocks (``random_blocks``) of a 1B-class model's two product shapes,
8192 x 2048 and 2048 x 8192 (an MLP's up and down), in the packed layout where the
kernel variant packs the format; int8 products (the kernels for many rows allowed,
``GROUPED``). Figures: ms a product (the mean of the two shapes). The weights are packed
by this tree's ops, so a change of the packed layout itself is not compared this way.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from kvpool.bench.random_blocks import TYPES, random_blocks
from kvpool.model.gguf_weights import PACKED
from kvpool.model.products import GROUPED, INT8

MODE = INT8 | GROUPED  # int8 products, the kernels for many rows allowed
SHAPES = ((8192, 2048), (2048, 8192))  # (rows, cols): a 1B-class MLP's up and down
DEFAULT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
DEFAULT_ROWS = (1, 8, 32)
_PRINT_MODULE = (
    "from kvpool.model.native import native_ops; ops = native_ops(); print(ops.__file__)"
)


def native_module_file(tree: Path) -> Path:
    """The native module of the kvpool sources under ``tree`` (built there first if its
    sources' build is not cached): a subprocess imports that tree's ``kvpool``."""
    if not (tree / "kvpool" / "model" / "native.py").is_file():
        raise ValueError(f"{tree} holds no kvpool source tree (kvpool/model/native.py)")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", _PRINT_MODULE], env=env, cwd=tree, capture_output=True, text=True
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].endswith((".so", ".pyd")):
        raise RuntimeError(f"{tree}: its native ops did not build or load:\n{done.stderr}")
    return Path(lines[-1])


def load_module(path: Path) -> ModuleType:
    """A native module from its file, beside any other (each build's file has its own
    module name: the sources' hash)."""
    name = path.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _weights(ops: ModuleType, qtype: str, variant: str, shapes) -> list[tuple]:
    tid = TYPES[qtype][0]
    weights = []
    for seed, (n, k) in enumerate(shapes):
        raw = torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(seed)))
        if ops.quant_packs(tid, variant):
            weights.append((ops.quant_pack(raw, tid), tid | PACKED, k))
        else:
            weights.append((raw, tid, k))
    return weights


def _mode_known(ops: ModuleType, variant: str) -> int:
    """``MODE`` where ``ops`` knows its bits, else ``MODE`` less ``GROUPED``: a tree from
    before that bit (the forty-sixth session) refuses it, and took its kernels for many
    rows at every step of many."""
    x, raw = torch.zeros(1, 32), torch.zeros(1, 34, dtype=torch.uint8)  # (one Q8_0 block)
    try:
        ops.quant_matmul(x, [raw], [TYPES["Q8_0"][0]], MODE, variant, True)
    except RuntimeError as error:
        if "mode:" not in str(error):
            raise
        return MODE & ~GROUPED
    return MODE


def compare(
    base: Path,
    types=DEFAULT_TYPES,
    rows=DEFAULT_ROWS,
    calls: int = 30,
    threads: int | None = None,
    shapes=SHAPES,
    progress: bool = True,
) -> str:
    """The table: for each format and step size, ms a product with ``base``'s kernels and
    with this tree's, their ratio and whether the outputs are equal."""
    from kvpool.model.cpu import cpu_features
    from kvpool.model.native import kernel_variant, native_ops

    unknown = [t for t in types if t not in TYPES]
    if unknown:  # (before the base's build, which may take a minute)
        raise ValueError(f"unknown formats {unknown}; known: {', '.join(TYPES)}")
    here = native_ops()
    if here is None:
        raise RuntimeError("this tree's native ops are not built (a C++ compiler is needed)")
    here_file = Path(here.__file__)
    base_file = native_module_file(Path(base).resolve())
    theirs = here if base_file == here_file else load_module(base_file)
    variant = kernel_variant()  # (KVPOOL_CPU_FEATURES narrows it)
    base_mode = _mode_known(theirs, variant)
    if threads is not None:
        torch.set_num_threads(threads)
    lines = [
        f"int8 products, {variant} kernels, {torch.get_num_threads()} thread(s), "
        f"{cpu_features().summary()}",
        f"ms a product ({' and '.join(f'{n} x {k}' for n, k in shapes)}, their mean), the "
        f"fastest of {calls} alternating calls a build; base: {base}"
        + ("" if base_mode == MODE else " (its kernels for many rows: before GROUPED, always)"),
        f"{'format':8s} {'rows':>5s} {'base':>9s} {'this':>9s} {'ratio':>7s}  equal",
    ]
    for qtype in types:
        weights = _weights(here, qtype, variant, shapes)
        for m in rows:
            gen = torch.Generator().manual_seed(m)
            xs = {k: torch.randn(m, k, generator=gen) for _, k in shapes}
            best = {"base": float("inf"), "this": float("inf")}
            for _ in range(calls):
                for side, ops, mode in (("base", theirs, base_mode), ("this", here, MODE)):
                    start = time.perf_counter()
                    for raw, tid, k in weights:
                        ops.quant_matmul(xs[k], [raw], [tid], mode, variant, True)
                    best[side] = min(best[side], time.perf_counter() - start)
            equal = all(
                torch.equal(
                    theirs.quant_matmul(xs[k], [raw], [tid], base_mode, variant, True),
                    here.quant_matmul(xs[k], [raw], [tid], MODE, variant, True),
                )
                for raw, tid, k in weights
            )
            base_ms, this_ms = (best[s] / len(shapes) * 1e3 for s in ("base", "this"))
            lines.append(
                f"{qtype:8s} {m:5d} {base_ms:9.3f} {this_ms:9.3f} {this_ms / base_ms:6.3f}x  "
                f"{'yes' if equal else 'NO'}"
            )
            if progress:
                print(f"bench products: {lines[-1]}", file=sys.stderr, flush=True)
    lines.append("ratio: this tree's time over base's (below 1: this tree is faster)")
    return "\n".join(lines)
