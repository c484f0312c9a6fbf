"""``kvpool bench model``'s measuring protocol (its figures are only as fair as this):
both sides warm up before anything is measured, batch 1 included, and each figure is
the statistic its docstring names."""

from __future__ import annotations

import os

import pytest

from kvpool.bench import model


def test_warm_ups_come_first_and_each_figure_is_its_statistic(monkeypatch):
    monkeypatch.setattr(model, "BATCHES", (1, 8))
    calls: list[tuple[int, int, int]] = []
    decode_seconds = iter([4.0, 1.0, 2.0, 9.0, 1.0, 3.0])  # measured decode runs, in order

    def run(batch: int, length: int, new_tokens: int) -> tuple[float, float]:
        calls.append((batch, length, new_tokens))
        measured = len(calls) > model.WARMUP_PREFILLS + model.REPEATS + 1
        return 0.5, next(decode_seconds) if measured and length == model.PROMPT else 99.0

    out = model._rates(run)
    warm_prefill = [(1, model.PREFILL, 1)] * model.WARMUP_PREFILLS
    decode = (model.PROMPT, model.DECODE_STEPS + 1)
    assert calls == [
        *warm_prefill, *[(1, model.PREFILL, 1)] * model.REPEATS,
        (1, *decode),  # batch 1 warmed: its figure is a median
        *[(1, *decode)] * model.REPEATS, *[(8, *decode)] * model.REPEATS,
    ]  # fmt: skip
    assert out["prefill_tok_s"] == model.PREFILL / 0.5
    assert out["decode_b1_tok_s"] == model.DECODE_STEPS / 2.0  # the median of 4, 1, 2 s
    assert out["decode_b8_tok_s"] == 8 * model.DECODE_STEPS / 1.0  # the best of 9, 1, 3 s


def test_thread_counts_alternate_and_each_side_gets_its_count(monkeypatch, tmp_path):
    """``--threads 1 2``: every side measured at each count, the rounds alternating over
    counts and sides; each count's table names it, and a last table sets the counts side
    by side with kvpool's ratio to the first other side's figure."""
    from kvpool.bench import llama_cpp

    path = tmp_path / "m.gguf"
    path.write_bytes(b"\0" * 1024)
    monkeypatch.setattr(model, "BATCHES", (1,))
    monkeypatch.setattr("kvpool.model_store.resolve_model_path", lambda m: path)
    monkeypatch.setattr(llama_cpp, "find", lambda given: tmp_path)
    order: list[tuple[str, int | None]] = []

    def figures(rate: float) -> dict[str, float]:
        return {"load_s": 1.0, "prefill_tok_s": rate, "decode_b1_tok_s": rate,
                "peak_rss_mib": 100.0}  # fmt: skip

    def child(side, dtype, m, threads):
        order.append((side, threads))
        return figures(30.0 * (threads or 1))

    def theirs(bin_dir, m, threads):
        order.append(("llama.cpp", threads))
        return figures(20.0 * threads)

    monkeypatch.setattr(model, "_child_side", child)
    monkeypatch.setattr(model, "_llama_cpp_side", theirs)
    out = model.run(rounds=2, model="m", against=["llama.cpp"], threads=[1, 2])
    assert order == [("kvpool", 1), ("llama.cpp", 1), ("kvpool", 2), ("llama.cpp", 2)] * 2
    tables = out.split("\n\n")
    assert len(tables) == 3
    assert ", 1 thread, " in tables[0] and ", 2 threads, " in tables[1]
    assert "decode batch 1 tok/s          60.0          40.0   1.50x" in tables[1]
    summary = tables[2].splitlines()
    assert summary[0] == "by threads: kvpool's figure (its ratio to llama.cpp's)"
    assert summary[1].split() == ["threads", "1", "2"]
    row = next(line for line in summary if line.startswith("decode batch 1"))
    assert row.split()[-4:] == ["1.50x", "(30.0)", "1.50x", "(60.0)"]
    # without --threads: one table, at the default count, the children's env untouched
    order.clear()
    monkeypatch.setattr(model, "default_threads", lambda: 7)
    out = model.run(rounds=1, model="m", against=["llama.cpp"])
    assert order == [("kvpool", None), ("llama.cpp", 7)] and "\n\n" not in out


