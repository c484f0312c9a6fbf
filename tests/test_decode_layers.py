"""``DecodeLayers`` (kvpool/model/csrc/decode_layers.h): a decode step's layers in one
native call compute what ``LlamaModel._layers`` computes, bit for bit (logits and the
K/V written), on every way the runner uses the threads; it is taken only for the steps
it covers."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvpool.cache import KVCacheManager  # noqa: E402
from kvpool.model.native import native_ops  # noqa: E402
from kvpool.model.threads import Mode  # noqa: E402
from tests.paged_runner import Chunk, PagedRunner  # noqa: E402

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="native ops not built here")


def _model(path, dtype, policy):
    from kvpool.model.gguf_weights import load_gguf_weights
    from kvpool.model.llama import LlamaModel

    config, weights = load_gguf_weights(path, dtype, quantized=True)
    return LlamaModel(config, weights, torch.device("cpu"), dtype, policy)


@pytest.fixture(scope="module")
def int8_model(default_model_file):
    """bf16 with int8 products at every step size, as ``dtype=None`` serves on the CPU."""
    from kvpool.model.products import ProductPolicy

    return _model(default_model_file, torch.bfloat16, ProductPolicy(int8_max_rows=None))


class _Counted:
    """The model's ``DecodeLayers`` with its ``run`` calls counted."""

    def __init__(self, layers):
        self.layers, self.calls = layers, 0

    def run(self, *args):
        self.calls += 1
        return self.layers.run(*args)


def _set_mode(model, mode: Mode, threads: int = 2) -> None:
    """What ``ModelRunner._run`` sets for a step in ``mode``."""
    torch.set_num_threads(threads if mode is Mode.ALL else 1)
    model.heavy_threads = threads if mode is Mode.SPLIT else 0


def _decode(model, native_layers: bool, mode: Mode, steps: int = 3, store: str = "auto"):
    """Logits of a prefill and ``steps`` decode steps of four sequences of different
    lengths (one past a block boundary, one long enough for the attention to count as
    large), and the KV store after them. ``store``: ``auto`` (the native decode
    attention), ``int8`` or ``varlen`` (every token through ``paged_attention``, as for
    a batch-invariant model)."""
    rng = random.Random(11)
    top = min(49000, model.vocab_rows)
    prompts = [[rng.randrange(3, top) for _ in range(n)] for n in (5, 16, 47, 300)]
    layers = model._native_layers()
    assert layers is not None
    counted = _Counted(layers)
    model._decode_layers = counted if native_layers else False
    threads = torch.get_num_threads()
    try:
        kv_dtype = torch.int8 if store == "int8" else None
        runner = PagedRunner(model, KVCacheManager(96, 16), threads=None, kv_dtype=kv_dtype)
        runner.runner.varlen |= store == "varlen"
        for seq, prompt in enumerate(prompts):
            runner.manager.allocate(seq, prompt)
        _set_mode(model, mode)
        logits = [runner.forward([Chunk(s, p, 0) for s, p in enumerate(prompts)])]
        assert counted.calls == 0  # a prefill step takes the loop
        for step in range(steps):
            chunks = []
            for seq, prompt in enumerate(prompts):
                token = int(logits[-1][seq].argmax())
                runner.manager.append(seq, [token])
                chunks.append(Chunk(seq, [token], len(prompt) + step))
            logits.append(runner.forward(chunks))
        assert counted.calls == (steps if native_layers else 0)
        return torch.stack(logits[1:]), runner.kv.layers
    finally:
        model._decode_layers = layers
        model.heavy_threads = 0
        torch.set_num_threads(threads)


@pytest.mark.parametrize("store", ["auto", "int8", "varlen"])
@pytest.mark.parametrize("mode", list(Mode))
def test_native_layers_equal_the_python_loop(int8_model, mode, store):
    got, got_kv = _decode(int8_model, True, mode, store=store)
    want, want_kv = _decode(int8_model, False, mode, store=store)
    assert torch.equal(got, want)
    for a, b in zip(got_kv, want_kv, strict=True):
        assert torch.equal(a, b)


def test_native_layers_with_float_products(default_model_file):
    """The float products (``exact``) and a bias on the fused QKV go through it as well
    (the default model has none: one is added here)."""
    from kvpool.model.products import ProductPolicy

    model = _model(default_model_file, torch.bfloat16, ProductPolicy(exact=True))
    gen = torch.Generator().manual_seed(3)
    cfg = model.config
    rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    for layer in model.layers:
        layer.qkv.bias = (torch.randn(rows, generator=gen) * 0.1).to(torch.bfloat16)
    got, _ = _decode(model, True, Mode.ONE, steps=2)
    want, _ = _decode(model, False, Mode.ONE, steps=2)
    assert torch.equal(got, want)


def test_native_layers_with_qk_norms(default_model_file):
    """Per-head Q/K norms (qwen3's) run in the native call as in the loop (the default
    model has none: random ones are added here), and they change what it computes."""
    from kvpool.model.products import ProductPolicy

    def decode(norms: bool, native: bool) -> torch.Tensor:
        model = _model(default_model_file, torch.bfloat16, ProductPolicy())
        gen = torch.Generator().manual_seed(5)
        for layer in model.layers if norms else []:
            for name in ("q_norm", "k_norm"):
                weight = 1 + 0.3 * torch.randn(model.config.head_dim, generator=gen)
                setattr(layer, name, weight.to(torch.bfloat16))
        return _decode(model, native, Mode.ONE, steps=2)[0]

    got = decode(True, True)
    assert torch.equal(got, decode(True, False))
    assert not torch.equal(got, decode(False, True))


