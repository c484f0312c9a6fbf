"""Loader and model beyond one file: small random GGUF models of every architecture and
many ggml types, against transformers loading the same files."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool.cache import KVCacheManager  # noqa: E402
from kvpool.formats.gguf_header import read_gguf_header  # noqa: E402
from kvpool.model.gguf_weights import (  # noqa: E402
    QuantizedMatrix,
    QuantizedRows,
    load_gguf_weights,
)
from kvpool.model.llama import LlamaModel  # noqa: E402
from tests.paged_runner import Chunk, PagedRunner  # noqa: E402
from tests.synthetic_gguf import (  # noqa: E402
    EXPERT_INTER,
    EXPERTS,
    GEMMA3_LAYERS,
    GEMMA3_WINDOW,
    HEADS,
    HIDDEN,
    USED,
    write_model,
)

MIXES = {
    "legacy": {
        "token_embd.weight": "Q8_0", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1",
        "attn_v.weight": "Q5_0", "attn_output.weight": "Q5_1", "ffn_gate.weight": "F16",
        "ffn_up.weight": "BF16", "ffn_down.weight": "Q8_0", "output.weight": "F16",
    },
    "k-quants": {
        "token_embd.weight": "Q6_K", "attn_q.weight": "Q4_K", "attn_k.weight": "Q5_K",
        "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q5_K",
        "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K", "output.weight": "Q8_0",
    },
    "low-bit": {
        "token_embd.weight": "Q4_K", "attn_q.weight": "Q2_K", "attn_k.weight": "Q3_K",
        "attn_v.weight": "Q3_K", "attn_output.weight": "Q2_K", "ffn_gate.weight": "Q3_K",
        "ffn_up.weight": "Q2_K", "ffn_down.weight": "Q3_K", "output.weight": "Q6_K",
    },
    "iq4": {
        "token_embd.weight": "IQ4_XS", "attn_q.weight": "IQ4_NL", "attn_k.weight": "IQ4_XS",
        "attn_v.weight": "IQ4_NL", "attn_output.weight": "IQ4_XS", "ffn_gate.weight": "IQ4_XS",
        "ffn_up.weight": "IQ4_NL", "ffn_down.weight": "IQ4_XS", "output.weight": "Q6_K",
    },
    "grids": {  # kept in their blocks, multiplied by dequantized tiles
        "token_embd.weight": "IQ3_S", "attn_q.weight": "IQ2_XXS", "attn_k.weight": "IQ2_XS",
        "attn_v.weight": "IQ3_XXS", "attn_output.weight": "IQ2_S", "ffn_gate.weight": "IQ1_S",
        "ffn_up.weight": "IQ1_M", "ffn_down.weight": "IQ3_S", "output.weight": "IQ2_XXS",
    },
    "ternary": {  # kept in their blocks (TriLM's and BitNet-style files), as llama.cpp mixes
        "token_embd.weight": "Q4_K", "attn_q.weight": "TQ2_0", "attn_k.weight": "TQ1_0",
        "attn_v.weight": "TQ2_0", "attn_output.weight": "TQ1_0", "ffn_gate.weight": "TQ2_0",
        "ffn_up.weight": "TQ1_0", "ffn_down.weight": "TQ2_0", "output.weight": "Q6_K",
    },
}  # fmt: skip
# The quantized path's logits against the dequantized reference: float products are
# exact up to the order of sums; int8 products (activations quantized per block of 32)
# stay within this share of the largest logit (measured on these random models:
# 3-9%; on the default model: tests/test_quant_products.py).
INT8_LOGIT_BOUND = 0.1


def _native():
    from kvpool.model.native import native_ops

    return native_ops()


def _logits(model, prompt: list[int]) -> torch.Tensor:
    runner = PagedRunner(model, KVCacheManager(32, 16))
    runner.manager.allocate("s", prompt[:-1])
    prefill = runner.forward([Chunk("s", prompt[:-1], 0)], all_logits=True)
    runner.manager.append("s", prompt[-1:])
    decode = runner.forward([Chunk("s", prompt[-1:], len(prompt) - 1)])
    return torch.cat([prefill, decode])


def _reference(path: Path, arch: str):
    """transformers' model of the file. Its GGUF loader does not read a qwen3moe file's
    expert width (it takes Qwen3MoeConfig's default, 768), nor the factor a gemma3
    file's scores are scaled by (Gemma3TextConfig's default: 256 ** -0.5; the file's
    heads are 64 wide, and llama.cpp scales by the head width): given here."""
    more: dict = {}
    if arch == "qwen3moe":
        more = {"moe_intermediate_size": EXPERT_INTER}
    if arch == "gemma3":
        more = {"query_pre_attn_scalar": HIDDEN // HEADS}
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **more
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_random_model_matches_reference(tmp_path: Path, arch: str, mix: str):
    """qwen3moe: each layer's feed-forward a mixture of experts, the expert stacks in the
    mix's types (experts take the type of the matrix they stand for), the router F32.
    gemma3: five sliding-window layers (a window of 11, the 45-token prompt's longer)
    and a global one, each with its rotary base, sandwich norms, gelu, the embedding
    scaled (and tied to the head)."""
    path = write_model(tmp_path / f"{arch}-{mix}.gguf", arch, MIXES[mix], seed=len(arch + mix))
    reference = _reference(path, arch)
    quantized = _native() is not None  # the weights in their blocks, as the runtime has them
    config, weights = load_gguf_weights(path, quantized=quantized)
    assert config.architecture == arch and config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch.startswith("qwen3") or arch == "gemma3")
    moe = (EXPERTS, USED, EXPERT_INTER) if arch == "qwen3moe" else (0, 0, 0)
    assert (config.experts, config.experts_used, config.expert_ffn) == moe
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    if quantized:
        assert isinstance(model.embed, QuantizedRows)
    prompt = [(7 * i + 3) % 500 for i in range(45)]
    ours = _logits(model, prompt)
    with torch.inference_mode():
        ref = reference(torch.tensor([prompt])).logits[0].float()
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - ref).abs().max().item() < 1e-3


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_int8_products_stay_near_the_float_products(tmp_path: Path, mix: str):
    """Every quant type's int8 products (the fast path) against its float products
    (the dequantized reference), whole model, in float32 activations."""
    from kvpool.model.products import ProductPolicy

    path = write_model(tmp_path / f"{mix}.gguf", "llama", MIXES[mix], seed=len(mix))
    logits = {}
    for name, policy in (("float", ProductPolicy(exact=True)), ("int8", ProductPolicy())):
        config, weights = load_gguf_weights(path, quantized=True)
        model = LlamaModel(config, weights, torch.device("cpu"), torch.float32, policy)
        logits[name] = _logits(model, [(5 * i + 1) % 500 for i in range(40)])
    scale = logits["float"].abs().max().item()
    error = (logits["int8"] - logits["float"]).abs().max().item()
    assert scale > 1.0 and error < INT8_LOGIT_BOUND * scale, (error, scale)


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
@pytest.mark.parametrize(
    ("dtype", "int8_max_rows"),
    [(torch.float32, "exact"), (torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 40)],
)
def test_a_long_steps_feed_forward_runs_in_slices_with_the_whole_steps_kernel(
    tmp_path, monkeypatch, dtype, int8_max_rows
):
    """A prefill step's feed-forward runs over slices of at least ``FFN_SLICE_ROWS``
    tokens (its largest transient, cut), never under the int8 crossover when that is
    set higher (each slice then takes the product kernel the whole step takes). int8
    products are row-invariant: the same bits; float tiles within float32 rounding."""
    from kvpool.model import llama
    from kvpool.model.products import ProductPolicy

    path = write_model(tmp_path / "m.gguf", "llama", MIXES["k-quants"], seed=3)
    exact = int8_max_rows == "exact"
    policy = ProductPolicy(exact=exact, int8_max_rows=None if exact else int8_max_rows)
    prompt = [(7 * i + 3) % 500 for i in range(100)]
    logits, calls = {}, {}
    for slice_rows in (1000, 16):
        monkeypatch.setattr(llama, "FFN_SLICE_ROWS", slice_rows)
        config, weights = load_gguf_weights(path, dtype, quantized=True)
        model = LlamaModel(config, weights, torch.device("cpu"), dtype, policy)
        rows: list[int] = []
        gate_up = model.layers[0].gate_up
        model.layers[0].gate_up = lambda x, f=gate_up, seen=rows: seen.append(len(x)) or f(x)
        runner = PagedRunner(model, KVCacheManager(32, 16))
        runner.manager.allocate("s", prompt)
        logits[slice_rows] = runner.forward([Chunk("s", prompt, 0)], all_logits=True)
        calls[slice_rows] = rows
    assert calls[1000] == [100]
    # slices of 16 or more, or of 41 or more where int8 runs up to 40 rows (tiles above)
    assert calls[16] == ([50, 50] if int8_max_rows == 40 else [17] * 4 + [16] * 2)
    if policy.mode(16) == policy.mode(100) == 0:  # int8 products
        assert torch.equal(logits[16], logits[1000])
    else:
        scale = logits[1000].abs().max().item()
        assert (logits[16] - logits[1000]).abs().max().item() < 1e-4 * scale


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "gemma3"])
def test_qwen3_serving_path_stays_near_float32(tmp_path: Path, arch: str):
    """A qwen3 file as ``kvpool serve`` runs it (bfloat16, int8 products, a decode step's
    layers and their Q/K norms in one native call; a qwen3moe file's experts through the
    same products; a gemma3 file's windows, layer by layer) against its float32
    float-product reference. The median row: a tiny
    random model has positions where bf16's rounding alone (float products too) flips a
    near-tie in a hidden state and moves a few rows' logits by the whole scale, in llama
    files as in qwen3 ones."""
    from kvpool.model.products import ProductPolicy

    path = write_model(tmp_path / f"{arch}.gguf", arch, MIXES["k-quants"], seed=9)
    logits, models = {}, {}
    for dtype, policy in ((torch.float32, ProductPolicy(exact=True)), (torch.bfloat16, None)):
        config, weights = load_gguf_weights(path, dtype, quantized=True)
        models[dtype] = LlamaModel(config, weights, torch.device("cpu"), dtype, policy)
        logits[dtype] = _logits(models[dtype], [(5 * i + 2) % 500 for i in range(40)])
    if arch == "qwen3":
        assert models[torch.bfloat16]._decode_layers  # its decode step took the native call
    scale = logits[torch.float32].abs().max().item()
    rows = (logits[torch.bfloat16] - logits[torch.float32]).abs().amax(dim=-1)
    assert scale > 1.0 and rows.median().item() < 0.25 * INT8_LOGIT_BOUND * scale, (rows, scale)


def _llama3_rope_factors(head_dim: int, base: float, scaling: dict[str, float]):
    """``rope_freqs.weight`` as llama.cpp's converter writes it for a Llama-3.1 model: the
    factor each rotary frequency is divided by (1 for short wavelengths, ``factor`` for
    long ones, a smooth blend between)."""
    import numpy as np

    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    old, low, high = (scaling[k] for k in ("original_max_position_embeddings",
                                          "low_freq_factor", "high_freq_factor"))  # fmt: skip
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / scaling["factor"] + smooth)
    factors = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low,
                       scaling["factor"], blend))  # fmt: skip
    return factors.astype(np.float32)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_dense_load_is_the_same_on_any_threads_and_made_on_its_device(tmp_path, mix, monkeypatch):
    """Dequantized tensors (the GPU's load, or the CPU's without the native ops) are the
    same on one thread as on several, in the file's order, and each is made on the
    device asked for (a GPU's load never holds the whole model in host memory): here
    "meta", where a tensor made on the CPU and not moved would show."""
    from kvpool.model import gguf_weights

    path = write_model(tmp_path / "m.gguf", "llama", MIXES[mix], seed=4)
    loads = {}
    for threads in (1, 3):
        monkeypatch.setattr(gguf_weights, "DEQUANTIZE_THREADS", threads)
        loads[threads] = load_gguf_weights(path, torch.bfloat16)[1]
    names = [info.name for info in read_gguf_header(path).tensors]
    assert list(loads[1]) == list(loads[3]) == names
    for name in names:
        assert loads[1][name].dtype == torch.bfloat16
        assert torch.equal(loads[1][name], loads[3][name]), name
    _, on_meta = load_gguf_weights(path, torch.bfloat16, device=torch.device("meta"))
    assert all(t.device.type == "meta" and t.dtype == torch.bfloat16 for t in on_meta.values())
    assert {n: t.shape for n, t in on_meta.items()} == {n: t.shape for n, t in loads[1].items()}


def test_llama3_rope_scaling_matches_reference(tmp_path: Path):
    """A ``rope_freqs`` tensor (Llama 3.1 / 3.2 files) scales the rotary frequencies as
    transformers' ``llama3`` rope type does. transformers' GGUF loader ignores the tensor,
    so the reference is its model rebuilt with that rope type and the same weights."""
    from tests.synthetic_gguf import HEADS, HIDDEN

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    factors = _llama3_rope_factors(HIDDEN // HEADS, 10000.0, scaling)
    assert 1.0 < factors.mean() < 8.0  # the test scales some frequencies, not all or none
    path = write_model(tmp_path / "llama3.gguf", "llama", {}, extra={"rope_freqs.weight": factors})
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    config = plain.config
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, **scaling}
    reference = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    reference.load_state_dict(plain.state_dict())

    config_ours, weights = load_gguf_weights(path)
    runner = PagedRunner(
        LlamaModel(config_ours, weights, torch.device("cpu"), torch.float32),
        KVCacheManager(32, 16),
    )
    prompt = [(11 * i + 5) % 500 for i in range(120)]
    runner.manager.allocate("s", prompt)
    ours = runner.forward([Chunk("s", prompt, 0)], all_logits=True)
    with torch.inference_mode():
        want = reference(torch.tensor([prompt])).logits[0].float()
        unscaled = plain(torch.tensor([prompt])).logits[0].float()
    assert (ours - want).abs().max().item() < 1e-3
    assert (ours - unscaled).abs().max().item() > 1e-2  # the scaling is really applied


@pytest.mark.parametrize(
    "qname", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "Q2_K", "IQ3_S", "IQ1_M"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_embedding_rows_equal_the_dequantized_matrix(tmp_path, qname, dtype):
    path = write_model(tmp_path / "m.gguf", "llama", {"token_embd.weight": qname})
    _, kept = load_gguf_weights(path, dtype, quantized=True)
    _, dense = load_gguf_weights(path, dtype)
    table = QuantizedRows(kept["token_embd.weight"], dtype)
    full = dense["token_embd.weight"]
    assert table.shape == tuple(full.shape) and table.numel() == full.numel()
    ids = torch.tensor([0, 7, 7, full.shape[0] - 1, 3])
    got = table[ids]
    assert got.dtype == dtype and torch.equal(got, full[ids])


def test_quantized_weights_are_kept_once_in_their_blocks(tmp_path):
    """Quantized matrices stay as the file's bytes (one copy: the file's size), F16 ones
    dense in the runtime's dtype, and 1-D tensors dense."""
    path = write_model(tmp_path / "m.gguf", "llama", {**MIXES["k-quants"], "ffn_up.weight": "F16"})
    _, kept = load_gguf_weights(path, quantized=True)
    q = kept["blk.0.attn_q.weight"]
    assert isinstance(q, QuantizedMatrix) and q.raw.dtype == torch.uint8
    assert q.nbytes == q.numel() // 256 * 144  # Q4_K: 144 bytes per 256 values
    assert isinstance(kept["blk.0.ffn_up.weight"], torch.Tensor)
    assert isinstance(kept["blk.0.attn_norm.weight"], torch.Tensor)


def test_the_load_asks_for_the_file_ahead_of_its_reads(tmp_path, monkeypatch):
    """While the loader reads, a thread asks the OS for the tensor data after its reads
    (posix_fadvise WILLNEED, a chunk a call: a file not yet in the page cache comes from
    the disk while the loader packs what it read): the data's chunks in the file's order,
    none twice, at most READ_AHEAD_BYTES ahead of the reads. Where the OS refuses the
    advice, or has no such call (macOS), the load is the same."""
    import os
    import threading

    from kvpool.model import gguf_weights

    path = write_model(tmp_path / "m.gguf", "llama", MIXES["k-quants"])
    header = read_gguf_header(path)
    size = path.stat().st_size
    monkeypatch.setattr(gguf_weights, "READ_AHEAD_CHUNK", 4096)
    monkeypatch.setattr(gguf_weights, "READ_AHEAD_BYTES", 64 * 1024)
    calls, reads = [], []
    advised_once = threading.Event()  # (the first read waits for the thread's first call)
    real_readinto = gguf_weights._ReadAhead.readinto

    def readinto(self, buffer):
        assert advised_once.wait(timeout=60)
        reads.append(self.tell())
        return real_readinto(self, buffer)

    def advise(fd, offset, length, advice):
        assert threading.current_thread().name == "kvpool-read-ahead"
        calls.append((offset, length, advice, reads[-1] if reads else header.data_offset))
        advised_once.set()

    monkeypatch.setattr(gguf_weights._ReadAhead, "readinto", readinto)
    monkeypatch.setattr(os, "POSIX_FADV_WILLNEED", 3, raising=False)
    monkeypatch.setattr(os, "posix_fadvise", advise, raising=False)
    _, advised = load_gguf_weights(path, quantized=True)
    assert calls and reads == sorted(reads)  # (the loader reads in the file's order)
    for (offset, length, advice, reading), following in zip(calls, [*calls[1:], None], strict=True):
        assert advice == 3 and 0 < length <= 4096
        assert header.data_offset <= offset and offset + length <= size
        assert offset < reading + 64 * 1024  # (reading: where the loader's reads had got)
        if following is not None:
            assert following[0] >= offset + length  # in order, nothing asked twice
    assert not any(t.name == "kvpool-read-ahead" for t in threading.enumerate())

    def refuse(*call):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    monkeypatch.setattr(gguf_weights._ReadAhead, "readinto", real_readinto)
    _, refused = load_gguf_weights(path, quantized=True)
    monkeypatch.delattr(os, "posix_fadvise")
    _, without = load_gguf_weights(path, quantized=True)
    for name, tensor in advised.items():
        for other in (refused[name], without[name]):
            if isinstance(tensor, QuantizedMatrix):
                assert torch.equal(tensor.raw, other.raw), name
            else:
                assert torch.equal(tensor, other), name


def _skip_without_packed_kernels() -> None:
    """The loader packs matrices only for kernels that multiply the packed layout (none of
    the generic variant's: a CPU without AVX2, such as aarch64)."""
    from kvpool.model.native import kernel_variant

    if not _native().quant_packs(12, kernel_variant()):  # Q4_K
        pytest.skip(f"the {kernel_variant()} kernels multiply no packed layout")


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
@pytest.mark.parametrize(
    "arch, mix",
    [("llama", "legacy"), ("llama", "k-quants"), ("llama", "iq4"), ("qwen3moe", "k-quants")],
)
def test_matrices_packed_slice_by_slice_equal_those_packed_whole(tmp_path, monkeypatch, arch, mix):
    """The loader packs a matrix a slice of 8-row groups at a time (the staging buffer's
    bound): 8 rows a slice, 24-88 (a last slice shorter), or the whole matrix at once give
    the same bytes, for every packed type and a stack of experts."""
    import kvpool.model.gguf_weights as gguf_weights
    from kvpool.model.native import kernel_variant

    _skip_without_packed_kernels()
    path = write_model(tmp_path / "m.gguf", arch, MIXES[mix])
    loads = []
    # 8 rows a slice; 24 to 88 (rows of 544 to 144 bytes here), never dividing these
    # matrices' power-of-two rows: a shorter last slice; the whole matrix
    for limit in (1, 24 * 544, 1 << 40):
        monkeypatch.setattr(gguf_weights, "STAGING_BYTES", limit)
        loads.append(load_gguf_weights(path, quantized=True, pack_variant=kernel_variant())[1])
    packed = [name for name, w in loads[2].items() if isinstance(w, QuantizedMatrix) and w.packed]
    assert packed
    for name in packed:
        assert all(torch.equal(load[name].raw, loads[2][name].raw) for load in loads[:2]), name


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
@pytest.mark.parametrize("packed", [False, True])
def test_experts_are_views_of_their_stack(tmp_path: Path, packed: bool):
    """A stack of experts is held once, as the file's blocks (packed or not); the model's
    experts are views of it, each the rows of its own expert, and multiply as the whole
    stack's rows do."""
    from kvpool.model.native import kernel_variant
    from kvpool.model.products import ProductPolicy

    if packed:
        _skip_without_packed_kernels()
    path = write_model(tmp_path / "moe.gguf", "qwen3moe", MIXES["k-quants"])
    variant = kernel_variant() if packed else None
    _, kept = load_gguf_weights(path, quantized=True, pack_variant=variant)
    stack = kept["blk.1.ffn_up_exps.weight"]
    assert isinstance(stack, QuantizedMatrix) and stack.shape == (EXPERTS * EXPERT_INTER, 256)
    rows = EXPERTS * EXPERT_INTER  # Q4_K: the file's 144 bytes per 256 values, or packed
    size = _native().quant_packed_bytes(12, rows, 256) if packed else rows * 144
    assert stack.packed == packed and stack.nbytes == size
    experts = stack.split(EXPERTS)
    assert all(e.raw.data_ptr() == stack.raw[0].data_ptr() + i * e.nbytes
               for i, e in enumerate(experts))  # fmt: skip
    x = torch.randn(3, 256)
    ops, mode = _native(), 1  # float products: the dequantized rows
    whole = ops.quant_matmul(x, [stack.raw], [stack.native_type], mode, "", False)
    for i, expert in enumerate(experts):
        part = ops.quant_matmul(x, [expert.raw], [expert.native_type], mode, "", False)
        assert torch.equal(part, whole[:, i * EXPERT_INTER : (i + 1) * EXPERT_INTER])
    with pytest.raises(ValueError):
        stack.split(3)
    config, weights = load_gguf_weights(path, quantized=True, pack_variant=variant)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, ProductPolicy())
    moe = model.layers[1].experts
    assert model.layers[1].gate_up is None and len(moe.gate_up) == EXPERTS
    assert moe.router.dtype == torch.float32 and moe.router.shape == (EXPERTS, 256)


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
def test_native_mixture_computes_the_torch_mixture(tmp_path: Path):
    """The native ``MixtureOfExperts`` (what a bf16 model runs, prefill and decode) against
    the torch mixture (float32's, which the reference test holds to transformers), on the
    same float products: the same experts for every token and the same sums, up to
    float32 rounding."""
    from kvpool.model.products import FLOAT, INT8

    path = write_model(tmp_path / "moe.gguf", "qwen3moe", MIXES["k-quants"], seed=6)
    config, weights = load_gguf_weights(path, quantized=True)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    experts = model.layers[1].experts
    native = experts.native_for(_native())
    h = torch.randn(37, 256, generator=torch.Generator().manual_seed(2))
    want = model._mixture(h, experts)  # float32: torch's ops
    scale = want.abs().max().item()
    got = native.run(h, FLOAT, -1, "")
    assert scale > 0.1 and (got - want).abs().max().item() < 1e-5 * scale
    # int8 products are the batch-invariant ones: a token alone gets what it gets in a batch
    batch = native.run(h, INT8, -1, "")
    assert torch.equal(native.run(h[5:6].contiguous(), INT8, -1, ""), batch[5:6])
    # a mixture of one expert in eight is that expert's feed-forward, unweighted
    alone = _native().MixtureOfExperts(
        experts.router, [(p.raws, p.types, None) for p in experts.gate_up],
        [(p.raws, p.types, None) for p in experts.down], 1,
    )  # fmt: skip
    first = int(torch.nn.functional.linear(h[:1], experts.router).argmax())
    plain = experts.down[first](model._silu_mul(experts.gate_up[first](h[:1])))
    assert (alone.run(h[:1].contiguous(), FLOAT, -1, "") - plain).abs().max() < 1e-5 * scale


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_invariant_mixture_computes_a_sequence_alike_in_any_batch(tmp_path, dtype):
    """A batch-invariant model (``--batch-invariant``) of a mixture of experts: a sequence's
    logits are the same bits alone and beside another sequence in the step (its routing
    included: float32's torch router product sums in an order that changes with the
    rows, so the native mixture computes it there too)."""
    from kvpool.model.products import ProductPolicy

    path = write_model(tmp_path / "moe.gguf", "qwen3moe", MIXES["k-quants"], seed=8)
    config, weights = load_gguf_weights(path, dtype, quantized=True)
    model = LlamaModel(config, weights, torch.device("cpu"), dtype, ProductPolicy(fixed=True))
    prompts = {
        "a": [(3 * i + 1) % 500 for i in range(30)],
        "b": [(5 * i + 2) % 500 for i in range(41)],
    }

    def run(seqs: list[str]) -> torch.Tensor:
        """Prefill logits of every token of ``seqs``, then of one decode step of each."""
        runner = PagedRunner(model, KVCacheManager(32, 16))
        for seq in seqs:
            runner.manager.allocate(seq, prompts[seq])
        prefill = runner.forward([Chunk(s, prompts[s], 0) for s in seqs], all_logits=True)
        for seq in seqs:
            runner.manager.append(seq, [7])
        decode = runner.forward([Chunk(s, [7], len(prompts[s])) for s in seqs])
        return prefill, decode

    prefill, decode = run(["a"])  # a step of one row: torch's router product takes gemv
    prefill_both, decode_both = run(["b", "a"])
    assert torch.equal(prefill_both[len(prompts["b"]) :], prefill)
    assert torch.equal(decode_both[1:], decode)


def test_unsupported_mixtures_are_refused(tmp_path: Path):
    """Shared experts (qwen2moe's kind) are refused with the reason, not run wrong."""
    import numpy as np

    from kvpool.model.config import UnsupportedModel

    shared = {"blk.0.ffn_gate_shexp.weight": np.zeros((64, 256), np.float32)}
    path = write_model(tmp_path / "shared.gguf", "qwen3moe", {}, extra=shared)
    with pytest.raises(UnsupportedModel, match="shared experts"):
        load_gguf_weights(path)
    # a llama file with experts (Mixtral's kind) is refused, not run as a dense model
    path = write_model(tmp_path / "mixtral.gguf", "llama", {}, counts={"llama.expert_count": 8})
    with pytest.raises(UnsupportedModel, match="mixture of experts in a llama file"):
        load_gguf_weights(path)


# Parameter counts the models' publishers state (Hugging Face configs' totals).
PUBLISHED_PARAMETERS = {
    "smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248, "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624, "gemma3-1b": 999_885_952,
    # Gemma 3 4B's language model (its published 4.3 B count includes the vision tower,
    # which GGUF keeps in another file)
    "gemma3-4b": 3_880_263_168,
}  # fmt: skip


def test_synth_model_presets_have_the_published_sizes():
    import math

    from kvpool.bench.synth_model import PRESETS, _shapes

    assert set(PRESETS) == set(PUBLISHED_PARAMETERS)
    for name, geometry in PRESETS.items():
        shapes = _shapes(geometry)
        count = sum(math.prod(shape) for t, shape, _ in shapes if t != "rope_freqs.weight")
        assert count == PUBLISHED_PARAMETERS[name], name


def test_synth_model_refuses_an_unknown_preset_writing_nothing(tmp_path: Path, capsys):
    from kvpool.cli import main

    args = ["bench", "synth-model", "--preset", "llama-9b", "--out", str(tmp_path)]
    assert main(args) == 2
    said = capsys.readouterr()
    assert "unknown preset; choose from smollm2-135m, llama-3.2-1b" in said.err and not said.out
    assert not list(tmp_path.iterdir())


def test_synth_model_takes_a_mix_in_any_case_and_refuses_an_unknown_one(
    tmp_path: Path, capsys, monkeypatch
):
    from kvpool.bench import synth_model
    from kvpool.cli import main

    written = []
    monkeypatch.setattr(synth_model, "write", lambda *a: written.append(a) or a[2])
    args = ["bench", "synth-model", "--preset", "llama-3.2-1b", "--out", str(tmp_path)]
    assert main([*args, "--mix", "q4_k_m"]) == 0
    assert written == [("llama-3.2-1b", "Q4_K_M", tmp_path / "llama-3.2-1b-Q4_K_M.gguf")]
    capsys.readouterr()
    assert main([*args, "--mix", "Q4_9"]) == 2
    said = capsys.readouterr()
    assert "unknown mix 'Q4_9'; choose from Q4_0, Q8_0" in said.err and not said.out
    assert len(written) == 1


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
def test_the_compute_line_names_matrices_dequantized_at_load(tmp_path: Path, monkeypatch):
    """A type the kernels do not read is dequantized at load, and the line says so (how
    many matrices of which type); a file of types they read has no such words."""
    import kvpool.model.loader as loader

    path = write_model(tmp_path / "m.gguf", "llama", MIXES["legacy"])  # Q8_0: 3 matrices
    line = loader.load_model(str(path), dtype="float32", progress=False).compute_line()
    assert "weights kept quantized" in line and "dequantized at load" not in line
    monkeypatch.setattr(loader, "KEPT_QUANTIZED", loader.KEPT_QUANTIZED - {8})
    line = loader.load_model(str(path), dtype="float32", progress=False).compute_line()
    assert line.endswith("; matrices dequantized at load: 3 Q8_0"), line


@pytest.mark.skipif(_native() is None, reason="the native ops are not built here")
@pytest.mark.parametrize(
    ("mix", "types"), [("grids", {16, 17, 18, 19, 21, 22, 29}), ("ternary", {34, 35})]
)
def test_the_grid_and_ternary_formats_stay_in_their_blocks(tmp_path: Path, mix, types):
    """IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S matrices, and TQ1_0 and
    TQ2_0 ones, are kept as the file's bytes (integer products from their grids or
    digits, or dequantized tiles: no copy in another precision), the load line names no
    dequantized matrix, and a step at the dtype chosen at load gives the float path's
    logits within the int8 products' bound (test_random_model_matches_reference compares
    those with transformers')."""
    import kvpool.model.loader as loader
    from kvpool.model.products import QuantLinear

    path = write_model(tmp_path / f"{mix}.gguf", "llama", MIXES[mix], seed=5)
    loaded = loader.load_model(str(path), progress=False)
    layer = loaded.model.layers[0]
    products = (layer.qkv, layer.o, layer.gate_up, layer.down)
    assert all(isinstance(p, QuantLinear) for p in products)
    assert {t for p in products for t in p.types} == types
    assert loaded.dequantized == {} and "dequantized at load" not in loaded.compute_line()
    matrices = [t for t in read_gguf_header(path).tensors if len(t.shape) == 2]
    file_bytes = sum(t.num_bytes for t in matrices if t.name.startswith("blk."))
    held = sum(p.nbytes for layer in loaded.model.layers for p in (
        layer.qkv, layer.o, layer.gate_up, layer.down))  # fmt: skip
    assert held == file_bytes  # the layers' matrices: the file's blocks, once
    exact = loader.load_model(str(path), dtype="float32", progress=False).model
    prompt = [(5 * i + 1) % 500 for i in range(24)]
    want = _logits(exact, prompt)
    error = (_logits(loaded.model, prompt).float() - want).abs().max().item()
    assert error < INT8_LOGIT_BOUND * want.abs().max().item(), (error, loaded.compute_line())


def test_the_native_grids_are_the_gguf_packages():
    """The tables handed to the native module are the gguf package's own (its
    dequantizers read them), in the shapes the kernels index; other values are refused."""
    from kvpool.model.native import iq_grids

    ops = _native()
    grids = iq_grids()
    shapes = [(256, 8), (512, 8), (1024, 8), (256, 4), (512, 4), (2048, 8)]
    assert [tuple(g.shape) for g in grids] == shapes
    assert set(grids[0].unique().tolist()) == {8, 25, 43} and grids[5].dtype == torch.int8
    assert set(grids[5].unique().tolist()) == {-1, 0, 1}
    if ops is None:
        return
    ops.set_iq_grids(grids)  # again, the same: accepted
    other = [g.clone() for g in grids]
    other[0][0, 0] = 9
    with pytest.raises(RuntimeError, match="other values"):
        ops.set_iq_grids(other)
    with pytest.raises(RuntimeError, match="grid 3"):
        ops.set_iq_grids([*grids[:3], grids[3][:, :2], *grids[4:]])


def test_synth_models_iq2_xxs_mix():
    """IQ2_XXS: the head Q5_K, an untied embedding Q2_K, attn_v Q4_K where four or more
    query heads share a KV head (Q2_K elsewhere), the rest IQ2_XXS."""
    from kvpool.bench.synth_model import FILE_TYPES, PRESETS, tensor_type

    g, untied = PRESETS["llama-3.2-1b"], PRESETS["llama-3.1-8b"]  # 4 heads a KV head
    assert tensor_type("IQ2_XXS", "token_embd.weight", -1, g) == "Q5_K"  # tied: the head
    assert tensor_type("IQ2_XXS", "token_embd.weight", -1, untied) == "Q2_K"
    assert tensor_type("IQ2_XXS", "output.weight", -1, untied) == "Q5_K"
    assert tensor_type("IQ2_XXS", "blk.3.attn_v.weight", 3, g) == "Q4_K"
    for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        assert tensor_type("IQ2_XXS", f"blk.3.{name}.weight", 3, g) == "IQ2_XXS"
    assert FILE_TYPES["IQ2_XXS"] == 19  # llama.cpp's LLAMA_FTYPE_MOSTLY_IQ2_XXS


@pytest.mark.parametrize("mix", ["TQ1_0", "TQ2_0"])
def test_synth_models_ternary_mixes(tmp_path: Path, mix):
    """TQ1_0 and TQ2_0: every matrix in the format but the head (Q6_K; a tied embedding
    is the head) and an untied embedding (Q4_K, llama.cpp's rule); rows that are not
    whole 256-blocks fall back to Q4_0 (SmolLM2's 576-wide hidden size). The runtime
    keeps the file's blocks and computes finite, moving logits from them."""
    import dataclasses

    from kvpool.bench.random_blocks import TYPES
    from kvpool.bench.synth_model import FILE_TYPES, PRESETS, tensor_type, write
    from kvpool.formats.gguf_header import read_gguf_header

    g, untied = PRESETS["llama-3.2-1b"], PRESETS["llama-3.1-8b"]
    assert tensor_type(mix, "token_embd.weight", -1, g) == "Q6_K"  # tied: the head
    assert tensor_type(mix, "token_embd.weight", -1, untied) == "Q4_K"
    assert tensor_type(mix, "output.weight", -1, untied) == "Q6_K"
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        assert tensor_type(mix, f"blk.3.{name}.weight", 3, g) == mix
    assert FILE_TYPES[mix] == {"TQ1_0": 36, "TQ2_0": 37}[mix]  # LLAMA_FTYPE_MOSTLY_TQ*
    tiny = dataclasses.replace(PRESETS["smollm2-135m"], layers=2, ffn=512, vocab=2048)
    path = write(tiny, mix, tmp_path / "tiny.gguf", progress=False)
    types = {t.name: t.ggml_type for t in read_gguf_header(path).tensors}
    assert types["blk.0.attn_q.weight"] == 2  # Q4_0 (576 columns)
    assert types["blk.0.ffn_down.weight"] == TYPES[mix][0]  # 512 columns
    config, weights = load_gguf_weights(path, quantized=_native() is not None)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    logits = _logits(model, [(3 * i + 7) % 2000 for i in range(20)])
    assert logits.isfinite().all() and logits.std() > 0.1


def test_synth_models_iq4_xs_mix_follows_llama_cpps_rules(tmp_path: Path):
    """IQ4_XS without an importance matrix: the head Q6_K, attn_v Q5_K where four or more
    query heads share a KV head, the first eighth's ffn_down Q5_K; rows that are not whole
    256-blocks fall back to IQ4_NL (SmolLM2's 576-wide hidden size)."""
    import dataclasses

    from kvpool.bench.synth_model import PRESETS, tensor_type, write
    from kvpool.formats.gguf_header import read_gguf_header

    g = PRESETS["llama-3.2-1b"]  # 16 layers, 32 heads over 8 KV heads
    kinds = {
        ("output.weight", -1): "Q6_K", ("blk.0.attn_v.weight", 0): "Q5_K",
        ("blk.1.ffn_down.weight", 1): "Q5_K", ("blk.2.ffn_down.weight", 2): "IQ4_XS",
        ("blk.5.attn_q.weight", 5): "IQ4_XS", ("blk.5.ffn_up.weight", 5): "IQ4_XS",
    }  # fmt: skip
    assert {key: tensor_type("IQ4_XS", *key, g) for key in kinds} == kinds
    assert tensor_type("IQ4_XS", "token_embd.weight", -1, g) == "Q6_K"  # tied: the head
    tiny = dataclasses.replace(PRESETS["smollm2-135m"], layers=2, ffn=512, vocab=2048)
    path = write(tiny, "IQ4_XS", tmp_path / "tiny.gguf", progress=False)
    types = {t.name: t.ggml_type for t in read_gguf_header(path).tensors}
    assert types["blk.0.attn_q.weight"] == 20 and types["blk.0.ffn_up.weight"] == 20  # IQ4_NL
    config, weights = load_gguf_weights(path, quantized=_native() is not None)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    prompt = [(3 * i + 7) % 2000 for i in range(20)]
    logits = _logits(model, prompt)
    assert logits.isfinite().all() and logits.std() > 0.1
    if _native() is not None:  # packed where the kernels pack (x86), int8 products
        from kvpool.model.native import kernel_variant
        from kvpool.model.products import ProductPolicy

        _, weights = load_gguf_weights(path, quantized=True, pack_variant=kernel_variant())
        fast = LlamaModel(config, weights, torch.device("cpu"), torch.float32, ProductPolicy())
        error = (_logits(fast, prompt) - logits).abs().max().item()
        assert error < INT8_LOGIT_BOUND * logits.abs().max().item()


def test_a_model_in_both_layouts_measures_a_crossover_for_each(tmp_path: Path, monkeypatch):
    """Q5_1 beside Q4_K: where the kernels pack Q4_K and keep Q5_1 in the file's layout
    (it has no packed layout), the load measures a crossover for each layout (the row
    kernels' int8 products of many rows are several times slower than the packed ones');
    one layout alone, one crossover. Each calibration measures that layout's part."""
    if _native() is None:
        pytest.skip("the native kernels did not build")
    from kvpool.model import loader
    from kvpool.model.native import kernel_variant

    if not _native().quant_packs(12, kernel_variant()):  # Q4_K
        pytest.skip(f"the {kernel_variant()} kernels keep every format in the file's layout")
    measured = []

    def calibrate(linear, tiles):
        measured.append(sorted({t & 0xFF for t in linear.types}))
        return 8 if (linear.types[0] & 0xFF) == 7 else 64  # Q5_1: 8 rows

    monkeypatch.setattr(loader, "calibrate", calibrate)
    monkeypatch.delenv("KVPOOL_INT8_MAX_ROWS", raising=False)
    mix = {**MIXES["k-quants"], "attn_q.weight": "Q5_1", "ffn_up.weight": "Q5_1"}
    path = write_model(tmp_path / "both.gguf", "llama", mix)
    policy = loader.load_model(str(path), progress=False).model.products
    assert measured == [[12], [7]]  # o's Q4_K, then q's Q5_1
    assert (policy.int8_max_rows, policy.file_crossover, policy.file_int8_max_rows) == (64, True, 8)
    measured.clear()
    one = loader.load_model(str(write_model(tmp_path / "one.gguf", "llama", MIXES["k-quants"])))
    assert measured == [[12]] and not one.model.products.file_crossover


def test_synth_models_low_bit_k_mixes_follow_llama_cpps_rules(tmp_path: Path):
    """Q3_K_M: Q3_K, the head Q6_K, attn_output Q4_K, attn_v Q5_K in the first two layers
    and Q4_K after, ffn_down Q5_K in the first sixteenth and Q4_K after. Q2_K: Q2_K, the
    head Q6_K, attn_output and ffn_down Q3_K, attn_v Q4_K where four or more query heads
    share a KV head (Q3_K where fewer). Rows that are not whole 256-blocks take Q4_0."""
    import dataclasses

    from kvpool.bench.synth_model import PRESETS, tensor_type, write
    from kvpool.formats.gguf_header import read_gguf_header

    g = PRESETS["llama-3.1-8b"]  # 32 layers, 32 heads over 8 KV heads, an untied head
    q3 = {
        ("output.weight", -1): "Q6_K", ("token_embd.weight", -1): "Q3_K",
        ("blk.1.attn_v.weight", 1): "Q5_K", ("blk.2.attn_v.weight", 2): "Q4_K",
        ("blk.1.ffn_down.weight", 1): "Q5_K", ("blk.2.ffn_down.weight", 2): "Q4_K",
        ("blk.5.attn_output.weight", 5): "Q4_K", ("blk.5.attn_q.weight", 5): "Q3_K",
        ("blk.5.ffn_gate.weight", 5): "Q3_K", ("blk.5.ffn_up.weight", 5): "Q3_K",
    }  # fmt: skip
    assert {key: tensor_type("Q3_K_M", *key, g) for key in q3} == q3
    q2 = {
        ("output.weight", -1): "Q6_K", ("token_embd.weight", -1): "Q2_K",
        ("blk.0.attn_v.weight", 0): "Q4_K", ("blk.9.ffn_down.weight", 9): "Q3_K",
        ("blk.5.attn_output.weight", 5): "Q3_K", ("blk.5.attn_k.weight", 5): "Q2_K",
        ("blk.5.ffn_up.weight", 5): "Q2_K",
    }  # fmt: skip
    assert {key: tensor_type("Q2_K", *key, g) for key in q2} == q2
    few = dataclasses.replace(g, kv_heads=16)  # two query heads a KV head
    assert tensor_type("Q2_K", "blk.0.attn_v.weight", 0, few) == "Q3_K"
    tiny = dataclasses.replace(PRESETS["smollm2-135m"], layers=2, ffn=512, vocab=2048)
    path = write(tiny, "Q2_K", tmp_path / "tiny.gguf", progress=False)
    types = {t.name: t.ggml_type for t in read_gguf_header(path).tensors}
    assert types["blk.0.attn_q.weight"] == 2  # Q4_0 (576 columns)
    assert types["blk.0.ffn_down.weight"] == 11  # Q3_K (512 columns)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "Q4_0", "Q8_0", "IQ4_XS"])
@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_synth_model_writes_a_qwen3_file_the_runtime_loads(tmp_path: Path, mix: str, preset):
    """A qwen3 geometry shrunk to test size, written by ``kvpool bench synth-model``'s
    writer: wide heads (128 over a hidden size of 256), Q/K norms, the mix's types (and
    for the mixture of experts, stacked experts and an F32 router); the runtime reads its
    geometry back and computes finite, moving logits from it."""
    import dataclasses

    from kvpool.bench.random_blocks import TYPES
    from kvpool.bench.synth_model import PRESETS, tensor_type, write
    from kvpool.formats.gguf_header import read_gguf_header

    tiny = dataclasses.replace(
        PRESETS[preset], hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=2048
    )
    if tiny.experts:
        tiny = dataclasses.replace(tiny, experts=8, experts_used=2, expert_ffn=256)
    path = write(tiny, mix, tmp_path / "tiny.gguf", progress=False)
    infos = {t.name: t for t in read_gguf_header(path).tensors}
    types = {name: t.ggml_type for name, t in infos.items()}
    assert len(set(types.values())) >= (3 if mix.endswith("_K_M") else 2)  # F32 norms too
    base = {"Q4_K_M": 12, "Q5_K_M": 13, "Q3_K_M": 11, "Q2_K": 10, "Q4_0": 2, "Q8_0": 8}
    assert types["blk.0.attn_q.weight"] == base.get(mix, 23)  # (IQ4_XS: 23)
    if tiny.experts:  # each stack the type of the matrix it stands for
        assert tuple(infos["blk.0.ffn_down_exps.weight"].shape) == (256, 256, 8)  # ggml order
        assert types["blk.0.ffn_gate_inp.weight"] == 0  # F32
        down = tensor_type(mix, "blk.0.ffn_down.weight", 0, tiny)
        assert types["blk.0.ffn_down_exps.weight"] == TYPES[down][0]
    config, weights = load_gguf_weights(path, quantized=_native() is not None)
    assert (config.architecture, config.head_dim, config.q_size) == (tiny.arch, 128, 512)
    assert config.qk_norm and config.context_length == 40960
    assert (config.experts, config.experts_used) == (tiny.experts, tiny.experts_used)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    logits = _logits(model, [(3 * i + 7) % 2000 for i in range(20)])
    assert logits.isfinite().all() and logits.std() > 0.1


def test_gemma3_layers_attend_over_their_windows(tmp_path: Path):
    """A gemma3 file's local layers see their window and its global layer everything, in
    prefill and in decode steps well past the window, on the native ops and on the torch
    path alike; the same file read with every layer global is another model (so the
    windows are what the reference test holds)."""
    path = write_model(tmp_path / "g.gguf", "gemma3", MIXES["k-quants"], seed=12)
    config, _ = load_gguf_weights(path, quantized=True)
    windows = [config.layer_window(i) for i in range(GEMMA3_LAYERS)]
    assert windows == [GEMMA3_WINDOW] * 5 + [0]
    assert config.rope_local_theta == 10000.0 and config.rope_theta == 1e6
    assert config.embedding_scale == HIDDEN**0.5 and config.activation == "gelu_tanh"
    with torch.inference_mode():
        prompt = [(13 * i + 2) % 500 for i in range(50)]
        want = _reference(path, "gemma3")(torch.tensor([prompt])).logits[0].float()

    def stepwise(model) -> torch.Tensor:  # 16 prompt tokens, then 34 decode steps
        runner = PagedRunner(model, KVCacheManager(32, 4))
        runner.manager.allocate("s", prompt[:16])
        rows = [runner.forward([Chunk("s", prompt[:16], 0)], all_logits=True)]
        for i in range(16, len(prompt)):
            runner.manager.append("s", prompt[i : i + 1])
            rows.append(runner.forward([Chunk("s", prompt[i : i + 1], i)]))
        return torch.cat(rows)

    def model(native: bool = True, windows: bool = True) -> LlamaModel:
        _, weights = load_gguf_weights(path, quantized=_native() is not None)
        m = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
        if not native:
            m.native_fused = m.native_decode = None
        if not windows:
            m.windows = [0] * len(m.windows)
        return m

    assert (stepwise(model()) - want).abs().max().item() < 1e-3
    assert (stepwise(model(native=False)) - want).abs().max().item() < 1e-3
    assert (_logits(model(windows=False), prompt) - want).abs().max().item() > 1e-2


def test_gemma3_27b_scales_its_scores_by_hidden_over_heads(tmp_path: Path):
    """Gemma 3 27B's queries are scaled by (hidden / heads) ** -0.5 (168), not by its head
    width's (128): the file does not say so, and llama.cpp tells the 27B by its 62
    layers, as the config does; a file that says (``attention.scale``) is taken at its
    word. (The header is edited: the rule reads only metadata.)"""
    from kvpool.formats.gguf_header import read_gguf_header
    from kvpool.model.config import ModelConfig

    header = read_gguf_header(write_model(tmp_path / "g.gguf", "gemma3", {}))
    header.metadata["gemma3.attention.key_length"] = 32  # narrower than hidden / heads
    header.metadata["gemma3.attention.value_length"] = 32
    assert ModelConfig.from_gguf(header).scale == 32**-0.5
    header.metadata["gemma3.block_count"] = 62
    assert ModelConfig.from_gguf(header).scale == (HIDDEN / HEADS) ** -0.5
    header.metadata["gemma3.attention.scale"] = 0.125
    assert ModelConfig.from_gguf(header).scale == 0.125


def test_synth_model_writes_a_gemma3_file_the_runtime_loads(tmp_path: Path):
    """Gemma 3 4B's geometry shrunk to test size, by ``kvpool bench synth-model``'s
    writer: heads of 256, Q/K and sandwich norms, a tied head, the sliding window, the
    global layers' linear rope scaling; the runtime reads it all back and computes
    finite, moving logits."""
    import dataclasses

    from kvpool.bench.synth_model import PRESETS, write

    tiny = dataclasses.replace(
        PRESETS["gemma3-4b"], hidden=256, layers=6, heads=2, kv_heads=1, ffn=512, vocab=2048,
        sliding_window=7,
    )  # fmt: skip
    path = write(tiny, "Q4_K_M", tmp_path / "tiny.gguf", progress=False)
    config, weights = load_gguf_weights(path, quantized=_native() is not None)
    assert (config.architecture, config.head_dim, config.sliding_window) == ("gemma3", 256, 7)
    assert config.sandwich_norms and config.qk_norm and config.tie_word_embeddings
    assert config.rope_linear_scale == 8.0 and config.rms_norm_eps == pytest.approx(1e-6)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    logits = _logits(model, [(3 * i + 7) % 2000 for i in range(20)])
    assert logits.isfinite().all() and logits.std() > 0.1
