"""``load_model``: a model name to a ready runtime, with progress and a report.

The device is CUDA when torch has it, else the CPU. On the CPU with the native ops the
default compute dtype is measured at load (a few decode steps under bfloat16 and under
float32, in alternating rounds; bfloat16 unless float32 is clearly faster, since it also
halves the KV);
``float32`` gives exact comparisons.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpool.formats.gguf_header import read_gguf_header
from kvpool.model.config import ModelConfig
from kvpool.model.cpu import cpu_features
from kvpool.model.gguf_weights import (
    KEPT_QUANTIZED,
    PACKED,
    dequantized_types,
    load_gguf_weights,
)
from kvpool.model.int4_products import FOUR_BIT, Int4Linear, int4_unavailable
from kvpool.model.llama import LlamaModel, can_prepack
from kvpool.model.measured import MeasuredStore, load_key
from kvpool.model.native import kernel_variant, native_ops, unavailable_reason
from kvpool.model.products import (
    BF16_TILES,
    FLOAT,
    ONE_ROW_NARROW,
    ONE_ROW_WIDE,
    ProductPolicy,
    QuantLinear,
    calibrate,
    probe,
)
from kvpool.model.runner import ModelRunner
from kvpool.model.tokenizer import Tokenizer
from kvpool.model_store import resolve_model_path
from kvpool.progress import Progress

# dtype=None keeps bfloat16 (half the KV bytes per token) unless float32 decodes faster
# by more than this factor.
BF16_MARGIN = 1.1
# The measuring (median_of_alternating): at most 9 rounds of one decode step per dtype,
# ending after 3 once one dtype's median step is 1.5x the other's.
DTYPE_ROUNDS, DTYPE_CLEAR_AFTER, DTYPE_CLEAR = 9, 3, 1.5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The single row's choice is measured on products reading at least this many bytes of a
# step's layers (_products_stepper): more than any CPU's cache holds.
PROBE_BYTES = 256 << 20
# What the load says as each of its measurements starts (by the kind kept in measured.py)
MEASURING = {
    "dtype": "the compute dtype: bf16 against float32 in batch-1 decode steps",
    "crossover": "where int8 products hand over to dequantized tiles",
    "single row": "the single row's kernel and read-ahead on a batch-1 step's products",
}


def choose_device(name: str | None = None) -> torch.device:
    """``name`` (``cpu``, ``cuda``, ``cuda:N``), checked against what torch sees; None:
    the GPU where torch sees one, else the CPU."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; choose cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: kvpool computes on cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU build")
            raise ValueError(f"device {name!r}: torch sees no CUDA device ({build})")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r}: torch sees {count} CUDA device(s)")
    return device


