"""The forward pass makes every tensor on its inputs' device. Run under a default device of
"meta", a tensor made without an explicit device lands there and cannot mix with the real
ones: this finds, on a machine without a GPU, the slips that would break the CUDA path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpool.cache import KVCacheManager  # noqa: E402
from tests.paged_runner import Chunk, PagedRunner  # noqa: E402


def _forward_off_default_device(runner: PagedRunner, chunks: list[Chunk]) -> torch.Tensor:
    batch = runner.build_batch(chunks)  # host-side index building is the runner's own
    with torch.device("meta"):
        return runner.model.forward(batch, runner.kv)


def test_prefill_and_grouped_decode_make_no_tensor_off_their_device(fp32_model):
    manager = KVCacheManager(64, 16)
    runner = PagedRunner(fp32_model, manager, threads=None, min_shared_tokens=16)
    prompts = {0: list(range(3, 43)), 1: list(range(50, 67))}  # 40 and 17 tokens
    chunks = []
    for seq, prompt in prompts.items():
        manager.allocate(seq, prompt)
        chunks.append(Chunk(seq, prompt, 0))
    want = runner.forward(chunks)
    got = _forward_off_default_device(runner, chunks)
    assert got.device.type == "cpu" and torch.equal(got, want)

    for child in (2, 3):  # n > 1 samples of prompt 0 share its two full blocks
        manager.fork(0, child)
        prompts[child] = prompts[0]
    chunks = []
    for seq, prompt in prompts.items():
        runner.copy_blocks(manager.append(seq, [7 + seq]))
        chunks.append(Chunk(seq, [7 + seq], len(prompt)))
    assert runner.build_batch(chunks).shared_prefixes  # the grouped decode path runs
    want = runner.forward(chunks)
    got = _forward_off_default_device(runner, chunks)
    assert torch.equal(got, want)
