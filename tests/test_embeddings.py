"""Embeddings: the last token's final-normed hidden state, L2-normalized, computed through
the engine (batched with other work, cached prefixes shared), and served by Ollama's and
OpenAI's embedding routes to the real clients."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402

EMBED = SamplingParams(max_tokens=1, temperature=0.0, embedding=True)


def test_an_embedding_is_the_last_tokens_final_hidden_state(fp32_model, default_tokenizer):
    from kvpool.model.runner import ModelRunner, SeqChunk

    ids = default_tokenizer.encode("Paged memory for language models")
    (out,) = Engine(fp32_model, num_blocks=32).generate([ids], EMBED)
    assert out.token_ids == [] and out.finish_reason == "stop"
    vector = torch.tensor(out.embedding)
    assert vector.shape == (fp32_model.config.hidden_size,)
    assert abs(float(vector.norm()) - 1) < 1e-5
    runner = ModelRunner(fp32_model, 8, 16, threads=None)
    _, hidden = runner.forward([SeqChunk(ids, 0, list(range(8)))], return_hidden=True)
    want = torch.nn.functional.normalize(hidden[0].float(), dim=0)
    assert (vector - want).abs().max() < 1e-5


def test_equal_inputs_give_equal_vectors_alone_and_batched_and_share_a_prefix(
    fp32_model, default_tokenizer
):
    shared = default_tokenizer.encode("A long shared beginning about the block pool. " * 4)
    inputs = [shared + default_tokenizer.encode(f" Question {i}?") for i in range(4)]
    engine = Engine(fp32_model, num_blocks=64)
    alone = [engine.generate([x], EMBED)[0] for x in inputs]
    assert alone[1].cached_prompt_tokens >= len(shared) // 16 * 16 - 16
    engine2 = Engine(fp32_model, num_blocks=64)
    chat = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    batched = engine2.generate([*inputs, inputs[0]], [EMBED] * 4 + [chat])
    for a, b in zip(alone, batched[:4], strict=True):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-4
    assert len(batched[4].token_ids) == 4 and batched[4].embedding is None
    cos = sum(x * y for x, y in zip(alone[0].embedding, alone[1].embedding, strict=True))
    assert 0 < cos < 1 - 1e-6  # related, not equal
    stats = engine2.cache_stats()
    assert stats.used_blocks == 0


ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def _norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_ollama_and_openai_clients_get_embeddings(fp32_server, fp32_model):
    hidden = fp32_model.config.hidden_size
    texts = ["The pool keeps blocks.", "Bananas are yellow.", "The pool keeps blocks."]
    got = ollama.Client(host=fp32_server.url).embed(model="smollm2:135m", input=texts)
    vectors = got.embeddings
    assert len(vectors) == 3 and all(len(v) == hidden for v in vectors)
    assert all(abs(_norm(v) - 1) < 1e-4 for v in vectors)
    assert max(abs(a - b) for a, b in zip(vectors[0], vectors[2], strict=True)) < 1e-4
    alone = ollama.Client(host=fp32_server.url).embed(model="smollm2:135m", input=texts[1])
    assert max(abs(a - b) for a, b in zip(alone.embeddings[0], vectors[1], strict=True)) < 1e-4
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="-")
    reply = client.embeddings.create(model="smollm2:135m", input=texts)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.usage.prompt_tokens > 0
    assert max(abs(a - b) for a, b in zip(reply.data[1].embedding, vectors[1], strict=True)) < 1e-4
    short = client.embeddings.create(model="smollm2:135m", input=texts[0], dimensions=64)
    assert len(short.data[0].embedding) == 64 and abs(_norm(short.data[0].embedding) - 1) < 1e-4
    old = httpx.post(
        f"{fp32_server.url}/api/embeddings", json={"model": "smollm2:135m", "prompt": texts[0]}
    )
    assert old.status_code == 200 and len(old.json()["embedding"]) == hidden


def test_bad_embedding_requests_are_400s(fp32_server):
    for path, body in (
        ("/api/embed", {"model": "smollm2:135m", "input": []}),
        ("/api/embed", {"model": "smollm2:135m", "input": [""]}),
        ("/api/embed", {"model": "smollm2:135m", "input": ["x"] * 300}),
        ("/v1/embeddings", {"model": "smollm2:135m", "input": "x", "encoding_format": "hex"}),
        ("/v1/embeddings", {"model": "smollm2:135m", "input": "x", "dimensions": 0}),
        ("/v1/embeddings", {"model": "smollm2:135m", "input": [[1, 2, 10**9]]}),
    ):
        r = httpx.post(f"{fp32_server.url}{path}", json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert "error" in r.json()
    assert httpx.get(f"{fp32_server.url}/api/kvcache").json()["used_blocks"] == 0
