"""``EngineConfig``: every setting of an engine, with its default, in one place.

The CLI (``kvpool serve``, ``kvpool generate``), the server, the benchmarks, ``LLM`` and
``AsyncLLM`` all build their engine from one of these; ``add_arguments`` gives
``kvpool serve`` a flag for every field and ``from_args`` reads them back.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from kvpool.cache import Policy
from kvpool.engine.scheduler import IDLE_STEP_TARGETS

MiB = 2**20

# KV block dtypes: "auto" is the model's compute dtype; int8 holds a scale per (token,
# KV head) beside the values (kvpool.model.kv_store). The long names are aliases.
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8")
_KV_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs its model over one block pool.

    Invariants (checked at construction): sizes positive, ``0 <= watermark < 1``,
    ``policy`` a ``Policy``, ``0 < gpu_memory_utilization <= 1``; ``num_blocks``, when
    given, wins over ``kv_cache_memory``.
    """

    block_size: int = 16  # tokens per KV block
    # bytes of KV blocks (the whole pool); None: 512 MiB on the CPU, on a GPU what the
    # model and its steps leave of gpu_memory_utilization of it (kvpool.model.device_memory)
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9  # share of a GPU's memory: weights, steps, pool
    num_blocks: int | None = None  # the pool in blocks instead of bytes (tests, benchmarks)
    kv_cache_dtype: str = "auto"  # "auto": the model's compute dtype
    max_batch_tokens: int = 2048  # tokens computed in one step; longer prompts are chunked
    # While requests stream or wait, prompt chunks sized so that a step takes about this
    # long (estimated from measured steps; at least 32 prompt tokens a step), otherwise
    # scheduler.IDLE_STEP_TARGETS times this long; 0: chunks of max_batch_tokens
    step_target_ms: float = 500.0
    max_running: int = 256  # requests in the batch at once
    watermark: float = 0.01  # share of the pool kept free when admitting, for growth
    policy: Policy = Policy.PAGED
    enable_prefix_caching: bool = True
    seed: int | None = None  # the sampler's seed for requests that give none
    max_queue: int | None = None  # waiting requests at most (QueueFull past it); None: no bound
    # A second KV tier (kvpool.cache.tier): evicted cached blocks kept in files under
    # this directory (kept across restarts) ...
    kv_offload_dir: str | None = None
    kv_offload_size: int = 4096 * MiB  # ... up to this many bytes
    kv_offload_memory: int | None = None  # or in host memory, this many bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))
        positive = ("block_size", "kv_cache_memory", "max_batch_tokens", "max_running")
        for name in positive:
            value = getattr(self, name)
            if value is not None and int(value) <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        kv = _KV_ALIASES.get(str(self.kv_cache_dtype).lower(), str(self.kv_cache_dtype).lower())
        object.__setattr__(self, "kv_cache_dtype", kv)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_offload_dir is not None and self.kv_offload_memory is not None:
            raise ValueError("one second KV tier: kv_offload_dir or kv_offload_memory")
        for name in ("kv_offload_size", "kv_offload_memory"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not self.step_target_ms >= 0:  # (NaN too)
            raise ValueError(f"step_target_ms must be >= 0, got {self.step_target_ms}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with ``changes`` (unknown names raise ``TypeError``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def prefix_caching(self) -> bool:
        """Prefix caching as it runs: the static policy shares nothing."""
        return self.enable_prefix_caching and self.policy is Policy.PAGED


DEFAULTS = EngineConfig()


def add_compute_arguments(p: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device``, as ``kvpool serve`` and ``kvpool generate`` take them
    (``load_model``)."""
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: the fastest measured at load; float32 "
                        "on the CPU: the exact reference, float products, several times "
                        "slower)")  # fmt: skip
    p.add_argument("--device", default=None, metavar="{cpu,cuda,cuda:N}",
                   help="where the model computes (default: the GPU where torch sees "
                        "one, else the CPU)")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser, *, serving: bool = True) -> None:
    """Flags for the engine's settings, their defaults from ``EngineConfig``.
    ``serving=False`` (``kvpool generate``): the pool's size and shape only."""
    d = DEFAULTS
    p.add_argument("--kv-cache-memory", type=int, default=None, metavar="MiB",
                   help="KV pool (default: 512 on the CPU; on a GPU what the model and "
                   "its steps leave of --gpu-memory-utilization)")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                   default=d.gpu_memory_utilization,
                   help="on a GPU without --kv-cache-memory: the share of its memory for "
                   "the model, its steps and the KV pool, divided among --max-models "
                   f"(default {d.gpu_memory_utilization})")  # fmt: skip
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV block (default {d.block_size})")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=[*KV_CACHE_DTYPES, *_KV_ALIASES],
                   default=d.kv_cache_dtype, metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                   help="KV block dtype; auto: the compute dtype; int8: about half of "
                   "bf16's bytes")  # fmt: skip
    if not serving:
        return
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help=f"tokens computed per step (default {d.max_batch_tokens})")  # fmt: skip
    p.add_argument("--step-target-ms", type=float, default=d.step_target_ms, metavar="MS",
                   help="while requests stream or wait, size prompt chunks so a step "
                   "takes about this long (measured; at least 32 prompt tokens a step), "
                   "so a long prompt holds neither the streams' next tokens nor the "
                   f"prompts behind it; otherwise {IDLE_STEP_TARGETS}x as long, so a "
                   "request arriving meanwhile is not held long; 0: chunks of "
                   f"--max-batch-tokens (default {d.step_target_ms:g})")  # fmt: skip
    p.add_argument("--max-running", type=int, default=d.max_running,
                   help=f"requests in the batch at once (default {d.max_running})")  # fmt: skip
    p.add_argument("--watermark", type=float, default=d.watermark, metavar="FRACTION",
                   help=f"pool share kept free at admission (default {d.watermark})")  # fmt: skip
    p.add_argument("--policy", choices=[x.value for x in Policy], default=d.policy.value,
                   help="paged: blocks on demand; static: whole-context slots")  # fmt: skip
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-offload", default=d.kv_offload_dir, metavar="DIR",
                   help="keep evicted KV blocks in files under DIR, across restarts")  # fmt: skip
    p.add_argument("--kv-offload-size", type=int, default=d.kv_offload_size // MiB,
                   metavar="MiB", help="the --kv-offload tier's size "
                   f"(default {d.kv_offload_size // MiB})")  # fmt: skip
    p.add_argument("--kv-offload-memory", type=int, default=None, metavar="MiB",
                   help="keep evicted KV blocks in this much host memory instead")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed,
                   help="sampler seed for requests that give none (default: random)")  # fmt: skip


def from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The ``EngineConfig`` that ``add_arguments``' flags describe."""
    fields: dict[str, object] = {
        "kv_cache_memory": (
            args.kv_cache_memory * MiB if args.kv_cache_memory is not None else None
        ),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if hasattr(args, "max_batch_tokens"):
        fields.update(
            max_batch_tokens=args.max_batch_tokens,
            step_target_ms=args.step_target_ms,
            max_running=args.max_running,
            watermark=args.watermark,
            policy=Policy(args.policy),
            enable_prefix_caching=not args.no_prefix_caching,
            seed=args.seed,
            kv_offload_dir=args.kv_offload,
            kv_offload_size=args.kv_offload_size * MiB,
            kv_offload_memory=(
                args.kv_offload_memory * MiB if args.kv_offload_memory is not None else None
            ),
        )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]
