"""``kvpool bench model``: the runtime beside llama.cpp (``kvpool.bench.llama_cpp``: its
own tools on the same GGUF file) and transformers' ``generate()`` (same model, device
and dtype), each side in its own process (so peak memory is its own: the process's
host memory, and on a GPU also the most its tensors took there). Any GGUF file
(``--model``), e.g. the synthetic models of ``kvpool bench synth-model``; transformers
is left out for files over 1 GiB unless asked for (it dequantizes every weight to
float).

Figures: load time (kvpool: ``load_model``, its dtype and crossover measurements
included; llama.cpp: ``llama-server`` from its start to its first healthy answer, its
warm-up included); kvpool's load again, a restart's: its measurements taken from the
first load's store (kvpool.model.measured), where the other sides load as before;
prefill tokens/s for a 512-token prompt; decode tokens/s at batch 1, 8
and 32 (100-token prompts, the time of the N decode steps after the first token, so
prefill is not counted: for transformers, whose ``generate()`` does both, the time of
N+1 generated tokens minus the time of 1); peak resident memory of the process. kvpool
prefills a batch's prompts in steps of at most the engine's default step budget
(``EngineConfig.max_batch_tokens``), as it serves them; transformers in one call, as
``generate()`` does.

Every side computes with the same number of threads: one a physical core (torch's
count), or each of ``--threads N ...`` in turn (a table per count, then every count side
by side: how each side's figures grow with cores). Each side runs with its own
defaults: kvpool's OpenMP settings (``kvpool/__init__.py``) come with importing kvpool,
transformers gets libgomp's (unless the user set them).

``--against no-openmp`` measures kvpool a second time, built without OpenMP (its native
ops on their own thread pool, ``csrc/parallel.h``: macOS's build; on Linux a choice to
measure, e.g. on many cores), as a side of its own; that build is made before the
rounds, so no round's load time holds it.

The two sides alternate over several rounds (kvpool, transformers, kvpool, ...) and each
figure is the median over rounds: the shared machines this is measured on have slow
phases lasting tens of seconds (the same decode step can take 1.4x as long in one),
and alternating lets both sides meet them alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import kvpool

# decode batch sizes measured (``--batches``; passed to the sides' processes by env)
BATCHES = tuple(int(b) for b in os.environ.get("KVPOOL_BENCH_BATCHES", "1,8,32").split(","))
PROMPT = 100
PREFILL = 512
DECODE_STEPS = 16
REPEATS = 3
WARMUP_PREFILLS = 3


def _prompts(batch: int, length: int, vocab: int = 40003) -> list[list[int]]:
    return [[(31 * b + 7 * i) % (vocab - 3) + 3 for i in range(length)] for b in range(batch)]


def _rates(run) -> dict[str, float]:
    """Prefill and decode rates from ``REPEATS`` measurements each: the median for
    prefill and batch-1 decode (llama.cpp's side: ``llama-bench``'s mean of its
    repetitions), the best for larger batches (llama.cpp's side: the best of as many
    runs through ``llama-server``), so that both sides' figures are the same statistic.
    ``run(batch, prompt_len, new_tokens)`` returns (seconds to the first token, seconds
    of the decode steps after it). Both sides first run the prefill shape a few times
    unmeasured, as any warm-up: kvpool's thread policy makes its first trials of a kind
    of step there (one of them on one thread, twice as slow at this size), which a
    server pays once, not once in three steps. Batch 1's decode is warmed the same way
    (one unmeasured run, as ``llama-bench`` warms its own): its first runs hold the
    policy's first trials of a decode step, one of them on one thread, which costs a step
    of a 16-core machine several times its time, and would be in the median. Larger
    batches take the best of their runs, which leaves such trials out."""
    for _ in range(WARMUP_PREFILLS):
        run(1, PREFILL, 1)
    prefill = (PREFILL / run(1, PREFILL, 1)[0] for _ in range(REPEATS))
    out = {"prefill_tok_s": statistics.median(prefill)}
    if 1 in BATCHES:
        run(1, PROMPT, DECODE_STEPS + 1)  # warm-up (batch 1's figure is a median)
    for batch in BATCHES:
        rates = [
            batch * DECODE_STEPS / run(batch, PROMPT, DECODE_STEPS + 1)[1] for _ in range(REPEATS)
        ]
        out[f"decode_b{batch}_tok_s"] = statistics.median(rates) if batch == 1 else max(rates)
    return out


def kv_tokens() -> int:
    """KV slots both kvpool and llama.cpp get: the largest batch's prompts and outputs,
    with room to spare (llama.cpp splits its context evenly between its slots), and never
    fewer than the prefill's prompt (``--batches 1`` alone)."""
    return max(max(BATCHES) * 128, PREFILL + 128)


