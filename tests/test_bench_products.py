"""``kvpool bench products``: two trees' kernels in one process, each line timed for both
and their outputs compared bit for bit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool.bench import products
from kvpool.cli import main
from kvpool.model.native import kernel_variant, native_ops

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="native ops not built here")
REPO = Path(__file__).resolve().parents[1]
SMALL = ((64, 256), (32, 512))


def _rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines()[3:-1]]


def test_the_same_tree_as_base_gives_a_line_a_format_and_step_with_equal_outputs():
    table = products.compare(
        REPO, types=("Q4_0", "Q6_K"), rows=(1, 5), calls=2, shapes=SMALL, progress=False
    )
    assert f"{kernel_variant()} kernels" in table.splitlines()[0]
    rows = _rows(table)
    assert [(r[0], int(r[1])) for r in rows] == [("Q4_0", 1), ("Q4_0", 5), ("Q6_K", 1), ("Q6_K", 5)]
    for _, _, base, this, ratio, equal in rows:
        assert float(base) > 0 and float(this) > 0
        # the ratio of the unrounded times: within what the figures' rounding allows
        low = max(float(this) - 5e-4, 0) / (float(base) + 5e-4)
        high = (float(this) + 5e-4) / max(float(base) - 5e-4, 1e-9)
        assert low - 1e-3 <= float(ratio.rstrip("x")) <= high + 1e-3
        assert equal == "yes"


def test_outputs_that_differ_are_flagged(monkeypatch):
    """A base build whose products differ in one element: its lines say NO."""

    def perturbed(x, raws, types, mode, variant, float_out):
        y = ops.quant_matmul(x, raws, types, mode, variant, float_out)
        y[0, 0] += 1.0
        return y

    other = SimpleNamespace(quant_matmul=perturbed)
    monkeypatch.setattr(products, "native_module_file", lambda tree: Path("/elsewhere/x.so"))
    monkeypatch.setattr(products, "load_module", lambda path: other)
    table = products.compare(
        REPO, types=("Q4_K",), rows=(3,), calls=1, shapes=SMALL[:1], progress=False
    )
    assert _rows(table)[0][-1] == "NO"


def test_a_base_without_kvpool_sources_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no kvpool source tree"):
        products.compare(tmp_path, types=("Q4_0",), rows=(1,), calls=1, progress=False)


def test_the_command_needs_a_base(capsys):
    assert main(["bench", "products"]) == 2
    assert "--base" in capsys.readouterr().err


def test_the_command_says_what_is_wrong_with_its_base_or_formats(tmp_path, capsys):
    assert main(["bench", "products", "--base", str(tmp_path)]) == 2
    assert "no kvpool source tree" in capsys.readouterr().err
    assert main(["bench", "products", "--base", str(REPO), "--formats", "Q9_9"]) == 2
    assert "unknown formats" in capsys.readouterr().err


def test_a_base_from_before_the_grouped_bit_is_called_without_it(monkeypatch):
    """A tree older than ``GROUPED`` refuses that mode bit ("mode: ..."): its products are
    called without it, the table says so, and its outputs still compare."""
    modes = []

    def old(x, raws, types, mode, variant, float_out):
        if mode & products.GROUPED:
            raise RuntimeError("mode: 0 (integer), 1 (float) or 2 (bf16 tiles), ...")
        modes.append(mode)
        return ops.quant_matmul(x, raws, types, mode | products.GROUPED, variant, float_out)

    monkeypatch.setattr(products, "native_module_file", lambda tree: Path("/elsewhere/x.so"))
    monkeypatch.setattr(products, "load_module", lambda path: SimpleNamespace(quant_matmul=old))
    table = products.compare(
        REPO, types=("Q4_0",), rows=(2,), calls=1, shapes=SMALL[:1], progress=False
    )
    assert "before GROUPED" in table.splitlines()[1]
    assert _rows(table)[0][-1] == "yes"
    assert set(modes) == {products.MODE & ~products.GROUPED}


def test_a_base_that_fails_otherwise_is_not_taken_for_an_old_one(monkeypatch):
    def broken(*args):
        raise RuntimeError("x: rows of whole blocks")

    monkeypatch.setattr(products, "native_module_file", lambda tree: Path("/elsewhere/x.so"))
    monkeypatch.setattr(products, "load_module", lambda path: SimpleNamespace(quant_matmul=broken))
    with pytest.raises(RuntimeError, match="whole blocks"):
        products.compare(REPO, types=("Q4_0",), rows=(2,), calls=1, shapes=SMALL[:1])
