"""kvpool: an LLM inference server built around a paged KV-cache memory manager."""

__version__ = "0.1.0"