def choose_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``name``, or for None the device's fast dtype: on the CPU bfloat16 where it has
    bf16 products in hardware (AVX-512 BF16, AMX), else float32 (oneDNN emulates bf16
    products elsewhere, several times slower than float32)."""
    if name is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_features().bf16_products else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}") from None


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    load_seconds: float
    native_seconds: float = 0.0  # readying the native ops: a build on an install's first start
    dtype_choice: str = ""  # the compute dtype and why it was chosen (one line)
    dtype_seconds: dict[str, float] | None = None  # measured decode step per dtype
    # matrices of quantized types the kernels do not read, dequantized at load: by type
    dequantized: dict[str, int] = field(default_factory=dict)
    # where choices came from an earlier load's measurements (kvpool.model.measured)
    measured_note: str | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_geometry(self.model.dtype.itemsize).bytes_per_token

    def make_runner(self, kv_cache_memory: int, block_size: int) -> ModelRunner:
        """A runner over as many blocks as ``kv_cache_memory`` bytes hold."""
        geometry = self.config.kv_geometry(self.model.dtype.itemsize)
        blocks = geometry.blocks_for_budget(kv_cache_memory, block_size)
        return ModelRunner(self.model, blocks, block_size)

    def compute_line(self) -> str:
        """One line: the compute dtype chosen and why, and how products are computed."""
        line = f"compute dtype {self.dtype_choice or self.model.dtype}"
        device = self.model.device
        if device.type == "cuda":  # the CPU's features are in the dtype's reason
            line += f" on {device} ({torch.cuda.get_device_name(device)})"
        if isinstance(self.model.layers[0].o, QuantLinear):
            line += f"; weights kept quantized, {self.model.products.describe()}"
            if self.dequantized:  # formats the kernels do not read
                kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.dequantized.items()))
                line += f"; matrices dequantized at load: {kinds}"
            if self.measured_note:
                line += f"; {self.measured_note}"
            return line
        if device.type == "cpu" and unavailable_reason() is not None:
            line += f"; torch's path, no native kernels ({unavailable_reason()})"
        model = self.model
        products = model.matrix_products()
        four_bit = sum(isinstance(p, Int4Linear) for p in products)
        if four_bit:
            line += (
                f"; 4-bit matrices in torch's int4 kernels ({four_bit} of {len(products)} "
                f"products), the others dequantized to {model.dtype} at load"
            )
        else:
            why = int4_unavailable(device) if model.dtype == torch.bfloat16 else None
            line += "; quantized weights dequantized at load" + (f" ({why})" if why else "")
        return line

    def describe(self, runner: ModelRunner | None = None) -> str:
        cfg = self.config
        lines = [
            f"loaded {cfg.name} ({cfg.architecture}) from {self.path}",
            f"  {self.model.num_parameters / 1e6:.1f} M parameters, {cfg.num_layers} layers, "
            f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
            f"context {cfg.context_length}",
            f"  {self.model.dtype} on {self.model.device}, KV {self.kv_bytes_per_token:,} "
            f"bytes per token, loaded in {self.load_seconds:.2f} s",
        ]
        if self.native_seconds >= 2:  # a build, once per install: not part of loading
            lines[-1] += f" (native ops built in {self.native_seconds:.0f} s, once)"
        lines.append(f"  {self.compute_line()}")
        if runner is not None:
            n, bs = runner.kv.num_blocks, runner.block_size
            lines.append(
                f"  KV pool: {n} blocks of {bs} tokens = {n * bs:,} token slots, "
                f"{runner.kv.nbytes / 2**20:.0f} MiB"
            )
        return "\n".join(lines)


def _release_heap_memory() -> None:
    """Hand the heap pages freed by loading (the dequantized fp32 tensors, the plain
    copies of prepacked weights) back to the OS: glibc keeps them otherwise. A no-op
    where the C library has no ``malloc_trim``.

    Tried and dropped: also giving every allocation of 1 MiB or more its own mapping
    (``mallopt``): a lower peak, but the sampler's per-step logits tensors then
    page-faulted on every step and the server ran slower under load (docs/performance.md,
    "Memory").
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim(0)


