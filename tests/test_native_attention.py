"""The native decode attention (``kvpool.model.native``) computes what the torch path
computes: the op against a plain softmax over each sequence's slots, and whole decode
steps of the model with and without it."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvpool.cache import KVCacheManager  # noqa: E402
from kvpool.model.native import paged_decode_attention  # noqa: E402
from kvpool.model.runner import ModelRunner, SeqChunk  # noqa: E402

native = paged_decode_attention()
pytestmark = pytest.mark.skipif(native is None, reason="native kernel not built here")


def _reference(q, layer_kv, tables, lens, block_size):
    nkv = layer_kv.shape[0] // 2
    b, nh, d = q.shape
    rows = []
    for i in range(b):
        slots = (tables[i][:, None] * block_size + torch.arange(block_size)).reshape(-1)
        slots = slots[: int(lens[i])]
        keys, values = layer_kv[:nkv, slots].float(), layer_kv[nkv:, slots].float()
        queries = q[i].float().view(nkv, nh // nkv, d)
        probs = torch.softmax(queries @ keys.transpose(1, 2) * d**-0.5, dim=-1)
        rows.append((probs @ values).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 4), (80, 32)])
def test_op_matches_a_plain_softmax_over_each_sequence(dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    nkv, nh, blocks = 2, 6, 40
    layer_kv = torch.randn(2 * nkv, blocks * block_size, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, block_size, 3 * block_size + 1, 7 * block_size - 2])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:7] for _ in lens])
    q = torch.randn(len(lens), nh, head_dim, generator=gen).to(dtype)
    got = native(q, layer_kv, tables, lens, block_size, head_dim**-0.5)
    want = _reference(q, layer_kv, tables, lens, block_size)
    assert got.dtype == dtype and got.shape == (len(lens), nh * head_dim)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want).abs().max().item() < tolerance


def test_decode_steps_equal_the_torch_path(fp32_model):
    rng = random.Random(3)
    manager = KVCacheManager(128, 16)
    runner = ModelRunner(fp32_model, manager, threads=None)
    prompts = [[rng.randrange(3, 49000) for _ in range(n)] for n in (5, 16, 33, 200)]
    for seq, prompt in enumerate(prompts):
        manager.allocate(seq, prompt)
        runner.forward([SeqChunk(seq, prompt, 0)])
    chunks = []
    for seq, prompt in enumerate(prompts):
        manager.append(seq, [11 + seq])
        chunks.append(SeqChunk(seq, [11 + seq], len(prompt)))
    assert fp32_model.native_decode is native
    with_native = runner.forward(chunks)
    fp32_model.native_decode = None
    try:
        torch_path = runner.forward(chunks)
    finally:
        fp32_model.native_decode = native
    assert (with_native - torch_path).abs().max().item() < 1e-4
    assert with_native.argmax(-1).tolist() == torch_path.argmax(-1).tolist()


def test_op_rejects_tables_that_would_read_out_of_the_store():
    layer_kv = torch.zeros(4, 8 * 16, 64)
    q = torch.zeros(1, 4, 64)
    good = torch.tensor([[0, 7]])
    assert native(q, layer_kv, good, torch.tensor([20]), 16, 0.125).shape == (1, 256)
    with pytest.raises(RuntimeError, match="block id"):
        native(q, layer_kv, torch.tensor([[0, 8]]), torch.tensor([20]), 16, 0.125)
    with pytest.raises(RuntimeError, match="context length"):
        native(q, layer_kv, good, torch.tensor([33]), 16, 0.125)
