"""``LocalServer``: a ``kvpool serve`` (or ``kvpool cluster``) child process on 127.0.0.1
and a free port, for the HTTP benchmarks and the tests. It is given port 0 and chooses
the port itself when it binds (a port picked here could be taken before then: Ray's own
processes take ports while the cluster starts). It prints its URL once it listens; we
read that line (no sleeping), and stop it with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx


class LocalServer:
    """``command``: ``serve``, or ``cluster`` (``kvpool cluster``: Ray Serve replicas)."""

    def __init__(self, *args: str, timeout: float = 180, command: str = "serve") -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KVPOOL_HOST", None)
        argv = [sys.executable, "-m", "kvpool.cli", command, "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [*argv, "--port", "0", "--quiet", *args],
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
