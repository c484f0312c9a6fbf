"""Tables, JSON and plots of simulation results."""

from __future__ import annotations

import json
from pathlib import Path

from kvpool.sim.presets import GiB
from kvpool.sim.replay import SimResult

JSON_KEYS = (
    "strategy",
    "block_size",
    "num_blocks",
    "max_concurrent",
    "mean_concurrent",
    "kv_utilization",
    "waste_internal",
    "waste_over_reservation",
    "prefix_hit_rate",
    "sharing_saved_fraction",
    "sharing_saved_bytes_mean",
    "preemptions",
    "rejected",
    "completed",
    "queue_delay_mean",
    "queue_delay_p50",
    "queue_delay_p99",
    "ttft_p50",
    "ttft_p99",
    "output_tokens_per_s",
    "prompt_tokens_computed",
    "prompt_tokens_cached",
    "evictions",
    "makespan",
    "steps",
    "sim_wall_s",
    "manager_wall_s",
)


def to_json_lines(results: list[SimResult]) -> str:
    """One JSON object per strategy, one per line."""
    return "\n".join(json.dumps({k: getattr(r, k) for k in JSON_KEYS}) for r in results)


def format_table(results: list[SimResult]) -> str:
    head = (
        f"{'strategy':<13}{'block':>6}{'blocks':>8}{'max conc':>9}{'mean':>7}{'KV util':>8}"
        f"{'int.frag':>9}{'over-res':>9}{'hit rate':>9}{'shared':>8}{'preempt':>8}{'reject':>7}"
        f"{'queue p50':>10}{'p99':>8}{'TTFT p50':>9}{'out tok/s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.strategy:<13}{r.block_size:>6}{r.num_blocks:>8}{r.max_concurrent:>9}"
            f"{r.mean_concurrent:>7.1f}{r.kv_utilization:>8.1%}{r.waste_internal:>9.1%}"
            f"{r.waste_over_reservation:>9.1%}{r.prefix_hit_rate:>9.1%}"
            f"{r.sharing_saved_fraction:>8.1%}{r.preemptions:>8}{r.rejected:>7}"
            f"{r.queue_delay_p50:>9.1f}s{r.queue_delay_p99:>7.1f}s{r.ttft_p50:>8.1f}s"
            f"{r.output_tokens_per_s:>10.1f}"
        )
    lines.append(
        "blocks: pool blocks (static: context slots); KV util: slots holding tokens / slots "
        "reserved; shared: KV the sequences hold that sharing saves storing"
    )
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError("plots need matplotlib: pip install 'kvpool[sim]'") from exc
    return plt


def plot_occupancy(results: list[SimResult], path: str | Path, title: str) -> Path:
    """Concurrency and KV memory over simulated time, one line per strategy."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for r in results:
        label = f"{r.strategy} (bs {r.block_size})" if r.strategy != "static" else "static"
        s = r.series
        ax1.plot(s.t, s.running, label=label, linewidth=1)
        line = ax2.plot(s.t, [b / GiB for b in s.stored_bytes], label=f"{label}: holding tokens")
        ax2.plot(
            s.t,
            [b / GiB for b in s.reserved_bytes],
            linestyle=":",
            color=line[0].get_color(),
            label=f"{label}: reserved",
        )
    if results:
        ax2.axhline(results[0].kv_bytes / GiB, color="black", linewidth=0.8, label="KV budget")
    ax1.set_ylabel("requests running")
    ax1.set_title(title)
    ax1.legend(loc="upper right", fontsize=8)
    ax2.set_ylabel("KV memory (GiB)")
    ax2.set_xlabel("simulated time (s)")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=7, ncol=3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_block_sizes(sweep: dict[str, list[SimResult]], path: str | Path, title: str) -> Path:
    """Capacity (most requests at once) and KV utilisation against block size."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for strategy, results in sweep.items():
        sizes = [r.block_size for r in results]
        ax1.plot(sizes, [r.max_concurrent for r in results], marker="o", label=strategy)
        ax2.plot(sizes, [100 * r.kv_utilization for r in results], marker="o", label=strategy)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.legend(fontsize=8)
    ax1.set_ylabel("most requests running at once")
    ax2.set_ylabel("KV utilisation (%)")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_html(
    result: SimResult, path: str | Path, title: str, bytes_per_token: int, kv_dtype: str,
    model: str,
) -> Path:  # fmt: skip
    """The live view's page with ``result``'s frames in it (``kvpool simulate --html``)."""
    from kvpool.web import replay_page

    assert result.frames is not None, "the replay kept no frames"
    per_block = result.block_size * bytes_per_token
    base = {
        "capacity": {"model": model, "block_size": result.block_size,
                     "total_blocks": result.num_blocks, "kv_cache_dtype": kv_dtype,
                     "bytes_per_block": per_block, "total_bytes": per_block * result.num_blocks},
    }  # fmt: skip
    replay = {"title": title, "base": base, "frames": result.frames.frames,
              "history": result.frames.history}  # fmt: skip
    out = Path(path)
    out.write_text(replay_page(replay))
    return out
