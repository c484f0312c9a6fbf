"""ThreadPolicy: how a step uses the CPU's threads, chosen by measured step times."""

from __future__ import annotations

import pytest

from kvpool.model.threads import Mode, ThreadPolicy


def _run(policy: ThreadPolicy, cost: dict[Mode, float], steps: int, tokens: int = 1):
    """Steps whose time per token in each mode is ``cost``; the modes chosen."""
    chosen = []
    for _ in range(steps):
        mode = policy.choose(tokens, decode_only=True)
        policy.record(cost[mode] * tokens)
        chosen.append(mode)
    return chosen


def test_one_thread_always_runs_one():
    policy = ThreadPolicy(1)
    assert {policy.choose(t, d) for t in (1, 8, 512) for d in (True, False)} == {Mode.ONE}


def test_settles_on_the_faster_mode_and_keeps_checking_the_other():
    policy = ThreadPolicy(2, explore_every=16)
    chosen = _run(policy, {Mode.ALL: 0.014, Mode.SPLIT: 0.013, Mode.ONE: 0.017}, 100)
    settled = chosen[8:]
    assert settled.count(Mode.SPLIT) > 0.85 * len(settled)  # two others, each 1 in 16
    assert Mode.ONE in settled and Mode.ALL in settled  # explored now and then


def test_follows_the_machine_getting_busy_and_idle_again():
    policy = ThreadPolicy(2, explore_every=16)
    idle = {Mode.ALL: 0.013, Mode.SPLIT: 0.014, Mode.ONE: 0.017}
    busy = {Mode.ALL: 0.08, Mode.SPLIT: 0.073, Mode.ONE: 0.0175}  # measured: a busy core
    _run(policy, idle, 50)
    chosen = _run(policy, busy, 50)
    assert chosen[5:].count(Mode.ONE) > 0.9 * len(chosen[5:])  # switched within a step
    chosen = _run(policy, busy, 600)  # the much slower modes are retried ever less often
    assert len(chosen[-400:]) - chosen[-400:].count(Mode.ONE) <= 6
    chosen = _run(policy, idle, 400)  # a mode that was much slower is retried less often
    assert chosen[-200:].count(Mode.ALL) > 0.85 * 200  # and back


def test_large_prefill_chooses_between_all_threads_and_one():
    policy = ThreadPolicy(2)
    modes = set()
    for _ in range(10):
        modes.add(policy.choose(512, decode_only=False))
        policy.record(0.5)
    assert modes == {Mode.ALL, Mode.ONE}  # SPLIT does not pay for large prefills
    seen = set()
    for _ in range(10):  # small steps try all three
        seen.add(policy.choose(4, decode_only=False))
        policy.record(0.01)
    assert seen == set(Mode)


def test_step_kinds_are_measured_apart():
    policy = ThreadPolicy(2, explore_every=1000)
    for _ in range(20):  # batch 1: one thread is faster
        mode = policy.choose(1, decode_only=True)
        policy.record({Mode.ALL: 0.03, Mode.SPLIT: 0.02, Mode.ONE: 0.01}[mode])
        mode = policy.choose(32, decode_only=True)  # batch 32: split is faster
        policy.record({Mode.ALL: 0.07, Mode.SPLIT: 0.06, Mode.ONE: 0.09}[mode])
    assert policy.choose(1, decode_only=True) is Mode.ONE
    policy.record(0.01)
    assert policy.choose(32, decode_only=True) is Mode.SPLIT


def test_modes_give_bit_identical_logits(fp32_model):
    """Switching modes can never change a token: every op computes the same values on
    one thread or several."""
    torch = pytest.importorskip("torch")
    from kvpool.cache import KVCacheManager
    from tests.paged_runner import Chunk, PagedRunner

    class Fixed(ThreadPolicy):
        mode = Mode.ONE

        def choose(self, tokens: int, decode_only: bool) -> Mode:
            return self.mode

    policy = Fixed(2)
    runner = PagedRunner(fp32_model, KVCacheManager(128, 16), threads=policy)
    prompts = [[(7 * i + 31 * b) % 40000 + 3 for i in range(40 + 9 * b)] for b in range(8)]
    for b, p in enumerate(prompts):
        runner.manager.allocate(b, p)
    results = {}
    for mode in Mode:
        policy.mode = mode
        prefill = runner.forward([Chunk(b, p[:-1], 0) for b, p in enumerate(prompts)])
        decode = runner.forward([Chunk(b, p[-1:], len(p) - 1) for b, p in enumerate(prompts)])
        results[mode] = (prefill, decode)
    for mode in (Mode.SPLIT, Mode.ALL):
        assert all(torch.equal(a, b) for a, b in zip(results[Mode.ONE], results[mode], strict=True))


def test_long_prefill_steps_are_one_kind():
    """Trying one thread on a long prefill costs a whole slow step: all sizes from 128
    tokens share what was learnt."""
    policy = ThreadPolicy(2)
    for tokens in (200, 700, 2048):
        policy.choose(tokens, decode_only=False)
        policy.record(tokens * 0.001)
    assert list(policy.summary()) == ["prefill >=128 tokens"]


def test_in_passing_thread_runs_on_a_thread_that_ends_and_hands_back_its_outcome():
    import threading

    from kvpool.model.threads import in_passing_thread

    seen = []

    def work(a, *, b):
        seen.append(threading.current_thread())
        return a + b

    assert in_passing_thread(work, 2, b=3) == 5
    (thread,) = seen
    assert thread is not threading.current_thread() and not thread.is_alive()

    def fail():
        raise KeyError("no such model")

    with pytest.raises(KeyError, match="no such model"):
        in_passing_thread(fail)


def test_the_server_loads_its_model_on_a_thread_that_has_ended(monkeypatch):
    """The thread that serves HTTP must not keep an OpenMP pool beside the engine
    thread's (``in_passing_thread``): the model and its engine are built elsewhere."""
    pytest.importorskip("torch")
    import threading

    from kvpool.cli import build_parser
    from kvpool.server import main

    loaders = []
    original = main._load_with_engine

    def recording(*args, **kwargs):
        loaders.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(main, "_load_with_engine", recording)
    args = build_parser().parse_args(["serve", "--quiet", "--kv-cache-memory", "16"])
    built = main.build(args)
    try:
        (thread,) = loaders
        assert thread is not threading.current_thread() and not thread.is_alive()
        assert built.model.loaded.model is not None
    finally:
        built.llm.shutdown()
