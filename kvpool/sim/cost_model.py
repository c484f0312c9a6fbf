"""Simulated step time: a roofline model, documented so that queueing can be reasoned about.

One engine step runs every running sequence's decode and the admitted prompts' prefill
together. Its time is the larger of

- memory: every weight byte once, plus the KV each decoding sequence reads (its context,
  ``context_tokens x bytes_per_token``), at ``bandwidth x efficiency``;
- compute: ``2 x parameters`` FLOPs per token computed (decode tokens and uncached prompt
  tokens) at ``flops x efficiency``,

plus a fixed per-step overhead. Cached prompt tokens cost nothing: that is what prefix
reuse buys in time. The model is deliberately simple; the simulator's memory figures do
not depend on it, only its times (queueing delay, time to first token, throughput) do.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.sim.presets import DeviceSpec


@dataclass(frozen=True)
class StepCost:
    """Inputs of one step."""

    decode_tokens: int
    prefill_tokens: int  # uncached prompt tokens computed this step
    context_tokens: int  # KV slots read by the decoding sequences


class RooflineCost:
    def __init__(
        self,
        device: DeviceSpec,
        weight_bytes: int,
        num_parameters: int,
        kv_bytes_per_token: int,
        *,
        bandwidth_efficiency: float = 0.8,
        compute_efficiency: float = 0.5,
        overhead_s: float = 0.002,
    ) -> None:
        self.bandwidth = device.bandwidth_bytes_per_s * bandwidth_efficiency
        self.flops = device.flops_per_s * compute_efficiency
        self.weight_bytes = weight_bytes
        self.flops_per_token = 2.0 * num_parameters
        self.kv_bytes_per_token = kv_bytes_per_token
        self.overhead_s = overhead_s

    def step_time(self, step: StepCost) -> float:
        kv_read = step.context_tokens * self.kv_bytes_per_token
        memory = (self.weight_bytes + kv_read) / self.bandwidth
        compute = (step.decode_tokens + step.prefill_tokens) * self.flops_per_token / self.flops
        return self.overhead_s + max(memory, compute)

    def decode_step_time(self, decode_tokens: int, context_tokens: int) -> float:
        """``step_time`` of a step without prefill, on plain numbers (the quiet-step loop)."""
        memory = (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / self.bandwidth
        return self.overhead_s + max(memory, decode_tokens * self.flops_per_token / self.flops)

    def describe(self) -> str:
        return (
            f"roofline: {self.bandwidth / 1e9:.0f} GB/s effective, "
            f"{self.flops / 1e12:.0f} TFLOP/s effective, {self.overhead_s * 1e3:.0f} ms/step"
        )


class ConstantCost:
    """Every step takes the same time (for hand-computed tests and step-count studies)."""

    def __init__(self, step_s: float = 1.0) -> None:
        self.step_s = step_s

    def step_time(self, step: StepCost) -> float:
        return self.step_s

    def decode_step_time(self, decode_tokens: int, context_tokens: int) -> float:
        return self.step_s

    def describe(self) -> str:
        return f"constant: {self.step_s} s/step"
