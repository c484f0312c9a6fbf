"""How the native ops share their work among threads (``csrc/parallel.h``): torch's OpenMP
pool where the compiler has OpenMP, a pool of their own where it does not (macOS's
clang), with the same chunks and the same results.

The module this process built (OpenMP on Linux) is checked directly; the build without
OpenMP (``KVPOOL_NATIVE_OPENMP=0``, a module of its own) in a subprocess: its chunks,
its errors, the kernel tests that vary the thread count, and its products and greedy
tokens against this process's, bit for bit."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvpool.model import native  # noqa: E402

ops = native.native_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="native ops not built here")
REPO = Path(__file__).resolve().parents[1]


def test_openmp_is_asked_for_where_the_compiler_has_it(monkeypatch):
    monkeypatch.delenv("KVPOOL_NATIVE_OPENMP", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    assert native._openmp()
    monkeypatch.setattr(sys, "platform", "darwin")  # Apple's clang: no -fopenmp
    assert not native._openmp()
    monkeypatch.setenv("KVPOOL_NATIVE_OPENMP", "1")
    assert native._openmp()
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("KVPOOL_NATIVE_OPENMP", "0")
    assert not native._openmp()
    assert "-fopenmp" in native._flags(True) and "-fopenmp" not in native._flags(False)
    assert native._module_name(native._flags(True)) != native._module_name(native._flags(False))


@pytest.mark.parametrize(
    ("log", "lacks"),
    [
        ("quant_ops.cpp:1:10: fatal error: omp.h: No such file or directory", True),
        ("clang: error: unsupported option '-fopenmp'", True),
        ("/usr/bin/ld: cannot find -lomp: No such file or directory", True),
        ("ld: library not found for -lomp", True),
        ("/bin/sh: 1: c++: not found", False),
        ("quant_ops.cpp:9:3: error: expected ';' after expression", False),
        # a compile command names -fopenmp whatever failed: not a reason by itself
        ("FAILED: quant_ops.o\nc++ -MMD -fopenmp -c quant_ops.cpp -o quant_ops.o" + " -I/x" * 100
         + "\nquant_ops.cpp:9:3: error: expected ';'", False),
    ],
)  # fmt: skip
def test_a_build_that_failed_for_want_of_openmp_is_told_from_other_failures(log, lacks):
    assert native._lacks_openmp(log) == lacks


def expected_chunks(begin: int, end: int, grain: int, threads: int) -> list[tuple[int, int]]:
    """torch's OpenMP build's cut of [begin, end): as many chunks as threads, at most one
    per grain indices, of equal length (at::parallel_for, ParallelOpenMP.h)."""
    n = end - begin
    if n <= grain or n <= 1 or threads <= 1:
        return [(begin, end)]
    tasks = min(threads, -(-n // grain)) if grain > 0 else threads
    size = -(-n // tasks)
    return [(b, min(end, b + size)) for b in range(begin, end, size)]


CASES = [(0, 10, 1), (3, 4, 1), (0, 100, 64), (5, 1000, 7), (0, 64, 64), (0, 3, 0)]


def check_chunks(module, threads: int) -> None:
    for begin, end, grain in CASES:
        got = module.parallel_chunks(begin, end, grain)
        want = expected_chunks(begin, end, grain, threads)
        assert len(got) == end - begin
        for i, (start, stop, nested, visits) in zip(range(begin, end), got, strict=True):
            assert visits == 1 and start <= i < stop and (start, stop) in want
            assert nested == (len(want) > 1)  # a chunk of a shared range runs in a region


@needs_ops
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_parallel_range_is_cut_as_torchs_and_every_index_runs_once(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_chunks(ops, threads)
    finally:
        torch.set_num_threads(before)


@needs_ops
def test_a_chunks_error_reaches_the_caller_and_the_next_range_runs():
    for _ in range(3):
        with pytest.raises(RuntimeError, match="index 6 refused"):
            ops.parallel_raises(8, 6)
        ops.parallel_raises(8, 9)  # no chunk holds 9


FLUSH_CONTROL = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
needs_flush_control = pytest.mark.skipif(
    not FLUSH_CONTROL, reason=f"no flush-to-zero control known on {platform.machine()}"
)


def check_float_control(module) -> None:
    """Every chunk of a parallel range computes under the calling thread's float control
    (float_control.h), on whichever thread it runs: flushing subnormals under the ops'
    scope, not flushing without it, flushing again where the caller set it itself (torch's
    set_flush_denormal sets only the calling thread's). The scope leaves the caller's state
    as it was."""
    for flush in (True, False, True):
        chunks = module.chunks_flush_denormals(16, flush)
        assert [flushed for flushed, _ in chunks] == [flush] * 16
        assert not module.flushes_denormals()
    if torch.set_flush_denormal(True):  # (False where torch's build cannot set it)
        try:
            assert module.flushes_denormals()
            assert all(flushed for flushed, _ in module.chunks_flush_denormals(16, False))
        finally:
            torch.set_flush_denormal(False)
    assert not module.flushes_denormals()


@needs_ops
@needs_flush_control
def test_every_chunk_computes_under_the_callers_float_control():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_float_control(ops)
        chunks = ops.chunks_flush_denormals(16, True)
        assert not all(on_caller for _, on_caller in chunks)  # a worker took some
    finally:
        torch.set_num_threads(before)


# A fresh process whose first parallel region runs under the ops' scope, which starts
# OpenMP's workers there. Prints one JSON line.
_FIRST_REGION_FLUSHED = r"""
import json
import torch
import torch.nn.functional as F
from kvpool.model import native

ops = native.native_ops()
torch.set_num_threads(3)
chunks = ops.chunks_flush_denormals(12, True)
tiny = torch.full((96, 576), 1e-40)
normed = F.rms_norm(tiny, (576,), torch.ones(576), 1e-6)
print(json.dumps({"flushed": [flushed for flushed, _ in chunks],
                  "workers": sum(not on_caller for _, on_caller in chunks),
                  "torch_zero_rows": int((normed == 0).all(-1).sum())}))
"""


@needs_ops
@needs_flush_control
def test_threads_started_inside_a_flushing_op_do_not_flush_after_it():
    """Threads inherit their creator's float state: OpenMP's workers, started by the
    first parallel region (here inside an op's scope), would flush subnormals in all
    their later work, torch's own ops included, had the region begun in the scope's
    state. torch's norm of subnormal rows on those workers keeps them normal."""
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_REGION_FLUSHED], capture_output=True, text=True,
        cwd=REPO, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["flushed"] == [True] * 12 and report["workers"] > 0
    assert report["torch_zero_rows"] == 0


# Run in a process whose native ops are built without OpenMP. Prints one JSON line.
_WITHOUT_OPENMP = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from kvpool.model import native
import test_native_threads as t

ops = native.native_ops()
assert ops is not None, native.unavailable_reason()
report = {"threads_from": ops.threads_from(), "module": ops.__name__}
for threads in (1, 2, 3):
    torch.set_num_threads(threads)
    t.check_chunks(ops, threads)
torch.set_num_threads(2)
for _ in range(3):
    try:
        ops.parallel_raises(8, 6)
        raise SystemExit("no error")
    except RuntimeError as exc:
        assert "index 6 refused" in str(exc)
    ops.parallel_raises(8, 9)
if t.FLUSH_CONTROL:
    t.check_float_control(ops)
import os, signal
pid = os.fork()  # a child has none of the pool's workers: it must start its own
if pid == 0:
    signal.alarm(60)  # a hang ends the child (SIGALRM), not the test
    try:
        t.check_chunks(ops, 2)
        os._exit(0)
    except BaseException:
        os._exit(1)
_, status = os.waitpid(pid, 0)
report["forked_child"] = os.waitstatus_to_exitcode(status)
torch.save(t.products(ops), sys.argv[2])
report["tokens"], report["line"] = t.greedy_tokens(sys.argv[3])
print(json.dumps(report))
"""


def products(module) -> dict[str, torch.Tensor]:
    """Products of every integer format on 1 and 2 threads, in int8 mode at 1 to 130 rows
    and in float mode below the rows where MKL's tiles take over (an OpenMP build's
    only: kvp's own pool multiplies float tiles by float_dot)."""
    import numpy as np

    from kvpool.bench.random_blocks import TYPES, random_blocks

    out = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for qtype in ("Q4_0", "Q4_1", "Q5_K", "Q6_K", "Q8_0"):
                tid = TYPES[qtype][0]
                raw = torch.from_numpy(random_blocks(qtype, 72, 512, np.random.default_rng(3)))
                for rows, modes in ((1, (0, 1)), (5, (0, 1)), (37, (0,)), (130, (0,))):
                    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
                    for mode in modes:
                        for dtype in (torch.float32, torch.bfloat16):
                            y = module.quant_matmul(x.to(dtype), [raw], [tid], mode, "")
                            out[f"{qtype}/{rows}/{mode}/{dtype}/{threads}"] = y
    finally:
        torch.set_num_threads(before)
    return out


def greedy_tokens(model_path: str) -> tuple[list[list[int]], str]:
    """The default model's greedy tokens for three prompts at once, bf16 compute, and the
    load's compute line."""
    from kvpool import LLM, SamplingParams

    llm = LLM(model_path, dtype="bfloat16", progress=False, kv_cache_memory=32 << 20)
    prompts = ["The capital of France is", "def fibonacci(n):", "Paged KV caches"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    return [list(o.token_ids) for o in outs], llm.loaded.compute_line()


@needs_ops
@pytest.mark.skipif(not native._openmp(), reason="this process's build is the one without OpenMP")
def test_the_build_without_openmp_computes_what_the_openmp_build_does(default_model_file, tmp_path):
    env = dict(os.environ, KVPOOL_NATIVE_OPENMP="0")
    saved = tmp_path / "products.pt"
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OPENMP, str(Path(__file__).parent), str(saved),
         str(default_model_file)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["threads_from"] == "own pool" and ops.threads_from() == "openmp"
    assert report["forked_child"] == 0  # its parallel ranges ran on a pool of its own
    assert report["module"] != ops.__name__  # a build of its own
    theirs, ours = torch.load(saved), products(ops)
    assert theirs.keys() == ours.keys()
    for key, y in ours.items():
        assert torch.equal(theirs[key], y), key
    tokens, line = greedy_tokens(str(default_model_file))
    assert report["tokens"] == tokens
    assert "own thread pool" in report["line"] and "own thread pool" not in line


@needs_ops
@pytest.mark.skipif(not native._openmp(), reason="this process's build is the one without OpenMP")
def test_the_kernel_tests_that_vary_threads_pass_without_openmp():
    """The suite's own tests of thread counts and row invariance, run on the build
    without OpenMP (its products on 1-4 threads, the decode attention's, a batch's rows
    against each row alone)."""
    env = dict(os.environ, KVPOOL_NATIVE_OPENMP="0")
    selection = "threads or invariant or any_number"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
         "tests/test_quant_products.py", "tests/test_native_ops.py"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


_LOAD = r"""
import json
from kvpool.model import native
ops = native.native_ops()
print(json.dumps({"threads_from": ops.threads_from() if ops else None,
                  "reason": native.unavailable_reason()}))
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to stand behind the wrapper")
def test_a_compiler_without_openmp_gets_the_build_without_it(tmp_path):
    """CXX a compiler that refuses OpenMP (as clang without libomp does): the first load
    fails that build, says so in a line, and builds without OpenMP; the next process goes
    straight to the build without it (the failed build's log remembers)."""
    calls = tmp_path / "openmp-calls"
    wrapper = tmp_path / "cxx-without-openmp"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do if [ "$a" = -fopenmp ]; then\n'
        f'  echo x >> {calls}\n'
        '  echo "x.cpp:1:10: fatal error: omp.h: No such file or directory" >&2; exit 1\n'
        "fi; done\n"
        'exec g++ "$@"\n'
    )  # fmt: skip
    wrapper.chmod(0o755)
    env = dict(os.environ, CXX=str(wrapper), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop("KVPOOL_NATIVE_OPENMP", None)
    env.pop("KVPOOL_NATIVE", None)
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _LOAD], capture_output=True, text=True, env=env, cwd=REPO,
            timeout=1200,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append((json.loads(done.stdout.strip().splitlines()[-1]), done.stderr))
        if len(runs) == 1:
            tried = calls.read_text().count("x")
    (first, first_err), (second, second_err) = runs
    assert first == second == {"threads_from": "own pool", "reason": None}
    assert "the compiler has no OpenMP (x.cpp:1:10: fatal error: omp.h" in first_err
    assert tried >= 1 and calls.read_text().count("x") == tried  # the second never tried it
    assert "no OpenMP" not in second_err and "compiling" not in second_err
