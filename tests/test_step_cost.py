"""Prompt chunks sized to keep streams moving: ``StepCost``'s estimates, the scheduler's
cap while requests stream, and the engine under it (its outputs unchanged)."""

from __future__ import annotations

import random

import pytest

from kvpool.cache import KVCacheManager
from kvpool.engine.request import Request
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.scheduler import IDLE_STEP_TARGETS, Scheduler
from kvpool.engine.step_cost import StepCost

STREAM = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_estimates_follow_a_step_time_linear_in_tokens_and_context():
    cost = StepCost()
    assert cost.tokens_within(0.5, 0, 2048) == 0  # nothing measured yet
    rng = random.Random(0)
    a, b = 0.002, 0.0005  # seconds a prompt token, and a token and 1000 positions
    for _ in range(40):  # a step: 10 ms of decode rows + its chunks
        rows = rng.randrange(0, 9)
        chunks = [
            (rng.randrange(0, 8000), rng.choice([64, 300, 1000]))
            for _ in range(rng.randrange(0, 3))
        ]
        prompt = sum(n * (a + b * (s + n / 2) / 1000) for s, n in chunks)
        cost.observe(rows, chunks, (0.010 if rows else 0.0) + prompt)
    assert cost.decode_step == pytest.approx(0.010)
    assert cost.per_token == pytest.approx(a, rel=1e-2)
    assert cost.per_token_context == pytest.approx(b, rel=1e-2)
    # 0.49 s of prompt at the start of a context, and 6000 positions into it
    assert cost.tokens_within(0.49, 0, 2048) in range(236, 241)  # n (a + b n / 2000) = 0.49
    deep = cost.tokens_within(0.49, 6000, 2048)
    assert deep in range(95, 100)  # n (a + b (6 + n / 2000)) = 0.49
    assert cost.prompt_seconds(deep, 6000) == pytest.approx(0.49, rel=0.02)
    assert cost.tokens_within(0.49, 0, 100) == 100  # never past what is asked
    assert cost.tokens_within(0.0, 0, 100) == 0


def test_small_chunks_and_prompt_only_steps_inform_as_they_can():
    cost = StepCost()
    cost.observe(1, [(0, 5)], 1.0)  # five prompt tokens: the step's fixed part, not theirs
    assert not cost.measured
    cost.observe(0, [(0, 1000)], 2.0)  # no decode rows: the whole step is the prompt's
    assert cost.measured and cost.per_token == pytest.approx(0.002)
    assert cost.per_token_context == 0  # one context seen: per token only
    cost.observe(3, [], 0.05)
    cost.observe(3, [(0, 100)], 0.01)  # faster than its decode rows alone (noise)
    assert cost.per_token >= 0 and cost.per_token_context >= 0


def _running(scheduler: Scheduler, prompt: list[int], produced: int) -> Request:
    """A request admitted and computed, with ``produced`` output tokens."""
    request = Request(f"r{len(scheduler.running)}", list(prompt), STREAM)
    scheduler.add(request)
    while request.num_computed < len(request.tokens):
        work, _ = scheduler.schedule()
        scheduler.after_forward(work)
    for i in range(produced):
        request.tokens.append(7 + i)
        work, _ = scheduler.schedule()
        scheduler.after_forward(work)
    return request


def _scheduler(step_target: float, cost: StepCost) -> Scheduler:
    manager = KVCacheManager(512, 16)
    return Scheduler(
        manager, max_batch_tokens=2048, max_running=8, watermark=0.0, step_cost=cost,
        step_target=step_target,
    )  # fmt: skip


@pytest.mark.parametrize("step_target", [0.1, 0.0])
def test_a_long_prompt_beside_a_stream_is_computed_in_steps_of_the_target(step_target):
    cost = StepCost()
    cost.observe(1, [], 0.010)
    cost.observe(0, [(0, 1000)], 1.0)  # 1 ms a prompt token: 0.1 s holds 90 beside the stream
    scheduler = _scheduler(step_target, cost)
    stream = _running(scheduler, [3] * 20, produced=1)
    long = Request("long", [5 + i % 50 for i in range(3000)], STREAM)
    scheduler.add(long)
    chunks = []
    while long.num_computed < len(long.tokens):
        stream.tokens.append(9)  # the stream's next token, sampled in the last step
        work, _ = scheduler.schedule()
        by_request = {w.request.request_id: w for w in work}
        assert len(by_request[stream.request_id].token_ids) == 1  # the stream goes on
        chunks.append(len(by_request["long"].token_ids))
        scheduler.after_forward(work)
    if step_target:
        assert set(chunks[:-1]) == {90} and 0 < chunks[-1] <= 90
    else:
        assert chunks == [2047, 3000 - 2047]  # the budget less the stream's token


