"""One request never breaks the others, at the engine (fp32, the default model): token
ids are checked before anything is queued, an exception tied to one request of a running
batch ends that request alone while the rest produce exactly the tokens of a clean run,
tenants are admitted in turn, and the waiting queue is bounded."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.errors import InvalidTokens, QueueFull  # noqa: E402
from kvpool.engine.outputs import RequestOutput  # noqa: E402
from kvpool.engine.sampling import InvalidSamplingParams, SamplingParams  # noqa: E402
from tests.test_engine import GREEDY, assert_pool_empty, prompts  # noqa: E402


@pytest.mark.parametrize("bad", [[-5], [49152], [10**9], [2**70], [1, 2, 3.0], [True]])
def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(fp32_model, bad):
    engine = Engine(fp32_model, num_blocks=32)
    with pytest.raises(InvalidTokens, match=r"\[0, 49152\)"):
        engine.add_request([7, 8, *bad], GREEDY)
    assert not engine.has_work() and engine.snapshot().waiting == 0
    assert_pool_empty(engine)


class Fault:
    """Wraps the engine's runner (a test reaching inside on purpose): raises while the
    request ``victim`` is in the step (a fault tied to one request, wherever it happens
    to sit in the batch). A chunk is the victim's when it carries the victim's block
    table (no two running sequences have the same: their last blocks are their own)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.victim: str | None = None  # a request id
        self.forward = engine._runner.forward
        self.raised = 0
        engine._runner.forward = self  # type: ignore[method-assign]

    def __call__(self, chunks, **kw):
        samples = self.engine._requests.get(self.victim or "")
        if samples and samples[0].seq_id >= 0 and samples[0].finish_reason is None:
            table = self.engine._manager.block_table(samples[0].seq_id)
            if any(c.block_table == table for c in chunks):
                self.raised += 1
                raise RuntimeError("injected fault")
        return self.forward(chunks, **kw)


def run(engine: Engine) -> dict[str, RequestOutput]:
    """Step until idle; each request's outputs folded: its tokens, last finish reason
    and error (sample 0)."""
    tokens: dict[str, list[int]] = {}
    last: dict[str, RequestOutput] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            last[out.request_id] = out
    return {rid: replace(out, token_ids=tokens[rid]) for rid, out in last.items()}


@pytest.mark.parametrize("victim", [0, 3, 5])
def test_a_fault_tied_to_one_request_fails_it_alone(fp32_model, expected_clean, victim):
    engine = Engine(fp32_model, num_blocks=256)
    fault = Fault(engine)
    ids = [engine.add_request(p, GREEDY) for p in prompts()]
    early: dict[str, list[int]] = {}
    for _ in range(3):  # all six decoding together, then the fault strikes
        for out in engine.step():
            early.setdefault(out.request_id, []).extend(out.token_ids)
    assert engine.snapshot().running == 6
    fault.victim = ids[victim]
    assert ids[victim] in {out.request_id for out in engine.step()}
    fault.victim = None
    results = run(engine)
    failed = results.get(ids[victim])
    assert failed is None  # it ended in the faulting step: nothing after
    for i, rid in enumerate(ids):
        if i != victim:
            assert results[rid].finish_reason == "length"
    assert 1 <= fault.raised <= 4  # the whole batch, then the halves that hold it
    assert_pool_empty(engine)


def test_a_failed_request_reports_error_and_the_others_match_a_clean_run(
    fp32_model, expected_clean
):
    engine = Engine(fp32_model, num_blocks=256)
    fault = Fault(engine)
    ids = [engine.add_request(p, GREEDY) for p in prompts()]
    tokens: dict[str, list[int]] = {}
    outputs = {}
    step = 0
    while engine.has_work():
        step += 1
        if step == 4:
            fault.victim = ids[2]
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            outputs[out.request_id] = out
    assert outputs[ids[2]].finish_reason == "error"
    assert "internal error (id " in (outputs[ids[2]].error or "")
    for i, rid in enumerate(ids):
        if i != 2:
            assert outputs[rid].finish_reason == "length"
            assert tokens[rid] == expected_clean[i], i
    assert_pool_empty(engine)


