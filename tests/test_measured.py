"""What a load measured is kept for the next load of the same file on the same machine and
build (kvpool.model.measured): the next load takes every choice without measuring, makes
the same model (dtype, crossovers, single-row kernel, read-ahead) and says so in its
line; a changed file, machine setting or ``KVPOOL_MEASURED`` measures again; a store that
cannot be read or written only costs the time."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpool.model.measured import MeasuredStore, store_dir

KEY = {"file": "/m.gguf", "size": 1, "mtime_ns": 2}


@pytest.fixture
def store_env(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVPOOL_MEASURED", raising=False)
    return tmp_path / "cache" / "measured"


def test_a_kept_record_comes_back_with_its_fields(store_env: Path):
    store = MeasuredStore(KEY)
    assert store.get("dtype", {"chosen": (str,)}) is None and store.provenance() is None
    store.put("dtype", {"chosen": "bfloat16", "bfloat16": 0.01, "float32": 0.02})
    assert store.path.parent == store_env == store_dir()
    again = MeasuredStore(dict(KEY))
    got = again.get("dtype", {"chosen": (str,), "bfloat16": (float,)})
    assert got is not None and got["chosen"] == "bfloat16" and got["float32"] == 0.02
    assert again.get("dtype", {"missing": (str,)}) is None  # without a field asked for
    assert again.get("dtype", {"chosen": (float,)}) is None  # a field of another type
    assert again.get("single row: x", {}) is None  # a kind never kept
    assert again.provenance().startswith("dtype as measured at a load on ")
    assert "kept in" in again.provenance() and "KVPOOL_MEASURED=again" in again.provenance()
    # another kind beside it keeps the first
    again.put("single row: x", {"one_row": 2})
    assert MeasuredStore(KEY).get("dtype", {"chosen": (str,)}) is not None


def test_another_key_reads_nothing(store_env: Path):
    MeasuredStore(KEY).put("dtype", {"chosen": "float32"})
    for change in ({"size": 3}, {"mtime_ns": 4}, {"file": "/n.gguf"}):
        assert MeasuredStore({**KEY, **change}).get("dtype", {}) is None
    # a file at this key's name holding another key's records (a digest's collision)
    store = MeasuredStore({**KEY, "size": 5})
    other = json.loads(MeasuredStore(KEY).path.read_text())
    store.path.write_text(json.dumps(other))
    assert store.get("dtype", {}) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"key": 1, "kinds": 2}', ""])
def test_a_damaged_record_is_measured_again_and_replaced(store_env: Path, text: str):
    store = MeasuredStore(KEY)
    store_env.mkdir(parents=True)
    store.path.write_text(text)
    assert store.get("dtype", {}) is None
    store.put("dtype", {"chosen": "float32"})
    assert MeasuredStore(KEY).get("dtype", {"chosen": (str,)})["chosen"] == "float32"


def test_a_store_that_cannot_be_written_costs_nothing_but_time(tmp_path: Path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(blocker))  # its measured/ cannot be made
    store = MeasuredStore(KEY)
    store.put("dtype", {"chosen": "float32"})  # no exception
    assert store.get("dtype", {}) is None


def test_without_a_home_nothing_is_kept_and_nothing_fails(monkeypatch, tmp_path: Path):
    """No cache directory set and no home to put one in (a container's user without a
    passwd entry): every load measures, and none fails for it."""
    monkeypatch.delenv("KVPOOL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("KVPOOL_MEASURED", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert store_dir() is None
    monkeypatch.chdir(tmp_path)
    store = MeasuredStore(KEY)
    store.put("dtype", {"chosen": "float32"})
    assert store.get("dtype", {}) is None and store.provenance() is None
    assert list(tmp_path.iterdir()) == []  # (nothing written where it runs either)


def test_the_modes(store_env: Path, monkeypatch):
    MeasuredStore(KEY).put("dtype", {"chosen": "float32"})
    monkeypatch.setenv("KVPOOL_MEASURED", "again")  # measures, and replaces what is kept
    again = MeasuredStore(KEY)
    assert again.get("dtype", {}) is None
    again.put("dtype", {"chosen": "bfloat16"})
    monkeypatch.setenv("KVPOOL_MEASURED", "off")  # reads and keeps nothing
    off = MeasuredStore(KEY)
    assert off.get("dtype", {}) is None
    off.put("dtype", {"chosen": "float16"})
    monkeypatch.delenv("KVPOOL_MEASURED")
    assert MeasuredStore(KEY).get("dtype", {"chosen": (str,)})["chosen"] == "bfloat16"
    monkeypatch.setenv("KVPOOL_MEASURED", "sometimes")
    with pytest.raises(ValueError, match="KVPOOL_MEASURED"):
        MeasuredStore(KEY)


def _native():
    pytest.importorskip("torch")
    from kvpool.model.native import native_ops

    return native_ops()


def test_a_load_key_follows_the_file_and_the_machine_settings(tmp_path: Path, monkeypatch):
    if _native() is None:
        pytest.skip("the native kernels did not build: nothing is measured at load")
    from kvpool.model.measured import load_key

    path = tmp_path / "m.gguf"
    path.write_bytes(b"1234")
    key = load_key(path, "avx2", False)
    assert key == load_key(path, "avx2", False)
    assert key["file"] == str(path.resolve()) and key["size"] == 4
    assert key != load_key(path, "generic", False)  # another kernel variant
    assert key != load_key(path, "avx2", True)  # batch-invariant products
    # a cap on oneDNN's instructions, other than the one the run may have set
    before = os.environ.get("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2" if before != "AVX2" else "AVX512_CORE")
    assert key != load_key(path, "avx2", False)
    if before is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", before)
    assert key == load_key(path, "avx2", False)
    os.utime(path, ns=(1, 1))  # the file changed (as a download replacing it would)
    assert key != load_key(path, "avx2", False)


def _spy_measuring(monkeypatch) -> list[str]:
    """Counts the loader's measurings, by kind, as they run."""
    from kvpool.model import loader

    calls: list[str] = []
    for name, kind in (
        ("median_of_alternating", "steps"),
        ("_measure_crossover", "crossover"),
        ("_measure_one_row", "one row"),
    ):
        real = getattr(loader, name)

        def spy(*args, _real=real, _kind=kind, **kwargs):
            calls.append(_kind)
            return _real(*args, **kwargs)

        monkeypatch.setattr(loader, name, spy)
    return calls


