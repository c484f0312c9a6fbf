"""Loader and model beyond one file: small random GGUF models of both architectures and
many ggml types, against transformers loading the same files."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool.cache import KVCacheManager  # noqa: E402
from kvpool.model.gguf_weights import load_gguf_weights  # noqa: E402
from kvpool.model.llama import LlamaModel  # noqa: E402
from kvpool.model.runner import ModelRunner, SeqChunk  # noqa: E402
from tests.synthetic_gguf import write_model  # noqa: E402

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
}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_random_model_matches_reference(tmp_path: Path, arch: str, mix: str):
    path = write_model(tmp_path / f"{arch}-{mix}.gguf", arch, MIXES[mix], seed=len(arch + mix))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    rows: dict = {}  # the quantized embedding is looked up in its blocks
    config, weights = load_gguf_weights(path, rows=rows)
    assert config.architecture == arch and config.attention_bias == (arch == "qwen2")
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32, rows=rows)
    assert model.embed is rows["token_embd.weight"]
    runner = ModelRunner(model, KVCacheManager(32, 16))
    prompt = [(7 * i + 3) % 500 for i in range(45)]
    runner.manager.allocate("s", prompt[:-1])
    prefill = runner.forward([SeqChunk("s", prompt[:-1], 0)], all_logits=True)
    runner.manager.append("s", prompt[-1:])
    decode = runner.forward([SeqChunk("s", prompt[-1:], len(prompt) - 1)])
    ours = torch.cat([prefill, decode])
    with torch.inference_mode():
        ref = reference(torch.tensor([prompt])).logits[0].float()
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - ref).abs().max().item() < 1e-3


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
    runner = ModelRunner(
        LlamaModel(config_ours, weights, torch.device("cpu"), torch.float32),
        KVCacheManager(32, 16),
    )
    prompt = [(11 * i + 5) % 500 for i in range(120)]
    runner.manager.allocate("s", prompt)
    ours = runner.forward([SeqChunk("s", prompt, 0)], all_logits=True)
    with torch.inference_mode():
        want = reference(torch.tensor([prompt])).logits[0].float()
        unscaled = plain(torch.tensor([prompt])).logits[0].float()
    assert (ours - want).abs().max().item() < 1e-3
    assert (ours - unscaled).abs().max().item() > 1e-2  # the scaling is really applied


@pytest.mark.parametrize("qname", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_embedding_rows_equal_the_dequantized_matrix(tmp_path, qname, dtype):
    path = write_model(tmp_path / "m.gguf", "llama", {"token_embd.weight": qname})
    rows: dict = {}
    _, weights = load_gguf_weights(path, dtype, rows=rows)
    table, dense = rows["token_embd.weight"], weights["token_embd.weight"]
    assert table.shape == tuple(dense.shape) and table.numel() == dense.numel()
    ids = torch.tensor([0, 7, 7, dense.shape[0] - 1, 3])
    got = table[ids]
    assert got.dtype == dtype and torch.equal(got, dense[ids])


def test_unquantized_embedding_is_not_kept_twice(tmp_path):
    path = write_model(tmp_path / "m.gguf", "llama", {"token_embd.weight": "F16"})
    rows: dict = {}
    load_gguf_weights(path, rows=rows)
    assert rows == {}
