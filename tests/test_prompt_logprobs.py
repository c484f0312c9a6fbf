"""Prompt scoring: the log-probability of every prompt token (``prompt_logprobs``,
OpenAI ``echo`` with ``logprobs`` on completions), against transformers' float32
log-softmax of the same file, through chunked prefill and beside cached prefixes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.sampling import InvalidSamplingParams, SamplingParams  # noqa: E402


def _reference(reference_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(reference_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_the_reference_in_chunks_and_beside_the_cache(
    fp32_model, reference_model, default_tokenizer
):
    context = default_tokenizer.encode(
        "The planets of the solar system, in order from the Sun, are Mercury, Venus, "
        "Earth, Mars, Jupiter, Saturn, Uranus and Neptune.\n"
        "Question: which planet is known as the red planet? Answer:"
    )
    choices = [" Mars", " Venus", " Jupiter"]
    # small steps: each prompt is computed in several chunks
    engine = Engine(fp32_model, num_blocks=64, block_size=16, max_batch_tokens=24)
    plain = engine.generate([context], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.prompt_logprobs is None
    prompts = [context + default_tokenizer.encode(c, add_bos=False) for c in choices]
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    best = None
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.cached_prompt_tokens == 0  # scoring computes every position
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        ref = _reference(reference_model, prompt)
        for i in range(1, len(prompt)):
            lp = out.prompt_logprobs[i]
            assert lp.token_id == prompt[i]
            assert abs(lp.logprob - float(ref[i - 1, prompt[i]])) < 1e-3
            assert [t for t, _ in lp.top] == ref[i - 1].topk(2).indices.tolist()
        score = sum(lp.logprob for lp in out.prompt_logprobs[len(context) :])
        best = max(best or (score, prompt), (score, prompt))
    # the scored prompts' blocks serve later requests from the cache
    again = engine.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0))[0]
    assert again.cached_prompt_tokens >= 16
    assert engine.cache_stats().used_blocks == 0
    with pytest.raises(InvalidSamplingParams, match="prompt logprobs"):
        SamplingParams(prompt_logprobs=21)


openai = pytest.importorskip("openai")


def test_echo_scores_the_prompt_through_openai(fp32_server, reference_model, default_tokenizer):
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="-")
    prompt = "The capital of France is Paris"
    ids = default_tokenizer.encode(prompt)
    ref = _reference(reference_model, ids)
    # lm-eval's loglikelihood request: the prompt alone, scored
    r = client.completions.create(
        model="smollm2", prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < 1e-3
        assert len(lp.top_logprobs[i]) == 1
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    # echo and a continuation: the prompt's entries, then the new tokens'
    r = client.completions.create(
        model="smollm2", prompt=prompt, echo=True, logprobs=0, max_tokens=3, temperature=0
    )
    choice = r.choices[0]
    assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(ids) + 3
    assert choice.logprobs.text_offset[len(ids)] == len(prompt)
    # streamed: the prompt arrives first, with its logprobs
    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt=prompt,
            echo=True,
            logprobs=1,
            max_tokens=2,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(prompt)
    first = next(c for c in chunks if c.choices and c.choices[0].logprobs)
    assert first.choices[0].logprobs.token_logprobs[0] is None
