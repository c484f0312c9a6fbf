"""The ``kvpool`` command line. Each subcommand imports only the layer it needs."""

from __future__ import annotations

import argparse
import sys


def _bench(args: argparse.Namespace) -> int:
    if args.what == "cache":
        from kvpool.bench import cache

        print(cache.format_table(cache.run(tuple(args.block_sizes))))
        return 0
    raise AssertionError(args.what)


def _serve(args: argparse.Namespace) -> int:
    print(
        "kvpool: the HTTP server is not built yet (it lands with the server issue).\n"
        "What exists today is the KV block manager; here is its benchmark.\n",
        file=sys.stderr,
    )
    from kvpool.bench import cache

    print(cache.format_table(cache.run()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool", description="LLM server built on a paged, prefix-sharing KV cache."
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("what", choices=["cache"], help="cache: the block manager's own cost")
    bench.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256], metavar="N")
    bench.set_defaults(func=_bench)

    simulate = sub.add_parser(
        "simulate",
        help="replay a workload through the block manager for a model and memory budget",
    )
    from kvpool.sim import cli as sim_cli

    sim_cli.add_arguments(simulate)
    simulate.set_defaults(func=sim_cli.run)

    serve = sub.add_parser("serve", help="serve a model over HTTP")
    serve.set_defaults(func=_serve)
    return parser


def _version() -> str:
    from kvpool import __version__

    return f"kvpool {__version__}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
