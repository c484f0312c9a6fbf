"""kvpool.model: the PyTorch runtime for LLaMA-family models read from GGUF files.

It owns the physical KV tensors and runs prefill and decode through the block tables
that ``kvpool.cache`` hands out. OpenMP's settings are made in ``kvpool/__init__.py``
(before torch loads); how each step uses the threads, in ``kvpool.model.threads``.
"""
