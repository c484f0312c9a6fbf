"""llama.cpp as the other side of ``kvpool bench model``: its own tools at their best
settings on the same GGUF file (never a CI dependency; ``build-llama-cpp.sh`` builds them).

- ``llama-bench``: prefill of the benchmark's prompt length and decode at batch 1,
  flash attention off (faster decoding on the CPUs this project runs on), repacking on.
- ``llama-server`` with as many slots as the largest batch (``-np``) and a context of
  exactly the KV budget kvpool is given (llama.cpp reserves it whole): decode throughput
  of 8 and 32 streams sent at once (the decode steps after each stream's first token),
  and the server's peak resident memory (``VmHWM``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def find(given: str | None) -> Path | None:
    """llama.cpp's bin directory: ``given``, ``$KVPOOL_LLAMA_CPP``, or the PATH's."""
    for candidate in (given, os.environ.get("KVPOOL_LLAMA_CPP")):
        if candidate and (Path(candidate) / "llama-bench").exists():
            return Path(candidate)
    found = shutil.which("llama-bench")
    return Path(found).parent if found else None


class LlamaCppFailed(RuntimeError):
    """llama.cpp's tool ended without its figures (a crash, an error): the message says
    which tool, how it ended and its last words."""


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died of signal {-returncode}"
    return f"exited with status {returncode}"


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return f"; its last line: {lines[-1][:200]}" if lines else ""


def _env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{bin_dir}:{env.get('LD_LIBRARY_PATH', '')}"
    return env


def bench(bin_dir: Path, model: Path, threads: int, prefill: int, decode: int) -> dict:
    """Prefill and batch-1 decode tokens/s from ``llama-bench`` (3 repetitions, mean).
    Raises LlamaCppFailed where it ends without them (a build whose AMX path crashes,
    on a CPU with AMX, dies of SIGSEGV)."""
    out = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-fa", "0",
         "-p", str(prefill), "-n", str(decode), "-r", "3", "-o", "json"],
        capture_output=True, text=True, env=_env(bin_dir),
    )  # fmt: skip
    if out.returncode != 0:
        raise LlamaCppFailed(
            f"llama-bench {_how_it_ended(out.returncode)} on {model.name}{_last_line(out.stderr)}"
        )
    rows = json.loads(out.stdout)
    result = {}
    for row in rows:
        if row["n_prompt"] and not row["n_gen"]:
            result["prefill_tok_s"] = row["avg_ts"]
        elif row["n_gen"] and not row["n_prompt"]:
            result["decode_b1_tok_s"] = row["avg_ts"]
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def serve(
    bin_dir: Path,
    model: Path,
    threads: int,
    batches: tuple[int, ...],
    prompts: dict[int, list[list[int]]],
    decode: int,
    kv_tokens: int,
    repeats: int = 3,
) -> dict:
    """Aggregate decode tokens/s at each batch size through ``llama-server`` (one slot per
    stream, a context of ``kv_tokens`` shared by the slots), the best of ``repeats`` runs,
    its peak memory, and its load time: from its start to its first healthy answer (its
    model read, its KV allocated and its warm-up run; polled every 0.2 s)."""
    port = _free_port()
    slots = max(batches, default=1)
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-fa", "off",
         "-np", str(slots), "-c", str(kv_tokens), "--host", "127.0.0.1", "--port", str(port),
         "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(bin_dir),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:  # it answers 503 while loading: poll for 200
            if proc.poll() is not None:
                raise LlamaCppFailed(
                    f"llama-server {_how_it_ended(proc.returncode)} while loading {model.name}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become ready")
            time.sleep(0.2)
        result = {"load_s": time.monotonic() - started}
        for batch in batches:  # (none: only the peak memory of the loaded server)
            rates = [asyncio.run(_decode_rate(url, prompts[batch], decode)) for _ in range(repeats)]
            result[f"decode_b{batch}_tok_s"] = max(rates)
        result["peak_rss_mib"] = _peak_rss_mib(proc.pid)
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _decode_rate(url: str, prompts: list[list[int]], decode: int) -> float:
    """Streams sent at once: tokens/s from the moment every stream has its first token
    to the last token (the tokens generated in that span, over its length)."""
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: list[int]) -> list[float]:
            body = {"prompt": prompt, "n_predict": decode + 1, "stream": True,
                    "ignore_eos": True, "cache_prompt": False, "temperature": 0}  # fmt: skip
            times = []
            async with client.stream("POST", f"{url}/completion", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        times.append(time.perf_counter())
            return times

        streams = await asyncio.gather(*(one(p) for p in prompts))
    start = max(times[0] for times in streams)
    stop = max(times[-1] for times in streams)
    tokens = sum(1 for times in streams for t in times if t > start)
    return tokens / max(stop - start, 1e-9)
