"""The capacity simulator: hand-computed cases, strategy properties, inputs and outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.sim import (
    ConstantCost,
    SimConfig,
    Strategy,
    SyntheticSpec,
    Workload,
    generate,
    kv_budget,
    load_trace,
    model_from_gguf,
    model_from_hf_config,
    resolve_model,
    simulate,
    write_trace,
)
from kvpool.sim.workload import USER, LengthDist, Request


def two_requests(output_b: int, context: int = 16) -> Workload:
    return Workload(
        "hand",
        [
            Request(0, 0.0, ((USER, 0, 5),), 4 if output_b == 2 else 6),
            Request(1, 0.0, ((USER, 1, 3),), output_b),
        ],
        context,
    )


def run(workload: Workload, strategy: Strategy, kv_bytes: int, **kw) -> object:
    cfg = SimConfig(strategy, kv_bytes=kv_bytes, kv_bytes_per_token=1, block_size=4, **kw)
    return simulate(workload, cfg, ConstantCost(1.0))


def test_hand_computed_paged_case():
    # bs 4, 4 blocks. A: 5 prompt + 4 out, B: 3 prompt + 2 out, both at t=0.
    # step 0 prefills both (A 2 blocks, B 1); B finishes after step 1, A after step 3.
    r = run(two_requests(2), Strategy.PAGED, kv_bytes=16)
    assert (r.completed, r.preemptions, r.max_concurrent, r.steps) == (2, 0, 2, 4)
    assert r.makespan == 4.0
    assert r.output_tokens_per_s == 6 / 4
    assert r.ttft_p50 == 1.0 and r.queue_delay_mean == 0.0
    # slots holding tokens / reserved, per step: 8/12, 10/12, 7/8, 8/8
    assert r.kv_utilization == pytest.approx(33 / 40)
    assert r.waste_internal == pytest.approx(7 / 40)


def test_hand_computed_static_case():
    # context 16, 16 token slots: one slot; B waits for A (4 steps), then runs 2 steps.
    r = run(two_requests(2), Strategy.STATIC, kv_bytes=16)
    assert (r.num_blocks, r.max_concurrent, r.completed, r.makespan) == (1, 1, 2, 6.0)
    assert r.queue_delay_p99 == 4.0
    assert r.waste_over_reservation == pytest.approx(1 - r.kv_utilization)


def test_hand_computed_preemption_case():
    # 3 blocks. A: 5 + 6 out, B: 3 + 6 out. At step 2, B (the latest admitted) needs its
    # second block, none is free: B is preempted with 2 tokens generated, waits for A
    # (done after step 5), is re-prefilled with 5 tokens at step 6 and finishes after step 9.
    r = run(two_requests(6), Strategy.PAGED, kv_bytes=12)
    assert (r.preemptions, r.completed, r.makespan) == (1, 2, 10.0)
    assert r.prompt_tokens_computed == 5 + 3 + 5


def seeded(**kw) -> Workload:
    base = dict(
        num_requests=120,
        rate=4.0,
        context_length=1024,
        prompt_len=LengthDist.parse("50-400"),
        output_len=LengthDist.parse("20-300"),
    )
    base.update(kw)
    return generate(SyntheticSpec(**base))


def test_no_shared_prefix_gives_equal_paged_results():
    w = seeded()
    kv = 400 * 1024  # ample: nothing is preempted
    paged = run(w, Strategy.PAGED, kv).as_dict()
    prefix = run(w, Strategy.PAGED_PREFIX, kv).as_dict()
    assert paged["preemptions"] == prefix["preemptions"] == 0
    assert prefix["prefix_hit_rate"] == 0.0 and prefix["sharing_saved_fraction"] == 0.0
    for key in (
        "max_concurrent",
        "mean_concurrent",
        "kv_utilization",
        "makespan",
        "steps",
        "queue_delay_mean",
        "ttft_p99",
        "completed",
    ):
        assert paged[key] == prefix[key], key


def test_static_never_exceeds_its_slots():
    w = seeded(rate=0.0)
    r = run(w, Strategy.STATIC, kv_bytes=5 * 1024 + 100)
    assert r.num_blocks == 5
    assert r.max_concurrent == 5 and max(r.series.running) <= 5
    assert r.completed == len(w.requests)


def test_paged_reserves_within_one_block_per_sequence_of_live_tokens():
    w = seeded(rate=8.0)
    cfg = SimConfig(
        Strategy.PAGED, kv_bytes=3000, kv_bytes_per_token=1, block_size=16, max_series_points=10**9
    )
    r = simulate(w, cfg, ConstantCost(1.0))
    assert r.preemptions > 0  # the bound must hold under pressure too
    s = r.series
    for running, reserved, live in zip(s.running, s.reserved_bytes, s.logical_bytes, strict=True):
        assert 0 <= reserved - live < 16 * running
    assert len(s.t) > 100  # sampled at every event and at the end of every quiet run


def test_shared_prefix_raises_capacity_and_hit_rate():
    w = seeded(system_prompt_len=300, rate=0.0, num_requests=64)
    paged = run(w, Strategy.PAGED, kv_bytes=8000)
    prefix = run(w, Strategy.PAGED_PREFIX, kv_bytes=8000)
    assert prefix.max_concurrent > paged.max_concurrent
    assert prefix.prefix_hit_rate > 0.4 and prefix.sharing_saved_fraction > 0.2
    assert prefix.prompt_tokens_computed < paged.prompt_tokens_computed


def test_pinned_prefix_is_kept_under_pressure():
    w = seeded(system_prompt_len=256, rate=2.0, num_requests=80)
    pinned = run(w, Strategy.PAGED_PREFIX, kv_bytes=6000, pin_prefixes=True)
    assert pinned.completed == 80
    assert pinned.prompt_tokens_cached >= 256 * 79


def test_request_that_cannot_fit_alone_is_rejected():
    w = Workload(
        "big", [Request(0, 0.0, ((USER, 0, 100),), 50), Request(1, 0.0, ((USER, 1, 10),), 5)], 4096
    )
    r = run(w, Strategy.PAGED, kv_bytes=64)
    assert (r.rejected, r.completed) == (1, 1)


def test_multi_turn_chat_reuses_history():
    w = seeded(system_prompt_len=100, turns=(3, 5), think_time=2.0, num_requests=60, rate=1.0)
    assert any(r.follows >= 0 for r in w.requests)
    r = run(w, Strategy.PAGED_PREFIX, kv_bytes=200_000)
    assert r.completed == 60 and r.prefix_hit_rate > 0.5


# -- models, budgets, traces ---------------------------------------------------------------------
def test_presets_and_budget():
    m = resolve_model("llama-2-13b")
    assert m.geometry(2).bytes_per_token == 819_200
    b = kv_budget(m, device="16GB", weight_format="q4")
    assert b.kv_bytes == 16 * 2**30 - m.weight_bytes("q4") - 2**30
    with pytest.raises(ValueError, match="does not fit"):
        kv_budget(m, device="16GB", weight_format="fp16")
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("gpt-5")


def test_model_from_hf_config(tmp_path: Path):
    cfg = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_from_hf_config(tmp_path / "config.json")
    assert m.geometry(2).bytes_per_token == 131_072
    assert abs(m.num_parameters - 8_030_261_248) / 8e9 < 0.01  # Llama-3.1-8B
    assert m.active_parameters == m.num_parameters and m.expert_share == 0.0


def test_a_mixture_of_experts_costs_its_active_parameters(tmp_path: Path):
    """Qwen3-30B-A3B's published config: 30.5 B parameters, ~3.3 B a token (its name's A3B);
    a step reads the shared weights and only the experts its tokens touch, so one token
    costs a fraction of a dense model's read, and a large batch nearly all of it."""
    from kvpool.sim import RooflineCost, StepCost
    from kvpool.sim.presets import DEVICE_PRESETS, MODEL_PRESETS

    cfg = {
        "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_from_hf_config(tmp_path / "config.json")
    preset = MODEL_PRESETS["qwen3-30b-a3b"]
    assert m.num_parameters == preset.num_parameters - 48 * 2 * 128  # (no Q/K norms counted)
    assert (m.experts, m.experts_used, m.expert_parameters) == (128, 8, preset.expert_parameters)
    assert 3.2e9 < preset.active_parameters < 3.4e9
    device = DEVICE_PRESETS["24GB"]
    weights = preset.weight_bytes("q4")
    moe = RooflineCost(device, weights, preset.active_parameters, 0,
                       expert_share=preset.expert_share, expert_pick=8 / 128)  # fmt: skip
    dense = RooflineCost(device, weights, preset.num_parameters, 0)
    assert moe.weights_read(1) < 0.2 * weights and moe.weights_read(256) > 0.99 * weights
    one, many = (StepCost(n, 0, 0) for n in (1, 64))
    assert moe.step_time(one) < 0.2 * dense.step_time(one)
    assert moe.step_time(many) < dense.step_time(many)


def test_trace_round_trip(tmp_path: Path):
    w = seeded(system_prompt_len=64, num_requests=30)
    path = tmp_path / "t.jsonl"
    write_trace(w, path)
    back = load_trace(path, 1024)
    assert [r.prompt_tokens() for r in back.requests] == [r.prompt_tokens() for r in w.requests]
    assert [r.output_len for r in back.requests] == [r.output_len for r in w.requests]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_trace(bad, 1024)


def test_cli_json_has_one_object_per_strategy(capsys):
    assert (
        main(
            [
                "simulate",
                "--model",
                "smollm2-135m",
                "--kv-memory",
                "64MiB",
                "--workload",
                "templated",
                "--requests",
                "40",
                "--json",
                "--quiet",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["strategy"] for r in rows] == ["static", "paged", "paged+prefix"]
    for row in rows:
        for key in (
            "block_size",
            "max_concurrent",
            "kv_utilization",
            "prefix_hit_rate",
            "preemptions",
            "rejected",
        ):
            assert key in row


def test_cli_plots(tmp_path: Path):
    assert (
        main(
            [
                "simulate",
                "--requests",
                "30",
                "--plot",
                str(tmp_path),
                "--block-sizes",
                "32",
                "64",
                "--quiet",
            ]
        )
        == 0
    )
    for name in ("occupancy.png", "block_sizes.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_cli_bad_input_is_a_clear_error(capsys):
    assert main(["simulate", "--model", "nope", "--quiet"]) == 2
    assert "unknown model" in capsys.readouterr().err


def _replay_of(page: str) -> dict:
    start = page.index("window.KVPOOL_REPLAY = ") + len("window.KVPOOL_REPLAY = ")
    return json.loads(page[start : page.index(";</script>", start)].replace("<\\/", "</"))


def test_cli_html_writes_the_live_view_of_the_replay(tmp_path: Path, capsys):
    import base64

    from kvpool.cache.block_map import count_states

    out = tmp_path / "view.html"
    args = ["simulate", "--requests", "60", "--html", str(out), "--quiet", "--json"]
    assert main(args) == 0
    rows = {r["strategy"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    page = out.read_text()
    assert "http://" not in page.replace("http://www.w3.org", "")  # self-contained
    replay = _replay_of(page)
    blocks = replay["base"]["capacity"]["total_blocks"]
    assert blocks == rows["paged+prefix"]["num_blocks"]
    frames = replay["frames"]
    assert 2 <= len(frames) < 400 and len(replay["history"]) == len(frames)
    times = [f["t"] for f in frames]
    assert times == sorted(times)
    for frame in frames:
        states = base64.b64decode(frame["map"])
        assert len(states) == blocks and count_states(states) == frame["counts"]
        used = {b for r in frame["requests"] for b in r["blocks"]}
        assert all(states[b] & 0x3F or states[b] & 0x40 for b in used)  # held blocks
    assert any(f["counts"]["shared"] for f in frames)  # the seed's shared system prompts
    assert frames[-1]["pool"]["prefix_hit_tokens"] == rows["paged+prefix"]["prompt_tokens_cached"]


def test_model_from_gguf_reads_a_mixture_of_experts(tmp_path: Path):
    pytest.importorskip("gguf")
    from tests.synthetic_gguf import EXPERT_INTER, EXPERTS, HIDDEN, LAYERS, USED, write_model

    m = model_from_gguf(write_model(tmp_path / "moe.gguf", "qwen3moe", {}))
    assert (m.experts, m.experts_used) == (EXPERTS, USED)
    assert m.expert_parameters == LAYERS * EXPERTS * 3 * EXPERT_INTER * HIDDEN
    assert m.active_parameters < m.num_parameters
