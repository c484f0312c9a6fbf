"""Model and device presets for the capacity simulator.

Model geometry is the published configuration of each model (layers, KV heads, head
dimension, parameter count, context length). Weight sizes follow ggml's storage: fp16 2
bytes per parameter, q8_0 34 bytes per 32, q4 (q4_0) 18 bytes per 32. Devices give memory,
memory bandwidth and dense fp16 throughput of a representative card of that size; the
cost model (``cost_model.py``) uses them for simulated step time only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.cache import ModelGeometry

GiB = 1024**3

WEIGHT_BYTES_PER_PARAM: dict[str, float] = {
    "fp16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4": 18 / 32,
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    context_length: int
    weight_bytes_override: int | None = None  # the real size, when read from a file
    # A mixture of experts (qwen3moe): each token computes ``experts_used`` of ``experts``
    # feed-forwards, which hold ``expert_parameters`` of the parameters together.
    experts: int = 0
    experts_used: int = 0
    expert_parameters: int = 0

    @property
    def active_parameters(self) -> int:
        """The parameters one token computes with (all of them for a dense model)."""
        if not self.experts:
            return self.num_parameters
        idle = self.expert_parameters * (self.experts - self.experts_used) // self.experts
        return self.num_parameters - idle

    @property
    def expert_share(self) -> float:
        """The share of the weights in experts (0 for a dense model)."""
        return self.expert_parameters / self.num_parameters if self.experts else 0.0

    def geometry(self, kv_dtype_bytes: float) -> ModelGeometry:
        return ModelGeometry(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype_bytes)

    def weight_bytes(self, weight_format: str) -> int:
        if self.weight_bytes_override is not None:
            return self.weight_bytes_override
        try:
            per_param = WEIGHT_BYTES_PER_PARAM[weight_format]
        except KeyError:
            known = ", ".join(WEIGHT_BYTES_PER_PARAM)
            raise ValueError(f"unknown weight format {weight_format!r}; known: {known}") from None
        return int(self.num_parameters * per_param)


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-2-7b", 32, 32, 128, 6_738_415_616, 4096),
        ModelSpec("llama-2-13b", 40, 40, 128, 13_015_864_320, 4096),
        ModelSpec("llama-2-70b", 80, 8, 128, 68_976_648_192, 4096),
        ModelSpec("llama-3.1-8b", 32, 8, 128, 8_030_261_248, 131072),
        ModelSpec("llama-3.1-70b", 80, 8, 128, 70_553_706_496, 131072),
        ModelSpec("mistral-7b", 32, 8, 128, 7_241_732_096, 32768),
        ModelSpec("qwen2.5-7b", 28, 4, 128, 7_615_616_512, 32768),
        ModelSpec("qwen3-0.6b", 28, 8, 128, 596_049_920, 40960),
        ModelSpec("qwen3-8b", 36, 8, 128, 8_190_735_360, 40960),
        ModelSpec(
            "qwen3-30b-a3b",
            48,
            4,
            128,
            30_532_122_624,
            40960,
            experts=128,
            experts_used=8,
            expert_parameters=48 * 128 * 3 * 2048 * 768,
        ),
        ModelSpec("smollm2-135m", 30, 3, 64, 134_515_008, 8192),
        # Gemma 3's language models (kvpool keeps every layer's K/V for every position,
        # its sliding-window layers' too: their KV per token is all layers')
        ModelSpec("gemma3-1b", 26, 1, 256, 999_885_952, 32768),
        ModelSpec("gemma3-4b", 34, 4, 256, 3_880_263_168, 131072),
    )
}


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops_per_s: float  # dense fp16


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("16GB", 16 * GiB, 448e9, 65e12),  # a 16 GB consumer/T4-class card
        DeviceSpec("24GB", 24 * GiB, 1008e9, 165e12),  # RTX 4090-class
        DeviceSpec("40GB", 40 * GiB, 1555e9, 312e12),  # A100 40GB
        DeviceSpec("48GB", 48 * GiB, 864e9, 181e12),  # L40S / A6000-class
        DeviceSpec("80GB", 80 * GiB, 2039e9, 312e12),  # A100 80GB
    )
}


def find_device(name: str) -> DeviceSpec:
    key = name.upper().replace("GIB", "GB").replace(" ", "")
    if not key.endswith("GB"):
        key += "GB"
    if key not in DEVICE_PRESETS:
        known = ", ".join(DEVICE_PRESETS)
        raise ValueError(f"unknown device {name!r}; presets: {known}")
    return DEVICE_PRESETS[key]