def test_a_sides_environment_carries_its_thread_count():
    assert model._side_env("kvpool", 3)["OMP_NUM_THREADS"] == "3"
    assert model._side_env("transformers", 5)["OMP_NUM_THREADS"] == "5"
    # kvpool a second time, its native ops built without OpenMP (their own thread pool)
    assert model._side_env("no-openmp", 2)["KVPOOL_NATIVE_OPENMP"] == "0"
    assert model._side_env("kvpool").get("KVPOOL_NATIVE_OPENMP") == os.environ.get(
        "KVPOOL_NATIVE_OPENMP"
    )


def test_the_no_openmp_side_is_built_before_any_round(monkeypatch, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"\0" * 1024)
    monkeypatch.setattr(model, "BATCHES", (1,))
    monkeypatch.setattr("kvpool.model_store.resolve_model_path", lambda m: path)
    order: list[str] = []
    monkeypatch.setattr(model, "_build_without_openmp", lambda: order.append("build"))

    def child(side, dtype, m, threads):
        order.append(side)
        return {"load_s": 1.0, "prefill_tok_s": 9.0, "decode_b1_tok_s": 3.0, "peak_rss_mib": 1.0}

    monkeypatch.setattr(model, "_child_side", child)
    out = model.run(rounds=2, model="m", against=["no-openmp"])
    assert order == ["build", "kvpool", "no-openmp", "kvpool", "no-openmp"]
    assert "no-openmp" in out.splitlines()[2] and "1.00x" in out


def test_thread_counts_beyond_the_machine_are_refused(capsys):
    import os

    from kvpool.cli import main

    assert main(["bench", "model", "--threads", "1", str((os.cpu_count() or 1) + 1)]) == 2
    assert main(["bench", "model", "--threads", "0"]) == 2
    said = capsys.readouterr()
    assert "--threads: each count from 1 to" in said.err and not said.out


def test_a_sides_own_lines_reach_the_report(monkeypatch, capsys):
    """The kvpool side's process says its compute line and its thread policy's
    estimates on stderr: they are passed on (they were swallowed), other output is not."""
    import subprocess

    said = "bench model: kvpool compute dtype torch.bfloat16: measured ...\n"

    def fake_run(args, **kw):
        assert kw["env"]["OMP_NUM_THREADS"] == "4"
        return subprocess.CompletedProcess(args, 0, '{"prefill_tok_s": 1.5}\n', "noise\n" + said)

    monkeypatch.setattr(model.subprocess, "run", fake_run)
    assert model._child_side("kvpool", None, None, 4) == {"prefill_tok_s": 1.5}
    assert capsys.readouterr().err == said


def test_a_kvpool_side_loads_again_from_what_its_first_load_kept(monkeypatch, tmp_path):
    """The kvpool side's process measures into a store of its own, empty (a first start's
    load); a second process loads again from it (a restart's load), never from the user's
    store; the table's "load again" row sets that beside the other side's load (it keeps
    nothing between loads)."""
    import subprocess

    calls: list[tuple[str, str, str]] = []

    def fake_run(args, **kw):
        store = kw["env"]["KVPOOL_CACHE_DIR"]
        assert not os.listdir(store) or args[3] == "reload"
        calls.append((args[3], store, kw["env"]["KVPOOL_MEASURED"]))
        out = '{"load_s": 0.5}' if args[3] == "reload" else '{"load_s": 4.0, "prefill_tok_s": 2}'
        return subprocess.CompletedProcess(args, 0, out + "\n", "")

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "users"))
    monkeypatch.setattr(model.subprocess, "run", fake_run)
    got = model._child_side("kvpool", None, None, None)
    assert got == {"load_s": 4.0, "prefill_tok_s": 2, "load_again_s": 0.5}
    assert [c[0] for c in calls] == ["kvpool", "reload"] and calls[0][1:] == calls[1][1:]
    assert calls[0][1] != str(tmp_path / "users") and calls[0][2] == "kept"
    assert not os.path.exists(calls[0][1])  # (removed after the side)
    medians = {
        "kvpool": {"load_s": 4.0, "load_again_s": 0.5, "peak_rss_mib": 1.0},
        "llama.cpp": {"load_s": 1.0, "peak_rss_mib": 1.0},
    }
    (tmp_path / "m.gguf").write_bytes(b"\0" * 1024)
    table = model._table(tmp_path / "m.gguf", None, 1, 2, medians, ["llama.cpp"])
    rows = {line[:24].strip(): line[24:].split() for line in table.splitlines()[3:-1]}
    assert rows["load (s)"] == ["4.0", "1.0", "0.25x"]
    assert rows["load again (s)"] == ["0.5", "1.0", "2.00x"]