def _choices(loaded) -> tuple:
    p = loaded.model.products
    return (
        loaded.model.dtype, loaded.dtype_seconds, p.int8_max_rows, p.file_int8_max_rows,
        p.file_crossover, p.tiles, p.one_row, p.one_row_ms, p.far_ahead, p.ahead_ms,
    )  # fmt: skip


def test_the_next_load_takes_what_the_first_measured(tmp_path: Path, store_env, monkeypatch):
    """The default model loaded twice (dtype=None): the second load measures nothing, and
    its model and line are the first's (the line says where its choices came from)."""
    if _native() is None:
        pytest.skip("the native kernels did not build: nothing is measured at load")
    from kvpool.model import loader

    for name in ("KVPOOL_INT8_MAX_ROWS", "KVPOOL_ONE_ROW", "KVPOOL_READ_AHEAD"):
        monkeypatch.delenv(name, raising=False)
    calls = _spy_measuring(monkeypatch)
    first = loader.load_model(None, progress=False)
    assert "steps" in calls and "crossover" in calls  # the dtype's steps, the crossover
    assert first.measured_note is None
    calls.clear()
    second = loader.load_model(None, progress=False)
    assert calls == []
    assert _choices(second) == _choices(first)
    note = second.measured_note
    assert note is not None and str(store_env) in note
    measured = first.model.products.one_row_ms or first.model.products.ahead_ms
    kinds = "dtype, crossover, single row" if measured else "dtype, crossover"  # (x86's)
    assert note.startswith(f"{kinds} as measured at a load on")
    assert second.compute_line() == f"{first.compute_line()}; {note}"
    # asked for again: measured again, and kept
    monkeypatch.setenv("KVPOOL_MEASURED", "again")
    third = loader.load_model(None, progress=False)
    assert "steps" in calls and third.measured_note is None
    # a dtype asked for: the dtype is not measured, the rest is kept per dtype
    monkeypatch.delenv("KVPOOL_MEASURED")
    loader.load_model(None, dtype="bfloat16", progress=False)
    calls.clear()
    asked = loader.load_model(None, dtype="bfloat16", progress=False)
    assert calls == [] and asked.dtype_seconds is None


