"""AsyncLLM: the engine on its own thread, driven from asyncio, as the server uses it."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from kvpool import LLM, SamplingParams
from kvpool.engine.async_llm import AsyncLLM
from kvpool.engine.errors import EngineStopped, PromptTooLong

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", progress=False, kv_cache_memory=16 * 2**20)


async def collect(engine: AsyncLLM, ids, params=GREEDY, **kw):
    text, tokens, last = "", [], None
    async for delta in engine.generate(ids, params, **kw):
        text += delta.text
        tokens += delta.token_ids
        last = delta
    return text, tokens, last


def test_streams_equal_the_offline_api_and_share_a_prefix_sent_at_once(llm):
    system = "You are a terse assistant. " * 8
    questions = [f"{system}Question {i}: name a number." for i in range(8)]
    expected = [out.text for out in llm.generate(questions, GREEDY)]
    llm.engine.reset_prefix_cache()
    engine = AsyncLLM(llm.engine)
    engine.start()
    try:

        async def main():
            ids = [llm.tokenizer.encode(q) for q in questions]
            results = await asyncio.gather(*(collect(engine, i) for i in ids))
            return results, await engine.stats()

        results, snapshot = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [text for text, _, _ in results] == expected
    for text, tokens, last in results:
        assert last.finish_reason == "length" and len(tokens) == 16 == last.completion_tokens
        assert llm.tokenizer.decode(tokens) == text
    assert sum(last.cached_prompt_tokens for _, _, last in results) >= 7 * 48
    assert snapshot.cache.used_blocks == 0 and snapshot.running == snapshot.waiting == 0


def test_leaving_the_stream_cancels_and_frees_blocks_and_errors_are_typed(llm):
    engine = AsyncLLM(llm.engine)
    engine.start()
    try:

        async def main():
            long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            stream = engine.generate(llm.tokenizer.encode("Count to a thousand:"), long)
            seen = 0
            async for delta in stream:
                seen += len(delta.token_ids)
                if seen >= 3:
                    break
            await stream.aclose()
            after = await engine.stats()
            with pytest.raises(PromptTooLong):
                await collect(engine, [1] * llm.engine.context_length)
            count = llm.tokenizer.encode("1, 2, 3, 4,")
            stop6 = SamplingParams(temperature=0, stop=(" 6",))
            text, _, last = await collect(engine, count, stop6)
            pinned = await engine.pin_prefix(llm.tokenizer.encode("A pinned prefix. " * 10))
            pinned_stats = await engine.stats()
            await engine.unpin_prefix(llm.tokenizer.encode("A pinned prefix. " * 10))
            two = SamplingParams(n=2, max_tokens=3, seed=1)
            n2 = [d async for d in engine.generate([5, 6, 7], two)]
            return seen, after, text, last, pinned, pinned_stats, n2, await engine.stats()

        seen, after, text, last, pinned, pinned_stats, n2, final = asyncio.run(main())
    finally:
        engine.shutdown()
    assert seen >= 3 and after.cache.used_blocks == 0 and after.running == 0
    assert last.finish_reason == "stop" and " 6" not in text and " 5" in text
    assert pinned == 48 and pinned_stats.cache.pinned_blocks == 3
    assert final.cache.pinned_blocks == 0 and final.cache.used_blocks == 0
    assert sorted(d.index for d in n2 if d.finish_reason) == [0, 1]


def test_shutdown_cancels_requests_in_flight(llm):
    engine = AsyncLLM(llm.engine)
    engine.start()

    async def main():
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        stream = engine.generate(llm.tokenizer.encode("Write a long story."), long)
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineStopped):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert llm.engine.cache_stats().used_blocks == 0


def test_the_engine_thread_ends_when_idle_and_the_next_command_starts_another(llm):
    """An idle engine thread ends (its OpenMP pool with it); whatever comes next (a
    request, a call, an abort) starts a new one, and nothing sent while a thread is
    ending is lost: requests sent at random moments against a thread that ends after a
    millisecond idle all complete, equal to the offline answers."""
    import random

    prompts = [f"Count to {i}:" for i in range(12)]
    expected = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    engine = AsyncLLM(llm.engine, idle_exit=0.001)
    engine.start()
    threads = set()
    try:

        async def main():
            first = engine._thread
            ids = [llm.tokenizer.encode(p) for p in prompts]
            results = [(await collect(engine, ids[0]))[1]]
            while first.is_alive():  # it ends once idle
                await asyncio.sleep(0.001)
            stats = await engine.stats()  # a call starts a new thread
            threads.update({first, engine._thread})
            rng = random.Random(5)

            async def later(i):
                await asyncio.sleep(rng.random() * 0.02)
                threads.add(engine._thread)
                return (await collect(engine, ids[i]))[1]

            results += await asyncio.gather(*(later(i) for i in range(1, len(ids))))
            return results, stats, await engine.stats()

        # (a bound only for a broken hand-over, which would wait forever)
        results, stats, last = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        engine.shutdown()
    assert results == expected
    assert len(threads) >= 2 and stats.running == 0
    assert last.cache.used_blocks == 0 and last.running == last.waiting == 0
    assert not any(t.is_alive() for t in threads)
