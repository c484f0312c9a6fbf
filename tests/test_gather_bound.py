"""The torch attention path (a GPU, or a CPU without the native ops) gathers each row's
context, padded to the step's longest, into one scratch buffer. A step whose gather
would pass ``ModelRunner.gather_blocks_max`` blocks runs as forwards over groups of rows
of similar context length: the same logits, the buffer bounded."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvpool.cache import KVCacheManager  # noqa: E402
from kvpool.model.runner import GATHER_BYTES_MAX, ModelRunner, SeqChunk  # noqa: E402
from tests.paged_runner import Chunk, PagedRunner  # noqa: E402


@pytest.fixture(scope="module")
def torch_path_model(default_model_file):
    """The default model, dense float32, its native ops taken away: every step's
    attention gathers (as on a GPU)."""
    from kvpool.model.gguf_weights import load_gguf_weights
    from kvpool.model.llama import LlamaModel

    config, weights = load_gguf_weights(default_model_file, quantized=False)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    model.native_fused = None
    model.native_decode = None
    return model


def _chunks(blocks: list[int], block_size: int = 16) -> list[SeqChunk]:
    """Decode chunks whose contexts fill ``blocks`` blocks each (tables unused here)."""
    return [SeqChunk([1], n * block_size - 1, list(range(n))) for n in blocks]


def test_groups_cover_every_row_once_within_the_bound(torch_path_model):
    runner = ModelRunner(torch_path_model, 8, 16, threads=None)
    cfg = torch_path_model.config
    block = 2 * cfg.num_kv_heads * 16 * cfg.head_dim * 4
    assert runner.gather_blocks_max == GATHER_BYTES_MAX // block  # float32 K and V
    runner.gather_blocks_max = 12
    assert runner.gather_groups(_chunks([1, 2, 3])) is None  # 3 rows x 3 blocks fit
    assert runner.gather_groups(_chunks([5])) is None  # one row: nothing to split
    rng = random.Random(3)
    for _ in range(200):
        blocks = [rng.choice([1, 1, 2, 3, 5, 13, 20]) for _ in range(rng.randrange(2, 12))]
        groups = runner.gather_groups(_chunks(blocks))
        if len(blocks) * max(blocks) <= 12:
            assert groups is None
            continue
        assert groups is not None
        assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
        for g in groups:  # within the bound, or one row longer than it alone
            assert len(g) * max(blocks[i] for i in g) <= 12 or len(g) == 1


def test_a_split_step_gives_the_whole_steps_logits(torch_path_model):
    """A decode step of rows with 1 to 9 blocks of context (and a prompt chunk beside
    them), whole and in groups: the same logits and hidden states, and the scratch
    buffer no larger than the bound (or the longest row alone)."""
    rng = random.Random(11)
    manager = KVCacheManager(96, 16)
    runner = PagedRunner(torch_path_model, manager, threads=None)
    lengths = [5, 20, 140, 33, 60, 17, 100, 9]
    prompts = [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]
    chunks = runner.decode_step_after_prefills(prompts, 7)
    extra = [rng.randrange(3, 49000) for _ in range(30)]
    manager.allocate(99, extra)
    chunks.insert(3, Chunk(99, extra, 0))  # a prompt chunk among them

    inner = runner.runner
    assert inner.gather_groups(runner.chunks(chunks)) is None
    whole, whole_hidden = runner.forward(chunks, return_hidden=True)
    inner.gather_blocks_max = 12  # the longest row alone: 9 blocks
    groups = inner.gather_groups(runner.chunks(chunks))
    assert groups is not None and len(groups) >= 3
    torch_path_model._buffer = None
    split, split_hidden = runner.forward(chunks, return_hidden=True)
    assert split.shape == whole.shape
    assert (split - whole).abs().max().item() < 1e-4
    assert (split_hidden - whole_hidden).abs().max().item() < 1e-4
    assert split.argmax(-1).tolist() == whole.argmax(-1).tolist()
    assert torch.equal(runner.forward(chunks), split)  # logits alone: the same rows
    cfg = torch_path_model.config
    per_block = 2 * cfg.num_kv_heads * 16 * cfg.head_dim  # elements of K and V
    assert torch_path_model._buffer.numel() <= 12 * per_block
