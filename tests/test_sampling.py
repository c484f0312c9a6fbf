"""The batched sampler: each filter, penalties, seeds independent of the batch."""

from __future__ import annotations

import math
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from kvpool.engine.sampling import InvalidSamplingParams, Sampler, SamplingParams  # noqa: E402

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])


def draw(params: SamplingParams, n: int = 400, logits=LOGITS) -> Counter:
    sampler = Sampler(seed=1)
    gens = [params.make_generator()]
    return Counter(sampler.sample(logits, [params], [[]], [[]], gens)[0] for _ in range(n))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"n": 0}, "n must"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_out_of_range_values_are_rejected(kwargs, message):
    with pytest.raises(InvalidSamplingParams, match=message):
        SamplingParams(**kwargs)


def test_greedy_takes_the_best_token_beside_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [3.0, 0.0, 0.0, 2.9]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    out = Sampler(seed=0).sample(logits, params, [[], []], [[], []], [None, None])
    assert out[0] == 1


def test_the_argmax_never_builds_the_native_ops(monkeypatch):
    """Rows copied to the CPU on a GPU machine (whose runtime never loads the native
    ops) take torch's argmax, not a build of the ops (tens of seconds in a step); where
    the runtime has loaded them, the native argmax."""
    from kvpool.engine import sampling
    from kvpool.model import native

    info = native.native_ops.cache_info()

    def no_build():
        raise AssertionError("built the native ops")

    no_build.cache_info = lambda: info._replace(currsize=0)
    monkeypatch.setattr(native, "native_ops", no_build)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 2.0]])
    assert sampling.argmax_rows(logits) == [1, 0]
    calls = []

    class Loaded:
        def argmax_rows(self, x):
            calls.append(x.shape)
            return x.argmax(-1)

    loaded = lambda: Loaded()  # noqa: E731
    loaded.cache_info = lambda: info._replace(currsize=1)
    monkeypatch.setattr(native, "native_ops", loaded)
    assert sampling.argmax_rows(logits) == [1, 0] and calls == [(2, 3)]


def test_plain_sampling_follows_the_distribution():
    counts = draw(SamplingParams(temperature=1.0), n=4000)
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_top_k_top_p_min_p_exclude_what_they_should():
    assert set(draw(SamplingParams(top_k=1))) == {0}
    assert set(draw(SamplingParams(top_k=3))) <= {0, 1, 2}
    assert set(draw(SamplingParams(top_p=0.8))) == {0, 1}  # 0.5 + 0.3 reach 0.8
    assert set(draw(SamplingParams(top_p=0.81))) == {0, 1, 2}
    assert set(draw(SamplingParams(min_p=0.5))) == {0, 1}  # at least half the best's


def test_seeded_request_is_independent_of_the_batch():
    mine = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, 50)

    def run(others: int) -> list[int]:
        sampler = Sampler(seed=others)
        gens = [mine.make_generator()] + [None] * others
        params = [mine] + [SamplingParams(temperature=0.7, top_k=5)] * others
        rows = torch.cat([logits, torch.randn(others, 50)])
        return [
            sampler.sample(rows, params, [[]] * (others + 1), [[]] * (others + 1), gens)[0]
            for _ in range(30)
        ]

    alone = run(0)
    assert run(3) == alone and run(7) == alone
    assert len(set(alone)) > 3  # it really samples


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.5, 1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 (2.0 -> 1.0) falls behind token 2 (1.5)
    assert Sampler().sample(logits, [p], [[0]], [[]], [None]) == [2]
    assert Sampler().sample(logits, [p], [[1]], [[]], [None]) == [0]
    p = SamplingParams(temperature=0, frequency_penalty=0.6, presence_penalty=0.5)
    # token 0: 2.0 - 2 * 0.6 - 0.5 = 0.3 < 1.5
    assert Sampler().sample(logits, [p], [[]], [[0, 0]], [None]) == [2]
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    negative = torch.tensor([[-1.0, -1.5, -3.0]])
    # a negative logit is multiplied: -1.0 -> -2.0 falls behind -1.5
    assert Sampler().sample(negative, [p], [[0]], [[]], [None]) == [1]


def test_a_nucleus_wider_than_the_first_candidates_is_still_exact():
    # 1,000 tokens: the first 600 likely, the rest 100x less so. top_p=0.9 keeps about
    # 540 tokens, more than the 256 candidates looked at first.
    logits = torch.cat([torch.zeros(600), torch.full((400,), -4.6)])[None, :]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1)]
    gens = [params[0].make_generator()]
    sampler = Sampler(seed=0)
    seen = {sampler.sample(logits, params, [[]], [[]], gens)[0] for _ in range(3000)}
    assert len(seen) > 400 and max(seen) < 600  # beyond 256, never the unlikely tail


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "kwargs", [{"top_p": 0.9}, {"top_p": 0.99}, {"min_p": 0.001}, {"top_p": 0.95, "min_p": 1e-4}]
)
def test_wide_nucleus_keeps_exactly_what_a_full_sort_keeps(seed: int, kwargs: dict):
    """Flat rows, whose nucleus or min-p floor reaches far past the first candidates,
    keep the same tokens with the same weights as filtering the fully sorted row."""
    from kvpool.engine.sampling import NUCLEUS_CANDIDATES, _best_candidates, _filter_sorted

    gen = torch.Generator().manual_seed(seed)
    vocab = 5000
    probs = torch.softmax(torch.randn(3, vocab, generator=gen) * (0.5 + seed / 4), dim=-1)
    params = [SamplingParams(temperature=1.0, **kwargs)] * 3
    best = _best_candidates(probs, params)
    for j, (weights, ids, draws) in enumerate(best):
        kept = _filter_sorted(weights, params[j])
        values, order = probs[j].sort(descending=True, stable=True)
        want = _filter_sorted(values, params[j])
        assert int((kept > 0).sum()) == int((want > 0).sum())
        assert torch.equal(kept[kept > 0], want[want > 0])
        assert set(ids[kept > 0].tolist()) == set(order[want > 0].tolist())
        assert draws in (NUCLEUS_CANDIDATES, vocab)
