"""The runtime against transformers loading the same GGUF file (fp32): exact tokens.

Prompts are token ids, so these tests check the model, not the tokenizer.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvpool.cache import KVCacheManager  # noqa: E402
from tests.paged_runner import Chunk, PagedRunner  # noqa: E402

CHAT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
        411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2,
        198, 1, 520, 9531, 198]  # fmt: skip
NEW_TOKENS = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [CHAT, CHAT[:20], [504, 3575, 282]]
    for length in (5, 64, 130, 333):
        prompts.append([rng.randrange(3, 49152) for _ in range(length)])
    prompts.append((CHAT * 30)[:1100])  # over 1,000 tokens
    return prompts


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with transformers' own KV cache; EOS does not stop it."""
    out: list[int] = []
    with torch.inference_mode():
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), cache=result.past_key_values, use_cache=True)
    return out


def greedy(runner: PagedRunner, seqs: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    """Greedy decoding of several sequences batched together, prompt hits honoured."""
    manager = runner.manager
    chunks = []
    for seq_id, prompt in seqs.items():
        alloc = manager.allocate(seq_id, prompt)
        start = alloc.num_cached_tokens
        chunks.append(Chunk(seq_id, prompt[start:], start))
    logits = runner.forward(chunks)
    out: dict[str, list[int]] = {s: [] for s in seqs}
    for _ in range(n):
        chunks = []
        for row, seq_id in zip(logits, seqs, strict=True):
            token = int(row.argmax())
            out[seq_id].append(token)
            start = manager.num_tokens(seq_id)
            runner.copy_blocks(manager.append(seq_id, [token]))
            chunks.append(Chunk(seq_id, [token], start))
        logits = runner.forward(chunks)
    return out


@pytest.fixture(scope="module")
def expected(reference_model):
    return [reference_greedy(reference_model, p, NEW_TOKENS) for p in _prompts()]


def make_runner(model, num_blocks: int = 600, block_size: int = 16) -> PagedRunner:
    return PagedRunner(model, KVCacheManager(num_blocks, block_size))


def test_logits_match_reference(fp32_model, reference_model):
    prompt = _prompts()[4]  # 64 random tokens
    runner = make_runner(fp32_model)
    runner.manager.allocate("a", prompt)
    ours = runner.forward([Chunk("a", prompt, 0)], all_logits=True)
    with torch.inference_mode():
        ref = reference_model(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_tokens_match_reference_alone(fp32_model, expected):
    for i, prompt in enumerate(_prompts()):
        runner = make_runner(fp32_model)
        assert greedy(runner, {"s": prompt}, NEW_TOKENS)["s"] == expected[i], f"prompt {i}"


def test_batch_of_mixed_lengths_matches_alone(fp32_model, expected):
    prompts = _prompts()
    runner = make_runner(fp32_model, num_blocks=1200)
    seqs = {f"s{i}": prompts[i % len(prompts)] for i in range(16)}
    out = greedy(runner, seqs, NEW_TOKENS)
    for i in range(16):
        assert out[f"s{i}"] == expected[i % len(prompts)], f"sequence {i}"


def test_cached_prefix_and_recompute_after_eviction(fp32_model, expected):
    prompts = _prompts()
    long = prompts[-1]
    runner = make_runner(fp32_model, num_blocks=80, block_size=16)
    manager = runner.manager
    assert greedy(runner, {"first": long}, NEW_TOKENS)["first"] == expected[-1]
    manager.free("first")
    # The prompt's blocks are cached: the second run computes only its last block.
    assert manager.count_cached_tokens(long) == (len(long) - 1) // 16 * 16
    assert greedy(runner, {"hit": long}, NEW_TOKENS)["hit"] == expected[-1]
    manager.free("hit")
    # Pressure: other sequences take the pool; the cached prefix is evicted, then recomputed.
    other = {"x": prompts[6] * 3}
    greedy(runner, other, 1)
    manager.free("x")
    assert manager.stats().evictions > 0
    assert greedy(runner, {"again": long}, NEW_TOKENS)["again"] == expected[-1]


def test_forked_sequences_copy_on_write_and_match_separate_runs(fp32_model):
    """Two continuations of one prompt share its blocks; the first write into the shared
    partial block copies it, and each continuation equals a run of its own."""
    prompt = _prompts()[5]  # 130 tokens: 8 full blocks and a partial one
    runner = make_runner(fp32_model)
    manager = runner.manager
    manager.allocate("p", prompt)
    runner.forward([Chunk("p", prompt, 0)])
    manager.fork("p", "c")
    assert manager.stats().shared_blocks == 9
    heads = {"p": 504, "c": 3575}
    chunks = []
    for seq, token in heads.items():
        copies = manager.append(seq, [token])
        runner.copy_blocks(copies)
        chunks.append(Chunk(seq, [token], len(prompt)))
    assert manager.stats().cow_copies == 1 and manager.stats().shared_blocks == 8
    logits = runner.forward(chunks)
    out = {seq: [int(row.argmax())] for seq, row in zip(heads, logits, strict=True)}
    for _ in range(5):
        chunks = []
        for seq in heads:
            position = manager.num_tokens(seq)
            manager.append(seq, [out[seq][-1]])
            chunks.append(Chunk(seq, [out[seq][-1]], position))
        logits = runner.forward(chunks)
        for seq, row in zip(heads, logits, strict=True):
            out[seq].append(int(row.argmax()))
    for seq, token in heads.items():
        alone = greedy(make_runner(fp32_model), {"x": [*prompt, token]}, 6)["x"]
        assert out[seq] == alone, seq
