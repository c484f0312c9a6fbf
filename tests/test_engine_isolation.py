"""One request never breaks the others, at the engine (fp32, the default model): token
ids are checked before anything is queued, an exception tied to one request of a running
batch ends that request alone while the rest produce exactly the tokens of a clean run,
tenants are admitted in turn, and the waiting queue is bounded."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.errors import InvalidTokens, QueueFull  # noqa: E402
from kvpool.engine.request import Status  # noqa: E402
from kvpool.engine.sampling import InvalidSamplingParams, SamplingParams  # noqa: E402
from tests.test_engine import GREEDY, assert_pool_empty, prompts  # noqa: E402


@pytest.mark.parametrize("bad", [[-5], [49152], [10**9], [2**70], [1, 2, 3.0], [True]])
def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(fp32_model, bad):
    engine = Engine(fp32_model, num_blocks=32)
    with pytest.raises(InvalidTokens, match=r"\[0, 49152\)"):
        engine.add_request([7, 8, *bad], GREEDY)
    assert not engine.has_work() and engine.requests == {}
    assert_pool_empty(engine)


class Fault:
    """Wraps the runner's forward: raises while ``victim`` is in the step (a fault tied
    to one request, wherever it happens to sit in the batch)."""

    def __init__(self, engine: Engine, on_sample: bool = False) -> None:
        self.engine = engine
        self.victim: int | None = None  # a seq id
        self.forward = engine.runner.forward
        self.raised = 0
        engine.runner.forward = self  # type: ignore[method-assign]

    def __call__(self, chunks, **kw):
        if any(c.seq_id == self.victim for c in chunks):
            self.raised += 1
            raise RuntimeError("injected fault")
        return self.forward(chunks, **kw)


@pytest.mark.parametrize("victim", [0, 3, 5])
def test_a_fault_tied_to_one_request_fails_it_alone(fp32_model, expected_clean, victim):
    engine = Engine(fp32_model, num_blocks=256)
    fault = Fault(engine)
    requests = [engine.add_request(p, GREEDY) for p in prompts()]
    for _ in range(3):  # all six decoding together, then the fault strikes
        engine.step()
    assert all(r.status is Status.RUNNING for r in requests)
    fault.victim = requests[victim].seq_id
    progressed = engine.step()
    assert requests[victim] in progressed
    while engine.has_work():
        engine.step()
    assert requests[victim].finish_reason == "error"
    assert "internal error (id " in requests[victim].error
    for i, request in enumerate(requests):
        if i != victim:
            assert request.finish_reason == "length"
            assert request.output_ids == expected_clean[i], i
    assert 1 <= fault.raised <= 4  # the whole batch, then the halves that hold it
    assert_pool_empty(engine)


def test_a_step_where_every_request_faults_fails_them_all_and_the_engine_goes_on(
    fp32_model, expected_clean
):
    engine = Engine(fp32_model, num_blocks=256)
    forward = engine.runner.forward
    engine.runner.forward = lambda chunks, **kw: 1 / 0  # type: ignore[method-assign]
    failed = [engine.add_request(p, GREEDY) for p in prompts()[:4]]
    while engine.has_work():
        engine.step()
    assert [r.finish_reason for r in failed] == ["error"] * 4
    assert_pool_empty(engine)
    engine.runner.forward = forward  # type: ignore[method-assign]
    (after,) = engine.generate([prompts()[0]], GREEDY)
    assert after.output_ids == expected_clean[0]


def test_a_fault_in_sampling_fails_that_row_alone(fp32_model, expected_clean):
    engine = Engine(fp32_model, num_blocks=256)
    sample = engine.sampler.sample
    poisoned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=(1,))

    def flaky(logits, params, *rest):
        if any(p is poisoned for p in params):
            raise ValueError("injected sampling fault")
        return sample(logits, params, *rest)

    engine.sampler.sample = flaky  # type: ignore[method-assign]
    requests = [engine.add_request(p, GREEDY) for p in prompts()[:3]]
    victim = engine.add_request(prompts()[3], poisoned)
    while engine.has_work():
        engine.step()
    assert victim.finish_reason == "error"
    assert [r.output_ids for r in requests] == expected_clean[:3]
    assert_pool_empty(engine)


@pytest.fixture(scope="module")
def expected_clean(fp32_model) -> list[list[int]]:
    engine = Engine(fp32_model, num_blocks=256)
    return [r.output_ids for r in engine.generate(prompts(), GREEDY)]


def test_tenants_are_admitted_in_turn(fp32_model):
    """Tenant a queues a burst of 40 requests, then tenant b one: b is admitted in the
    next admission round, not after a's burst."""
    engine = Engine(fp32_model, num_blocks=40)  # room for a few requests at a time
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    burst = [engine.add_request([5 + i] * 60, params, salt="tenant:a") for i in range(40)]
    engine.step()
    running_before = len(engine.scheduler.running)
    single = engine.add_request([9] * 60, params, salt="tenant:b")
    admitted_before_b = 0
    while single.status is Status.WAITING:
        engine.step()
        if single.status is Status.WAITING:
            admitted_before_b = sum(r.status is not Status.WAITING for r in burst)
    a_admitted_first = admitted_before_b - running_before
    assert a_admitted_first <= 1, (running_before, admitted_before_b)
    while engine.has_work():
        engine.step()
    assert all(r.finish_reason == "length" for r in [*burst, single])
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
    a, b = engine.generate([prompts()[0]] * 2, [params, same])
    assert [s.output_ids for s in a.siblings] == [s.output_ids for s in b.siblings]


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
