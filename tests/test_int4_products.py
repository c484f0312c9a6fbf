"""4-bit GGUF matrices in torch's int4 kernels (``kvpool.model.int4_products``), the
runtime's products where kvpool's native kernels are not (a GPU, a CPU where they did not
build): the values are the file's exactly, a product stays within bf16's error of the
dequantized one, and a model built that way holds its 4-bit matrices at ~0.63 bytes a
weight and answers as near the float32 reference as the dense bf16 model does. Here on
the CPU's int4 kernels; ``tests/test_cuda.py`` runs them on a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpool.bench.random_blocks import TYPES, random_blocks  # noqa: E402
from kvpool.cache import KVCacheManager  # noqa: E402
from kvpool.model.gguf_weights import QuantizedMatrix, load_gguf_weights  # noqa: E402
from kvpool.model.int4_products import (  # noqa: E402
    FOUR_BIT,
    Int4Linear,
    fits,
    four_bit_values,
    int4_unavailable,
)
from tests.paged_runner import Chunk, PagedRunner  # noqa: E402
from tests.synthetic_gguf import write_model  # noqa: E402

CPU = torch.device("cpu")
needs_int4 = pytest.mark.skipif(
    int4_unavailable(CPU) is not None, reason=f"torch's int4 kernels: {int4_unavailable(CPU)}"
)
# An int4 product against the dequantized float32 one, as a share of its largest output:
# bf16 activations, scales, zeros and outputs (measured 0.3-0.4%; a bf16 dense product's
# error is of the same size)
PRODUCT_BOUND = 0.01


# Every 4-bit format, a fused gate/up of two of them, a QKV with a 6-bit part (dense)
FOUR_BIT_MIX = {
    "token_embd.weight": "Q8_0", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1",
    "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q4_K",
    "ffn_up.weight": "Q4_0", "ffn_down.weight": "Q4_1", "output.weight": "Q4_K",
}  # fmt: skip


def logits(model) -> torch.Tensor:
    """A 40-token prompt's logits, float32 on the CPU."""
    runner = PagedRunner(model, KVCacheManager(16, 16))
    prompt = [(5 * i + 2) % 500 for i in range(40)]
    runner.manager.allocate("s", prompt)
    return runner.forward([Chunk("s", prompt, 0)], all_logits=True).float().cpu()