def test_a_step_where_every_request_faults_fails_them_all_and_the_engine_goes_on(
    fp32_model, expected_clean
):
    engine = Engine(fp32_model, num_blocks=256)
    forward = engine._runner.forward
    engine._runner.forward = lambda chunks, **kw: 1 / 0  # type: ignore[method-assign]
    failed = [engine.add_request(p, GREEDY) for p in prompts()[:4]]
    results = run(engine)
    assert [results[rid].finish_reason for rid in failed] == ["error"] * 4
    assert_pool_empty(engine)
    engine._runner.forward = forward  # type: ignore[method-assign]
    (after,) = engine.generate([prompts()[0]], GREEDY)
    assert after.token_ids == expected_clean[0]


def test_a_fault_in_sampling_fails_that_row_alone(fp32_model, expected_clean):
    engine = Engine(fp32_model, num_blocks=256)
    sample = engine._sampler.sample_logprobs
    poisoned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=(1,))

    def flaky(logits, params, *rest):
        if any(p is poisoned for p in params):
            raise ValueError("injected sampling fault")
        return sample(logits, params, *rest)

    engine._sampler.sample_logprobs = flaky  # type: ignore[method-assign]
    ids = [engine.add_request(p, GREEDY) for p in prompts()[:3]]
    victim = engine.add_request(prompts()[3], poisoned)
    results = run(engine)
    assert results[victim].finish_reason == "error"
    assert [results[rid].token_ids for rid in ids] == expected_clean[:3]
    assert_pool_empty(engine)


@pytest.fixture(scope="module")
def expected_clean(fp32_model) -> list[list[int]]:
    engine = Engine(fp32_model, num_blocks=256)
    return [r.token_ids for r in engine.generate(prompts(), GREEDY)]


def test_tenants_are_admitted_in_turn(fp32_model):
    """Tenant a queues a burst of 40 requests, then tenant b one: b is admitted in the
    next admission round, not after a's burst."""
    engine = Engine(fp32_model, num_blocks=40)  # room for a few requests at a time
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    burst = [engine.add_request([5 + i] * 60, params, salt="tenant:a") for i in range(40)]
    reasons: dict[str, str | None] = {}  # requests that produced a token (admitted)

    def step() -> set[str]:
        outputs = engine.step()
        reasons.update({out.request_id: out.finish_reason for out in outputs})
        return {out.request_id for out in outputs}

    running_before = len(step())
    single = engine.add_request([9] * 60, params, salt="tenant:b")
    admitted_before_b = running_before
    while single not in reasons:
        if single not in step():
            admitted_before_b = len(reasons.keys() & set(burst))
    a_admitted_first = admitted_before_b - running_before
    assert a_admitted_first <= 1, (running_before, admitted_before_b)
    while engine.has_work():
        step()
    assert all(reasons[rid] == "length" for rid in [*burst, single])
    assert_pool_empty(engine)


def test_the_waiting_queue_is_bounded(fp32_model):
    engine = Engine(fp32_model, num_blocks=32, max_queue=3)
    for i in range(3):
        engine.add_request([5 + i] * 10, GREEDY)
    with pytest.raises(QueueFull, match="3 requests are waiting"):
        engine.add_request([9] * 10, GREEDY)
    engine.step()  # admits them: the queue has room again
    engine.add_request([9] * 10, GREEDY)
    while engine.has_work():
        engine.step()
    assert_pool_empty(engine)


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63, 2**64 - 1])
def test_seeds_of_64_bits_are_taken_modulo_2_64(fp32_model, seed):
    engine = Engine(fp32_model, num_blocks=64)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True, n=2)
    same = SamplingParams(temperature=1.0, max_tokens=6, seed=seed % 2**64, ignore_eos=True, n=2)
    a0, a1, b0, b1 = engine.generate([prompts()[0]] * 2, [params, same])
    assert [a0.token_ids, a1.token_ids] == [b0.token_ids, b1.token_ids]
    assert (a0.index, a1.index) == (0, 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", 1e308),
        ("temperature", float("nan")),
        ("repetition_penalty", 1e308),
        ("top_k", 2**40),
        ("stop", ("x",) * 33),
        ("stop", ("x" * 513,)),
    ],
)
def test_numbers_out_of_their_bounds_are_refused(field, value):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**{field: value})
