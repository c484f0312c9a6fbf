"""The engine on the default model (fp32): batching, preemption and cancellation change
nothing in what a request generates, and no block stays in use."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.errors import PromptExceedsPool, PromptTooLong  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    system = [rng.randrange(3, 49152) for _ in range(40)]
    out = [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 30)]
    out += [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 70, 120)]
    return out


def alone(model, prompt: list[int]) -> list[int]:
    engine = Engine(model, num_blocks=64)
    return engine.generate([prompt], GREEDY)[0].token_ids


def drain(engine: Engine) -> dict[tuple[str, int], list[int]]:
    """Step until the engine is idle; each sample's output tokens, by (request id, index)."""
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.token_ids)
    return tokens


@pytest.fixture(scope="module")
def expected(fp32_model) -> list[list[int]]:
    return [alone(fp32_model, p) for p in prompts()]


def assert_pool_empty(engine: Engine) -> None:
    stats = engine.cache_stats()
    assert stats.used_blocks == 0 and stats.num_sequences == 0


def test_mixed_batch_equals_each_alone(fp32_model, expected):
    engine = Engine(fp32_model, num_blocks=256)
    results = engine.generate(prompts(), GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert_pool_empty(engine)
    # The shared system prompt's blocks stay cached: a later request computes less.
    later = engine.generate([prompts()[0]], GREEDY)[0]
    assert later.cached_prompt_tokens == 32 and later.token_ids == expected[0]


def test_a_prompt_shared_by_requests_sent_together_is_computed_once(fp32_model, expected):
    engine = Engine(fp32_model, num_blocks=256)
    results = engine.generate(prompts()[:3], GREEDY)  # one 40-token system prompt
    assert [r.token_ids for r in results] == expected[:3]
    # the first computes the system prompt's two full blocks; the others hit them
    assert [r.cached_prompt_tokens for r in results] == [0, 32, 32]
    assert_pool_empty(engine)


def test_chunked_prefill_equals_whole(fp32_model, expected):
    engine = Engine(fp32_model, num_blocks=256, max_batch_tokens=24)
    assert [r.token_ids for r in engine.generate(prompts(), GREEDY)] == expected
    assert_pool_empty(engine)


def test_small_pool_preempts_and_still_matches(fp32_model, expected):
    # 53 blocks of 4 tokens hold the three distinct prompts (195 tokens, 50 blocks) but
    # not their growth (6 blocks). After a run of one-token requests, admission expects
    # short outputs and lets all three in with a block of headroom each; their growth
    # then preempts the latest admitted, which resume. (A stop token they never produce
    # keeps their length unknown to admission, as for requests that may end early.)
    engine = Engine(fp32_model, num_blocks=53, block_size=4)
    engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=1))
    assert engine.snapshot().expected_output == 1.0
    results = engine.generate(prompts()[3:], replace(GREEDY, stop_token_ids=(49151,)))
    assert [r.token_ids for r in results] == expected[3:]
    preemptions = engine.snapshot().preemptions
    assert preemptions > 0 and sum(r.preemptions for r in results) == preemptions
    assert_pool_empty(engine)


