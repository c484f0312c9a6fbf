"""Simulated step time: a roofline model, documented so that queueing can be reasoned about.

One engine step runs every running sequence's decode and the admitted prompts' prefill
together. Its time is the larger of

- memory: every weight byte once, plus the KV each decoding sequence reads (its context,
  ``context_tokens x bytes_per_token``), at ``bandwidth x efficiency``; for a mixture of
  experts, the experts' share of the weights only as far as the step's tokens touch
  them: with ``n`` tokens each choosing ``k`` of ``E`` experts, a fraction
  ``1 - (1 - k / E) ** n`` of them (independent, uniform choices: a small batch reads few
  experts, a large one nearly all);
- compute: ``2 x parameters`` FLOPs per token computed (decode tokens and uncached prompt
  tokens; a mixture's active parameters) at ``flops x efficiency``,

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
        expert_share: float = 0.0,
        expert_pick: float = 0.0,
    ) -> None:
        """``num_parameters``: those a token computes with (a mixture's active ones);
        ``expert_share``: the weights' share in experts, ``expert_pick``: the share of
        experts a token uses (a mixture of experts; 0 for a dense model)."""
        self.bandwidth = device.bandwidth_bytes_per_s * bandwidth_efficiency
        self.flops = device.flops_per_s * compute_efficiency
        self.weight_bytes = weight_bytes
        self.flops_per_token = 2.0 * num_parameters
        self.kv_bytes_per_token = kv_bytes_per_token
        self.overhead_s = overhead_s
        self.expert_share = expert_share
        self.expert_pick = expert_pick

    def weights_read(self, tokens: int) -> float:
        """Weight bytes a step of ``tokens`` tokens reads: all of a dense model's, the
        shared part and the touched experts of a mixture."""
        if not self.expert_share:
            return self.weight_bytes
        touched = 1.0 - (1.0 - self.expert_pick) ** tokens
        return self.weight_bytes * (1.0 - self.expert_share * (1.0 - touched))

    def step_time(self, step: StepCost) -> float:
        tokens = step.decode_tokens + step.prefill_tokens
        kv_read = step.context_tokens * self.kv_bytes_per_token
        memory = (self.weights_read(tokens) + kv_read) / self.bandwidth
        compute = tokens * self.flops_per_token / self.flops
        return self.overhead_s + max(memory, compute)

    def decode_step_time(self, decode_tokens: int, context_tokens: int) -> float:
        """``step_time`` of a step without prefill, on plain numbers (the quiet-step loop)."""
        weights = self.weights_read(decode_tokens)
        memory = (weights + context_tokens * self.kv_bytes_per_token) / self.bandwidth
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
