"""One ``EngineConfig``: its defaults are the CLI's, every field is reachable from
``kvpool serve`` flags, bad values are refused, and the simulator's strategies name the
same ``Policy``."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.cache import Policy
from kvpool.cli import build_parser
from kvpool.engine.config import DEFAULTS, EngineConfig, MiB, from_args
from kvpool.sim.replay import Strategy


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_serve_without_flags_runs_the_defaults():
    args = serve_args()
    assert from_args(args) == DEFAULTS
    # the pool's size: the device's default (512 MiB on the CPU, measured on a GPU)
    assert DEFAULTS.kv_cache_memory is None and DEFAULTS.policy is Policy.PAGED
    with pytest.raises(ValueError, match="kv_cache_memory must be positive"):
        from_args(serve_args("--kv-cache-memory", "0"))


def test_every_field_is_reachable_from_kvpool_serve():
    args = serve_args(
        "--kv-cache-memory", "64", "--block-size", "32", "--kv-cache-dtype", "float32",
        "--max-batch-tokens", "512", "--step-target-ms", "250", "--max-running", "8",
        "--watermark", "0.05", "--policy", "static", "--no-prefix-caching", "--seed", "7",
        "--max-queue", "9", "--kv-offload", "/tmp/tier", "--kv-offload-size", "64",
        "--gpu-memory-utilization", "0.5",
    )  # fmt: skip
    config = from_args(args, max_queue=args.max_queue)
    assert config == EngineConfig(
        block_size=32,
        kv_cache_memory=64 * MiB,
        kv_cache_dtype="float32",
        max_batch_tokens=512,
        step_target_ms=250.0,
        max_running=8,
        watermark=0.05,
        policy=Policy.STATIC,
        enable_prefix_caching=False,
        seed=7,
        max_queue=9,
        kv_offload_dir="/tmp/tier",
        kv_offload_size=64 * MiB,
        gpu_memory_utilization=0.5,
    )
    memory = from_args(serve_args("--kv-offload-memory", "32"))
    assert memory.kv_offload_memory == 32 * MiB and memory.kv_offload_dir is None
    # every field but num_blocks (the pool in blocks, for tests and benchmarks) differs
    # from its default: each has its flag
    differ = {
        f.name
        for f in dataclasses.fields(EngineConfig)
        if getattr(config, f.name) != getattr(DEFAULTS, f.name)
    }
    # (and kv_offload_memory, the other kind of tier: checked above)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert differ == fields - {"num_blocks", "kv_offload_memory"}


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"kv_cache_memory": -1},
        {"kv_cache_memory": 0},
        {"gpu_memory_utilization": 0.0},
        {"gpu_memory_utilization": 1.5},
        {"max_running": 0},
        {"watermark": 1.0},
        {"policy": "slots"},
        {"kv_cache_dtype": "int3"},
        {"num_blocks": 0},
        {"max_queue": -2},
        {"step_target_ms": -1.0},
        {"step_target_ms": float("nan")},
        {"kv_offload_dir": "/tmp/t", "kv_offload_memory": 1 << 20},
        {"kv_offload_memory": 0},
    ],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_replace_keeps_the_rest_and_static_turns_prefix_caching_off():
    config = DEFAULTS.replace(policy="static")
    assert config.policy is Policy.STATIC and config.block_size == DEFAULTS.block_size
    assert config.enable_prefix_caching and not config.prefix_caching


def test_the_simulator_replays_the_engines_policies():
    assert Strategy.STATIC.policy is Policy.STATIC
    assert Strategy.PAGED.policy is Policy.PAGED and not Strategy.PAGED.prefix_caching
    assert Strategy.PAGED_PREFIX.policy is Policy.PAGED and Strategy.PAGED_PREFIX.prefix_caching


def test_a_kv_dtype_other_than_the_compute_dtype_holds_its_own_bytes(fp32_model):
    pytest.importorskip("torch")
    from kvpool.engine.engine import Engine
    from kvpool.model.native import native_ops

    if native_ops() is None:
        pytest.skip("a KV dtype other than the compute dtype needs the native ops")

    fp32 = Engine(fp32_model, kv_cache_memory=8 * MiB, kv_cache_dtype="float32")
    bf16 = Engine(fp32_model, kv_cache_memory=8 * MiB, kv_cache_dtype="bfloat16")
    assert (fp32.kv_cache_dtype, bf16.kv_cache_dtype) == ("fp32", "bf16")
    assert bf16.kv_bytes_per_block * 2 == fp32.kv_bytes_per_block
    assert bf16.num_blocks in (2 * fp32.num_blocks, 2 * fp32.num_blocks + 1)
