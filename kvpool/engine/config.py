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

MiB = 2**20

# What "auto" KV dtypes resolve to: the model's compute dtype.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs its model over one block pool.

    Invariants (checked at construction): sizes positive, ``0 <= watermark < 1``,
    ``policy`` a ``Policy``; ``num_blocks``, when given, wins over ``kv_cache_memory``.
    """

    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int = 512 * MiB  # bytes of KV blocks (the whole pool)
    num_blocks: int | None = None  # the pool in blocks instead of bytes (tests, benchmarks)
    kv_cache_dtype: str = "auto"  # "auto": the model's compute dtype
    max_batch_tokens: int = 2048  # tokens computed in one step; longer prompts are chunked
    max_running: int = 256  # requests in the batch at once
    watermark: float = 0.01  # share of the pool kept free when admitting, for growth
    policy: Policy = Policy.PAGED
    enable_prefix_caching: bool = True
    seed: int | None = None  # the sampler's seed for requests that give none
    max_queue: int | None = None  # waiting requests at most (QueueFull past it); None: no bound

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))
        positive = ("block_size", "kv_cache_memory", "max_batch_tokens", "max_running")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
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


def add_arguments(p: argparse.ArgumentParser, *, serving: bool = True) -> None:
    """Flags for the engine's settings, their defaults from ``EngineConfig``.
    ``serving=False`` (``kvpool generate``): the pool's size and shape only."""
    d = DEFAULTS
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory // MiB,
                   metavar="MiB", help=f"KV pool (default {d.kv_cache_memory // MiB})")  # fmt: skip
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV block (default {d.block_size})")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV block dtype; auto: the compute dtype")  # fmt: skip
    if not serving:
        return
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help=f"tokens computed per step (default {d.max_batch_tokens})")  # fmt: skip
    p.add_argument("--max-running", type=int, default=d.max_running,
                   help=f"requests in the batch at once (default {d.max_running})")  # fmt: skip
    p.add_argument("--watermark", type=float, default=d.watermark, metavar="FRACTION",
                   help=f"pool share kept free at admission (default {d.watermark})")  # fmt: skip
    p.add_argument("--policy", choices=[x.value for x in Policy], default=d.policy.value,
                   help="paged: blocks on demand; static: whole-context slots")  # fmt: skip
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="sampler seed for requests that give none (default: random)")  # fmt: skip


def from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The ``EngineConfig`` that ``add_arguments``' flags describe."""
    fields: dict[str, object] = {
        "kv_cache_memory": args.kv_cache_memory * MiB,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if hasattr(args, "max_batch_tokens"):
        fields.update(
            max_batch_tokens=args.max_batch_tokens,
            max_running=args.max_running,
            watermark=args.watermark,
            policy=Policy(args.policy),
            enable_prefix_caching=not args.no_prefix_caching,
            seed=args.seed,
        )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]
