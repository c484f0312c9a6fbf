"""kvpool.sim: capacity simulator. Replays workloads through the real block manager.

Needs only ``kvpool.cache`` (plots need matplotlib, imported only when plotting).
"""

from kvpool.sim.cost_model import ConstantCost, RooflineCost, StepCost
from kvpool.sim.model_source import model_from_gguf, model_from_hf_config, resolve_model
from kvpool.sim.presets import DEVICE_PRESETS, MODEL_PRESETS, DeviceSpec, ModelSpec
from kvpool.sim.replay import SimConfig, SimResult, Strategy, simulate
from kvpool.sim.scenario import Budget, kv_budget, parse_bytes, run_strategies
from kvpool.sim.workload import (
    NAMED,
    LengthDist,
    Request,
    SyntheticSpec,
    Workload,
    generate,
    load_trace,
    write_trace,
)

__all__ = [
    "DEVICE_PRESETS",
    "MODEL_PRESETS",
    "NAMED",
    "Budget",
    "ConstantCost",
    "DeviceSpec",
    "LengthDist",
    "ModelSpec",
    "Request",
    "RooflineCost",
    "SimConfig",
    "SimResult",
    "StepCost",
    "Strategy",
    "SyntheticSpec",
    "Workload",
    "generate",
    "kv_budget",
    "load_trace",
    "model_from_gguf",
    "model_from_hf_config",
    "parse_bytes",
    "resolve_model",
    "run_strategies",
    "simulate",
    "write_trace",
]
