"""The test servers: ``kvpool serve`` child processes at fp32 (exact outputs)."""

from __future__ import annotations

from kvpool.bench.local_server import LocalServer


class ServerProcess(LocalServer):
    def __init__(self, *args: str) -> None:
        super().__init__("--dtype", "float32", *args)
