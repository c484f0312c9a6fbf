"""``kvpool serve``: load a model, build its block pool, serve the APIs with uvicorn.

Binds 127.0.0.1:11434 by default (Ollama's port; ``KVPOOL_HOST`` as ``host`` or
``host:port``, like ``OLLAMA_HOST``). Prints ``kvpool: serving <model> on <url>`` once the
socket listens (``--port 0`` picks a free port and prints it). SIGINT / SIGTERM cancel the
requests in flight (their blocks are freed), end their streams and exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpool.engine import config as engine_config

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 11434


def host_and_port(args: argparse.Namespace) -> tuple[str, int]:
    host, port = DEFAULT_HOST, DEFAULT_PORT
    env = os.environ.get("KVPOOL_HOST", "").strip()
    if env:
        env = env.split("://", 1)[-1].rstrip("/")
        if env.count(":") == 1:
            host, _, port_text = env.partition(":")
            port = int(port_text)
        else:
            host = env
    return (args.host or host), (port if args.port is None else args.port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF path or Ollama model name (default: the built-in model)")  # fmt: skip
    p.add_argument("--host", default=None, help=f"default {DEFAULT_HOST} (or KVPOOL_HOST)")
    p.add_argument("--port", type=int, default=None, help=f"default {DEFAULT_PORT}; 0: any free")
    engine_config.add_compute_arguments(p)
    engine_config.add_arguments(p)
    p.add_argument("--batch-invariant", action="store_true",
                   help="int8 products at every step size, in any dtype, and one attention "
                        "kernel for every token: no output depends on what else is batched, "
                        "how a prompt is chunked or what the prefix cache held")  # fmt: skip
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this key (repeatable; these keys are admins)")  # fmt: skip
    p.add_argument("--keys-file", type=Path, default=None,
                   help="keys, one per line: '[tenant] key [admin]'")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20)
    p.add_argument("--max-queue", type=int, default=512,
                   help="waiting requests at most; more get 503 + Retry-After (as "
                        "OLLAMA_MAX_QUEUE); default 512")  # fmt: skip
    p.add_argument("--tenant-pin-share", type=float, default=0.25, metavar="FRACTION",
                   help="share of the pin budget one non-admin tenant's pins may hold")  # fmt: skip
    p.add_argument("--max-models", type=int, default=1, metavar="N",
                   help="models loaded at once (as OLLAMA_MAX_LOADED_MODELS): the KV budget "
                        "is split into N equal pools; a request naming another model loads "
                        "it on demand (default 1: the started model only)")  # fmt: skip
    p.add_argument("--keep-alive", default=None, metavar="DURATION",
                   help="how long a model loaded on demand stays after its last request "
                        "(e.g. 5m, 0, -1 for ever; default OLLAMA_KEEP_ALIVE, else 5m); "
                        "the started model always stays")  # fmt: skip
    p.add_argument("--alias", action="append", default=None, metavar="NAME",
                   help="another name the started model answers to (repeatable; * matches "
                        "any text), for clients that send fixed names: 'claude-*'")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no load progress, warnings only")


@dataclasses.dataclass
class Built:
    """A server's parts before it listens: the ASGI app, the started model's driver
    (``llm``, not started yet) and its pool's description (one line)."""

    app: Any
    llm: Any
    model: Any
    summary: str


class StartupError(Exception):
    """The server cannot start (an unknown model, a bad flag): said in one line."""


def _load_with_engine(
    requested: str | None, args: argparse.Namespace, config: Any, progress: bool
) -> Any:
    """The model ``requested`` as the flags ask, and its engine on ``config``."""
    from kvpool.engine.engine import Engine
    from kvpool.model.loader import load_model

    loaded = load_model(
        requested,
        dtype=args.dtype,
        device=args.device,
        progress=progress,
        batch_invariant=args.batch_invariant,
    )
    return loaded, Engine(loaded.model, config, tokenizer=loaded.tokenizer)


