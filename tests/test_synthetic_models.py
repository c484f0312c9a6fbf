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
    config, weights = load_gguf_weights(path)
    assert config.architecture == arch and config.attention_bias == (arch == "qwen2")
    runner = ModelRunner(
        LlamaModel(config, weights, torch.device("cpu"), torch.float32), KVCacheManager(32, 16)
    )
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
