"""Q4_0 / Q4_1 weights kept in torch's int4 layout for small steps (CPU, bfloat16)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvpool.model.cpu import cpu_features  # noqa: E402
from kvpool.model.gguf_weights import load_gguf_weights  # noqa: E402
from tests.synthetic_gguf import write_model  # noqa: E402

needs_bf16_products = pytest.mark.skipif(
    not cpu_features().bf16_products,
    reason=f"the int4 path runs only with hardware bf16 products ({cpu_features().summary()})",
)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_layout_reproduces_the_file_weights(tmp_path: Path, arch: str):
    qtypes = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "ffn_down.weight": "Q4_1"}
    path = write_model(tmp_path / "m.gguf", arch, qtypes)
    int4: dict = {}
    _, dense = load_gguf_weights(path, torch.float32, int4=int4)
    assert sorted(int4) == sorted(n for n in dense if n.endswith(tuple(qtypes)))
    for name, weight in int4.items():
        x = torch.randn(3, dense[name].shape[1])
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), weight.packed, 32, weight.scales_zeros.bfloat16()
        ).float()
        want = x.bfloat16().float() @ dense[name].T
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), name


@needs_bf16_products
def test_bf16_with_int4_agrees_with_fp32_on_the_default_model(fp32_model):
    from kvpool.cache import KVCacheManager
    from kvpool.model.loader import load_model
    from kvpool.model.runner import ModelRunner, SeqChunk

    fast = load_model(None, dtype="bfloat16", progress=False, int4=True)
    assert any(layer.down.int4 is not None for layer in fast.model.layers)
    prompt = fast.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    tops = []
    for model in (fast.model, fp32_model):
        runner = ModelRunner(model, KVCacheManager(64, 16))
        runner.manager.allocate("s", prompt[:-1])
        runner.forward([SeqChunk("s", prompt[:-1], 0)])  # prefill: the bf16 weights
        runner.manager.append("s", prompt[-1:])
        logits = runner.forward([SeqChunk("s", prompt[-1:], len(prompt) - 1)])  # int4
        tops.append(logits[0].topk(3).indices.tolist())
    assert tops[0][0] == tops[1][0]


def test_bf16_decode_attention_in_fp32_agrees_with_bf16_products(monkeypatch):
    """Short decode steps compute attention in fp32 on the CPU (fewer fixed costs): the
    logits stay those of the bf16 products, within bf16's rounding."""
    from kvpool.cache import KVCacheManager
    from kvpool.model import llama
    from kvpool.model.loader import load_model
    from kvpool.model.runner import ModelRunner, SeqChunk

    model = load_model(None, dtype="bfloat16", progress=False, int4=False).model
    model.native_decode = None  # the torch path's choice is under test
    prompt = [(37 * i) % 40000 + 3 for i in range(120)]

    def decode_logits() -> torch.Tensor:
        runner = ModelRunner(model, KVCacheManager(64, 16))
        runner.manager.allocate("s", prompt)
        runner.forward([SeqChunk("s", prompt[:-1], 0)])
        return runner.forward([SeqChunk("s", prompt[-1:], len(prompt) - 1)])[0]

    fp32_attention = decode_logits()  # 128 keys: within FP32_ATTENTION_MAX_KEYS
    monkeypatch.setattr(llama, "FP32_ATTENTION_MAX_KEYS", 0)
    bf16_attention = decode_logits()
    assert fp32_attention.argmax() == bf16_attention.argmax()
    assert (fp32_attention - bf16_attention).abs().max() < 0.02 * bf16_attention.abs().max()
    assert not torch.equal(fp32_attention, bf16_attention)  # the two paths really ran
