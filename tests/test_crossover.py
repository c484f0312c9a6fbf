"""Where int8 products hand over to dequantized tiles (``products.calibrate``): the
largest step size at which int8 was measured faster, confirmed before a size goes to
tiles. The products here are stand-ins whose cost a scripted clock counts, so nothing
depends on this machine's speed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from kvpool.model import products
from kvpool.model.products import BF16_TILES, GROUPED, INT8, calibrate


class ScriptedProducts:
    """``quant_matmul`` whose calls advance a clock by ``cost(rows, mode, call)``, ``call``
    counting that size and kind's calls from 0 (``GROUPED`` apart: ``modes`` keeps every
    mode asked for); ``perf_counter`` reads the clock."""

    def __init__(self, cost):
        self.cost, self.now, self.calls, self.modes = cost, 0.0, {}, set()

    def perf_counter(self) -> float:
        return self.now

    def quant_matmul(self, x, raws, types, mode, variant):
        self.modes.add(mode)
        mode &= ~GROUPED
        key = (x.shape[0], mode)
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        self.now += self.cost(x.shape[0], mode, call)


def _calibrate(monkeypatch, cost) -> tuple[int | None, dict]:
    script = ScriptedProducts(cost)
    monkeypatch.setattr(products, "native_ops", lambda: script)
    monkeypatch.setattr(products, "time", script)
    linear = SimpleNamespace(raws=[], types=[], cols=64, policy=SimpleNamespace(variant=""))
    crossover = calibrate(linear, BF16_TILES)
    # int8 measured with its fastest kernels: those for many rows where the kernels have
    # them (GROUPED), as every step but a batch-invariant model's takes them
    assert script.modes == {INT8 | GROUPED, BF16_TILES}
    return crossover, script.calls


def steady(rows: int, mode: int, call: int) -> float:
    """int8 linear in the rows; tiles a fixed cost and half int8's per row: tiles win
    from 201 rows."""
    return rows * 1.0 if mode == INT8 else 100.0 + rows * 0.5


def test_the_crossover_is_the_last_size_int8_wins(monkeypatch):
    crossover, calls = _calibrate(monkeypatch, steady)
    assert crossover == 128  # tiles win at 256
    assert calls[(128, INT8)] == 3 and calls[(256, INT8)] == 6  # the win at 256 confirmed
    assert (512, INT8) not in calls


def test_a_busy_moment_across_int8_s_runs_does_not_hand_a_size_to_tiles(monkeypatch):
    def busy(rows, mode, call):  # int8's first three runs at 16 rows, 10x slower
        slow = rows == 16 and mode == INT8 and call < 3
        return steady(rows, mode, call) * (10 if slow else 1)

    crossover, calls = _calibrate(monkeypatch, busy)
    assert crossover == 128 and calls[(16, INT8)] == 6


def test_tiles_that_win_twice_take_the_size(monkeypatch):
    def early(rows, mode, call):  # tiles win from 16 rows, every time
        return rows * 10.0 if mode == INT8 else 100.0

    crossover, calls = _calibrate(monkeypatch, early)
    assert crossover == 8 and calls[(16, BF16_TILES)] == 6
    crossover, _ = _calibrate(monkeypatch, lambda rows, mode, call: 1.0 if mode == INT8 else 2.0)
    assert crossover is None  # int8 at every size measured