@pytest.mark.parametrize("int8_max_rows", [None, 1])
@pytest.mark.parametrize("mode", list(Mode))
def test_native_layers_with_experts(tmp_path, mode, int8_max_rows):
    """A mixture of experts (qwen3moe) runs in the native call as ``_mixture`` runs it:
    routing, the experts' products (each in the mode of its own rows: with a crossover
    at one row, an expert two tokens chose takes float tiles, one a single token chose
    int8, as QuantLinear would), the weighted sum."""
    from kvpool.model.products import ProductPolicy
    from tests.synthetic_gguf import write_model
    from tests.test_synthetic_models import MIXES

    path = write_model(tmp_path / "moe.gguf", "qwen3moe", MIXES["k-quants"], seed=4)
    model = _model(path, torch.bfloat16, ProductPolicy(int8_max_rows=int8_max_rows))
    got, got_kv = _decode(model, True, mode)
    want, want_kv = _decode(model, False, mode)
    assert torch.equal(got, want)
    for a, b in zip(got_kv, want_kv, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("store", ["auto", "varlen"])
@pytest.mark.parametrize("mode", list(Mode))
def test_native_layers_with_gemma3_layers(tmp_path, mode, store):
    """Gemma 3's layers run in the native call as in the loop: local layers with their
    window (contexts past it) and rotation, the global one with its own, the sandwich
    norms, the gelu gate; and with every layer made global after its first step."""
    from kvpool.model.products import ProductPolicy
    from tests.synthetic_gguf import write_model
    from tests.test_synthetic_models import MIXES

    path = write_model(tmp_path / "gemma3.gguf", "gemma3", MIXES["k-quants"], seed=4)
    model = _model(path, torch.bfloat16, ProductPolicy())
    got, got_kv = _decode(model, True, mode, store=store)
    want, want_kv = _decode(model, False, mode, store=store)
    assert torch.equal(got, want)
    for a, b in zip(got_kv, want_kv, strict=True):
        assert torch.equal(a, b)
    # windows changed after the native call was built: built again with them
    model.windows = [0] * len(model.windows)
    global_got, _ = _decode(model, True, mode, store=store)
    global_want, _ = _decode(model, False, mode, store=store)
    assert torch.equal(global_got, global_want) and not torch.equal(global_got, got)


def test_steps_it_does_not_cover_take_the_loop(int8_model, fp32_model):
    """float32 (the reference keeps torch's norms), a model without the native ops, and
    steps whose attention is not the native decode op (prefix groups) run the loop."""
    assert fp32_model._native_layers() is None
    saved = int8_model.native_fused
    int8_model.native_fused = None
    try:
        assert int8_model._native_layers() is None
    finally:
        int8_model.native_fused = saved
    layers = int8_model._native_layers()
    assert layers is not None
    counted = _Counted(layers)
    int8_model._decode_layers = counted
    try:
        prompt = list(range(3, 40))
        runner = PagedRunner(int8_model, KVCacheManager(32, 16), threads=None,
                             min_shared_tokens=16)  # fmt: skip
        for seq in (0, 1):
            runner.manager.allocate(seq, prompt)
        runner.forward([Chunk(0, prompt, 0)])
        runner.forward([Chunk(1, prompt, 0)])
        for seq in (0, 1):
            runner.manager.append(seq, [9])
        batch = runner.build_batch([Chunk(0, [9], len(prompt)), Chunk(1, [9], len(prompt))])
        assert batch.shared_prefixes
        runner.forward([Chunk(0, [9], len(prompt)), Chunk(1, [9], len(prompt))])
        assert counted.calls == 0
    finally:
        int8_model._decode_layers = layers


def test_a_wrong_call_raises_and_leaves_one_thread(int8_model):
    """A check failing inside raises (a RuntimeError, the GIL taken back) and the
    thread count the products set is put back."""
    layers = int8_model._native_layers()
    cfg = int8_model.config
    x = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    cos = torch.ones(1, 1, cfg.head_dim, dtype=torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.long)
    tables = torch.zeros(1, 1, dtype=torch.long)
    lens = torch.ones(1, dtype=torch.long)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="one KV store layer per layer"):
            layers.run(x, cos, cos, slots, tables, lens, [], 16, 0, 2, False, "")
        kv = [torch.zeros(2 * cfg.num_kv_heads, 16, cfg.head_dim, dtype=torch.bfloat16)]
        kv = kv * cfg.num_layers
        bad_slots = torch.full((1,), 99, dtype=torch.long)  # past the store: rope's check
        with pytest.raises(RuntimeError, match="slot out of the store"):
            layers.run(x, cos, cos, bad_slots, tables, lens, kv, 16, 0, 2, False, "")
        assert torch.get_num_threads() == 1  # the products' threads put back
    finally:
        torch.set_num_threads(threads)


def test_a_step_without_the_native_ops_decides_nothing(default_model_file):
    """A model's first decode step taken while its native ops are away (as a test may
    take them) leaves the layers to be built once they are back."""
    from kvpool.model.products import ProductPolicy

    model = _model(default_model_file, torch.bfloat16, ProductPolicy(int8_max_rows=None))
    model.native_fused = None
    try:
        runner = PagedRunner(model, KVCacheManager(8, 16), threads=None)
        runner.manager.allocate(0, [5, 6, 7])
        runner.forward([Chunk(0, [5, 6, 7], 0)])
        runner.manager.append(0, [8])
        runner.forward([Chunk(0, [8], 3)])  # the loop, with torch's ops
        assert model._native_layers() is None
    finally:
        model.native_fused = ops
    assert model._native_layers() is not None
