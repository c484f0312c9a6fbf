"""``LocalServer``: a ``kvpool serve`` child process on 127.0.0.1 and a free port, for the
HTTP benchmark and the tests. The server prints its URL once it listens; we read that
line (no sleeping), and stop it with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    """A port free now (for servers that cannot be given port 0: Ray Serve's proxy)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalServer:
    """``command``: ``serve``, or ``cluster`` (``kvpool cluster``: Ray Serve replicas)."""

    def __init__(self, *args: str, timeout: float = 180, command: str = "serve") -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KVPOOL_HOST", None)
        port = "0" if command == "serve" else str(free_port())
        argv = [sys.executable, "-m", "kvpool.cli", command, "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [*argv, "--port", port, "--quiet", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + timeout
        self.url = ""
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:  # the process ended before listening
                raise RuntimeError(f"kvpool {command} exited: {self.logs()}")
            if line.startswith("kvpool: serving "):
                self.url = line.rsplit(" on ", 1)[1].strip()
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"kvpool {command} did not start: {self.logs()}")

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def kvcache(self, **headers: str) -> dict:
        return httpx.get(f"{self.url}/api/kvcache", headers=headers, timeout=30).json()

    def wait_idle(self, timeout: float = 60, **headers: str) -> dict:
        """Poll until no request runs or waits; the final stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.kvcache(**headers)
            if stats["running"] == stats["waiting"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode
