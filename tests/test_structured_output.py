"""Structured output: every output parses and validates, under any budget, in a batch
with free requests that it leaves untouched; bad formats are refused up front; both APIs
through the real ``ollama`` and ``openai`` clients."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from kvpool.bench.grammar import SCHEMAS as BENCH_SCHEMAS  # noqa: E402
from kvpool.engine.engine import Engine  # noqa: E402
from kvpool.engine.sampling import InvalidSamplingParams, SamplingParams  # noqa: E402
from kvpool.engine.structured import GrammarCompiler, ResponseFormat  # noqa: E402

PERSON = BENCH_SCHEMAS["person"]  # the schema `kvpool bench grammar` measures
SCHEMAS = [
    PERSON,
    {
        "type": "object",
        "properties": {
            "email": {"type": "string", "format": "email"},
            "id": {"type": "string", "format": "uuid"},
            "code": {"type": "string", "pattern": "^(ab)+c$"},
            "n": {"type": "array", "items": {"type": "integer"}, "minItems": 6},
        },
        "required": ["email", "id", "code", "n"],
    },
    {"type": "array", "items": {"type": "string", "minLength": 12}, "minItems": 2},
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "number"},
        },
        "required": ["answer", "confidence"],
    },
    {
        "anyOf": [
            {"type": "integer"},
            {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
        ]
    },
]


def _valid(text: str, schema: dict | None) -> bool:
    try:
        value = json.loads(text)
        if schema is None:
            return isinstance(value, dict)
        jsonschema.validate(value, schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    return GrammarCompiler(default_tokenizer, default_tokenizer.vocab_size)


@pytest.mark.parametrize(
    "schema", [None, *SCHEMAS], ids=["json", "person", "formats", "strings", "enum", "any_of"]
)
def test_random_walks_always_complete_within_their_budget(compiler, default_tokenizer, schema):
    """Random logits (no model) drawn through the mask and the closing: whatever the
    budget the format allows, the text is a whole, valid document."""
    fmt = ResponseFormat.json_object() if schema is None else ResponseFormat.json_schema(schema)
    least = compiler._compile(fmt).min_tokens
    compiler.check(fmt, least)
    if least > 1:
        with pytest.raises(InvalidSamplingParams, match="at least"):
            compiler.check(fmt, least - 1)
    g = torch.Generator().manual_seed(0)
    for budget in (least, least + 1, least + 9, least + 40, 300):
        for _ in range(2):
            state, out = compiler.start(fmt), []
            while len(out) < budget:
                left = budget - len(out)
                logits = torch.randn(compiler.vocab_rows, generator=g) * 4
                logits[~state.allowed(left)] = float("-inf")
                noise = torch.empty_like(logits).exponential_(generator=g)
                token = state.accept(int((logits - noise.log()).argmax()), left)
                if token in default_tokenizer.stop_ids:
                    break
                out.append(token)
                if state.complete:
                    break
            text = default_tokenizer.decode(out)
            assert state.accepting, (budget, text)
            assert _valid(text, schema), (budget, text)


def test_model_outputs_validate_and_free_rows_are_untouched(fp32_model, default_tokenizer):
    engine = Engine(fp32_model, num_blocks=256, tokenizer=default_tokenizer)
    ask = default_tokenizer.encode_chat(
        [{"role": "user", "content": "Describe a person as JSON: name, age, tags, address."}]
    )
    free_prompt = default_tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    fmt = ResponseFormat.json_schema(PERSON)
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = engine.generate([free_prompt], free)[0]
    constrained = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=m, response_format=fmt)
        for s, m in ((1, 48), (2, 64), (3, 96))
    ]
    outs = engine.generate([free_prompt, ask, ask, ask], [free, *constrained])
    assert outs[0].token_ids == alone.token_ids  # the free row shares the batch untouched
    for out, params in zip(outs[1:], constrained, strict=True):
        text = default_tokenizer.decode(out.token_ids)
        assert _valid(text, PERSON), text
        assert out.finish_reason == "stop"
        assert len(out.token_ids) <= params.max_tokens
    # n samples fork one grammar state each
    forked = engine.generate(
        [ask], SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=48, response_format=fmt)
    )
    assert len(forked) == 3
    assert all(_valid(default_tokenizer.decode(o.token_ids), PERSON) for o in forked)
    assert engine.cache_stats().used_blocks == 0


def test_a_failing_grammar_fails_its_request_only(fp32_model, default_tokenizer, monkeypatch):
    engine = Engine(fp32_model, num_blocks=128, tokenizer=default_tokenizer)
    prompt = default_tokenizer.encode("The capital of France is")
    fmt = ResponseFormat.json_object()
    from kvpool.engine import structured

    def broken(self, budget):
        raise RuntimeError("grammar fault")

    monkeypatch.setattr(structured.GrammarState, "allowed", broken)
    free = SamplingParams(temperature=0, max_tokens=8)
    clean = engine.generate([prompt], free)[0]
    outs = engine.generate(
        [prompt, prompt], [SamplingParams(max_tokens=30, response_format=fmt), free]
    )
    assert outs[0].finish_reason == "error"
    assert outs[1].token_ids == clean.token_ids
    assert engine.cache_stats().used_blocks == 0


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable"),
        ({"type": "foo"}, "invalid JSON schema"),
        ({"properties": {"x": {"pattern": "(("}}}, "invalid JSON schema"),
        ({"enum": []}, "cannot be used"),
        ([1, 2], "must be an object"),
    ],
)
def test_bad_formats_are_refused_before_anything_runs(compiler, schema, message):
    with pytest.raises(InvalidSamplingParams, match=message):
        compiler.check(ResponseFormat.json_schema(schema), 500)


# -- the APIs, through the real clients ----------------------------------------------------
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
SMALL = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
        "rivers": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["city", "population", "rivers"],
}
ASK = [{"role": "user", "content": "Give the largest city of France as JSON."}]


def test_ollama_format_schema_validates_over_20_seeds(fp32_server):
    client = ollama.Client(host=fp32_server.url)

    def one(seed: int) -> str:
        reply = client.chat(
            model="smollm2",
            messages=ASK,
            format=SMALL,
            options={"temperature": 1, "seed": seed, "num_predict": 60},
        )
        return reply.message.content

    with ThreadPoolExecutor(10) as pool:
        texts = list(pool.map(one, range(20)))
    bad = [t for t in texts if not _valid(t, SMALL)]
    assert not bad, bad
    reply = client.generate(
        model="smollm2",
        prompt="A JSON object:",
        format="json",
        options={"temperature": 1, "seed": 1, "num_predict": 40},
    )
    assert _valid(reply.response, None), reply.response


def test_openai_response_format_validates_over_20_seeds(fp32_server):
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="-")
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SMALL, "strict": True}}

    def one(seed: int) -> tuple[str, str]:
        reply = client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            response_format=fmt,
            temperature=1,
            seed=seed,
            max_tokens=60,
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(20)))
    assert not [t for t, _ in results if not _valid(t, SMALL)]
    assert {r for _, r in results} == {"stop"}
    stream = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=1,
        seed=5,
        max_tokens=40,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert _valid(text, None), text


def test_bad_formats_get_a_400_in_each_apis_shape(fp32_server):
    import httpx

    url = fp32_server.url
    unsat = {"type": "string", "minLength": 5, "maxLength": 2}
    cases = [
        ("/api/chat", {"model": "smollm2", "messages": ASK, "format": unsat}, "Unsatisfiable"),
        ("/api/chat", {"model": "smollm2", "messages": ASK, "format": 7}, "format"),
        (
            "/api/chat",
            {"model": "smollm2", "messages": ASK, "format": SMALL, "options": {"num_predict": 3}},
            "at least",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "smollm2",
                "messages": ASK,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                },
            },
            "invalid JSON schema",
        ),
        (
            "/v1/chat/completions",
            {"model": "smollm2", "messages": ASK, "response_format": {"type": "grammar"}},
            "not supported",
        ),
    ]
    for path, body, message in cases:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        text = error["message"] if path.startswith("/v1/") else error
        assert message in text, text
    r = httpx.post(
        url + "/api/chat",
        json={
            "model": "smollm2",
            "messages": ASK,
            "stream": False,
            "format": SMALL,
            "options": {"num_predict": 40, "seed": 1},
        },
        timeout=60,
    )
    assert r.status_code == 200 and _valid(r.json()["message"]["content"], SMALL)
