"""Decode attention that reads a shared prefix once per group (``SharedPrefix``) gives the
logits of attending to each sequence's blocks separately, including forks that share a
partially filled last block."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvpool.cache import KVCacheManager  # noqa: E402
from tests.paged_runner import Chunk, PagedRunner  # noqa: E402


def test_grouped_decode_equals_separate_decode(fp32_model):
    rng = random.Random(5)
    system = [rng.randrange(3, 49000) for _ in range(100)]  # 6 full blocks of 16, shared
    prompts = [system + [rng.randrange(3, 49000) for _ in range(n)] for n in (3, 17, 30, 12)]
    prompts.append([rng.randrange(3, 49000) for _ in range(40)])  # shares nothing
    manager = KVCacheManager(256, 16)
    runner = PagedRunner(fp32_model, manager, min_shared_tokens=16)
    for seq, prompt in enumerate(prompts):
        alloc = manager.allocate(seq, prompt, computed=False)
        runner.forward([Chunk(seq, prompt[alloc.num_cached_tokens :], alloc.num_cached_tokens)])
        manager.mark_computed(seq, len(prompt))
    manager.fork(3, 9)  # n > 1: shares every block, its partial last one too
    prompts.append(prompts[3])
    seqs = [0, 1, 2, 3, 4, 9]
    chunks = []
    for seq, prompt in zip(seqs, prompts, strict=True):
        runner.copy_blocks(manager.append(seq, [7 + seq], computed=False))
        chunks.append(Chunk(seq, [7 + seq], len(prompt)))
    batch = runner.build_batch(chunks)
    groups = sorted((g.blocks.shape[0], sorted(g.rows.tolist())) for g in batch.shared_prefixes)
    assert groups == [(6, [0, 1, 2, 3, 5])]  # the fork's partial block stays its own
    grouped = runner.forward(chunks)
    runner.runner.min_shared_blocks = 10**9  # no groups: every sequence reads all its blocks
    separate = runner.forward(chunks)
    assert (grouped - separate).abs().max().item() < 1e-4
    assert grouped.argmax(-1).tolist() == separate.argmax(-1).tolist()
