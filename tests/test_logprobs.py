"""Log-probabilities: the engine's (after penalties, before temperature) against
transformers' float32 log-softmax of the same file, and both APIs' shapes through the
real ``openai`` and ``ollama`` clients; vLLM's sampling extensions on the OpenAI route."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.sampling import InvalidSamplingParams, SamplingParams  # noqa: E402


def _reference_logprobs(reference_model, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of ``ids``."""
    with torch.no_grad():
        logits = reference_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_models_log_softmax_whatever_the_temperature(
    fp32_model, reference_model, default_tokenizer, temperature
):
    prompt = default_tokenizer.encode("The three primary colours are")
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logprobs=5)
    out = Engine(fp32_model, num_blocks=64).generate([prompt], params)[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    ref = _reference_logprobs(reference_model, prompt + out.token_ids)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-3
        best = row.topk(5)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert (
            max(abs(v - w) for (_, v), w in zip(lp.top, best.values.tolist(), strict=True)) < 1e-3
        )
        if temperature == 0:
            assert lp.top[0][0] == lp.token_id


def test_logprobs_come_after_penalties(fp32_model, default_tokenizer):
    prompt = default_tokenizer.encode("one one one one one")
    plain = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    penalised = SamplingParams(max_tokens=1, temperature=0, logprobs=0, repetition_penalty=2.0)
    engine = Engine(fp32_model, num_blocks=64)
    a, b = engine.generate([prompt, prompt], [plain, penalised])
    one = default_tokenizer.encode(" one")[-1]
    if a.token_ids[0] == one:  # the repeated word loses probability under the penalty
        assert b.token_ids[0] != one or b.logprobs[0].logprob < a.logprobs[0].logprob
    assert a.logprobs[0].top == () and math.isfinite(a.logprobs[0].logprob)


def test_no_logprobs_unless_asked_and_their_bound():
    assert SamplingParams().logprobs is None
    with pytest.raises(InvalidSamplingParams, match="top_logprobs"):
        SamplingParams(logprobs=21)


# -- the APIs -------------------------------------------------------------------------

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")


MESSAGES = [{"role": "user", "content": "Name a fruit."}]


def test_openai_chat_logprobs_match_the_reference(fp32_server, reference_model, default_tokenizer):
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="-")
    reply = client.chat.completions.create(
        model="smollm2:135m", messages=MESSAGES, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=5,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    prompt = default_tokenizer.encode_chat(MESSAGES)
    assert "".join(c.token for c in content).startswith(reply.choices[0].message.content)
    ref = _reference_logprobs(reference_model, prompt)[-1]  # the first token's row
    first = content[0]
    assert len(first.top_logprobs) == 5
    best = ref.topk(5)
    for entry, value in zip(first.top_logprobs, best.values.tolist(), strict=True):
        assert abs(entry.logprob - value) < 1e-3
        assert bytes(entry.bytes) == entry.token.encode()
    assert abs(first.logprob - first.top_logprobs[0].logprob) < 1e-6  # greedy: the best


def test_streamed_and_legacy_completion_logprobs(fp32_server):
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="-")
    stream = client.chat.completions.create(
        model="smollm2:135m", messages=MESSAGES, max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=2, stream=True,
    )  # fmt: skip
    entries = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for e in chunk.choices[0].logprobs.content]  # fmt: skip
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)
    done = client.completions.create(
        model="smollm2:135m", prompt="Apples are", max_tokens=4, temperature=0, logprobs=3
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == done.choices[0].text


def test_ollama_logprobs(fp32_server):
    client = ollama.Client(host=fp32_server.url)
    reply = client.chat(
        model="smollm2:135m", messages=MESSAGES, options={"num_predict": 4, "temperature": 0},
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert len(reply.logprobs) == reply.eval_count == 4
    assert all(len(e.top_logprobs) == 3 for e in reply.logprobs)
    streamed = client.generate(
        model="smollm2:135m", prompt="Name a fruit.", options={"num_predict": 4, "temperature": 0},
        logprobs=True, stream=True,
    )  # fmt: skip
    entries = [e for part in streamed if part.logprobs for e in part.logprobs]
    assert len(entries) == 4 and all(e.logprob <= 0 for e in entries)


def test_vllm_sampling_extensions_and_bad_logprob_requests(fp32_server):
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="-")
    greedy = client.chat.completions.create(
        model="smollm2:135m", messages=MESSAGES, max_tokens=8, temperature=0
    )
    top1 = client.chat.completions.create(
        model="smollm2:135m", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5,
        extra_body={"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.0},
    )  # fmt: skip
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    url = f"{fp32_server.url}/v1/chat/completions"
    for bad in (
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 2},
        {"top_k": -5},
        {"repetition_penalty": 0},
        {"min_p": "high"},
    ):
        r = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 2, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert "error" in r.json()
    r = httpx.post(f"{fp32_server.url}/api/chat", json={"messages": MESSAGES, "top_logprobs": 50})
    assert r.status_code == 400
