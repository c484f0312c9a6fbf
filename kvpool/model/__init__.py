"""kvpool.model: the PyTorch runtime for LLaMA-family models read from GGUF files.

It owns the physical KV tensors and runs prefill and decode through the block tables
that ``kvpool.cache`` hands out.
"""

import os

# With OpenMP's default (active) wait policy, torch's threads spin against each other when
# anything else runs and small ops slow down tenfold; this must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
