"""Put a model, a memory budget, a workload and strategies together and run them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpool.cache import kv_dtype_bytes
from kvpool.sim.cost_model import RooflineCost
from kvpool.sim.presets import DeviceSpec, GiB, ModelSpec, find_device
from kvpool.sim.replay import SimConfig, SimResult, Strategy, simulate
from kvpool.sim.workload import Workload

DEFAULT_RESERVE = GiB  # CUDA context, activations, allocator slack


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512MiB``, ``16GB`` (10^9), or a plain number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bad byte size {text!r} (e.g. 8GiB, 512MiB, 16GB)")
    value = float(m.group(1))
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {
        "B": 1,
        "K": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "KI": 2**10,
        "MI": 2**20,
        "GI": 2**30,
        "TI": 2**40,
    }[unit]
    return int(value * scale)


@dataclass(frozen=True)
class Budget:
    kv_bytes: int
    device: DeviceSpec | None
    weight_bytes: int
    reserve_bytes: int

    def describe(self) -> str:
        if self.device is None:
            return f"explicit KV budget {self.kv_bytes / GiB:.2f} GiB"
        return (
            f"{self.device.name} card: {self.device.memory_bytes / GiB:.1f} GiB - weights "
            f"{self.weight_bytes / GiB:.2f} GiB - reserve {self.reserve_bytes / GiB:.2f} GiB "
            f"= {self.kv_bytes / GiB:.2f} GiB for KV"
        )


def kv_budget(
    model: ModelSpec,
    *,
    device: str | None = None,
    weight_format: str = "fp16",
    reserve_bytes: int = DEFAULT_RESERVE,
    kv_bytes: int | None = None,
) -> Budget:
    """The KV byte budget: explicit, or a device's memory minus weights and a reserve."""
    dev = find_device(device) if device else None
    weights = model.weight_bytes(weight_format)
    if kv_bytes is not None:
        return Budget(kv_bytes, dev, weights, 0)
    if dev is None:
        raise ValueError("give a device preset or an explicit KV budget")
    left = dev.memory_bytes - weights - reserve_bytes
    if left <= 0:
        raise ValueError(
            f"{model.name} at {weight_format} ({weights / GiB:.1f} GiB) plus a "
            f"{reserve_bytes / GiB:.1f} GiB reserve does not fit a {dev.name} card"
        )
    return Budget(left, dev, weights, reserve_bytes)


def run_strategies(
    workload: Workload,
    model: ModelSpec,
    budget: Budget,
    *,
    kv_dtype: str = "fp16",
    weight_format: str = "fp16",
    strategies: list[Strategy] | None = None,
    block_size: int = 64,
    pin_prefixes: bool = False,
    progress: bool = False,
    frames_of: Strategy | None = None,
) -> list[SimResult]:
    """Replay ``workload`` under each strategy; ``frames_of``: the strategy whose replay
    keeps frames for the live view (``SimResult.frames``)."""
    strategies = strategies or list(Strategy)
    bpt = model.geometry(kv_dtype_bytes(kv_dtype, model.head_dim)).bytes_per_token
    device = budget.device or find_device("24GB")  # step times need some card
    pick = model.experts_used / model.experts if model.experts else 0.0
    cost = RooflineCost(
        device, model.weight_bytes(weight_format), model.active_parameters, bpt,
        expert_share=model.expert_share, expert_pick=pick,
    )  # fmt: skip
    results = []
    for strategy in strategies:
        cfg = SimConfig(
            strategy=strategy,
            kv_bytes=budget.kv_bytes,
            kv_bytes_per_token=bpt,
            block_size=block_size,
            pin_prefixes=pin_prefixes and strategy is Strategy.PAGED_PREFIX,
            frames=200 if strategy is frames_of else 0,
        )
        results.append(simulate(workload, cfg, cost, progress=progress))
    return results
