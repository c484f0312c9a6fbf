"""The runtime on a CUDA device: every test here skips where torch sees none (CI has none;
they run where a session is lent a GPU).

On a GPU the 4-bit matrices stay 4-bit in torch's int4 kernels in bf16, the others are
dequantized to the compute dtype at load (kvpool's quantized products are CPU kernels),
and attention is the torch path. These tests hold that path to the CPU's
references: transformers on the same files (float32, TF32 off), bfloat16 near float32,
the engine's batching, prefix hits, preemption, copy-on-write and its host-memory KV tier
changing no output and leaking no block, and ``kvpool serve`` answering over HTTP with
its pool on the GPU.
"""

from __future__ import annotations

import gc
import random
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.model.gguf_weights import load_gguf_weights  # noqa: E402
from kvpool.model.llama import Linear, LlamaModel  # noqa: E402
from tests.synthetic_gguf import VOCAB, write_model  # noqa: E402
from tests.test_engine import GREEDY, alone, assert_pool_empty  # noqa: E402
from tests.test_synthetic_models import INT8_LOGIT_BOUND, MIXES, _logits, _reference  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _full_float32():
    """float32 products in float32 (no TF32): the comparisons with the CPU reference."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _cuda_model(path: Path, dtype: torch.dtype = torch.float32) -> LlamaModel:
    config, weights = load_gguf_weights(path, dtype, quantized=False)
    return LlamaModel(config, weights, CUDA, dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_random_model_on_the_gpu_matches_the_reference(tmp_path: Path, arch: str, mix: str):
    """Every architecture and quant type, dequantized onto the GPU, float32: logits
    within the CPU path's bound of transformers' on the CPU; bfloat16's median row near
    float32's (the CPU serving path's bound)."""
    path = write_model(tmp_path / f"{arch}-{mix}.gguf", arch, MIXES[mix], seed=len(arch + mix))
    model = _cuda_model(path)
    assert model.device.type == "cuda" and isinstance(model.layers[0].o, Linear)
    assert model.native_decode is None  # the CPU kernels are not used on a GPU
    prompt = [(7 * i + 3) % 500 for i in range(45)]
    ours = _logits(model, prompt)
    assert ours.device.type == "cuda"
    with torch.inference_mode():
        ref = _reference(path, arch)(torch.tensor([prompt])).logits[0].float()
    assert ref.abs().max() > 1.0
    assert (ours.cpu() - ref).abs().max().item() < 1e-3
    half = _logits(_cuda_model(path, torch.bfloat16), prompt).float().cpu()
    rows = (half - ref).abs().amax(dim=-1)
    assert rows.median().item() < 0.25 * INT8_LOGIT_BOUND * ref.abs().max().item(), rows


def test_load_model_dequantizes_every_weight_onto_the_gpu(tmp_path: Path):
    """``load_model`` on a GPU machine (no flag): every weight made on the GPU as it is
    read (a Llama 3 file's ``rope_freqs`` too), the logits those of the CPU's model of
    the same file."""
    from kvpool.model.loader import load_model
    from tests.synthetic_gguf import HEADS, HIDDEN
    from tests.test_synthetic_models import _llama3_rope_factors

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    factors = _llama3_rope_factors(HIDDEN // HEADS, 10000.0, scaling)
    path = write_model(
        tmp_path / "llama3.gguf", "llama", MIXES["k-quants"], extra={"rope_freqs.weight": factors}
    )
    loaded = load_model(str(path), dtype="float32", progress=False)
    model = loaded.model
    assert model.device.type == "cuda" and model.embed.device.type == "cuda"
    layers = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in model.layers]
    assert all(p.weight.device.type == "cuda" for parts in layers for p in parts)
    prompt = [(11 * i + 5) % 500 for i in range(70)]
    config, weights = load_gguf_weights(path, quantized=False)
    on_cpu = _logits(LlamaModel(config, weights, torch.device("cpu"), torch.float32), prompt)
    assert (_logits(model, prompt).cpu() - on_cpu).abs().max().item() < 1e-3


def test_four_bit_matrices_stay_four_bit_on_the_gpu(tmp_path: Path):
    """``load_model`` on a GPU in bf16 (its default): the 4-bit matrices in torch's int4
    kernels (Ampere and later have them), the rest dense; its logits as near the CPU's
    float32 reference as the same model's with every matrix dequantized to bf16, and its
    weights on the GPU fewer bytes than those."""
    from kvpool.model.int4_products import Int4Linear, int4_unavailable
    from kvpool.model.loader import load_model
    from tests.test_int4_products import FOUR_BIT_MIX, logits

    if torch.cuda.get_device_capability(CUDA) >= (8, 0):
        assert int4_unavailable(CUDA) is None
    elif int4_unavailable(CUDA) is not None:
        pytest.skip(f"no int4 kernels on this GPU: {int4_unavailable(CUDA)}")
    path = write_model(tmp_path / "four-bit.gguf", "llama", FOUR_BIT_MIX, seed=4)
    loaded = load_model(str(path), progress=False)
    four = loaded.model
    assert four.dtype == torch.bfloat16 and isinstance(four.layers[0].gate_up, Int4Linear)
    assert four.layers[0].gate_up.packed.device.type == "cuda"
    assert "torch's int4 kernels" in loaded.compute_line()
    dense = _cuda_model(path, torch.bfloat16)
    config, weights = load_gguf_weights(path, quantized=False)
    reference = logits(LlamaModel(config, weights, torch.device("cpu"), torch.float32))
    int4_error = (logits(four) - reference).abs().max()
    bf16_error = (logits(dense) - reference).abs().max()
    assert int4_error <= 1.5 * bf16_error, (int4_error, bf16_error)
    gate_up = dense.layers[0].gate_up.weight
    assert four.layers[0].gate_up.nbytes() < 0.35 * gate_up.numel() * gate_up.element_size()


def test_device_chooses_where_a_gpu_machines_model_computes(tmp_path: Path):
    """``LLM(device=...)`` (``--device``): the CPU on a GPU machine when asked, a GPU
    by index, said in the compute line."""
    from kvpool.engine.llm import LLM

    path = write_model(tmp_path / "llama.gguf", "llama", MIXES["legacy"])
    on_cpu = LLM(str(path), device="cpu", dtype="float32", progress=False)
    assert on_cpu.loaded.model.device.type == "cpu"
    assert " on cuda" not in on_cpu.loaded.compute_line()
    # a pool of its own size: sized from the GPU, it would hold 0.9 of it for the module
    on_gpu = LLM(str(path), device="cuda:0", dtype="float32", progress=False,
                 kv_cache_memory=64 << 20)  # fmt: skip
    assert on_gpu.loaded.model.device == torch.device("cuda:0")
    assert " on cuda:0 (" in on_gpu.loaded.compute_line()
    want = on_cpu.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert on_gpu.generate([[5, 6, 7]], GREEDY)[0].token_ids == want


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory) -> LlamaModel:
    """A small random llama on the GPU, float32."""
    path = write_model(tmp_path_factory.mktemp("cuda") / "llama.gguf", "llama", MIXES["legacy"])
    return _cuda_model(path)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    system = [rng.randrange(3, VOCAB) for _ in range(40)]
    out = [system + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 30)]
    out += [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 70, 120)]
    return out


@pytest.fixture(scope="module")
def expected(gpu_model) -> list[list[int]]:
    return [alone(gpu_model, p) for p in _prompts()]


def test_a_batch_on_the_gpu_equals_each_request_alone_and_shares_its_prefix(gpu_model, expected):
    engine = Engine(gpu_model, num_blocks=256)
    results = engine.generate(_prompts(), GREEDY)
    assert [r.token_ids for r in results] == expected
    assert_pool_empty(engine)
    later = engine.generate([_prompts()[0]], GREEDY)[0]  # the system prompt's blocks
    assert later.cached_prompt_tokens == 32 and later.token_ids == expected[0]


def test_a_small_pool_on_the_gpu_preempts_and_still_matches(gpu_model, expected):
    """test_engine's preemption case (its pool of 4-token blocks, its admission) on the
    GPU: the preempted requests resume and end with the tokens they have alone."""
    engine = Engine(gpu_model, num_blocks=53, block_size=4)
    engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=1))
    never = min(set(range(3, VOCAB)) - {t for e in expected[3:] for t in e})
    results = engine.generate(_prompts()[3:], replace(GREEDY, stop_token_ids=(never,)))
    assert [r.token_ids for r in results] == expected[3:]
    preemptions = engine.snapshot().preemptions
    assert preemptions > 0 and sum(r.preemptions for r in results) == preemptions
    assert_pool_empty(engine)


def test_samples_on_the_gpu_copy_their_shared_last_block_on_write(gpu_model, expected):
    """n greedy samples of a prompt share its blocks, the partial last one too, until
    each appends: its copy is made on the GPU, and each sample equals the prompt alone."""
    prompt = _prompts()[4]  # 70 tokens: a partial last block
    engine = Engine(gpu_model, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3)
    outs = engine.generate([prompt], params)
    assert [o.token_ids for o in outs] == [expected[4]] * 3
    assert_pool_empty(engine)


def test_the_host_memory_tier_moves_gpu_blocks_out_and_back_with_the_same_tokens(gpu_model):
    rng = random.Random(5)
    docs = [[rng.randrange(3, VOCAB) for _ in range(65)] for _ in range(4)]
    engine = Engine(gpu_model, num_blocks=6, kv_offload_memory=16 << 20)
    first = [engine.generate([d], GREEDY)[0] for d in docs]
    second = [engine.generate([d], GREEDY)[0] for d in docs]
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert sum(o.cached_prompt_tokens for o in first) == 0
    assert sum(o.cached_prompt_tokens for o in second) == 4 * 64
    assert engine.tier_stats().hit_blocks == 16
    engine.close()


def test_an_engine_on_the_gpu_without_a_size_takes_what_the_model_leaves(gpu_model, expected):
    """No pool size on a GPU: the pool is what the model, its steps and the gather's
    bound leave of the share asked for (measured), and it runs as a sized one does."""
    from kvpool.model.device_memory import model_device_bytes

    total = torch.cuda.mem_get_info()[1]
    engine = Engine(gpu_model, gpu_memory_utilization=0.2)
    try:
        pool = engine.num_blocks * engine.kv_bytes_per_block
        assert engine.kv_sizing and "0.20 of it less weights" in engine.kv_sizing
        assert 0 < pool <= 0.2 * total - model_device_bytes(gpu_model)
        if total > 16 * 2**30:  # a GPU's share is more than the CPU's 512 MiB default
            assert pool > 512 * 2**20
        results = engine.generate(_prompts(), GREEDY)
        assert [r.token_ids for r in results] == expected
        assert_pool_empty(engine)
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()


def test_kvpool_serve_runs_on_the_gpu_and_answers(tmp_path: Path):
    """``kvpool serve`` on a GPU machine (no flag but a share of its memory): the model and
    its pool on the GPU (the pool sized from that share), Ollama's and OpenAI's routes
    answering, a stream ending well, no block left in use."""
    pytest.importorskip("fastapi")
    import httpx

    from kvpool.bench.local_server import LocalServer
    from kvpool.bench.synth_model import write

    path = write("smollm2-135m", "Q4_0", tmp_path / "smollm2-135m-Q4_0.gguf", progress=False)
    gc.collect()  # the server sizes its pool from what is free: none kept cached here
    torch.cuda.empty_cache()
    server = LocalServer(str(path), "--gpu-memory-utilization", "0.1")
    try:
        assert "KV pool sized from" in server.logs()
        tags = httpx.get(f"{server.url}/api/tags", timeout=30).json()["models"]
        assert tags
        chat = {"model": tags[0]["name"], "stream": False, "options": {"num_predict": 12},
                "messages": [{"role": "user", "content": "hello there"}]}  # fmt: skip
        answer = httpx.post(f"{server.url}/api/chat", json=chat, timeout=120).json()
        assert answer["done"] and answer["eval_count"] == 12
        loaded = httpx.get(f"{server.url}/api/ps", timeout=30).json()["models"]
        assert loaded[0]["size_vram"] == loaded[0]["size"] > 0  # Ollama's sign of a GPU
        body = {"model": tags[0]["name"], "stream": True, "max_tokens": 10,
                "messages": [{"role": "user", "content": "hello again"}]}  # fmt: skip
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, timeout=120
        ) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and lines[-1] == "data: [DONE]"
        stats = server.wait_idle()
        assert stats["running"] == stats["waiting"] == 0 and stats["used_blocks"] == 0
    finally:
        assert server.stop() == 0, server.logs()