def build(args: argparse.Namespace, response_tag: str = "") -> Built:
    """Load the model, build its engine and the app, as ``kvpool serve`` runs them (a
    cluster replica builds the same, in process, its id as ``response_tag``)."""
    from kvpool.engine.async_llm import AsyncLLM
    from kvpool.model.device_memory import CPU_KV_CACHE_MEMORY
    from kvpool.model.loader import choose_device
    from kvpool.model.threads import in_passing_thread
    from kvpool.model_store import ModelNotFound
    from kvpool.server.app import create_app
    from kvpool.server.auth import KeyRing
    from kvpool.server.errors import APIError
    from kvpool.server.models import ModelRegistry, keep_alive_seconds
    from kvpool.server.served_model import ServedModel

    try:
        if args.max_models < 1:
            raise ValueError("--max-models must be at least 1")
        keep_alive = keep_alive_seconds(
            args.keep_alive or os.environ.get("OLLAMA_KEEP_ALIVE") or "5m", 300.0
        )
        keys = KeyRing.load(args.api_key, args.keys_file)
        config = engine_config.from_args(args, max_queue=args.max_queue)
        # one KV budget, an equal pool for each model that may be loaded at once (on a
        # GPU without a size: an equal share of its memory for each)
        if config.kv_cache_memory is None and choose_device(args.device).type == "cpu":
            config = config.replace(kv_cache_memory=CPU_KV_CACHE_MEMORY)
        if config.kv_cache_memory is not None:
            config = config.replace(kv_cache_memory=config.kv_cache_memory // args.max_models)
        else:
            share = config.gpu_memory_utilization / args.max_models
            config = config.replace(gpu_memory_utilization=share)
        # on a thread that ends here: this one serves HTTP, and no OpenMP pool of its
        # own may stay beside the engine thread's (``in_passing_thread``)
        loaded, engine = in_passing_thread(
            _load_with_engine, args.model, args, config, not args.quiet
        )
    except (ModelNotFound, ValueError, OSError, APIError) as exc:
        raise StartupError(str(exc)) from None
    if args.quiet:  # the compute choice is said even then: one line
        print(f"kvpool: {loaded.compute_line()}", file=sys.stderr)
    llm = AsyncLLM(engine)
    model = ServedModel.open(args.model, loaded, llm, aliases=args.alias)
    n, bs = engine.num_blocks, engine.block_size
    summary = (
        f"  KV pool: {n} blocks of {bs} tokens = {n * bs:,} token slots "
        f"({n * engine.kv_bytes_per_block / 2**20:.0f} MiB, {engine.kv_cache_dtype}), policy "
        f"{config.policy}, prefix "
        f"caching {'on' if config.prefix_caching else 'off'}, API keys "
        f"{'on' if keys.enabled else 'off'}"
        + (f"; up to {args.max_models} models, a pool each" if args.max_models > 1 else "")
        + (f"\n  KV pool {engine.kv_sizing}" if engine.kv_sizing else "")
    )

    def load_more(requested: str, kv_bytes: int | None) -> ServedModel:
        """Another model, its own engine and pool (an executor's thread runs this: the
        loading itself on a thread that ends with it, as above)."""
        try:
            more, engine = in_passing_thread(
                _load_with_engine,
                requested,
                args,
                config.replace(kv_cache_memory=kv_bytes),
                False,
            )
        except ModelNotFound as exc:
            raise LookupError(str(exc)) from None
        driver = AsyncLLM(engine)
        driver.start()
        return ServedModel.open(requested, more, driver)

    registry = ModelRegistry(
        model,
        load_more,
        max_models=args.max_models,
        kv_bytes=config.kv_cache_memory,
        default_keep_alive=keep_alive,
    )
    app = create_app(
        model,
        keys=keys,
        max_body_bytes=args.max_body_bytes,
        tenant_pin_share=args.tenant_pin_share,
        max_queue=args.max_queue,
        models=registry,
        response_tag=response_tag,
    )
    return Built(app, llm, model, summary)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    host, port = host_and_port(args)
    try:
        built = build(args)
    except StartupError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # The load runs on a thread of its own (build), which a signal cannot stop, and
        # a process that exits normally around it aborts in native code: end it here.
        print("\nkvpool: stopped while loading", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    app, llm, model = built.app, built.llm, built.model
    print(built.summary, file=sys.stderr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"kvpool: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    # Listen now: connections made as soon as the line below is printed wait in the
    # backlog until uvicorn accepts them (it would listen only once it has started).
    sock.listen(2048)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning" if args.quiet else "info",
                            timeout_graceful_shutdown=10)  # fmt: skip

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            llm.stop_soon()  # in-flight requests end now; their blocks are freed
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own re-raises the signal after its graceful shutdown, which kills
            # the process with it; a clean stop on SIGTERM/SIGINT should exit with 0.
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    llm.start()
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"kvpool: serving {model.name} on http://{shown}:{bound_port}", flush=True)
    print(f"kvpool: the pool, live: http://{shown}:{bound_port}/dashboard", file=sys.stderr)
    try:
        Server(config).run(sockets=[sock])
    finally:
        llm.shutdown()
        print("kvpool: stopped", file=sys.stderr)
    return 0