def test_the_policy_line_puts_each_kinds_fastest_mode_first():
    line = model.policy_line(
        {"decode <2 tokens": {"all": 56.3, "split": 73.7, "one": 100.7},
         "prefill <32 tokens": {}, "decode <32 tokens": {"one": 9.0, "all": 4.25}}
    )  # fmt: skip
    assert line.endswith(
        "decode <2 tokens: all 56.30, split 73.70, one 100.70; "
        "decode <32 tokens: all 4.25, one 9.00"
    )


def test_a_llama_cpp_that_crashes_is_named_and_its_column_left_empty(monkeypatch, tmp_path, capsys):
    """A llama-bench that dies (a llama.cpp build whose AMX path crashes on such a CPU)
    ends its side with a line saying how and why, not the whole comparison: kvpool's
    figures are still measured and printed, llama.cpp's cells are empty, and a tool that
    crashed is not started again in later rounds."""
    from kvpool.bench import llama_cpp

    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'load_backend: loaded CPU backend' >&2\nkill -SEGV $$\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1024)
    with pytest.raises(llama_cpp.LlamaCppFailed) as failed:
        llama_cpp.bench(tmp_path, gguf, 2, 512, 16)
    assert str(failed.value) == (
        "llama-bench died of SIGSEGV on m.gguf; its last line: load_backend: loaded CPU backend"
    )

    monkeypatch.setattr(model, "BATCHES", (1,))
    monkeypatch.setattr("kvpool.model_store.resolve_model_path", lambda m: gguf)
    monkeypatch.setattr(llama_cpp, "find", lambda given: tmp_path)
    order: list[str] = []

    def child(side, dtype, m, threads):
        order.append(side)
        return {"load_s": 1.0, "prefill_tok_s": 30.0, "decode_b1_tok_s": 20.0,
                "peak_rss_mib": 100.0}  # fmt: skip

    def theirs(bin_dir, m, threads):
        order.append("llama.cpp")
        return llama_cpp.bench(bin_dir, gguf, threads, 512, 16)

    monkeypatch.setattr(model, "_child_side", child)
    monkeypatch.setattr(model, "_llama_cpp_side", theirs)
    out = model.run(rounds=2, model="m", against=["llama.cpp"])
    assert order == ["kvpool", "llama.cpp", "kvpool"]
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines()[3:-1]}
    assert rows["prefill 512 tok/s"] == ["30.0", "nan", "nanx"]
    assert rows["decode batch 1 tok/s"] == ["20.0", "nan", "nanx"]
    err = capsys.readouterr().err
    assert "llama.cpp gave no figures (llama-bench died of SIGSEGV on m.gguf" in err
    from kvpool.model.cpu import cpu_features

    assert ("This CPU has AMX" in err) == cpu_features().amx
    monkeypatch.setattr(model, "_amx_hint", lambda: "")
    order.clear()
    model.run(rounds=1, model="m", against=["llama.cpp"])
    assert "left empty (nan)\n" in capsys.readouterr().err  # no AMX: no advice about it


_FAKE_SERVER = """#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
answers = []


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # loading (503) for its first two polls, then ready
        answers.append(self.path)
        self.send_response(503 if len(answers) <= 2 else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_llama_cpps_load_time_is_its_servers_start_to_ready(tmp_path):
    """llama.cpp's load figure: ``llama-server`` from its start to its first healthy
    answer (a stand-in server here, loading for two polls), beside its peak memory."""
    import sys

    from kvpool.bench import llama_cpp

    fake = tmp_path / "llama-server"
    fake.write_text(_FAKE_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1024)
    figures = llama_cpp.serve(tmp_path, gguf, 2, (), {}, 16, 640)
    assert set(figures) == {"load_s", "peak_rss_mib"}
    assert figures["load_s"] >= 0.4  # two polls answered 503, 0.2 s apart
