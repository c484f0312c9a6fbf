"""The KV pool's size when none is given: 512 MiB on the CPU; on a GPU what the model and
its steps leave of ``gpu_memory_utilization`` of the device, never the last free 5%
(``GPUMemory.kv_budget``: arithmetic, checked here on any machine; the measurement on
a GPU is test_cuda's)."""

from __future__ import annotations

import pytest

from kvpool.model.device_memory import (
    CPU_KV_CACHE_MEMORY,
    FREE_MARGIN,
    GiB,
    GPUMemory,
    model_device_bytes,
)
from kvpool.model.runner import GATHER_BYTES_MAX

T = 140 * GiB


def test_an_empty_gpu_gives_the_pool_its_share_less_the_model_and_its_steps():
    m = GPUMemory(total=T, free=T - 16 * GiB - GiB // 2, weights=16 * GiB, peak=GiB)
    assert m.kv_budget(0.9) == int(0.9 * T) - 16 * GiB - GiB - GATHER_BYTES_MAX
    assert "0.90 of it less weights 16.00" in m.describe(0.9)


def test_memory_others_hold_is_never_taken():
    # another process holds 100 GiB: the pool takes what is free, less the margin
    m = GPUMemory(total=T, free=T - 116 * GiB, weights=16 * GiB, peak=GiB)
    assert m.kv_budget(0.9) == 24 * GiB - GiB - GATHER_BYTES_MAX - int(FREE_MARGIN * T)


def test_models_sharing_a_gpu_each_take_their_share():
    """Two models (the server divides the utilization among --max-models): the first
    takes its half; the second, loaded beside it, its own half, not what the first left."""
    first = GPUMemory(total=T, free=T - 8 * GiB, weights=8 * GiB, peak=GiB)
    pool = first.kv_budget(0.45)
    assert pool == int(0.45 * T) - 8 * GiB - GiB - GATHER_BYTES_MAX
    used = 8 * GiB + pool + GiB + GATHER_BYTES_MAX  # the first model's all
    second = GPUMemory(total=T, free=T - used - 8 * GiB, weights=8 * GiB, peak=GiB)
    assert second.kv_budget(0.45) == pool
    assert used + 8 * GiB + second.kv_budget(0.45) + GiB + GATHER_BYTES_MAX <= 0.9 * T


def test_no_room_gives_zero():
    m = GPUMemory(total=24 * GiB, free=2 * GiB, weights=20 * GiB, peak=GiB)
    assert m.kv_budget(0.9) == 0


def test_an_engine_on_the_cpu_without_a_size_takes_512_mib(fp32_model):
    pytest.importorskip("torch")
    from kvpool.engine.engine import Engine

    engine = Engine(fp32_model)
    try:
        pool = engine.num_blocks * engine.kv_bytes_per_block
        assert CPU_KV_CACHE_MEMORY - engine.kv_bytes_per_block < pool <= CPU_KV_CACHE_MEMORY
        assert engine.kv_sizing is None  # nothing measured
    finally:
        engine.close()


def test_a_models_device_bytes_are_the_loaders_or_its_parameters(fp32_model):
    pytest.importorskip("torch")
    assert fp32_model.device_bytes is None  # a CPU model: the loader measures none
    assert model_device_bytes(fp32_model) == fp32_model.num_parameters * 4


def test_the_step_peak_measurement_runs_its_two_steps(fp32_model, monkeypatch):
    """``step_peak_bytes``' steps (a prompt of ``max_batch_tokens`` with every token's
    logits, a decode of ``max_running`` rows) run on any device: here on the CPU, with
    torch.cuda's counters stood in for. The peak counts neither what was allocated
    before nor the small pool the steps run on."""
    torch = pytest.importorskip("torch")
    from kvpool.model.device_memory import step_peak_bytes
    from kvpool.model.runner import ModelRunner

    allocated = iter([1000, 1500])  # before the steps' pool, and with it
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 4000)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    steps = []
    forward = ModelRunner.forward

    def counted(self, chunks, **kw):
        steps.append(([len(c.token_ids) for c in chunks], kw, self.kv.num_blocks))
        return forward(self, chunks, **kw)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    assert step_peak_bytes(fp32_model, 16, 64, 8) == 4000 - 1000 - 500
    assert steps == [([64], {"all_logits": True}, 8), ([1] * 8, {}, 8)]
