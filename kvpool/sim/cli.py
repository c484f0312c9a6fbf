"""``kvpool simulate``: argument parsing and output for the capacity simulator."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from kvpool.cache import kv_dtype_bytes
from kvpool.sim import report
from kvpool.sim.model_source import resolve_model
from kvpool.sim.presets import DEVICE_PRESETS, MODEL_PRESETS, GiB
from kvpool.sim.replay import Strategy
from kvpool.sim.scenario import DEFAULT_RESERVE, kv_budget, parse_bytes, run_strategies
from kvpool.sim.workload import NAMED, LengthDist, generate, load_trace, write_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama-2-13b",
        help=f"preset ({', '.join(MODEL_PRESETS)}), a .gguf file or a config.json",
    )
    p.add_argument(
        "--weights",
        default="q4",
        choices=["fp16", "bf16", "q8_0", "q4"],
        help="weight format of a preset (a GGUF file's real size is used as is)",
    )
    p.add_argument(
        "--kv-dtype", default="fp16", choices=["fp16", "bf16", "fp32", "q8_0", "int8"],
        help="int8: kvpool's int8 blocks (a float16 scale per 32 values), counted as the "
        "runtime counts them",
    )  # fmt: skip
    mem = p.add_mutually_exclusive_group()
    mem.add_argument(
        "--device", default=None, help=f"card preset ({', '.join(DEVICE_PRESETS)}); default 16GB"
    )
    mem.add_argument("--kv-memory", default=None, help="explicit KV budget, e.g. 8GiB")
    p.add_argument("--reserve", default=None, help="runtime reserve besides weights (1GiB)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default="seed", choices=sorted(NAMED))
    src.add_argument("--trace", type=Path, help="JSONL trace (see docs/simulator.md)")
    p.add_argument("--requests", type=int, help="number of requests (turns)")
    p.add_argument("--rate", type=float, help="new conversations per second (0: all at once)")
    p.add_argument("--context", type=int, help="context length (default: the workload's)")
    p.add_argument("--prompt-len", type=LengthDist.parse, help="e.g. 32-256")
    p.add_argument("--output-len", type=LengthDist.parse, help="e.g. 80%%:200-500,20%%:10-1500")
    p.add_argument("--system-prompt", type=int, help="shared prefix length in tokens")
    p.add_argument("--system-share", type=float, help="share of requests with the prefix")
    p.add_argument("--prefix-groups", type=int, help="number of distinct shared prefixes")
    p.add_argument("--turns", help="turns per conversation, e.g. 3-8")
    p.add_argument("--think-time", type=float, help="seconds between a reply and the next turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--strategies",
        default="static,paged,paged+prefix",
        help="comma-separated: static, paged, paged+prefix",
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        metavar="N",
        help="also sweep these block sizes (paged strategies) for the capacity plot",
    )
    p.add_argument("--pin-prefix", action="store_true", help="pin shared prefixes (paged+prefix)")
    p.add_argument("--json", action="store_true", help="one JSON object per strategy")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument(
        "--html", type=Path, metavar="FILE",
        help="write the live view of the replay (paged+prefix, else the first strategy) as "
        "one self-contained page with a slider through simulated time",
    )  # fmt: skip
    p.add_argument("--save-trace", type=Path, help="write the workload as a JSONL trace")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _workload(args: argparse.Namespace):
    if args.trace:
        return load_trace(args.trace, args.context or 2048)
    spec = NAMED[args.workload]
    changes = {
        "num_requests": args.requests,
        "rate": args.rate,
        "context_length": args.context,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "system_prompt_len": args.system_prompt,
        "system_prompt_share": args.system_share,
        "num_prefix_groups": args.prefix_groups,
        "think_time": args.think_time,
        "seed": args.seed,
    }
    if args.turns:
        lo, _, hi = args.turns.partition("-")
        changes["turns"] = (int(lo), int(hi or lo))
    return generate(
        dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not None})
    )


def run(args: argparse.Namespace) -> int:
    try:
        strategies = [Strategy(s.strip()) for s in args.strategies.split(",") if s.strip()]
    except ValueError:
        print(f"kvpool simulate: unknown strategy in {args.strategies!r}", file=sys.stderr)
        return 2
    try:
        model = resolve_model(args.model)
        reserve = parse_bytes(args.reserve) if args.reserve else DEFAULT_RESERVE
        kv_bytes = parse_bytes(args.kv_memory) if args.kv_memory else None
        device = args.device or (None if kv_bytes else "16GB")
        budget = kv_budget(
            model,
            device=device,
            weight_format=args.weights,
            reserve_bytes=reserve,
            kv_bytes=kv_bytes,
        )
        workload = _workload(args)
    except (ValueError, OSError) as exc:
        print(f"kvpool simulate: {exc}", file=sys.stderr)
        return 2
    if args.save_trace:
        write_trace(workload, args.save_trace)
    bpt = model.geometry(kv_dtype_bytes(args.kv_dtype, model.head_dim)).bytes_per_token
    common = dict(
        kv_dtype=args.kv_dtype,
        weight_format=args.weights,
        pin_prefixes=args.pin_prefix,
        progress=not args.quiet,
    )
    t0 = time.perf_counter()
    viewed = None
    if args.html:
        viewed = Strategy.PAGED_PREFIX if Strategy.PAGED_PREFIX in strategies else strategies[0]
    results = run_strategies(
        workload, model, budget, strategies=strategies, block_size=args.block_size,
        frames_of=viewed, **common,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if args.json:
        print(report.to_json_lines(results))
    else:
        print(
            f"model      {model.name}: {model.num_layers} layers, {model.num_kv_heads} KV heads "
            f"x {model.head_dim}, KV {args.kv_dtype} = {bpt:,} bytes per token"
        )
        print(f"memory     {budget.describe()}")
        print(
            f"workload   {workload.name}: {len(workload.requests)} requests, context "
            f"{workload.context_length}. {workload.description}"
        )
        print()
        print(report.format_table(results))
        mgr = sum(r.manager_wall_s for r in results)
        print(
            f"\nreplayed in {wall:.2f} s wall, {mgr:.2f} s of it in the block manager "
            f"({100 * mgr / wall if wall else 0:.0f}%)"
        )
    if args.html:
        result = next(r for r in results if r.frames is not None)
        title = (f"kvpool simulate: {model.name}, {workload.name}, {result.strategy}, "
                 f"block {result.block_size}")  # fmt: skip
        report.write_html(result, args.html, title, bpt, args.kv_dtype, model.name)
        print(f"wrote {args.html}", file=sys.stderr)
    if args.plot:
        args.plot.mkdir(parents=True, exist_ok=True)
        title = f"{model.name}, {budget.kv_bytes / GiB:.1f} GiB KV, workload {workload.name}"
        paths = [report.plot_occupancy(results, args.plot / "occupancy.png", title)]
        if args.block_sizes:
            sweep = {}
            for strategy in (s for s in strategies if s is not Strategy.STATIC):
                sweep[str(strategy)] = [
                    run_strategies(
                        workload, model, budget, strategies=[strategy], block_size=bs, **common
                    )[0]
                    for bs in args.block_sizes
                ]
            paths.append(report.plot_block_sizes(sweep, args.plot / "block_sizes.png", title))
        for path in paths:
            print(f"wrote {path}", file=sys.stderr)
    return 0
