"""The physical KV store: zeros on creation, allocated once, committed as it is used."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from kvpool.model.config import ModelConfig  # noqa: E402
from kvpool.model.kv_store import PagedKVStore  # noqa: E402


def _config(layers: int = 4) -> ModelConfig:
    return ModelConfig(
        name="t", architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=1e4, context_length=64, attention_bias=False, tie_word_embeddings=True,
    )  # fmt: skip


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_store_starts_as_zeros_and_blocks_are_separate():
    store = PagedKVStore(_config(), num_blocks=6, block_size=4, dtype=torch.bfloat16,
                         device=torch.device("cpu"))  # fmt: skip
    assert len(store.k) == len(store.v) == 4
    assert all(t.shape == (2, 24, 16) and not t.any() for t in store.k + store.v)
    assert store.nbytes == 8 * 2 * 24 * 16 * 2
    store.k[1][:, 4:8] = 1.0  # block 1 of layer 1's K
    store.copy_blocks([(1, 5)])
    assert store.k[1][:, 20:24].eq(1).all() and store.k[1].sum() == 2 * 2 * 4 * 16
    assert not any(t.any() for i, t in enumerate(store.k + store.v) if i != 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_large_pool_costs_memory_only_for_the_blocks_used():
    before = _resident_mib()
    # 512 MiB of KV: 4 layers x K, V x 2 heads x 1M slots x 16 dims x 2 bytes
    store = PagedKVStore(_config(), num_blocks=1 << 16, block_size=16, dtype=torch.bfloat16,
                         device=torch.device("cpu"))  # fmt: skip
    assert store.nbytes == 1 << 29
    assert _resident_mib() - before < 64
    for t in store.k + store.v:
        t[:, : 16 * 64] = 1.0  # 64 blocks in every layer
    assert _resident_mib() - before < 64
    assert sum(int(t.sum()) for t in store.k) == 4 * 2 * 16 * 64 * 16