def test_abort_frees_blocks_at_once(fp32_model):
    engine = Engine(fp32_model, num_blocks=64)
    a = engine.add_request(prompts()[4], SamplingParams(temperature=0, max_tokens=50))
    b = engine.add_request(prompts()[0], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.snapshot().running == 2 and engine.cache_stats().used_blocks > 0
    engine.abort(a)
    engine.abort(b)
    engine.abort("no-such-request")  # ignored
    assert not engine.has_work()
    assert_pool_empty(engine)


def test_request_too_long_for_the_pool_is_refused_and_output_stops_at_the_pool(fp32_model):
    engine = Engine(fp32_model, num_blocks=2, block_size=16)
    with pytest.raises(PromptExceedsPool, match="2 blocks"):
        engine.add_request(prompts()[5], GREEDY)  # 120 tokens > 32 slots
    with pytest.raises(PromptTooLong, match="context"):
        engine.add_request([1] * engine.context_length, GREEDY)
    assert not engine.has_work()
    small, grows = engine.generate(
        [[1, 2, 3], [1, 2, 3]],
        [
            SamplingParams(temperature=0, max_tokens=2),
            SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
        ],
    )
    assert small.finish_reason == "length" and len(small.token_ids) == 2
    # Alone in the pool, its output ends where the pool does: 32 slots computed, plus
    # the token sampled from the last of them.
    assert grows.finish_reason == "length" and 3 + len(grows.token_ids) == 33
    assert_pool_empty(engine)


def test_seeded_sampling_is_reproducible_in_any_batch(fp32_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=6, ignore_eos=True)
    solo = Engine(fp32_model, num_blocks=64).generate([prompts()[1]], params)[0].token_ids
    engine = Engine(fp32_model, num_blocks=256, seed=5)
    mixed = engine.generate(prompts(), [GREEDY, params, GREEDY, GREEDY, GREEDY, GREEDY])
    assert mixed[1].token_ids == solo


def test_static_policy_reserves_the_context(fp32_model, expected):
    engine = Engine(fp32_model, num_blocks=1024, policy="static")
    rid = engine.add_request(prompts()[0], GREEDY)
    outputs = engine.step()
    slots = engine.cache_stats().used_blocks * engine.block_size
    assert slots >= len(prompts()[0]) + GREEDY.max_tokens
    assert engine.cache_stats().waste_slots_reserved > 0
    tokens = drain(engine)[(rid, 0)]
    assert [t for o in outputs for t in o.token_ids] + tokens == expected[0]


def test_n_samples_share_the_prompt_blocks_and_equal_seeded_runs_alone(fp32_model):
    prompt = prompts()[5]  # 120 tokens: 7 full blocks and a partial one
    params = SamplingParams(temperature=0.9, seed=42, max_tokens=6, ignore_eos=True, n=4)
    engine = Engine(fp32_model, num_blocks=64)
    rid = engine.add_request(prompt, params)
    first = engine.step()  # prefill and the four first tokens
    assert sorted(o.index for o in first) == [0, 1, 2, 3]
    assert {o.request_id for o in first} == {rid}  # samples told apart by index, not id
    second = engine.step()  # each sample writes its first token: the partial block is copied
    stats = engine.cache_stats()
    assert stats.shared_blocks == 7 and stats.cow_copies == 3
    assert stats.used_blocks == 7 + 4  # one prompt's KV plus one block per sample
    rest = drain(engine)
    for j in range(4):
        got = [t for step in (first, second) for o in step if o.index == j for t in o.token_ids]
        got += rest.get((rid, j), [])
        solo = replace(params, n=1, seed=42 + j)
        assert got == alone_with(fp32_model, prompt, solo), j
    assert_pool_empty(engine)


def alone_with(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return Engine(model, num_blocks=64).generate([prompt], params)[0].token_ids


def test_a_stop_string_ends_the_request_in_the_step_as_stop_and_counts_its_length(
    fp32_model, default_tokenizer
):
    """A stop string is matched by the engine's output processor, inside the step: the
    request ends there as ``stop`` (its blocks freed at once) and its output length
    enters the scheduler's expected-output average like any other ending."""
    engine = Engine(fp32_model, num_blocks=64, tokenizer=default_tokenizer)
    prompt = default_tokenizer.encode_chat([{"role": "user", "content": "Count to twenty."}])
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    assert engine.snapshot().expected_output == len(free.token_ids)
    stop = free.text[len(free.text) // 2 :][:3]  # three characters from the middle
    cut = free.text.index(stop)
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[
        0
    ]
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:cut]
    assert len(stopped.token_ids) < len(free.token_ids)
    n = len(stopped.token_ids)
    assert engine.snapshot().expected_output == pytest.approx(0.9 * len(free.token_ids) + 0.1 * n)
    assert_pool_empty(engine)


def test_bf16_outputs_do_not_depend_on_the_batch_with_int8_products(default_model_file):
    """bf16 with int8 products at every step size: every row's products are computed
    alone (fixed order), attention takes one path per sequence, so the greedy tokens of
    a request are the same alone and in any batch, bit for bit (the float products of
    oneDNN's bf16 GEMMs were not: 18 of 32 chat answers differed)."""
    from kvpool.model.gguf_weights import load_gguf_weights
    from kvpool.model.llama import LlamaModel
    from kvpool.model.native import native_ops
    from kvpool.model.products import ProductPolicy

    if native_ops() is None:
        pytest.skip("the int8 products are native ops, not built here")
    config, weights = load_gguf_weights(default_model_file, torch.bfloat16, quantized=True)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, ProductPolicy())
    params = replace(GREEDY, max_tokens=12)
    alone = [Engine(model, num_blocks=64).generate([p], params)[0].token_ids for p in prompts()]
    batched = Engine(model, num_blocks=256).generate(prompts(), params)
    assert [r.token_ids for r in batched] == alone
