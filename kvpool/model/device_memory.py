"""The KV pool's size on a GPU when none is given: what the model and its steps leave of
the engine's share of the device's memory.

On the CPU the pool has a fixed default (``CPU_KV_CACHE_MEMORY``): its memory is the
machine's, shared with everything else, and a size is the user's to choose. A GPU's
memory serves the model alone, and a fixed 512 MiB there would hold a few thousand
tokens of an 8B model on a card with a hundred times that free. So, with no
``--kv-cache-memory``, an engine on a GPU takes (``kv_budget``)::

    pool = utilization x total - weights - a step's peak - the attention gather's bound

never more than is free now less those two and ``FREE_MARGIN`` of the device (others'
use, the allocator's fragments). ``utilization`` is ``--gpu-memory-utilization`` (0.9 by
default), divided among ``--max-models``. A step's peak is measured once, before the
pool exists: the largest prompt step the engine takes (``max_batch_tokens`` tokens) and
its widest decode step, on a pool just large enough for them. The gather's bound is
``runner.GATHER_BYTES_MAX``: the torch attention path's scratch never grows past it
(``ModelRunner.gather_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.model.llama import LlamaModel
from kvpool.model.runner import GATHER_BYTES_MAX, ModelRunner, SeqChunk

MiB = 2**20
GiB = 2**30
CPU_KV_CACHE_MEMORY = 512 * MiB  # the pool's default size on the CPU
FREE_MARGIN = 0.05  # of the device's memory: never taken by the pool


class NoRoomForKV(ValueError):
    """The model and its steps leave no room for a KV pool on the GPU."""


@dataclass(frozen=True)
class GPUMemory:
    """What sizes the pool, in bytes: the device's ``total`` and ``free`` memory (others'
    use counted), this model's ``weights`` on it, a step's ``peak`` above what stays
    allocated, and the attention ``gather``'s bound."""

    total: int
    free: int
    weights: int
    peak: int
    gather: int = GATHER_BYTES_MAX
    name: str = "the GPU"

    def kv_budget(self, utilization: float) -> int:
        """The pool's bytes (0 when none fits): the model, its steps and the pool within
        ``utilization`` of the device, and the pool never in the last ``FREE_MARGIN``
        of it that is free."""
        steps = self.peak + self.gather
        by_share = int(utilization * self.total) - self.weights - steps
        by_free = self.free - steps - int(FREE_MARGIN * self.total)
        return max(0, min(by_share, by_free))

    def describe(self, utilization: float) -> str:
        """One line: how the budget was reached."""
        g = GiB
        return (
            f"sized from {self.name}'s {self.total / g:.1f} GiB ({self.free / g:.1f} free): "
            f"{utilization:.2f} of it less weights {self.weights / g:.2f}, a step's peak "
            f"{self.peak / g:.2f} and the gather's bound {self.gather / g:.2f} GiB"
        )


def model_device_bytes(model: LlamaModel) -> int:
    """The bytes the model holds on its device: as the loader measured them, or its
    parameters at the compute dtype's size."""
    if model.device_bytes:
        return model.device_bytes
    return model.num_parameters * model.dtype.itemsize


def step_peak_bytes(
    model: LlamaModel, block_size: int, max_batch_tokens: int, max_running: int
) -> int:
    """A step's GPU memory at its peak above what stays allocated: the larger of a
    prompt step of ``max_batch_tokens`` tokens, every token's logits asked for (a
    prompt's log-probabilities), and a decode step of ``max_running`` rows (at most
    ``max_batch_tokens``), run on a pool just large enough (its own bytes not counted).
    The steps' K/V goes into that pool, dropped after."""
    device = model.device
    tokens = min(max_batch_tokens, model.config.context_length)
    rows = min(max_running, max_batch_tokens)
    prompt_blocks = -(-tokens // block_size)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    runner = ModelRunner(model, max(prompt_blocks, rows), block_size, threads=None)
    pool = torch.cuda.memory_allocated(device) - before
    torch.cuda.reset_peak_memory_stats(device)
    ids = [(7 * i + 3) % model.vocab_rows for i in range(max(tokens, rows))]
    runner.forward([SeqChunk(ids[:tokens], 0, list(range(prompt_blocks)))], all_logits=True)
    runner.forward([SeqChunk([ids[r]], 0, [r]) for r in range(rows)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - pool
    del runner
    torch.cuda.empty_cache()
    return max(0, peak)


def gpu_memory(
    model: LlamaModel, block_size: int, max_batch_tokens: int, max_running: int
) -> GPUMemory:
    """The model's device's memory as ``kv_budget`` reads it (runs two steps)."""
    peak = step_peak_bytes(model, block_size, max_batch_tokens, max_running)
    free, total = torch.cuda.mem_get_info(model.device)
    return GPUMemory(
        total=total, free=free, weights=model_device_bytes(model), peak=peak,
        name=torch.cuda.get_device_name(model.device),
    )  # fmt: skip
