"""The offline API: text and chat in, completions with usage out; stop strings; streaming."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvpool import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=30)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", progress=False)


def test_chat_answers_with_usage_and_shares_the_system_prompt(llm):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a primary color."}],
    ]
    first, second = llm.chat(conversations, GREEDY)
    assert "4" in first.text and first.finish_reason == "stop"  # ended by <|im_end|>
    assert first.completion_tokens == len(first.token_ids) <= 30
    assert first.prompt_tokens == len(llm.tokenizer.encode_chat(conversations[0]))
    # both carry SmolLM2's default system prompt: the second hits its full block
    assert second.cached_prompt_tokens == 16
    assert llm.cache_stats().used_blocks == 0


def test_stop_strings_end_the_text_and_are_not_returned(llm):
    (out,) = llm.generate("The capital of France is", SamplingParams(temperature=0, stop=(".",)))
    assert out.finish_reason == "stop" and "." not in out.text and "Paris" in out.text


def test_stream_pieces_make_the_whole_and_stopping_early_frees_blocks(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (whole,) = llm.generate("Once upon a time", params)
    assert "".join(llm.stream("Once upon a time", params)) == whole.text
    stream = llm.stream("Once upon a time", params)
    next(stream)
    assert llm.cache_stats().used_blocks > 0
    stream.close()  # the client went away
    assert llm.cache_stats().used_blocks == 0


def test_bad_parameters_and_prompts_are_clear_errors(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)


def test_pinned_system_prompt_survives_pressure_and_is_hit():
    llm = LLM(dtype="float32", kv_cache_memory=120 * 16 * 46_080, progress=False)  # 120 blocks
    system = "You are a careful assistant. " * 12
    pinned = llm.pin_prefix(system)
    assert pinned >= 64 and llm.cache_stats().pinned_blocks == pinned // 16
    # push many distinct prompts through the pool to evict everything evictable
    flood = [f"Story number {i}: " + "once upon a time " * 40 for i in range(24)]
    llm.generate(flood, SamplingParams(temperature=0, max_tokens=2))  # ~250 blocks' worth
    assert llm.cache_stats().evictions > 100  # everything unpinned went round
    (out,) = llm.generate(system + "Hello!", SamplingParams(temperature=0, max_tokens=2))
    assert out.cached_prompt_tokens >= pinned
    llm.unpin_prefix(system)
    assert llm.cache_stats().pinned_blocks == 0


def test_batch_invariant_mode_uses_int8_products_at_every_size_in_float32():
    from kvpool.model.native import native_ops

    if native_ops() is None:
        pytest.skip("the int8 products are native ops, not built here")
    llm = LLM(dtype="float32", progress=False, batch_invariant=True, kv_cache_memory=16 * 2**20)
    policy = llm.loaded.model.products
    assert not policy.exact and policy.int8_max_rows is None and policy.fixed
    assert "batch-invariant" in llm.loaded.compute_line()
    prompts = ["The capital of France is", "One, two, three,", "Colors: red,"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert [out.token_ids for out in llm.generate(prompts, params)] == alone