@pytest.mark.parametrize("step_target", [0.1, 0.0])
def test_with_nobody_streaming_a_step_still_ends_within_a_few_targets(step_target):
    """Nobody streams or waits: prompt chunks take ``IDLE_STEP_TARGETS`` step targets,
    the admitting step's too, so a request arriving during any of those steps waits that
    long at most (whole-budget chunks: 2048 tokens). Target 0: the whole budget."""
    cost = StepCost()
    cost.observe(1, [], 0.010)
    cost.observe(0, [(0, 1000)], 1.0)  # 1 ms a prompt token
    idle = round(IDLE_STEP_TARGETS * step_target * 1000)  # tokens a step then holds
    scheduler = _scheduler(step_target, cost)
    first = Request("first", [3] * 100, STREAM)  # two prompts at once, nothing running
    long = Request("long", [5 + i % 50 for i in range(3000)], STREAM)
    scheduler.add(first)
    scheduler.add(long)
    work, _ = scheduler.schedule()
    sizes = [(w.request, len(w.token_ids)) for w in work]
    assert sizes == (
        [(first, 100), (long, idle - 100)] if step_target else [(first, 100), (long, 1948)]
    )
    scheduler.after_forward(work)
    scheduler.finish(first, "stop")
    chunks = []  # the long prompt alone
    while long.num_computed < len(long.tokens):
        work, _ = scheduler.schedule()
        chunks += [len(w.token_ids) for w in work]
        scheduler.after_forward(work)
    if step_target:
        assert set(chunks[:-1]) == {idle} and 0 < chunks[-1] <= idle
    else:
        assert chunks == [3000 - 1948]


def _fixed_costs(engine) -> None:
    """A measured machine where 0.2 s holds 64 prompt tokens beside a decode step, kept
    fixed (no timing in these tests)."""
    engine.step_cost.observe(1, [], 0.008)
    engine.step_cost.observe(0, [(0, 1000)], 3.0)
    engine.step_cost.observe = lambda *args: None


def _recorded_chunks(engine, request_id: str) -> list[int]:
    """The sizes of the chunks the engine's scheduler gives ``request_id`` from now on
    (the list fills as the engine steps)."""
    schedule, chunks = engine._scheduler.schedule, []

    def recorded():
        work, rejected = schedule()
        chunks.extend(len(w.token_ids) for w in work if w.request.request_id == request_id)
        return work, rejected

    engine._scheduler.schedule = recorded
    return chunks


