"""The ``kvpool`` command line. Each subcommand imports only the layer it needs."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _bench(args: argparse.Namespace) -> int:
    if args.what == "cache":
        from kvpool.bench import cache

        print(cache.format_table(cache.run(tuple(args.block_sizes))))
        off, on, per_step = cache.events_cost()
        print(
            f"KV events (a replica's publishing): a decode step of 32 sequences costs the "
            f"manager {off:.0f} us with events off, {on:.0f} us on ({per_step:.1f} events "
            "per step)"
        )
        return 0
    if args.what == "engine":
        from kvpool.bench import engine

        names = tuple(args.workloads) if args.workloads else engine.ALL
        print(
            engine.run(
                requests=args.requests or 64,
                names=names,
                block_sizes=tuple(args.block_sizes),
                plot=args.plot,
            )
        )
        return 0
    if args.what == "kv-dtype":
        from kvpool.bench import kv_dtype

        print(kv_dtype.run((args.kv_cache_memory or 32) * 2**20, args.requests or 32))
        return 0
    if args.what == "kv-tier":
        from kvpool.bench import kv_tier

        print(kv_tier.run((args.kv_cache_memory or 16) * 2**20, args.requests or 32))
        return 0
    if args.what == "grammar":
        from kvpool.bench import grammar

        print(grammar.run())
        return 0
    if args.what == "serve":
        from kvpool.bench import serve

        print(
            serve.run(
                urls=args.url,
                local=args.local if args.local is not None else ([] if args.url else ["kvpool"]),
                names=args.workloads or ["shared-prefix", "distinct", "chat"],
                requests=args.requests or 64,
                clients=args.clients,
                kv_cache_memory=args.kv_cache_memory or 256,
                model=args.model,
                api_key=args.api_key,
            )
        )
        return 0
    if args.what == "dashboard":
        from kvpool.bench import dashboard

        print(dashboard.run(args.requests or 16, rounds=args.rounds))
        return 0
    if args.what == "cluster":
        from kvpool.bench import cluster

        print(
            cluster.run(
                names=args.workloads or ["system-prompts", "chat"],
                requests=args.requests or 64,
                clients=args.clients,
                kv_cache_memory=args.kv_cache_memory or 160,
            )
        )
        return 0
    if args.what == "model":
        if args.batches:
            os.environ["KVPOOL_BENCH_BATCHES"] = ",".join(str(b) for b in args.batches)
        cpus = os.cpu_count() or 1
        if args.threads and not all(1 <= n <= cpus for n in args.threads):
            print(
                f"kvpool: --threads: each count from 1 to this machine's {cpus} CPUs",
                file=sys.stderr,
            )
            return 2
        from kvpool.bench import model

        print(
            model.run(
                args.dtype, args.rounds, args.model, args.against, args.llama_cpp, args.threads
            )
        )
        return 0
    if args.what == "products":
        from pathlib import Path

        from kvpool.bench import products

        if args.base is None:
            print("kvpool: bench products needs --base DIR (another kvpool tree)", file=sys.stderr)
            return 2
        try:
            table = products.compare(
                Path(args.base),
                types=tuple(args.formats or products.DEFAULT_TYPES),
                rows=tuple(args.batches or products.DEFAULT_ROWS),
                threads=args.threads[0] if args.threads else None,
            )
        except (ValueError, RuntimeError) as error:
            print(f"kvpool: bench products: {error}", file=sys.stderr)
            return 2
        print(table)
        return 0
    if args.what == "synth-model":
        from pathlib import Path

        from kvpool.bench import synth_model

        if args.preset not in synth_model.PRESETS:
            presets = ", ".join(synth_model.PRESETS)
            print(f"kvpool: unknown preset; choose from {presets}", file=sys.stderr)
            return 2
        try:
            mix = synth_model.mix_named(args.mix)
        except ValueError as error:
            print(f"kvpool: {error}", file=sys.stderr)
            return 2
        out = Path(args.out) / f"{args.preset}-{mix}.gguf"
        print(synth_model.write(args.preset, mix, out))
        return 0
    raise AssertionError(args.what)


def _generate(args: argparse.Namespace) -> int:
    from kvpool.engine import config as engine_config
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling import SamplingParams
    from kvpool.model_store import ModelNotFound

    try:
        llm = LLM(
            args.model,
            config=engine_config.from_args(args),
            dtype=args.dtype,
            device=args.device,
            progress=not args.quiet,
        )
    except (ModelNotFound, ValueError) as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 2
    if args.quiet:  # the compute choice is said even then: one line
        print(f"kvpool: {llm.loaded.compute_line()}", file=sys.stderr)
    else:
        n, bs = llm.engine.num_blocks, llm.engine.block_size
        print(f"  KV pool: {n} blocks of {bs} tokens = {n * bs:,} token slots", file=sys.stderr)
        if llm.engine.kv_sizing:  # a GPU's, sized from its memory
            print(f"  KV pool {llm.engine.kv_sizing}", file=sys.stderr)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    if args.raw:
        (out,) = llm.generate(args.prompt, params)
    else:
        (out,) = llm.chat([[{"role": "user", "content": args.prompt}]], params)
    elapsed = time.perf_counter() - start
    print(out.text)
    if not args.quiet:
        print(
            f"{out.prompt_tokens} prompt tokens, {out.completion_tokens} generated in "
            f"{elapsed:.2f} s ({out.completion_tokens / elapsed:.1f} tokens/s, greedy)",
            file=sys.stderr,
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvpool.server.main import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool", description="LLM server built on a paged, prefix-sharing KV cache."
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument(
        "what",
        choices=[
            "cache",
            "model",
            "engine",
            "kv-dtype",
            "kv-tier",
            "grammar",
            "serve",
            "cluster",
            "dashboard",
            "synth-model",
            "products",
        ],
        help="cache: the block manager's own cost; model: the runtime beside transformers "
        "and llama.cpp; engine: workloads with prefix caching on/off and the static policy; "
        "serve: the workloads over HTTP against kvpool and/or other servers; cluster: "
        "kvpool cluster's router beside Ray Serve's on the same replicas; synth-model: "
        "write a random-weight GGUF file with a real model's geometry and quant mix; "
        "kv-dtype: KV block dtypes' quality against float32 and capacity on a small budget; "
        "kv-tier: the second KV tier's time to first token and workloads with it on/off; "
        "grammar: llguidance beside xgrammar, and what constrained rows cost a batch; "
        "dashboard: decode throughput with the live view polled or not; products: the "
        "native kernels' products beside another kvpool tree's, in one process",
    )
    bench.add_argument(
        "--requests", type=int, default=None,
        help="engine, serve: requests per workload (default 64; cluster: per system "
        "prompt); kv-dtype: 32",
    )  # fmt: skip
    bench.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: measured"
    )
    bench.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256], metavar="N")
    bench.add_argument(
        "--url", action="append", default=[], metavar="[NAME=]URL",
        help="serve: a server to measure (repeatable), e.g. vllm=http://127.0.0.1:8000",
    )  # fmt: skip
    bench.add_argument(
        "--local", action="append", default=None, choices=["kvpool", "kvpool-noprefix",
        "kvpool-static", "kvpool-whole-chunks"],
        help="serve: start this kvpool configuration (default: kvpool; whole-chunks: "
        "--step-target-ms 0)",
    )  # fmt: skip
    bench.add_argument("--clients", type=int, default=64, help="serve: concurrent clients")
    bench.add_argument(
        "--workloads", nargs="+", default=None,
        help="engine: shared-prefix distinct chat prefix-length block-size (default: all); "
        "serve: system-prompts shared-prefix distinct chat long-prompt (default: "
        "shared-prefix distinct chat); "
        "cluster: default system-prompts chat",
    )  # fmt: skip
    bench.add_argument(
        "--kv-cache-memory", type=int, default=None, metavar="MiB",
        help="serve: the pool of the servers it starts (default 256); cluster: of each "
        "replica (default 160); kv-dtype: 32",
    )  # fmt: skip
    bench.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="model: alternating rounds of both sides; dashboard: rounds of each view",
    )
    bench.add_argument(
        "--model", default=None,
        help="model: a GGUF file or name (default: the built-in model); serve: model name",
    )  # fmt: skip
    bench.add_argument(
        "--against", nargs="+", default=None,
        choices=["transformers", "llama.cpp", "no-openmp"],
        help="model: the other sides (default: llama.cpp where found, and transformers for "
        "files under 1 GiB; no-openmp: kvpool built without OpenMP, on its own thread pool)",
    )  # fmt: skip
    bench.add_argument(
        "--llama-cpp", default=None, metavar="DIR",
        help="model: llama.cpp's bin directory (llama-bench, llama-server); default: "
        "$KVPOOL_LLAMA_CPP or the PATH",
    )  # fmt: skip
    bench.add_argument(
        "--batches", type=int, nargs="+", default=None, metavar="N",
        help="model: decode batch sizes (default 1 8 32); products: activation rows",
    )  # fmt: skip
    bench.add_argument(
        "--threads", type=int, nargs="+", default=None, metavar="N",
        help="model: measure every side at each of these thread counts (default: one "
        "thread a physical core); a table per count, then all counts side by side; "
        "products: the threads both builds compute with (the first count)",
    )  # fmt: skip
    bench.add_argument("--preset", default="llama-3.2-1b", help="synth-model: the geometry")
    bench.add_argument(
        "--mix",
        default="Q4_0",
        help="synth-model: Q4_0, Q8_0, Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, IQ4_XS, IQ2_XXS, TQ1_0 "
        "or TQ2_0",
    )
    bench.add_argument("--out", default="models", help="synth-model: the directory to write to")
    bench.add_argument(
        "--base", default=None, metavar="DIR",
        help="products: another kvpool source tree (e.g. a git worktree of an older commit) "
        "whose kernels are measured beside this tree's",
    )  # fmt: skip
    bench.add_argument(
        "--formats", nargs="+", default=None, metavar="TYPE",
        help="products: GGUF formats (default Q4_0 Q4_1 Q4_K Q5_K Q6_K Q8_0)",
    )  # fmt: skip
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--plot", default=None, metavar="PNG", help="engine: occupancy plot")
    bench.set_defaults(func=_bench)

    simulate = sub.add_parser(
        "simulate",
        help="replay a workload through the block manager for a model and memory budget",
    )
    from kvpool.sim import cli as sim_cli

    sim_cli.add_arguments(simulate)
    simulate.set_defaults(func=sim_cli.run)

    generate = sub.add_parser("generate", help="load a model and answer one prompt (greedy)")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=None, help="GGUF path or Ollama name (default model)")
    generate.add_argument("--raw", action="store_true", help="no chat template")
    _runtime_options(generate)
    generate.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve", help="serve a model over HTTP: Ollama and OpenAI APIs, metrics, KV admin"
    )
    from kvpool.server.main import add_arguments

    add_arguments(serve)
    serve.set_defaults(func=_serve)

    cluster = sub.add_parser(
        "cluster",
        help="serve replicas of a model on Ray Serve behind one ingress, each request routed "
        "to the replica that caches its prefix (pip install 'kvpool[cluster]')",
    )
    from kvpool.cluster.app import add_arguments as cluster_arguments

    cluster_arguments(cluster)
    cluster.set_defaults(func=_cluster)
    return parser


def _cluster(args: argparse.Namespace) -> int:
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        print("kvpool: the cluster needs Ray Serve: pip install 'kvpool[cluster]'", file=sys.stderr)
        return 2
    from kvpool.cluster.app import run

    return run(args)


def _runtime_options(p: argparse.ArgumentParser) -> None:
    from kvpool.engine import config as engine_config

    engine_config.add_compute_arguments(p)
    p.add_argument("--max-tokens", type=int, default=128)
    engine_config.add_arguments(p, serving=False)
    p.add_argument("--quiet", action="store_true")


def _version() -> str:
    from kvpool import __version__

    return f"kvpool {__version__}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