def matrix(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantizedMatrix:
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    return QuantizedMatrix(torch.from_numpy(raw), TYPES[qtype][0], cols)


def dequantized(m: QuantizedMatrix) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(m.raw.numpy(), GGMLQuantizationType(m.qtype)))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_the_four_bit_values_are_the_files(qtype):
    """(q - 8) scale + zero, in float32, is the gguf package's dequantization."""
    m = matrix(qtype, 48, 768)
    q, scale, zero = four_bit_values(m)
    assert q.dtype == torch.uint8 and q.shape == (48, 768) and int(q.max()) <= 15
    assert scale.shape == zero.shape == (48, 768 // 32)
    w = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    assert torch.allclose(w, dequantized(m), rtol=1e-6, atol=0)


def test_only_four_bit_file_layouts_fit():
    assert fits([matrix("Q4_0", 32, 256), matrix("Q4_K", 16, 256)])
    assert not fits([matrix("Q4_0", 32, 256), matrix("Q6_K", 16, 256)])  # a 6-bit part
    assert not fits([matrix("Q8_0", 32, 256)]) and not fits([matrix("Q5_K", 32, 256)])
    assert not fits([matrix("Q4_0", 40, 256)])  # N not a multiple of 16
    assert not fits([torch.zeros(32, 256)])  # a dense part
    assert {TYPES[t][0] for t in ("Q4_0", "Q4_1", "Q4_K")} == FOUR_BIT


@needs_int4
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_a_fused_product_of_four_bit_formats_is_the_dequantized_one(rows):
    """Three parts of three formats, fused as a QKV is, with a bias, against the float32
    product of the dequantized matrices."""
    parts = [matrix("Q4_K", 64, 512, 1), matrix("Q4_0", 32, 512, 2), matrix("Q4_1", 32, 512, 3)]
    bias = torch.randn(128).to(torch.bfloat16)
    linear = Int4Linear(parts, bias, CPU)
    assert linear.numel() == 128 * 512 + 128
    assert linear.nbytes() <= 128 * 512 * (0.5 + 4 / 32) + 4096  # values + bf16 pairs
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    y = linear(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 128)
    want = x @ torch.cat([dequantized(p) for p in parts]).T + bias.float()
    assert (y.float() - want).abs().max() <= PRODUCT_BOUND * want.abs().max()


@needs_int4
def test_a_model_without_native_kernels_keeps_four_bit_matrices_and_answers_alike(
    tmp_path: Path, monkeypatch
):
    """The runtime without kvpool's kernels (as on a GPU, or where they did not build):
    the 4-bit products (a fused gate/up of Q4_K and Q4_0, Q4_K and Q4_1 matrices) in
    torch's int4 kernels, a QKV with a 6-bit part dense; its logits as near the float32
    dequantized model's as those of the same model with every matrix in bf16."""
    import kvpool.model.llama as llama
    from kvpool.model.llama import Linear, LlamaModel

    path = write_model(tmp_path / "four-bit.gguf", "llama", FOUR_BIT_MIX, seed=4)
    monkeypatch.setattr(llama, "native_ops", lambda: None)
    config, weights = load_gguf_weights(path, quantized=True, kept_types=FOUR_BIT)
    assert isinstance(weights["blk.0.ffn_up.weight"], QuantizedMatrix)
    assert isinstance(weights["blk.0.attn_v.weight"], torch.Tensor)  # 6-bit: dense at load
    four = LlamaModel(config, weights, CPU, torch.bfloat16)
    layer = four.layers[0]
    assert all(isinstance(p, Int4Linear) for p in (layer.o, layer.gate_up, layer.down))
    assert isinstance(layer.qkv, Linear) and isinstance(four.lm_head, Int4Linear)
    config, weights = load_gguf_weights(path, torch.bfloat16)
    dense = LlamaModel(config, weights, CPU, torch.bfloat16)
    assert isinstance(dense.layers[0].o, Linear)
    config, weights = load_gguf_weights(path)
    reference = logits(LlamaModel(config, weights, CPU, torch.float32))  # dequantized, fp32
    assert reference.abs().max() > 1.0
    int4_error = (logits(four) - reference).abs().max()
    bf16_error = (logits(dense) - reference).abs().max()
    # the int4 model's error is bf16's (measured 4.1% and 4.0% of the largest logit):
    # its scales and zeros rounded to bf16 cost little beside bf16 activations
    assert int4_error <= 1.5 * bf16_error, (int4_error, bf16_error)


@needs_int4
def test_a_matrix_the_int4_kernels_refuse_stays_dense(tmp_path: Path, monkeypatch):
    """A shape a device's int4 packing refuses (the check at first use covers one shape)
    makes that product dense instead of failing the load."""
    import kvpool.model.int4_products as int4_products
    import kvpool.model.llama as llama
    from kvpool.model.llama import Linear, LlamaModel

    path = write_model(tmp_path / "four-bit.gguf", "llama", FOUR_BIT_MIX, seed=4)
    monkeypatch.setattr(llama, "native_ops", lambda: None)
    pack = int4_products._pack

    def refusing(q, device):
        if q.shape[0] == 2 * 512:  # the gate/up products (2 x INTER rows)
            raise RuntimeError("refused")
        return pack(q, device)

    monkeypatch.setattr(int4_products, "_pack", refusing)
    config, weights = load_gguf_weights(path, quantized=True, kept_types=FOUR_BIT)
    model = LlamaModel(config, weights, CPU, torch.bfloat16)
    layer = model.layers[0]
    assert isinstance(layer.gate_up, Linear) and isinstance(layer.o, Int4Linear)
    assert logits(model).isfinite().all()