def _decode_stepper(model: LlamaModel, steps: int, context: int = 8) -> Callable[[], float]:
    """A timed batch-1 decode step of ``model`` per call (one sequence after a short
    prefill, one position further each call, ``steps`` calls at most): what compute dtype
    to serve in is decided by them."""
    from kvpool.model.runner import ModelRunner, SeqChunk

    blocks = -(-(context + steps) // 16)
    runner = ModelRunner(model, blocks, 16, threads=None)
    table = list(range(blocks))  # one sequence, its blocks in order
    prompt = [(7 * i + 3) % model.vocab_rows for i in range(context)]
    runner.forward([SeqChunk(prompt, 0, table)])
    position = context

    def step() -> float:
        nonlocal position
        begin = time.perf_counter()
        runner.forward([SeqChunk([prompt[position % context]], position, table)])
        position += 1
        return time.perf_counter() - begin

    return step


def _products_stepper(model: LlamaModel) -> Callable[[], float]:
    """A timed pass of a batch-1 decode step's quantized products per call, scaled to
    the whole step: layers spread evenly through the model whose weights reach
    ``PROBE_BYTES`` (every layer of a smaller model), their time times the model's layers
    over theirs, plus the head's; of a mixture of experts, a layer's products are those
    one token runs (``step_products``: ``used`` of its experts). What the single row's
    kernel and read-ahead are decided by: it reads as many bytes from memory as a step of
    a large model would reach beyond any cache, it leaves out the step's other ops, which
    neither choice changes, and on an 8B-class model it takes a fraction of a whole
    step's time (docs/performance.md, fiftieth session)."""
    per_layer = [
        [p for p in model.step_products(i) if isinstance(p, QuantLinear)]
        for i in range(len(model.layers))
    ]
    average = sum(p.nbytes for ps in per_layer for p in ps) / len(per_layer)
    count = min(len(per_layer), max(1, math.ceil(PROBE_BYTES / max(average, 1))))
    layers = [p for i in range(count) for p in per_layer[i * len(per_layer) // count]]
    scale = len(per_layer) / count
    head = [model.lm_head] if isinstance(model.lm_head, QuantLinear) else []
    rows = {p.cols: torch.randn(1, p.cols, dtype=model.dtype) for p in [*layers, *head]}

    @torch.inference_mode()
    def step() -> float:
        begin = time.perf_counter()
        for product in layers:
            product(rows[product.cols])
        middle = time.perf_counter()
        for product in head:
            product(rows[product.cols])
        return (middle - begin) * scale + time.perf_counter() - middle

    return step


def median_of_alternating(steps: dict[Any, Callable[[], float]]) -> dict[Any, float]:
    """Each candidate's median step time, the candidates' steps alternating one by one
    (a round: one step of each; the first round is not counted: it pays the first
    step's one-off costs). ``DTYPE_ROUNDS`` rounds at most; after ``DTYPE_CLEAR_AFTER``
    counted rounds, ending once one median is ``DTYPE_CLEAR`` times another's (bf16
    compute on a CPU without bf16 products: 2-3x).

    A VM's phases make every step 1.2-2x as slow or as fast for a second or more: runs
    of steps per candidate, even alternating, let a fast moment fall on one candidate's
    run (the fastest of a few such runs chose float32 at 18.0 against 22.0 ms a step on
    an AVX-512 BF16 CPU, Zen 4, where the two decode within 5% of each other, and
    float32 then cost 330 MiB at peak and 12% of prefill). Steps alternating one by one
    meet each phase alike, and the median leaves out the moments a phase turns."""
    for step in steps.values():
        step()  # (uncounted)
    times: dict[Any, list[float]] = {name: [] for name in steps}
    for round_ in range(DTYPE_ROUNDS):
        for name, step in steps.items():
            times[name].append(step())
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        ratio = max(medians.values()) / min(medians.values())
        if round_ + 1 >= DTYPE_CLEAR_AFTER and ratio > DTYPE_CLEAR:
            break
    return medians


def _choose_crossover(
    products: ProductPolicy,
    model: LlamaModel,
    dtype: torch.dtype,
    store: MeasuredStore | None = None,
    say: Callable[[str, bool], None] | None = None,
) -> None:
    """Where int8 products hand over to dequantized tiles (bf16 tiles where the CPU has
    bf16 products in hardware and the model computes in bf16): measured on one of the
    model's own products at load, unless ``KVPOOL_INT8_MAX_ROWS`` sets it ("all": int8
    at every size). A model with matrices in both the packed layout and the file's (Q5_1,
    which has no packed layout, beside packed formats) gets a crossover for each, measured
    on the first layer's first matrix of each layout; others one, measured on ``o``.
    Taken from ``store`` where an earlier load of this key measured it."""
    products.tiles = BF16_TILES if dtype == torch.bfloat16 and can_prepack() else FLOAT
    forced = os.environ.get("KVPOOL_INT8_MAX_ROWS")
    if forced is not None:
        products.int8_max_rows = None if forced == "all" else int(forced)
        return
    rows = (int, type(None))
    fields = {"int8_max_rows": rows, "file_int8_max_rows": rows, "file_crossover": (bool,)}
    _kept_or_measured(
        store, f"crossover: {dtype} tiles {products.tiles}", products, fields,
        lambda: _measure_crossover(products, model), say,
    )  # fmt: skip


def _kept_or_measured(
    store: MeasuredStore | None,
    kind: str,
    products: ProductPolicy,
    fields: dict[str, tuple[type, ...]],
    measure: Callable[[], None],
    say: Callable[[str, bool], None] | None = None,
) -> None:
    """Sets ``fields`` of ``products`` from ``store``'s record of ``kind``, or runs
    ``measure`` (which sets them, after ``say`` told of it) and keeps what it set (no
    store: measures)."""
    kept = store.get(kind, fields) if store is not None else None
    if kept is not None:
        for name in fields:  # (JSON gives pairs back as lists)
            value = kept[name]
            setattr(products, name, tuple(value) if isinstance(value, list) else value)
        return
    if say is not None:
        say(kind.partition(":")[0], _keeps(store))
    measure()
    if store is not None:
        store.put(kind, {name: getattr(products, name) for name in fields})


def _keeps(store: MeasuredStore | None) -> bool:
    """Whether what a load measures now is kept for the next."""
    return store is not None and store.mode != "off"


def _measure_crossover(products: ProductPolicy, model: LlamaModel) -> None:
    """``_choose_crossover``'s measuring."""
    layer = model.layers[0]
    linears = [
        x for x in (layer.o, layer.qkv, layer.gate_up, layer.down) if isinstance(x, QuantLinear)
    ]
    packed = next((p for x in linears if (p := probe(x, packed=True)) is not None), None)
    file = next((p for x in linears if (p := probe(x, packed=False)) is not None), None)
    if packed is None or file is None:
        products.int8_max_rows = calibrate(layer.o, products.tiles)
        return
    products.int8_max_rows = calibrate(packed, products.tiles)
    products.file_int8_max_rows = calibrate(file, products.tiles)
    products.file_crossover = True


def _choose_one_row(
    products: ProductPolicy,
    model: LlamaModel,
    store: MeasuredStore | None = None,
    say: Callable[[str, bool], None] | None = None,
) -> None:
    """How a step of few rows reads its weights, where there is a choice: the packed
    kernel for one row (AVX-512's: a pair of groups in 512-bit vectors, or one group in
    256-bit ones; the same results bit for bit), and how far ahead passes of few rows ask
    for their weights (x86: 2 or 8 KiB; the same results). A batch-1 step's products
    (``_products_stepper``) with each combination, alternating, the fastest kept: the
    pair kernel read faster on an AMX Xeon and 1.3-1.5x slower on Zen 4, which runs a
    512-bit operation as two halves; 8 KiB ahead took 0.85x the time of 2 on Zen 5,
    whose cores stream three times an AMX Xeon's rate (docs/performance.md).
    ``KVPOOL_ONE_ROW`` ("wide", "narrow") and ``KVPOOL_READ_AHEAD`` ("near", "far") set
    them; where neither is set, ``store`` keeps what was measured for the next load of
    this key."""
    forced = os.environ.get("KVPOOL_ONE_ROW")
    if forced is not None:
        kinds = {"wide": ONE_ROW_WIDE, "narrow": ONE_ROW_NARROW}
        if forced not in kinds:
            raise ValueError(f"KVPOOL_ONE_ROW: 'wide' or 'narrow', not {forced!r}")
        products.one_row = kinds[forced]
    forced_ahead = os.environ.get("KVPOOL_READ_AHEAD")
    if forced_ahead is not None:
        if forced_ahead not in ("near", "far"):
            raise ValueError(f"KVPOOL_READ_AHEAD: 'near' or 'far', not {forced_ahead!r}")
        products.far_ahead = forced_ahead == "far"
    layer = model.layers[0]
    packed = any(
        isinstance(x, QuantLinear) and any(t & PACKED for t in x.types)
        for x in (layer.o, layer.qkv, layer.gate_up, layer.down)
    )
    avx512 = products.variant.startswith("avx512")
    widths = [products.one_row]
    if forced is None and avx512 and packed:
        widths = [ONE_ROW_WIDE, ONE_ROW_NARROW]
    aheads = [products.far_ahead]
    if forced_ahead is None and (avx512 or products.variant == "avx2"):  # (x86's kernels)
        aheads = [False, True]
    candidates = [(width, far) for width in widths for far in aheads]
    if len(candidates) == 1:
        return
    if forced is not None or forced_ahead is not None:
        store = None  # (a forced half: the other's measurement depends on it)
    pair = (list, type(None))  # (JSON's form of the measured pairs)
    fields = {"one_row": (int,), "far_ahead": (bool,), "one_row_ms": pair, "ahead_ms": pair}
    _kept_or_measured(
        store, f"single row: {model.dtype}, its products", products, fields,
        lambda: _measure_one_row(products, model, widths, aheads, candidates), say,
    )  # fmt: skip


def _measure_one_row(
    products: ProductPolicy,
    model: LlamaModel,
    widths: list[int],
    aheads: list[bool],
    candidates: list[tuple[int, bool]],
) -> None:
    """``_choose_one_row``'s measuring: each candidate's batch-1 step products
    (``_products_stepper``), alternating."""
    step = _products_stepper(model)

    def with_reads(width: int, far: bool) -> Callable[[], float]:
        def timed() -> float:
            products.one_row, products.far_ahead = width, far
            return step()

        return timed

    times = median_of_alternating({c: with_reads(*c) for c in candidates})
    width, far = min(times, key=times.__getitem__)
    products.one_row, products.far_ahead = width, far
    if len(widths) == 2:
        products.one_row_ms = (times[ONE_ROW_WIDE, far] * 1e3, times[ONE_ROW_NARROW, far] * 1e3)
    if len(aheads) == 2:
        products.ahead_ms = (times[width, False] * 1e3, times[width, True] * 1e3)


def load_model(
    name: str | os.PathLike[str] | None = None,
    *,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = True,
    batch_invariant: bool = False,
) -> LoadedModel:
    """Load a model by name (None: the built-in default), path or Ollama store name.

    On the CPU with the native ops built, quantized matrices stay in their GGUF blocks
    (``QuantLinear``): float products from dequantized tiles when ``dtype`` is
    ``float32`` (the exact reference), int8 products otherwise, handing over to
    dequantized tiles for the step sizes where those measure faster.

    ``batch_invariant``: int8 products at every step size, in any dtype (float32
    included), so that no output depends on what else is in the batch (each row's
    products are computed alone, in a fixed order); the runner then sends every token
    through the native ``paged_attention``, whose rows do not depend on chunking either.
    It costs the tiles' speed on large steps where a CPU has it, and float32's exact
    products.

    What the load measures (the dtype, the crossovers, the single row's kernel and
    read-ahead) is kept for the next load of the file on this machine and build, which
    takes it instead (``kvpool.model.measured``)."""
    path = resolve_model_path(name)
    dev = choose_device(device)
    torch_dtype = choose_dtype(dtype, dev)
    native_start = time.perf_counter()
    ops = native_ops() if dev.type == "cpu" else None  # built once per install (~60 s)
    start = time.perf_counter()
    native_seconds = start - native_start
    header = read_gguf_header(path)
    tokenizer = Tokenizer.from_gguf(header)
    on_gpu = dev.type == "cuda"
    gpu_before = torch.cuda.memory_allocated(dev) if on_gpu else 0
    bar = Progress(f"loading {path.name}", len(header.tensors)) if progress else None
    # earlier loads' measurements of this file on this machine and build (measured.py)
    store = MeasuredStore(load_key(path, kernel_variant(), batch_invariant)) if ops else None
    kept = None
    if store is not None and dtype is None:
        kept = store.get("dtype", {"chosen": (str,), "bfloat16": (float,), "float32": (float,)})
        if kept is not None and kept["chosen"] not in ("bfloat16", "float32"):
            kept = None
    if kept is not None:
        torch_dtype = DTYPES[kept["chosen"]]

    def say(kind: str, keeping: bool) -> None:
        """A line on stderr as a measurement starts: seconds of batch-1 steps on a large
        model, after the loading bar has ended."""
        if progress:
            once = " (once: kept for the next load)" if keeping else ""
            print(f"measuring {MEASURING[kind]}{once}...", file=sys.stderr, flush=True)

    try:
        # the compute dtype, by measurement (unless kept from an earlier load)
        measure = dtype is None and ops is not None and kept is None
        # float32 asked for: the exact reference, float products only (no packed layout)
        exact = torch_dtype == torch.float32 and dtype is not None and not batch_invariant
        # without kvpool's kernels (a GPU, a CPU where they did not build), 4-bit matrices
        # in bf16 stay 4-bit in torch's int4 kernels (int4_products); the rest is dense
        int4 = ops is None and torch_dtype == torch.bfloat16 and int4_unavailable(dev) is None
        config, weights = load_gguf_weights(
            path,
            torch.float32 if measure else torch_dtype,
            header=header,
            on_tensor=(lambda i, n: bar.advance()) if bar else None,
            quantized=ops is not None or int4,
            pack_variant=kernel_variant() if ops is not None and not exact else None,
            device=dev,
            kept_types=KEPT_QUANTIZED if ops is not None else FOUR_BIT,
        )
    finally:
        if bar:
            bar.__exit__()
    why = "asked for" if dtype is not None else "the device's default"
    choice = f"{torch_dtype} ({why})"
    if measure:
        say("dtype", _keeps(store))
        # Measured: the same blocks under each compute dtype (the dense 1-D tensors are
        # converted per model; the quantized matrices are shared, never copied).
        candidates = {}
        for candidate in (torch.bfloat16, torch.float32):
            policy = ProductPolicy(variant=kernel_variant(), fixed=batch_invariant)
            candidates[candidate] = LlamaModel(config, dict(weights), dev, candidate, policy)
        times = median_of_alternating(
            {c: _decode_stepper(m, DTYPE_ROUNDS + 1) for c, m in candidates.items()}
        )
        # bf16 unless float32 is clearly faster: bf16 also halves the KV per token
        fast = times[torch.float32] < times[torch.bfloat16] / BF16_MARGIN
        torch_dtype = torch.float32 if fast else torch.bfloat16
        model = candidates.pop(torch_dtype)
        del candidates
        seconds = {str(c).removeprefix("torch."): t for c, t in times.items()}
        if store is not None:
            store.put("dtype", {"chosen": str(torch_dtype).removeprefix("torch."), **seconds})
    else:
        products = ProductPolicy(exact=exact, variant=kernel_variant(), fixed=batch_invariant)
        model = LlamaModel(config, weights, dev, torch_dtype, products)
    if measure or kept is not None:
        if kept is not None:
            seconds = {name: kept[name] for name in ("bfloat16", "float32")}
        chosen = str(torch_dtype).removeprefix("torch.")
        (other,) = (name for name in seconds if name != chosen)
        choice = (
            f"torch.{chosen}: measured {seconds[chosen] * 1e3:.1f} ms a batch-1 decode "
            f"step vs {seconds[other] * 1e3:.1f} ms in torch.{other} "
            f"({cpu_features().summary()}; both with int8 products)"
        )
    weights.clear()
    _release_heap_memory()
    fixed = model.products.exact or model.products.fixed
    if not fixed and isinstance(model.layers[0].o, QuantLinear):
        _choose_crossover(model.products, model, torch_dtype, store, say)
    if not model.products.exact and isinstance(model.layers[0].o, QuantLinear):
        _choose_one_row(model.products, model, store, say)
    model.source_path = Path(path)
    if on_gpu:  # what the model holds there (device_memory sizes the KV pool with it)
        model.device_bytes = torch.cuda.memory_allocated(dev) - gpu_before
    loaded = LoadedModel(
        path, config, model, tokenizer, time.perf_counter() - start, native_seconds, choice
    )
    if ops is not None:
        loaded.dequantized = dequantized_types(header, KEPT_QUANTIZED)
    if measure or kept is not None:
        loaded.dtype_seconds = seconds
    if store is not None:
        loaded.measured_note = store.provenance()
    if progress:
        print(loaded.describe(), file=sys.stderr)
    return loaded