def test_a_load_says_what_it_measures_and_a_kept_load_says_nothing(store_env, monkeypatch, capsys):
    """The measuring comes after the loading bar has ended (seconds on an 8B model): a
    line on stderr as each starts, saying it is kept; a load that takes them from the
    store says none; under ``KVPOOL_MEASURED=off`` the lines do not promise keeping."""
    if _native() is None:
        pytest.skip("the native kernels did not build: nothing is measured at load")
    from kvpool.model import loader

    for name in ("KVPOOL_INT8_MAX_ROWS", "KVPOOL_ONE_ROW", "KVPOOL_READ_AHEAD"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    first = loader.load_model(None, progress=True)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("measuring ")]
    kinds = ["dtype", "crossover"]
    if first.model.products.one_row_ms or first.model.products.ahead_ms:  # (x86's)
        kinds.append("single row")
    once = " (once: kept for the next load)..."
    assert lines == [f"measuring {loader.MEASURING[k]}{once}" for k in kinds]
    loader.load_model(None, progress=True)
    err = capsys.readouterr().err
    assert "measuring " not in err and "as measured at a load on" in err
    monkeypatch.setenv("KVPOOL_MEASURED", "off")
    loader.load_model(None, progress=True)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("measuring ")]
    assert lines == [f"measuring {loader.MEASURING[k]}..." for k in kinds]


def test_a_load_measures_again_what_a_damaged_record_holds(store_env, monkeypatch):
    """Records that parse but hold the wrong things (edited by hand, another version's)
    are measured again, and the load goes on."""
    if _native() is None:
        pytest.skip("the native kernels did not build: nothing is measured at load")
    from kvpool.model import loader

    for name in ("KVPOOL_INT8_MAX_ROWS", "KVPOOL_ONE_ROW", "KVPOOL_READ_AHEAD"):
        monkeypatch.delenv(name, raising=False)
    first = loader.load_model(None, progress=False)
    (path,) = store_env.glob("*.json")
    data = json.loads(path.read_text())
    for record in data["kinds"].values():
        for name in record:
            if name != "measured_at":
                record[name] = "wide"  # every figure and choice of a type it never has
    path.write_text(json.dumps(data))
    calls = _spy_measuring(monkeypatch)
    again = loader.load_model(None, progress=False)
    assert "steps" in calls and "crossover" in calls and again.measured_note is None
    assert first.measured_note is None and again.dtype_seconds is not None


def test_forced_choices_are_neither_taken_nor_kept(tmp_path: Path, store_env, monkeypatch):
    """``KVPOOL_ONE_ROW`` / ``KVPOOL_READ_AHEAD`` / ``KVPOOL_INT8_MAX_ROWS`` set: the load
    takes them, keeps no record of them and takes none kept before."""
    if _native() is None:
        pytest.skip("the native kernels did not build: nothing is measured at load")
    from kvpool.model import loader

    monkeypatch.setenv("KVPOOL_INT8_MAX_ROWS", "all")
    monkeypatch.setenv("KVPOOL_READ_AHEAD", "near")
    calls = _spy_measuring(monkeypatch)
    for _ in range(2):
        loaded = loader.load_model(None, dtype="bfloat16", progress=False)
        assert "crossover" not in calls and loaded.model.products.int8_max_rows is None
        assert not loaded.model.products.far_ahead and loaded.measured_note is None
    kept = list(store_env.glob("*.json"))
    kinds = [k for f in kept for k in json.loads(f.read_text())["kinds"]]
    assert not any(k.startswith(("crossover", "single row")) for k in kinds)
    from kvpool.model.native import kernel_variant

    if kernel_variant().startswith("avx512"):  # the width is still a choice: measured twice
        assert calls.count("one row") == 2
