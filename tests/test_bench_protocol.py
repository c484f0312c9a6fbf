"""``kvpool bench model``'s measuring protocol (its figures are only as fair as this):
both sides warm up before anything is measured, batch 1 included, and each figure is
the statistic its docstring names."""

from __future__ import annotations

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