def _ours(dtype: str | None, model: str | None) -> dict[str, float]:
    import torch

    from kvpool.cache import KVCacheManager
    from kvpool.engine.config import DEFAULTS
    from kvpool.engine.sampling import argmax_rows
    from kvpool.model.loader import load_model
    from kvpool.model.runner import SeqChunk

    t0 = time.perf_counter()
    loaded = load_model(model, dtype=dtype, progress=False)
    result = {"load_s": time.perf_counter() - t0}
    print(f"bench model: kvpool {loaded.compute_line()}", file=sys.stderr, flush=True)
    budget = kv_tokens() * loaded.kv_bytes_per_token
    runner = loaded.make_runner(budget, 16)
    manager = KVCacheManager(runner.kv.num_blocks, 16, enable_prefix_caching=False)
    cuda = loaded.model.device.type == "cuda"
    vocab = loaded.model.vocab_rows

    def sync() -> None:  # a GPU runs the step's kernels after forward() returns
        if cuda:
            torch.cuda.synchronize()

    def run(batch: int, length: int, new_tokens: int) -> tuple[float, float]:
        prompts = _prompts(batch, length, min(vocab, 40003))
        start = time.perf_counter()
        for b, p in enumerate(prompts):
            manager.allocate(b, p)
        per_step = max(1, DEFAULTS.max_batch_tokens // length)  # prompts per step, as the engine
        logits = torch.cat([
            runner.forward([
                SeqChunk(prompts[b], 0, manager.block_table(b))
                for b in range(i, min(i + per_step, batch))
            ])
            for i in range(0, batch, per_step)
        ])  # fmt: skip
        sync()
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            chunks = []
            for b, token in enumerate(argmax_rows(logits)):  # greedy, as theirs
                pos = manager.num_tokens(b)
                manager.append(b, [token])
                chunks.append(SeqChunk([token], pos, manager.block_table(b)))
            logits = runner.forward(chunks)
        sync()
        end = time.perf_counter()
        for b in range(batch):
            manager.free(b)
        return first - start, end - first

    run(1, 16, 2)  # warm up
    result.update(_rates(run))
    if runner.threads is not None:
        print(f"bench model: kvpool {policy_line(runner.threads.summary())}", file=sys.stderr)
    return result


def policy_line(summary: dict[str, dict[str, float]]) -> str:
    """The thread policy's estimates (``ThreadPolicy.summary()``) in one line, each step
    kind's modes fastest first (the first is the one it runs)."""
    kinds = [
        f"{kind}: "
        + ", ".join(f"{mode} {ms:.2f}" for mode, ms in sorted(modes.items(), key=lambda m: m[1]))
        for kind, modes in summary.items()
        if modes
    ]
    return "thread policy, ms a token by step kind, fastest first: " + "; ".join(kinds)


def _transformers(dtype: str | None, model: str | None) -> dict[str, float]:
    import torch
    import transformers

    from kvpool.model.loader import choose_device, choose_dtype
    from kvpool.model_store import resolve_model_path

    path = resolve_model_path(model)
    dtype = str(choose_dtype(dtype, choose_device())).removeprefix("torch.")
    device = choose_device()  # the device kvpool's side chooses
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    )
    model.to(device).eval()
    result = {"load_s": time.perf_counter() - t0}

    def generate(batch: int, length: int, new_tokens: int) -> float:
        ids = torch.tensor(_prompts(batch, length), device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def run(batch: int, length: int, new_tokens: int) -> tuple[float, float]:
        first = generate(batch, length, 1)
        return first, (generate(batch, length, new_tokens) - first if new_tokens > 1 else 0.0)

    run(1, 16, 2)  # warm up
    result.update(_rates(run))
    return result


def _measure_side(side: str, dtype: str | None, model: str | None) -> None:
    """Child process: measure one side and print its figures as JSON (``reload``: only
    kvpool's load, taking what the side's load before it measured and kept)."""
    import torch

    if side == "reload":
        from kvpool.model.loader import load_model

        t0 = time.perf_counter()
        load_model(model, dtype=dtype, progress=False)
        print(json.dumps({"load_s": time.perf_counter() - t0}))
        return
    ours = side in ("kvpool", "no-openmp")
    figures = _ours(dtype, model) if ours else _transformers(dtype, model)
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.cuda.is_initialized():  # what the side's tensors took on the GPU at most
        figures["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(figures))


def _side_env(side: str, threads: int | None = None) -> dict[str, str]:
    """A side's environment: ``threads`` (when given) as its OpenMP thread count, which
    torch takes for its own, and so kvpool's products and thread policy."""
    env = dict(os.environ)
    if side == "transformers" and kvpool.openmp_defaults_applied:
        env["GOMP_SPINCOUNT"] = "300000"  # libgomp's own default, as torch alone runs
    if side == "no-openmp":
        env["KVPOOL_NATIVE_OPENMP"] = "0"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _build_without_openmp() -> None:
    """The no-openmp side's native build, made (or found) before any round is timed."""
    print("bench model: building kvpool's native ops without OpenMP...", file=sys.stderr)
    code = "from kvpool.model.native import native_ops, unavailable_reason\n"
    code += "assert native_ops() is not None, unavailable_reason()"
    subprocess.run([sys.executable, "-c", code], check=True, env=_side_env("no-openmp"))


def default_threads() -> int:
    """The threads kvpool computes with unless told: torch's count (one a physical core).
    Not ``os.cpu_count()``, which counts a core's hyperthreads too and would slow
    llama.cpp down on such CPUs."""
    import torch

    return torch.get_num_threads()


def _llama_cpp_side(bin_dir, model: str | None, threads: int) -> dict[str, float]:
    from kvpool.bench import llama_cpp
    from kvpool.formats.gguf_header import read_gguf_header
    from kvpool.model.config import ModelConfig
    from kvpool.model_store import resolve_model_path

    path = resolve_model_path(model)
    config = ModelConfig.from_gguf(read_gguf_header(path))
    figures = llama_cpp.bench(bin_dir, path, threads, PREFILL, DECODE_STEPS)
    prompts = {b: _prompts(b, PROMPT, min(config.vocab_size, 40003)) for b in BATCHES}
    served = llama_cpp.serve(
        bin_dir, path, threads, tuple(b for b in BATCHES if b > 1), prompts, DECODE_STEPS,
        kv_tokens(), REPEATS,
    )  # fmt: skip
    figures.update(served)  # (its load time: llama-server's, start to ready)
    return figures


def _gpu_name() -> str:
    """'; GPU: its name' where torch sees a CUDA device (the sides compute there)."""
    import torch

    return f"; GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""


def run(
    dtype: str | None = None,
    rounds: int = 3,
    model: str | None = None,
    against: list[str] | None = None,
    llama_cpp_dir: str | None = None,
    threads: list[int] | None = None,
) -> str:
    """The comparison's tables. ``threads``: the thread counts to measure at, every side
    at each (one table per count, then one of every count side by side); default: one
    table at ``default_threads()``. Rounds alternate over counts and sides alike."""
    from kvpool.bench import llama_cpp
    from kvpool.model_store import resolve_model_path

    path = resolve_model_path(model)
    bin_dir = llama_cpp.find(llama_cpp_dir)
    if against is None:
        against = (["llama.cpp"] if bin_dir else []) + (
            ["transformers"] if path.stat().st_size < 2**30 else []
        )
    if "llama.cpp" in against and bin_dir is None:
        raise SystemExit("kvpool: llama.cpp not found (--llama-cpp DIR or $KVPOOL_LLAMA_CPP)")
    counts = list(threads) if threads else [default_threads()]
    sides = ["kvpool", *against]
    if "no-openmp" in sides:
        _build_without_openmp()
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    failed: set[int] = set()  # the thread counts at which llama.cpp gave no figures
    for r in range(rounds):
        for n in counts:
            for side in sides:
                if side == "llama.cpp" and n in failed:
                    runs[n, side].append({})  # (it failed in an earlier round: not again)
                    continue
                print(
                    f"bench model: round {r + 1}/{rounds}, {_threads(n)}, measuring {side}...",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                if side != "llama.cpp":
                    figures = _child_side(side, dtype, model, n if threads else None)
                else:
                    try:
                        figures = _llama_cpp_side(bin_dir, model, n)
                    except llama_cpp.LlamaCppFailed as exc:
                        failed.add(n)
                        print(
                            f"bench model: llama.cpp gave no figures ({exc}); its column is "
                            f"left empty (nan){_amx_hint()}", file=sys.stderr, flush=True,
                        )  # fmt: skip
                        figures = {}
                runs.setdefault((n, side), []).append(figures)
    medians = {key: _medians(results) for key, results in runs.items()}
    tables = [
        _table(path, dtype, rounds, n, {side: medians[n, side] for side in sides}, against)
        for n in counts
    ]
    if len(counts) > 1:
        tables.append(_threads_table(counts, medians, against[0] if against else None))
    return "\n\n".join(tables)


def _amx_hint() -> str:
    """Where the CPU has AMX: llama.cpp's AMX path (GGML_NATIVE=ON takes it there) crashed
    on such a CPU with GCC 12 (docs/performance.md, thirty-fifth session)."""
    from kvpool.model.cpu import cpu_features

    if not cpu_features().amx:
        return ""
    return (
        ". This CPU has AMX: a llama.cpp built with its AMX path may crash on it; build it "
        "with GGML_NATIVE=OFF, the AVX-512 options on and GGML_AMX_TILE/INT8/BF16=OFF"
    )


def _medians(results: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds that gave it (a side that failed gave {})."""
    names = {name: None for result in results for name in result}
    return {name: statistics.median(r[name] for r in results if name in r) for name in names}


def _threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def _child_side(side: str, dtype: str | None, model: str | None, threads: int | None) -> dict:
    """One side's figures from its own process; the lines it said about itself (kvpool:
    its compute line, its thread policy's estimates) passed on to this one's stderr.

    A kvpool side measures its load-time choices into a store of its own (empty: its
    ``load_s`` is a first start's), then a second process loads again from that store:
    ``load_again_s``, a restart's load (kvpool.model.measured); the user's store is
    neither read nor written."""
    ours = side in ("kvpool", "no-openmp")
    env = _side_env(side, threads)
    kept = tempfile.TemporaryDirectory(prefix="kvpool-bench-measured-") if ours else None
    with kept or contextlib.nullcontext():
        if kept is not None:
            env.update(KVPOOL_CACHE_DIR=kept.name, KVPOOL_MEASURED="kept")

        def child(name: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "kvpool.bench.model", name, dtype or "auto", model or ""],
                capture_output=True, text=True, check=True, env=env,
            )  # fmt: skip

        out = child(side)
        again = json.loads(child("reload").stdout.strip().splitlines()[-1]) if ours else {}
    for line in out.stderr.splitlines():
        if line.startswith("bench model: "):
            print(line, file=sys.stderr, flush=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    if "load_s" in again:
        figures["load_again_s"] = again["load_s"]
    return figures


def _labels(kvpool_figures: dict[str, float]) -> list[tuple[str, str, bool]]:
    """(figure, label, higher is better) in the tables' order."""
    labels = [("load_s", "load (s)", False)]
    if "load_again_s" in kvpool_figures:  # (the other sides keep nothing: load_s again)
        labels += [("load_again_s", "load again (s)", False)]
    labels += [("prefill_tok_s", f"prefill {PREFILL} tok/s", True)]
    labels += [(f"decode_b{b}_tok_s", f"decode batch {b} tok/s", True) for b in BATCHES]
    labels += [("peak_rss_mib", "peak memory (MiB)", False)]
    if "peak_gpu_mib" in kvpool_figures:
        labels += [("peak_gpu_mib", "peak GPU memory (MiB)", False)]
    return labels


def _figure(figures: dict[str, float], key: str) -> float:
    """A side's figure, nan where it has none; a side that keeps nothing between loads
    (llama.cpp, transformers) loads again as it loaded."""
    if key == "load_again_s" and key not in figures:
        key = "load_s"
    return figures.get(key, float("nan"))


def _ratio(ours: float, theirs: float, higher_better: bool) -> float:
    return ours / theirs if higher_better else theirs / ours


def _table(path, dtype, rounds: int, threads: int, medians: dict, against: list[str]) -> str:
    from kvpool.model.cpu import cpu_features

    lines = [
        f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB), kvpool dtype {dtype or 'auto'}, "
        f"{_threads(threads)}, {os.cpu_count()} CPUs: {cpu_features().summary()}" + _gpu_name(),
        f"decode over {DECODE_STEPS} steps after {PROMPT}-token prompts; KV for "
        f"{kv_tokens()} tokens on every side; medians of {rounds} alternating rounds",
        f"{'':<24}{'kvpool':>10}" + "".join(f"{s:>14}{'ratio':>8}" for s in against),
    ]
    for key, label, higher_better in _labels(medians["kvpool"]):
        a = medians["kvpool"].get(key, float("nan"))
        row = f"{label:<24}{a:>10.1f}"
        for side in against:
            b = _figure(medians[side], key)
            row += f"{b:>14.1f}{_ratio(a, b, higher_better):>7.2f}x"
        lines.append(row)
    lines.append(
        "ratio: how many times better kvpool is (speed: ours/theirs; time, memory: theirs/ours)"
    )
    return "\n".join(lines)


def _threads_table(counts: list[int], medians: dict, other: str | None) -> str:
    """Each figure at every thread count: kvpool's, and its ratio to ``other``'s."""
    cell = 18
    lines = [
        "by threads: kvpool's figure" + (f" (its ratio to {other}'s)" if other else ""),
        f"{'threads':<24}" + "".join(f"{n:>{cell}}" for n in counts),
    ]
    for key, label, higher_better in _labels(medians[counts[0], "kvpool"]):
        row = f"{label:<24}"
        for n in counts:
            a = medians[n, "kvpool"].get(key, float("nan"))
            text = f"{a:.1f}"
            if other:
                b = _figure(medians[n, other], key)
                text = f"{_ratio(a, b, higher_better):.2f}x ({a:.1f})"
            row += f"{text:>{cell}}"
        lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    _measure_side(sys.argv[1], None if sys.argv[2] == "auto" else sys.argv[2], sys.argv[3] or None)
