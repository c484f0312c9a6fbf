"""Products with weights kept in GGUF blocks (``native.quant_matmul``), every kernel
variant this CPU runs: dequantization bit-identical to the gguf package's, float
products equal to the dequantized product, int8 products near it, row by row the same
whatever the batch, and fused parts of different formats. A variant the CPU lacks is
skipped with the reason; ``test_cpu_choice`` checks which variant the runtime picks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpool.bench.random_blocks import TYPES, random_blocks  # noqa: E402
from kvpool.model.cpu import cpu_features  # noqa: E402
from kvpool.model.native import native_ops  # noqa: E402
from kvpool.model.products import FAR_AHEAD, ONE_ROW_NARROW  # noqa: E402

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="native ops not built here")
VARIANTS = ["avx512-amx", "avx512-bf16", "avx512-vnni", "avx2", "aarch64-dotprod", "generic"]
X86_VARIANTS = VARIANTS[:4]  # one integer form: their products agree bit for bit
INT8_TYPES = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0",
]  # fmt: skip
# int8 products against the float ones, one product of random data: share of the
# largest output (measured: 0.4-1.2%)
INT8_PRODUCT_BOUND = 0.03


def variant_param(variant: str):
    runnable = ops.kernel_variants() if ops is not None else []
    reason = f"this CPU cannot run the {variant} kernels ({cpu_features().summary()})"
    return pytest.param(variant, marks=pytest.mark.skipif(variant not in runnable, reason=reason))


def blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, rows, cols, np.random.default_rng(seed)))


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_dequantization_equals_the_gguf_package(qtype, variant):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = blocks(qtype, 6, 512)
    want = dequantize(raw.numpy(), GGMLQuantizationType(TYPES[qtype][0]))
    got = ops.quant_dequantize(raw, TYPES[qtype][0], 512, variant).numpy()
    assert np.array_equal(got, want)
    # as a bf16 tile's weights: the same values rounded as torch rounds them
    bf16 = ops.quant_dequantize(raw, TYPES[qtype][0], 512, variant, None, True)
    assert torch.equal(bf16, torch.from_numpy(want).to(torch.bfloat16))


SCALED_TYPES = sorted(q for q, (_, _, _, scales, _) in TYPES.items() if scales)


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", SCALED_TYPES)
def test_blocks_with_subnormal_fp16_scales_multiply_as_their_values(qtype, variant):
    """A block's fp16 scale (and minimum) may be a subnormal half float: a K-quant block
    of weights of order 0.05 has d ~1e-5, below fp16's smallest normal 6.1e-5, and real
    files are full of them. Every kernel reads it as its value, in both layouts, in the
    float and the int8 products, while the ops flush subnormal floats: a CPU whose
    half-float conversion read them as zero under that flushing (qemu's emulated x86)
    would multiply such blocks as zeros (float_control.h: flush_denormals_control)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tid, _, size, scales, mins = TYPES[qtype]
    rng = np.random.default_rng(tid)
    raw = random_blocks(qtype, 16, 512, rng)
    per_row = raw.reshape(16, -1, size)  # (a view: the blocks of each row)
    for offset in scales + mins:  # halves 1 .. 1023 x 2^-24: every one subnormal
        halves = rng.integers(1, 1024, size=per_row.shape[:2], dtype=np.uint16)
        per_row[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(*halves.shape, 2)
    want = dequantize(raw, GGMLQuantizationType(tid)).astype(np.float64)
    assert np.abs(want).max() > 0
    raw = torch.from_numpy(raw)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(tid))
    reference = torch.from_numpy(x.double().numpy() @ want.T)
    scale = reference.abs().max().item()
    parts = [(raw, tid)]
    if qtype in PACKABLE:
        parts.append((ops.quant_pack(raw, tid), tid | PACKED))
    for weights, kind in parts:
        floats = ops.quant_matmul(x, [weights], [kind], 1, variant).double()
        assert (floats - reference).abs().max().item() <= 1e-5 * scale, kind
        ints = ops.quant_matmul(x, [weights], [kind], 0, variant).double()
        assert (ints - reference).abs().max().item() <= INT8_PRODUCT_BOUND * scale, kind


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_products_against_the_dequantized_product(qtype, variant, rows):
    tid = TYPES[qtype][0]
    raw = blocks(qtype, 72, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    scale = (x @ ops.quant_dequantize(raw, tid, 512).T).abs().max().item()
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        reference = xs.float() @ ops.quant_dequantize(raw, tid, 512).T
        floats = ops.quant_matmul(xs, [raw], [tid], 1, variant)
        assert floats.dtype == torch.float32 and floats.shape == (rows, 72)
        assert (floats - reference).abs().max().item() <= 1e-5 * scale
        ints = ops.quant_matmul(xs, [raw], [tid], 0, variant)
        assert (ints - reference).abs().max().item() <= INT8_PRODUCT_BOUND * scale


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_int8_products_are_row_invariant_and_equal_across_variants(qtype, variant):
    """Each output row is its activation row's dot products alone, in a fixed order: a
    batch of 37 rows gives, bit for bit, each row computed alone (and the integer sums
    make every x86 variant agree; the plain C++ of the generic and aarch64 variants sums
    its units in another order of floats). Reading the weights further ahead (FAR_AHEAD)
    changes no bit."""
    tid = TYPES[qtype][0]
    assert ops.quant_has_int_dot(tid, variant)
    raw = blocks(qtype, 27, 768)
    x = torch.randn(37, 768, generator=torch.Generator().manual_seed(1))
    batch = ops.quant_matmul(x, [raw], [tid], 0, variant)
    for i in (0, 3, 4, 17, 36):
        assert torch.equal(ops.quant_matmul(x[i : i + 1], [raw], [tid], 0, variant)[0], batch[i])
    for n in (2, 3, 9, 30):  # passes of 8, 4 and of the 1 to 3 rows left
        assert torch.equal(ops.quant_matmul(x[:n], [raw], [tid], 0, variant), batch[:n])
    for n in (1, 2, 5):
        assert torch.equal(ops.quant_matmul(x[:n], [raw], [tid], FAR_AHEAD, variant), batch[:n])
    if variant in X86_VARIANTS:
        assert torch.equal(batch, ops.quant_matmul(x, [raw], [tid], 0, X86_VARIANTS[-1]))


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_int8_products_of_exact_activations_equal_the_float_product(qtype, variant):
    """Activations of +-1 quantize exactly (q = +-127), so an integer product must equal
    the float product of the dequantized weights to float rounding: every value's
    magnitude, sign and scale unpacked right (a 3% bound on random activations would miss
    one group of 8 values with a wrong sign or grid row). Signs by position mod 2, 8, 16,
    32, and random ones."""
    tid = TYPES[qtype][0]
    k = 512
    raw = blocks(qtype, 20, k, seed=5)
    rng = np.random.default_rng(11)
    pos = np.arange(k)
    signs = [np.ones(k), -np.ones(k)] + [
        np.where(pos % (2 * p) < p, 1.0, -1.0) for p in (1, 4, 8, 16)
    ]
    signs += [rng.choice([-1.0, 1.0], k) for _ in range(3)]
    x = torch.tensor(np.stack(signs), dtype=torch.float32)
    want = x @ ops.quant_dequantize(raw, tid, k).T
    got = ops.quant_matmul(x, [raw], [tid], 0, variant)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


GRID_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
TERNARY_TYPES = ["TQ1_0", "TQ2_0"]


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", GRID_TYPES + TERNARY_TYPES)
def test_grouped_products_of_many_rows(qtype, variant):
    """``GROUPED`` lets a kernel for many rows take steps of many: the x86 variants' grid
    and ternary formats, 8 weight rows at a time (AVX-512: 16, then 8) from 5 activation rows
    (grid_group_dot); the generic variant's row kernels ignore it. Its integer sums are
    exact, its float steps its own (each unit into one accumulator, not 8 lanes summed at
    the end): near the row kernel's results, equal to the float product for exact
    activations, and a row's result the same at any number of rows from 5, in either
    width (27 weight rows: 16, then 8, then 3 for the row kernel; and the same from row 8
    on: 16, then 3), bit for bit on every x86 variant (AVX2's dot as maddubs and madd);
    below 5 rows, and for the rows past the last group of 8, the row kernel's."""
    from kvpool.model.products import GROUPED

    tid = TYPES[qtype][0]
    raw = blocks(qtype, 27, 768, seed=7)
    x = torch.randn(37, 768, generator=torch.Generator().manual_seed(7))
    rows = ops.quant_matmul(x, [raw], [tid], 0, variant)
    grouped = ops.quant_matmul(x, [raw], [tid], GROUPED, variant)
    assert (grouped - rows).abs().max().item() <= 1e-5 * rows.abs().max().item()
    for n in (5, 12, 20):
        assert torch.equal(ops.quant_matmul(x[:n], [raw], [tid], GROUPED, variant), grouped[:n])
    assert torch.equal(ops.quant_matmul(x[:4], [raw], [tid], GROUPED, variant), rows[:4])
    assert torch.equal(grouped[:, 24:], rows[:, 24:])
    shifted = ops.quant_matmul(x, [raw[8:]], [tid], GROUPED, variant)  # rows 8-23: one 16
    assert torch.equal(shifted[:, :16], grouped[:, 8:24])
    group_kernel = variant.startswith(("avx512", "avx2"))
    assert bool((grouped[:, :24] != rows[:, :24]).any()) == group_kernel
    if group_kernel:  # (every x86 CPU these variants run on runs avx2's)
        other = ops.quant_matmul(x, [raw], [tid], GROUPED, "avx2")
        assert torch.equal(grouped, other)
    k = 768
    pos = np.arange(k)
    signs = [np.where(pos % (2 * p) < p, 1.0, -1.0) for p in (1, 2, 4, 8, 16, 32)]
    rng = np.random.default_rng(12)
    signs += [np.ones(k), -np.ones(k)] + [rng.choice([-1.0, 1.0], k) for _ in range(6)]
    exact = torch.tensor(np.stack(signs), dtype=torch.float32)  # 14 rows: grid_group_dot
    want = exact @ ops.quant_dequantize(raw, tid, k).T
    got = ops.quant_matmul(exact, [raw], [tid], GROUPED, variant)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
def test_a_ternary_field_of_three_reads_as_two_in_every_kernel(variant):
    """TQ2_0's 2-bit fields hold 0 .. 2 in any file ggml writes; a 3 (a damaged or
    hand-made file) reads as the value 2, as ggml's and the gguf package's dequantizers
    read it, in the row kernel and the grouped one alike."""
    from kvpool.model.products import GROUPED

    tid, k = TYPES["TQ2_0"][0], 512
    raw = blocks("TQ2_0", 16, k, seed=3)
    threes = torch.tensor([0xC0, 0x03], dtype=torch.uint8).repeat(32)  # a field of 3 a byte
    raw.view(16, k // 256, 66)[:, :, :64] |= threes
    values = ops.quant_dequantize(raw, tid, k, variant)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    assert np.array_equal(values.numpy(), dequantize(raw.numpy(), GGMLQuantizationType(tid)))
    signs = np.where(np.arange(k) % 3 == 0, -1.0, 1.0)
    x = torch.tensor(np.stack([signs, -signs] * 4), dtype=torch.float32)  # 8 rows: grouped
    want = x @ values.T
    for mode in (0, GROUPED):
        for rows in (1, 8):
            got = ops.quant_matmul(x[:rows], [raw], [tid], mode, variant)
            assert (got - want[:rows]).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
def test_parts_in_the_files_layout_take_their_own_kind_of_product(variant):
    """mode's bits 2-3 (one more than a kind) give the parts kept in the file's layout
    (Q3_K) their own kind of product beside the packed parts' (Q4_K, Q6_K, where the
    variant packs them): each part's outputs as that part alone in its kind."""
    specs = [("Q4_K", 64, True), ("Q3_K", 40, False), ("Q6_K", 16, True)]
    raws, tids = mixed_parts(specs, 512, 5, variant)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(3))
    for packed_kind, file_kind in ((0, 1), (1, 0), (0, 2), (2, 0), (0, 0)):
        mixed = ops.quant_matmul(x, raws, tids, packed_kind | (1 + file_kind) << 2, variant)
        alone = [
            ops.quant_matmul(x, [raw], [tid], packed_kind if tid & PACKED else file_kind, variant)
            for raw, tid in zip(raws, tids, strict=True)
        ]
        assert torch.equal(mixed, torch.cat(alone, 1)), (packed_kind, file_kind)
    for bad in (3, 256, 3 | 1 << 2, 3 << 4):  # kinds 0-2; file kinds 1-3; one_row 0-2; bit 7
        with pytest.raises(RuntimeError, match="mode"):
            ops.quant_matmul(x, raws, tids, bad, variant)


def test_a_policy_with_a_crossover_for_the_files_layout_encodes_both_kinds():
    from kvpool.model.products import BF16_TILES, FLOAT, GROUPED, INT8, ProductPolicy

    both = ProductPolicy(int8_max_rows=128, tiles=BF16_TILES)
    modes = [both.mode(rows) for rows in (1, 32, 200)]
    assert modes == [INT8 | GROUPED, INT8 | GROUPED, BF16_TILES | GROUPED]
    both.file_crossover, both.file_int8_max_rows = True, 8
    assert both.mode(8) == INT8 | (1 + INT8) << 2 | GROUPED
    assert both.mode(32) == INT8 | (1 + BF16_TILES) << 2 | GROUPED
    assert both.mode(200) == BF16_TILES | (1 + BF16_TILES) << 2 | GROUPED
    assert "in the file's layout: int8 products up to 8 rows, bf16 tiles above" in both.describe()
    both.one_row, both.one_row_ms = ONE_ROW_NARROW, (4.5, 3.25)
    assert both.mode(1) == INT8 | (1 + INT8) << 2 | ONE_ROW_NARROW << 4 | GROUPED
    assert both.mode(200) == BF16_TILES | (1 + BF16_TILES) << 2 | ONE_ROW_NARROW << 4 | GROUPED
    assert "one row in 256-bit vectors (batch-1 products 4.5 ms in 512-bit, 3.2 in 256-bit)" in (
        both.describe()
    )
    both.exact = True
    assert both.mode(32) == FLOAT
    # batch-invariant: int8 at every size, each row's order of sums the same at any size
    fixed = ProductPolicy(fixed=True)
    assert [fixed.mode(rows) for rows in (1, 32, 200)] == [INT8, INT8, INT8]
    # reading further ahead changes no result: a batch-invariant policy takes it too
    fixed.far_ahead, fixed.ahead_ms = True, (21.5, 19.25)
    assert [fixed.mode(rows) for rows in (1, 200)] == [INT8 | FAR_AHEAD, INT8 | FAR_AHEAD]
    assert "weights asked for 8 KiB ahead (batch-1 products 21.5 ms at 2 KiB, 19.2 at 8 KiB)" in (
        fixed.describe()
    )


def test_the_single_rows_measure_reads_layers_spread_through_the_model(monkeypatch):
    """The single row's choice is measured on a batch-1 step's products: the head's and
    those of layers spread evenly through the model, enough to read ``PROBE_BYTES`` (every
    layer where the model holds less), their time scaled to every layer."""
    import kvpool.model.loader as loader
    from kvpool.model.products import QuantLinear

    model = loader.load_model(None, dtype="bfloat16", progress=False).model
    if not isinstance(model.layers[0].o, QuantLinear):
        pytest.skip("the native kernels did not build: the products are torch's")
    owner = {id(p): i for i in range(len(model.layers)) for p in model.layer_products(i)}
    owner[id(model.lm_head)] = "head"
    called: list = []
    real = QuantLinear.__call__

    def spy(self, x):
        assert x.shape == (1, self.cols) and x.dtype == model.dtype  # one row, as decoding
        called.append(owner[id(self)])
        return real(self, x)

    monkeypatch.setattr(QuantLinear, "__call__", spy)
    layers = len(model.layers)
    average = sum(p.nbytes for i in range(layers) for p in model.layer_products(i)) / layers
    for probe_bytes, expected in ((2**40, range(layers)), (1, [0]), (3 * average, [0, 10, 20])):
        monkeypatch.setattr(loader, "PROBE_BYTES", probe_bytes)
        called.clear()
        assert loader._products_stepper(model)() > 0
        assert called[-1] == "head" and called.count("head") == 1
        assert sorted(set(called[:-1])) == list(expected)


def test_the_single_rows_measure_runs_the_experts_a_token_runs(tmp_path, monkeypatch):
    """Of a mixture of experts the products measure runs what one token runs in a layer:
    its attention's products and ``used`` experts' (of 8, 2: the first and the fifth),
    not every expert's (which read 4x the bytes of a step's experts here, and of
    Qwen3-30B-A3B's 128, 8 used, 16x)."""
    import kvpool.model.loader as loader
    from kvpool.model.products import QuantLinear
    from tests.synthetic_gguf import EXPERTS, USED, write_model
    from tests.test_synthetic_models import MIXES

    path = write_model(tmp_path / "moe.gguf", "qwen3moe", MIXES["k-quants"], seed=4)
    model = loader.load_model(path, dtype="bfloat16", progress=False).model
    layer = model.layers[0]
    if not isinstance(layer.o, QuantLinear):
        pytest.skip("the native kernels did not build: the products are torch's")
    names = {id(model.lm_head): "head"}
    for i, layer in enumerate(model.layers):
        names |= {id(layer.qkv): f"{i} qkv", id(layer.o): f"{i} o"}
        for e in range(EXPERTS):
            names[id(layer.experts.gate_up[e])] = f"{i} gate_up {e}"
            names[id(layer.experts.down[e])] = f"{i} down {e}"
    called: list = []
    real = QuantLinear.__call__

    def spy(self, x):
        called.append(names[id(self)])
        return real(self, x)

    monkeypatch.setattr(QuantLinear, "__call__", spy)
    monkeypatch.setattr(loader, "PROBE_BYTES", 2**40)  # every layer
    assert loader._products_stepper(model)() > 0
    chosen = [e * EXPERTS // USED for e in range(USED)]
    want = [
        name
        for i in range(len(model.layers))
        for name in (
            f"{i} qkv",
            f"{i} o",
            *(f"{i} {part} {e}" for e in chosen for part in ("gate_up", "down")),
        )
    ]
    assert called == [*want, "head"] and chosen == [0, 4]


def test_a_single_rows_kernel_is_measured_where_there_are_two_or_set(monkeypatch):
    """AVX-512's packed kernels read one activation row as pairs of groups in 512-bit
    vectors or one group in 256-bit ones, and x86's passes of few rows ask for their
    weights 2 or 8 KiB ahead (the same bits: the products tests): the load measures a
    batch-1 step's products with each and keeps the fastest (test_cpu_choice checks the
    choice, and that a variant with one kernel measures no width and the generic
    variant no read-ahead, each in a process of its own: the variant is chosen once a
    process); ``KVPOOL_ONE_ROW`` and ``KVPOOL_READ_AHEAD`` set them."""
    from kvpool.model.loader import load_model

    monkeypatch.setenv("KVPOOL_ONE_ROW", "narrow")
    monkeypatch.setenv("KVPOOL_READ_AHEAD", "far")
    loaded = load_model(None, progress=False)
    products = loaded.model.products
    assert products.one_row == ONE_ROW_NARROW and products.far_ahead
    assert products.one_row_ms is None and products.ahead_ms is None
    line = loaded.compute_line()
    assert "one row in 256-bit vectors" in line and "batch-1 products" not in line
    assert "weights asked for 8 KiB ahead" in line
    assert products.mode(1) & FAR_AHEAD
    monkeypatch.setenv("KVPOOL_ONE_ROW", "widest")
    with pytest.raises(ValueError, match="KVPOOL_ONE_ROW"):
        load_model(None, progress=False)
    monkeypatch.delenv("KVPOOL_ONE_ROW")
    monkeypatch.setenv("KVPOOL_READ_AHEAD", "farther")
    with pytest.raises(ValueError, match="KVPOOL_READ_AHEAD"):
        load_model(None, progress=False)
    monkeypatch.delenv("KVPOOL_READ_AHEAD")


def test_fused_parts_of_different_formats_equal_separate_products():
    parts = [("Q4_K", 40), ("Q6_K", 8), ("Q8_0", 16)]
    raws = [blocks(q, n, 512, seed=i) for i, (q, n) in enumerate(parts)]
    tids = [TYPES[q][0] for q, _ in parts]
    x = torch.randn(3, 512)
    for mode in (0, 1):
        fused = ops.quant_matmul(x, raws, tids, mode)
        alone = torch.cat(
            [ops.quant_matmul(x, [r], [t], mode) for r, t in zip(raws, tids, strict=True)], 1
        )
        assert torch.equal(fused, alone)


def test_bad_input_raises():
    raw = blocks("Q4_0", 4, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.quant_matmul(torch.zeros(1, 64), [raw.float()], [2])
    with pytest.raises(RuntimeError, match="blocks"):
        ops.quant_matmul(torch.zeros(1, 48), [raw], [2])
    with pytest.raises(RuntimeError, match="type"):
        ops.quant_matmul(torch.zeros(1, 64), [raw], [99])
    with pytest.raises(RuntimeError, match="cannot run"):
        ops.quant_matmul(torch.zeros(1, 64), [raw], [2], 0, "avx9000")


def test_int8_products_on_the_default_model_stay_near_the_float_ones(default_model_file):
    """The fast path against the exact one on the default model, whole logits of four
    prompts (measured: mean |difference| 0.14-0.48, the bf16 dense products' was 0.43;
    the top token agrees at 95-97% of the 65 positions). Where it differs, the exact
    logits' two best were within 0.1 of each other (a near tie: counted per prompt, one
    such position of a 5-token prompt read as 80%)."""
    from kvpool.cache import KVCacheManager
    from kvpool.model.gguf_weights import load_gguf_weights
    from kvpool.model.llama import LlamaModel
    from kvpool.model.products import ProductPolicy
    from tests.paged_runner import Chunk, PagedRunner
    from tests.test_model_reference import _prompts

    models = {}
    for name, policy in (("float", ProductPolicy(exact=True)), ("int8", ProductPolicy())):
        config, weights = load_gguf_weights(default_model_file, quantized=True)
        models[name] = LlamaModel(config, weights, torch.device("cpu"), torch.float32, policy)
    agree, positions = 0, 0
    for prompt in _prompts()[:4]:
        logits = {}
        for name, model in models.items():
            runner = PagedRunner(model, KVCacheManager(64, 16), threads=None)
            runner.manager.allocate(0, prompt)
            logits[name] = runner.forward([Chunk(0, prompt, 0)], all_logits=True)
        assert (logits["int8"] - logits["float"]).abs().mean().item() < 0.6
        same = logits["int8"].argmax(-1) == logits["float"].argmax(-1)
        best_two = logits["float"].topk(2, dim=-1).values
        assert ((best_two[:, 0] - best_two[:, 1])[~same] < 0.3).all()
        agree, positions = agree + int(same.sum()), positions + len(prompt)
    assert agree >= 0.9 * positions


PACKABLE = [
    "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
]  # fmt: skip
PACKED = 0x100


def mixed_parts(
    specs: list[tuple[str, int, bool]], k: int, seed: int, variant: str = ""
) -> tuple[list[torch.Tensor], list[int]]:
    """One product's parts, each spec (format, rows, packed?) random blocks of K = ``k``
    (seeds from ``seed`` on), packed where asked and the variant packs that format."""
    raws, tids = [], []
    for i, (qtype, n, pack) in enumerate(specs):
        raw, tid = blocks(qtype, n, k, seed=seed + i), TYPES[qtype][0]
        if pack and ops.quant_packs(tid, variant):
            raw, tid = ops.quant_pack(raw, tid), tid | PACKED
        raws.append(raw)
        tids.append(tid)
    return raws, tids


def test_the_exact_path_keeps_the_files_layout_and_the_fast_path_packs():
    """float32 asked for (the exact reference: float products only) keeps every matrix
    in the file's layout (its tiles dequantize as fast from it, no repacking at load);
    the measured choice packs where the int8 kernels multiply the packed layout."""
    from kvpool.model.loader import load_model
    from kvpool.model.products import QuantLinear

    def types(loaded):
        layer = loaded.model.layers[0]
        products = (layer.qkv, layer.o, layer.gate_up, layer.down)
        assert all(isinstance(p, QuantLinear) for p in products)
        return [t for p in products for t in p.types]

    exact = load_model(None, dtype="float32", progress=False)
    assert exact.model.products.exact and "exact" in exact.compute_line()
    assert not any(t & PACKED for t in types(exact))
    fast = load_model(None, dtype=None, progress=False)
    packs = [ops.quant_packs(t & ~PACKED, fast.model.products.variant) for t in types(fast)]
    assert [bool(t & PACKED) for t in types(fast)] == packs
    # the x86 kernels multiply the packed layout; the plain C++ ones (generic, aarch64) none
    assert any(packs) == (fast.model.products.variant in X86_VARIANTS)


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", PACKABLE)
def test_the_packed_layout_holds_the_same_values(qtype, variant):
    """Repacked rows (groups of 8 interleaved) dequantize to exactly the file's values,
    whole or row by row (an embedding lookup), in the same number of bytes, by every
    variant's dequantization (the x86 ones gather a unit's row with vector shuffles)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tid = TYPES[qtype][0]
    raw = blocks(qtype, 24, 512, seed=3)
    packed = ops.quant_pack(raw, tid)
    # the scales unpacked: 32 bytes more per 8 blocks (Q4_K +2.8%, Q5_K +2.3%, Q3_K +3.6%),
    # IQ4_XS's 16
    more = {"Q4_K": 32, "Q5_K": 32, "Q3_K": 32, "IQ4_XS": 16}.get(qtype, 0)
    extra = raw.numel() * more // (8 * TYPES[qtype][2])
    assert packed.numel() == raw.numel() + extra and packed.shape[0] == 3
    want = dequantize(raw.numpy(), GGMLQuantizationType(tid))
    assert np.array_equal(ops.quant_dequantize(packed, tid | PACKED, 512, variant).numpy(), want)
    bf16 = ops.quant_dequantize(packed, tid | PACKED, 512, variant, None, True)
    assert torch.equal(bf16, torch.from_numpy(want).to(torch.bfloat16))
    rows = torch.tensor([23, 0, 9, 9])
    got = ops.quant_dequantize(packed, tid | PACKED, 512, variant, rows).numpy()
    assert np.array_equal(got, want[rows.numpy()])
    # 200 rows on 2 threads: chunks of 100, whole groups then a group's first 4 rows, and
    # a chunk starting inside a group
    raw = blocks(qtype, 200, 512, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = ops.quant_dequantize(ops.quant_pack(raw, tid), tid | PACKED, 512, variant).numpy()
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(got, dequantize(raw.numpy(), GGMLQuantizationType(tid)))


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", PACKABLE)
def test_packed_products_equal_the_row_kernels(qtype, variant):
    """The packed kernels compute each row's integer sums exactly as the row kernels do
    (only the float accumulation's rounding may differ), row-invariant too; a variant
    without packed kernels (generic, aarch64: they pack nothing) multiplies the packed
    layout by float tiles, as near its int8 row kernels as any float product.
    40 weight rows: two pairs of groups and an odd group (AVX-512 takes pairs in 512-bit
    vectors); 37, 30 and 27 activation rows: passes of 32 and 16 (AVX2's kWide formats,
    then its pair kernel's 4), 16, 8, 4, 3, 2 and 1 rows (from 32 rows, AVX-512 takes two
    units a row's visit: 25 units a row, for the odd one left)."""
    tid = TYPES[qtype][0]
    k = 768 if TYPES[qtype][1] == 256 else 800
    raw = blocks(qtype, 40, k, seed=4)
    packed = ops.quant_pack(raw, tid)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(4))
    for mode in (0, 1):
        rows = ops.quant_matmul(x, [raw], [tid], mode, variant)
        grouped = ops.quant_matmul(x, [packed], [tid | PACKED], mode, variant)
        exact = mode == 1 or ops.quant_packs(tid, variant)
        bound = 1e-5 if exact else INT8_PRODUCT_BOUND
        assert (grouped - rows).abs().max().item() <= bound * rows.abs().max().item()
    if not ops.quant_packs(tid, variant):  # float tiles: one order of sums below 16 rows
        x = x[:11]
    batch = ops.quant_matmul(x, [packed], [tid | PACKED], 0, variant)
    for i in (i for i in (0, 5, 10, 17, 33, 36) if i < len(x)):
        alone = ops.quant_matmul(x[i : i + 1], [packed], [tid | PACKED], 0, variant)[0]
        assert torch.equal(alone, batch[i])
    for n in (n for n in (30, 27) if n < len(x)):
        assert torch.equal(ops.quant_matmul(x[:n], [packed], [tid | PACKED], 0, variant), batch[:n])
    for one_row in (1, 2):  # a single row's two kernels (AVX-512's; one elsewhere): one result
        alone = ops.quant_matmul(x[:1], [packed], [tid | PACKED], one_row << 4, variant)
        assert torch.equal(alone[0], batch[0])
    # read further ahead (FAR_AHEAD): when the weights are asked for changes, no result
    for n in (1, 2, 3, 4, 5, 9):
        for one_row in (0, 1, 2):
            far = ops.quant_matmul(
                x[:n], [packed], [tid | PACKED], FAR_AHEAD | one_row << 4, variant
            )
            assert torch.equal(far, batch[:n])
    assert ops.quant_packs(tid, variant) == (variant in X86_VARIANTS)
    if variant.startswith("avx512"):  # AVX-512's packed kernels agree bit for bit, AMX too
        # 150 rows: a block of 128 (on AMX one call, its 16-row tiles after one unpacking
        # of each unit) and one of 22 (AMX: 16 rows, then the dot instructions' 4 and 2)
        x = torch.randn(150, k, generator=torch.Generator().manual_seed(5))
        batch = ops.quant_matmul(x, [packed], [tid | PACKED], 0, variant)
        assert torch.equal(batch, ops.quant_matmul(x, [packed], [tid | PACKED], 0, "avx512-vnni"))


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("rows", [1, 5, 130])  # 130: two blocks of activation rows
def test_products_are_the_same_on_any_number_of_threads(rows, variant):
    """Threads take runs of tiles from a shared counter, so which thread computes which
    outputs changes from call to call; the outputs do not: bit for bit the same on 1 to 4
    threads (more threads than this machine's cores included), for integer, float and
    bf16-tile products of packed and row-layout parts of different formats in one call.
    Each count twice: a thread's first tile is where torch's per-thread start reset the
    thread count oneDNN's bf16 matmul planned by (seen on an AMX Xeon)."""
    specs = [("Q4_0", 72, True), ("Q6_K", 40, True), ("Q4_K", 24, False), ("Q8_0", 48, True)]
    raws, tids = mixed_parts(specs, 512, 10, variant)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    threads = torch.get_num_threads()
    try:
        for mode in (0, 1, 2):
            for dtype in (torch.float32, torch.bfloat16):
                got = []
                for n in (1, 2, 3, 4) * 2:
                    torch.set_num_threads(n)
                    got.append(ops.quant_matmul(x.to(dtype), raws, tids, mode, variant, True))
                assert all(torch.equal(g, got[0]) for g in got[1:]), (mode, dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "specs",
    [
        [("Q8_0", 64, True)],
        [("Q4_K", 64, False)],
        [("Q4_K", 256, False), ("Q6_K", 128, True)],
        [("Q4_K", 1024, True), ("Q8_0", 512, False)],
    ],
    ids=["one-Q8_0-tile", "one-Q4_K-tile", "six-tiles", "wide-tiles"],
)
def test_large_float_products_are_the_same_on_any_number_of_threads(specs):
    """Float and bf16 tiles at a real model's K (2,048) and 300 rows, where torch's at::mm
    of a tile planned by the thread count (oneDNN's bf16 matmul by the OpenMP team's size,
    MKL's sgemm by its own count outside a region): on an AMX Xeon 1 and 2 threads gave
    other bits (in the engine, its thread policy's modes would have). Each tile's library
    call plans for and runs on its one thread, so 1 to 4 threads agree. Parts of 1,024 and
    512 rows take tiles wider than 64 rows where the CPUs are few (256 and 128 on 2 CPUs):
    their width comes from the CPUs, never from the call's threads."""
    raws, tids = mixed_parts(specs, 2048, 3)
    x = torch.randn(300, 2048, generator=torch.Generator().manual_seed(300))
    threads = torch.get_num_threads()
    try:
        for mode in (1, 2):
            for dtype in (torch.float32, torch.bfloat16):
                got = []
                for n in (1, 2, 3, 4, 2):
                    torch.set_num_threads(n)
                    got.append(ops.quant_matmul(x.to(dtype), raws, tids, mode, "", True))
                assert all(torch.equal(g, got[0]) for g in got[1:]), (mode, dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 32, 1100])  # 1100: several blocks of activation rows
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_products_in_bf16_round_once_as_torch_does(rows, mode):
    """``same_dtype``: a bf16 input's product comes back in bf16, each float32 sum rounded
    once, bit for bit what ``.to(torch.bfloat16)`` of the float32 result gives: each work
    item's sums are rounded into the output as it ends (integer tiles of packed and
    row-layout parts, float tiles, ``at::mm``'s, bf16 tiles), in a product of parts of
    different formats; calls of other sizes in between leave no trace."""
    specs = [("Q4_0", 40, True), ("Q6_K", 24, True), ("Q4_K", 16, False), ("Q8_0", 32, False)]
    raws, tids = mixed_parts(specs, 256, 5)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = ops.quant_matmul(x, raws, tids, mode).to(torch.bfloat16)
    ops.quant_matmul(torch.randn(7, 256).to(torch.bfloat16), raws, tids, mode, "", True)
    got = ops.quant_matmul(x, raws, tids, mode, "", True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    floats = ops.quant_matmul(x.float(), raws, tids, mode, "", True)
    assert floats.dtype == torch.float32  # a float32 input keeps float32
    # bf16 activations are quantized from rows widened a few at a time (no float32 copy
    # of x): the same blocks, so the same sums, as from the float32 input
    assert torch.equal(ops.quant_matmul(x, raws, tids, mode), floats)


def _extreme_blocks(qtype: str, n: int, k: int, rng) -> torch.Tensor:
    """Rows by n % 4: every value the format's lowest, every value its highest, a mix
    (Q4_0: 15 in each block's first half, 0 in its second), random bytes; Q6_K's int8
    scales random over their whole range; Q5_K's scales and mins all 63 (the largest)."""
    if qtype in ("Q4_0", "Q5_0"):  # (Q5_0: qh[4] | qs[16], the same patterns over both)
        width = 16 if qtype == "Q4_0" else 20
        body = np.zeros((n, k // 32, width), np.uint8)
        body[1::4] = 0xFF
        body[2::4] = 0x0F
        body[3::4] = rng.integers(0, 256, (n // 4, k // 32, width), dtype=np.uint8)
        d = np.full((n, k // 32, 1), 0.5, np.float16).view(np.uint8).reshape(n, k // 32, 2)
        return torch.from_numpy(np.concatenate([d, body], axis=2).reshape(n, -1).copy())
    if qtype == "Q5_K":  # d, dmin | scales[12] | qh[32] | qs[128]
        body = np.zeros((n, k // 256, 172), np.uint8)
        body[:, :, :12] = 0xFF  # every 6-bit scale and min 63
        body[1::4, :, 12:] = 0xFF  # q all 31
        body[2::4, :, 44:] = 0x0F  # q 15 or 0 by position, no fifth bits
        body[3::4, :, 12:] = rng.integers(0, 256, (n // 4, k // 256, 160), dtype=np.uint8)
        d = np.full((n, k // 256, 2), 2**-7, np.float16).view(np.uint8).reshape(n, k // 256, 4)
        return torch.from_numpy(np.concatenate([d, body], axis=2).reshape(n, -1).copy())
    body = np.zeros((n, k // 256, 192), np.uint8)  # ql[128] | qh[64]: q all 0
    body[1::4] = 0xFF  # q all 63
    body[2::4, :, :64] = 0xFF  # q 15 or 63 by position
    body[3::4] = rng.integers(0, 256, (n // 4, k // 256, 192), dtype=np.uint8)
    scales = rng.integers(-128, 128, (n, k // 256, 16)).astype(np.int8).view(np.uint8)
    scales[0::4, :, :2] = 0x80  # -128 for both halves of a unit: the largest sum
    d = np.full((n, k // 256, 1), 2**-7, np.float16).view(np.uint8).reshape(n, k // 256, 2)
    return torch.from_numpy(np.concatenate([body, scales, d], axis=2).reshape(n, -1).copy())


@pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q5_K", "Q6_K"])
def test_packed_offsets_in_the_sums_at_the_int16_limits(qtype, variant):
    """Q4_0's offset of 8 and Q6_K's of 32 taken into the integer sums (AVX2), and the 5-bit
    formats' sums by halves, at the extremes of int16: the format's lowest and highest
    values against activations all at +-127, signs by position mod 4 (the lanes an offset is
    split over). Activations of +-1 quantize exactly, so the integer products must equal the
    dequantized float product to its rounding; a wrapped int16 sum would be off by 65536
    times a scale. Batch and rows alone (different kernels) alike."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(7)
    n, k = 32, 512
    raw = _extreme_blocks(qtype, n, k, rng)
    pos = np.arange(k)
    signs = [
        np.ones(k), -np.ones(k), np.where(pos % 4 < 2, 1.0, -1.0),
        np.where(pos % 4 < 2, -1.0, 1.0), np.where(pos % 32 < 16, 1.0, -1.0),
        np.where(pos % 2 == 0, 1.0, -1.0), rng.choice([-1.0, 1.0], k), -np.ones(k), np.ones(k),
    ]  # fmt: skip
    # 18 rows: AMX's tiles take 16 at once (avx512-amx), the dot instructions the rest
    x = torch.tensor(np.concatenate([np.stack(signs), -np.stack(signs)]), dtype=torch.float32)
    tid = TYPES[qtype][0]
    want = x @ torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType(tid))).T
    packed = ops.quant_pack(raw, tid)
    batch = ops.quant_matmul(x, [packed], [tid | PACKED], 0, variant)
    assert (batch - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    for i in range(x.shape[0]):
        alone = ops.quant_matmul(x[i : i + 1], [packed], [tid | PACKED], 0, variant)[0]
        assert torch.equal(alone, batch[i])
