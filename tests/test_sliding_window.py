"""Sliding-window attention (Gemma 3's local layers): the native decode attention and
``paged_attention`` with a window against a plain masked softmax, every head width the
kernels specialize (256: Gemma's) and any other; a window's rows keep their bits in any
chunking; and the torch path's masks against the native ops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpool.model.native import native_ops  # noqa: E402
from tests.test_kv_dtype import _reference  # noqa: E402
from tests.test_native_ops import VARIANTS, needs_variant  # noqa: E402

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="native ops not built here")


def reference(q, layer_kv, tables, lens, starts, block_size, window):
    """test_kv_dtype's causal reference over a layer's K/V rows, windowed, in fp32."""
    nkv = layer_kv.shape[0] // 2
    k, v = layer_kv[:nkv].float(), layer_kv[nkv:].float()
    return _reference(q, k, v, tables, lens, starts, block_size, window)


def _case(head_dim: int, block_size: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    nkv, nh, blocks = 2, 4, 48
    layer_kv = torch.randn(2 * nkv, blocks * block_size, head_dim, generator=gen).to(dtype)
    width = 12
    tables = torch.randperm(blocks, generator=gen)[: 4 * width].view(4, width)
    return gen, layer_kv, tables, nh


@pytest.mark.parametrize("variant", [pytest.param(v, marks=needs_variant(v)) for v in VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("head_dim", "block_size"), [(256, 16), (128, 4), (64, 16), (80, 8)])
@pytest.mark.parametrize("window", [0, 1, 7, 16, 37])
def test_decode_attention_sees_its_window(variant, dtype, head_dim, block_size, window):
    gen, layer_kv, tables, nh = _case(head_dim, block_size, dtype, head_dim + window)
    # contexts shorter than the window, equal to it, a block past it, many blocks past it
    lens = torch.tensor([3, max(window, 1), window + block_size + 1, 10 * block_size + 5])
    lens = lens.clamp(max=tables.shape[1] * block_size)
    q = torch.randn(len(lens), nh, head_dim, generator=gen).to(dtype)
    got = ops.paged_decode_attention(
        q, layer_kv, tables, lens, block_size, head_dim**-0.5, variant, window
    )
    starts = torch.arange(len(lens) + 1)
    want = reference(q, layer_kv, tables, lens, starts, block_size, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want).abs().max().item() < tolerance


@pytest.mark.parametrize("variant", [pytest.param(v, marks=needs_variant(v)) for v in VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("head_dim", "block_size"), [(256, 16), (128, 4), (64, 16), (80, 8)])
@pytest.mark.parametrize("window", [0, 1, 7, 16, 37])
def test_paged_attention_sees_each_rows_window(variant, dtype, head_dim, block_size, window):
    gen, layer_kv, tables, nh = _case(head_dim, block_size, dtype, 2 * head_dim + window)
    # a whole prompt over several tiles, a decode token, a chunk after cached context, a
    # short prompt
    lens = torch.tensor([45, 3 * block_size + 2, 2 * block_size + 30, 6])
    new = torch.tensor([45, 1, 29, 6])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)])
    q = torch.randn(int(starts[-1]), nh, head_dim, generator=gen).to(dtype)
    got = ops.paged_attention(
        q, layer_kv, tables, lens, starts, block_size, head_dim**-0.5, variant, window
    )
    want = reference(q, layer_kv, tables, lens, starts, block_size, window)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tolerance


@pytest.mark.parametrize("variant", [pytest.param(v, marks=needs_variant(v)) for v in VARIANTS])
@pytest.mark.parametrize("head_dim", [256, 128])
def test_a_windowed_rows_bits_do_not_depend_on_its_chunk(variant, head_dim):
    """A prompt whole, and the same prompt in chunks of 13 after its cached start: each
    token's windowed attention has the same bits (the spans before a row's window are
    not read or add exact zeros)."""
    block_size, window = 16, 21
    gen, layer_kv, tables, nh = _case(head_dim, block_size, torch.float32, 5)
    n = 90
    q = torch.randn(n, nh, head_dim, generator=gen)
    table = tables[:1]

    def attend(first: int, last: int) -> torch.Tensor:
        starts = torch.tensor([0, last - first])
        return ops.paged_attention(
            q[first:last].contiguous(), layer_kv, table, torch.tensor([last]), starts,
            block_size, head_dim**-0.5, variant, window,
        )  # fmt: skip

    whole = attend(0, n)
    pieces = torch.cat([attend(i, min(i + 13, n)) for i in range(0, n, 13)])
    assert torch.equal(whole, pieces)


def test_a_negative_window_is_refused():
    q = torch.zeros(1, 2, 64)
    kv = torch.zeros(2, 16, 64)
    with pytest.raises(RuntimeError, match="window"):
        ops.paged_decode_attention(q, kv, torch.zeros(1, 1, dtype=torch.long),
                                   torch.tensor([1]), 16, 0.1, "", -1)  # fmt: skip