def test_the_engine_sizes_chunks_while_streaming_and_answers_the_same(fp32_model):
    """A long prompt arriving while another request streams: every step that computes
    part of it beside the stream holds at most the measured cap, and both answers are
    the tokens each gets with chunks of the whole budget."""
    from kvpool.engine.engine import Engine

    rng = random.Random(5)
    stream_prompt = [rng.randrange(3, 49152) for _ in range(12)]
    long_prompt = [rng.randrange(3, 49152) for _ in range(700)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(step_target_ms: float) -> tuple[list[list[int]], list[int]]:
        engine = Engine(fp32_model, num_blocks=128, step_target_ms=step_target_ms)
        _fixed_costs(engine)
        engine.add_request(stream_prompt, params, request_id="stream")
        for _ in range(3):
            engine.step()
        engine.add_request(long_prompt, params, request_id="long")
        chunks = _recorded_chunks(engine, "long")
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        assert engine.cache_stats().used_blocks == 0
        return [tokens["stream"], tokens["long"]], chunks

    capped, capped_chunks = run(200.0)
    whole, whole_chunks = run(0.0)
    assert capped == whole
    prompt_chunks = capped_chunks[: capped_chunks.index(1)]  # before its own decoding
    assert max(prompt_chunks) == 64 and sum(prompt_chunks) == len(long_prompt)
    assert whole_chunks[0] == len(long_prompt)


def test_chunks_shrink_as_the_context_they_attend_to_grows():
    cost = StepCost()
    cost.observe(1, [], 0.010)
    for start in (0, 4000, 0, 4000):  # 1 ms a token + 0.25 ms a token and 1000 positions
        cost.observe(0, [(start, 1000)], 1000 * (0.001 + 0.00025 * (start + 500) / 1000))
    scheduler = _scheduler(0.1, cost)
    stream = _running(scheduler, [3] * 20, produced=1)
    long = Request("long", [5 + i % 50 for i in range(6000)], STREAM)
    scheduler.add(long)
    chunks = []
    while long.num_computed < len(long.tokens):
        stream.tokens.append(9)
        work, _ = scheduler.schedule()
        chunks += [(w.start, len(w.token_ids)) for w in work if w.request is long]
        scheduler.after_forward(work)
    sizes = [n for _, n in chunks[:-1]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1.5 * sizes[-1]
    for start, n in chunks[:-1]:  # each fills the 0.09 s left beside the decode step
        assert 0.08 < cost.prompt_seconds(n, start) <= 0.09


def test_a_short_prompt_behind_a_long_one_starts_at_the_next_step():
    """While requests wait, the running prompts take at most half of the step's time:
    a short prompt sent after a long one is computed in the next step (whole budget
    chunks made it wait for all of the long one), and the long one goes on."""
    cost = StepCost()
    cost.observe(1, [], 0.010)
    cost.observe(0, [(0, 1000)], 1.0)  # 1 ms a prompt token
    for step_target in (0.1, 0.0):
        scheduler = _scheduler(step_target, cost)
        stream = _running(scheduler, [3] * 20, produced=1)
        long = Request("long", [5 + i % 50 for i in range(6000)], STREAM)
        short = Request("short", [7] * 40, STREAM)
        scheduler.add(long)
        stream.tokens.append(9)
        scheduler.after_forward(scheduler.schedule()[0])  # the long prompt is running
        scheduler.add(short)
        stream.tokens.append(9)
        work, _ = scheduler.schedule()
        sizes = {w.request.request_id: len(w.token_ids) for w in work}
        if step_target:  # 0.09 s of prompts: the long one 45 tokens, the short one whole
            assert sizes == {stream.request_id: 1, "long": 45, "short": 40}
        else:  # the budget less the stream's token to the long one: the short one waits
            assert "short" not in sizes and sizes["long"] == 2047


def test_a_batch_invariant_model_answers_the_same_whatever_its_chunks():
    """A batch-invariant model keeps the step target: its attention is the native one,
    each token's the same whatever chunk or step computes it. A long prompt computed in
    small chunks beside a stream, whole and alone, and again after a prefix-cache hit
    (its tail from a block boundary): the same tokens and logprobs, bit for bit (with
    SDPA's prompt attention, 32 of 40 tokens differed beside a stream)."""
    from kvpool.engine.engine import Engine
    from kvpool.model.loader import load_model
    from kvpool.model.native import native_ops

    if native_ops() is None:
        pytest.skip("the native ops are not built here (batch-invariant runs chunks whole)")
    model = load_model(None, dtype="bfloat16", progress=False, batch_invariant=True).model
    rng = random.Random(8)
    stream_prompt = [rng.randrange(3, 49152) for _ in range(12)]
    long_prompt = [rng.randrange(3, 49152) for _ in range(300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def answers(engine, with_stream):
        if with_stream:  # 64 prompt tokens fit beside a decode step
            _fixed_costs(engine)
            engine.add_request(stream_prompt, params, request_id="stream")
            for _ in range(3):
                engine.step()
        engine.add_request(long_prompt, params, request_id="long")
        chunks, got = _recorded_chunks(engine, "long"), []
        while engine.has_work():
            for out in engine.step():
                if out.request_id == "long":
                    got += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
        return got, chunks

    beside = Engine(model, num_blocks=128, step_target_ms=200.0)
    chunked, chunks = answers(beside, with_stream=True)
    assert max(chunks[: chunks.index(1)]) == 64  # the prompt in chunks of the target
    alone = Engine(model, num_blocks=128, step_target_ms=0.0)
    whole, _ = answers(alone, with_stream=False)
    hit, chunks = answers(alone, with_stream=False)  # its full blocks are cached now
    assert chunks[0] == 300 - 288  # its last 12 tokens computed, from a block boundary
    assert len(whole) == 24 and chunked == whole and hit == whole


def test_where_prompt_tokens_are_slow_a_short_prompt_is_not_held_behind_a_long_one():
    """20 ms a prompt token: the step's 32-token floor alone outlasts the half of the
    step a running prompt leaves to waiting requests. The floor goes to the admitted
    short prompt, not the long one (it took the whole time and the short one waited
    for all of the long prompt), and once both run, the short one's prompt goes first."""
    cost = StepCost()
    cost.observe(1, [], 0.010)
    cost.observe(0, [(0, 1000)], 20.0)
    scheduler = _scheduler(0.5, cost)
    long = Request("long", [5 + i % 50 for i in range(3000)], STREAM)
    scheduler.add(long)
    scheduler.after_forward(scheduler.schedule()[0])  # 2 s of it: 100 tokens
    short = Request("short", [7] * 40, STREAM)
    scheduler.add(short)
    work, _ = scheduler.schedule()  # 0.25 s to the long one, the rest and floor to short
    assert [(w.request, len(w.token_ids)) for w in work] == [(long, 12), (short, 20)]
    scheduler.after_forward(work)
    work, _ = scheduler.schedule()  # both running, nobody streaming or waiting: 2 s
    assert [(w.request, len(w.token_ids)) for w in work] == [(short, 20), (long, 80)]
