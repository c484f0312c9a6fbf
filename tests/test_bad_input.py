"""Bad input against a real ``kvpool serve``: every case gets its status with a JSON error
in the API's own shape, changes nothing (no block stays in use, nothing is queued), and
the server then answers a normal request exactly as before."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.server_process import ServerProcess  # noqa: E402

MODEL = "smollm2:135m"
G, C = "/api/generate", "/api/chat"
OC, OCC = "/v1/completions", "/v1/chat/completions"
PIN, UNPIN, RESET = "/api/kvcache/pin", "/api/kvcache/unpin", "/api/kvcache/reset"
USER = [{"role": "user", "content": "Hi"}]


def gen(**options):
    return {"model": MODEL, "prompt": "Hi", "options": options}


def comp(**fields):
    return {"model": MODEL, "prompt": "Hi", **fields}


def chat(**fields):
    return {"model": MODEL, "messages": USER, **fields}


# (path, body (bytes: sent as is), status, a word the message must contain)
CASES = [
    # Ollama /api/generate: token ids from outside
    (G, {"model": MODEL, "prompt": "hi", "context": [10**9]}, 400, "[0, 49152)"),
    (G, {"model": MODEL, "prompt": "hi", "context": [-5]}, 400, "context"),
    (G, {"model": MODEL, "prompt": "hi", "context": [2**70]}, 400, "context"),
    (G, {"model": MODEL, "prompt": "hi", "context": [1, 49152]}, 400, "position 1"),
    (G, {"model": MODEL, "prompt": "hi", "context": ["a"]}, 400, "context"),
    (G, {"model": MODEL, "prompt": "hi", "context": [1.5]}, 400, "context"),
    (G, {"model": MODEL, "prompt": "hi", "context": 7}, 400, "context"),
    # Ollama options: numbers
    (G, gen(seed=2**70), 400, "seed"),
    (G, gen(seed=-(2**63) - 1), 400, "seed"),
    (G, gen(seed=1.5), 400, "seed"),
    (G, gen(temperature=1e308), 400, "temperature"),
    (G, gen(temperature=-1), 400, "temperature"),
    (G, gen(temperature="hot"), 400, "temperature"),
    (G, gen(repeat_penalty=1e308), 400, "repetition_penalty"),
    (G, gen(repeat_penalty=0), 400, "repetition_penalty"),
    (G, gen(presence_penalty=5), 400, "presence_penalty"),
    (G, gen(frequency_penalty=-3), 400, "frequency_penalty"),
    (G, gen(num_predict=-5), 400, "num_predict"),
    (G, gen(num_predict=0), 400, "num_predict"),
    (G, gen(num_predict=1e30), 400, "num_predict"),
    (G, gen(top_k=-1), 400, "top_k"),
    (G, gen(top_k=2**40), 400, "top_k"),
    (G, gen(top_p=0), 400, "top_p"),
    (G, gen(top_p=1.5), 400, "top_p"),
    (G, gen(min_p=2), 400, "min_p"),
    (G, gen(num_ctx=0), 400, "num_ctx"),
    (G, gen(num_ctx=2**40), 400, "num_ctx"),
    (G, b'{"model": "smollm2:135m", "prompt": "x", "options": {"temperature": NaN}}', 400, ""),
    (G, b'{"model": "smollm2:135m", "prompt": "x", "options": {"top_p": Infinity}}', 400, ""),
    # Ollama options: stop strings
    (G, gen(stop=["x"] * 10_000), 400, "stop strings"),
    (G, gen(stop="x" * 1_000_000), 400, "stop strings"),
    (G, gen(stop=[1, 2]), 400, "stop"),
    # Ollama: the rest of the request
    (G, {"model": MODEL, "prompt": 42}, 400, "prompt"),
    (G, {"prompt": "x"}, 400, "model is required"),
    (G, {"model": "llama9:999b", "prompt": "x"}, 404, "not found"),
    (G, {"model": MODEL, "prompt": "x", "format": "yaml"}, 400, "format"),
    (G, {"model": MODEL, "prompt": "x", "format": {"type": "nope"}}, 400, "schema"),
    (G, {"model": MODEL, "prompt": "x", "images": ["aGk="]}, 400, "images"),
    (G, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    (G, {"model": MODEL, "prompt": "hi " * 9000, "raw": True}, 400, "context"),
    (G, b"{not json", 400, "malformed JSON"),
    (G, b"[1, 2, 3]", 400, "invalid request"),
    (G, b"x" * (2**21 + 10), 413, "limit"),
    (C, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (C, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (C, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    (C, {"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, 400, "tool"),
    (C, {"model": MODEL, "messages": USER, "options": {"seed": -(2**64)}}, 400, "seed"),
    (C, {"model": MODEL, "messages": USER, "options": {"temperature": -1}}, 400, "temperature"),
    (C, {"model": MODEL, "messages": USER, "format": {"enum": []}}, 400, "schema"),
    (C, {"model": MODEL, "messages": USER, "tools": [{"function": {"name": "a b"}}]}, 400, "name"),
    (C, {"model": MODEL, "messages": USER, "options": {"stop": ["a"] * 33}}, 400, "stop"),
    # OpenAI /v1/completions
    (OC, comp(prompt=[10**9]), 400, "[0, 49152)"),
    (OC, comp(prompt=[-1]), 400, "prompt"),
    (OC, comp(prompt=[2**70]), 400, "prompt"),
    (OC, comp(prompt=[]), 400, "empty"),
    (OC, comp(prompt=["a", "b"]), 400, "one prompt"),
    (OC, comp(prompt=5), 400, "prompt"),
    (OC, comp(seed=2**70), 400, "seed"),
    (OC, comp(seed=-(2**63) - 1), 400, "seed"),
    (OC, comp(temperature=3), 400, "temperature"),
    (OC, comp(top_p=2), 400, "top_p"),
    (OC, comp(n=100), 400, "n must"),
    (OC, comp(max_tokens=0), 400, "max_tokens"),
    (OC, comp(max_tokens=-5), 400, "max_tokens"),
    (OC, comp(max_tokens="many"), 400, "max_tokens"),
    (OC, comp(stop=["s"] * 40), 400, "stop strings"),
    (OC, comp(stop="x" * 1000), 400, "stop strings"),
    (OC, comp(presence_penalty=3), 400, "presence_penalty"),
    (OC, comp(logprobs=21), 400, "top_logprobs"),
    (OC, comp(top_k=-3), 400, "top_k"),
    (OC, comp(echo=True, max_tokens=-1), 400, "max_tokens"),
    (OC, comp(suffix="x"), 400, "suffix"),
    (OC, b'{"model": "smollm2:135m", "prompt": "x", "frequency_penalty": NaN}', 400, ""),
    # OpenAI /v1/chat/completions
    (OCC, chat(messages=[]), 400, "messages"),
    (OCC, chat(logprobs=3), 400, "logprobs must be true"),
    (OCC, chat(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    (OCC, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "text"),
    (OCC, chat(tools=[{"type": "function"}]), 400, "tool"),
    (OCC, chat(response_format={"type": "grammar"}), 400, "response_format"),
    (OCC, chat(response_format={"type": "json_schema"}), 400, "json_schema"),
    (OCC, chat(tool_choice="required"), 400, "tool_choice needs tools"),
    (OCC, chat(seed=2**64), 400, "seed"),
    (OCC, chat(max_completion_tokens=0), 400, "max_tokens"),
    (OCC, chat(temperature=-0.5), 400, "temperature"),
    (OCC, {"model": "gpt-7", "messages": USER}, 404, "not found"),
    (OCC, b"[1, 2", 400, "malformed JSON"),
    # admin routes
    (PIN, {"model": MODEL, "tokens": [10**9]}, 400, "[0, 49152)"),
    (PIN, {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    (PIN, {"model": MODEL, "tokens": [2**70, 1]}, 400, "tokens"),
    (PIN, {"model": MODEL}, 400, "exactly one"),
    (PIN, {"model": MODEL, "system": "x", "prompt": "y"}, 400, "exactly one"),
    (PIN, {"model": MODEL, "prompt": ""}, 400, "empty"),
    (PIN, {"model": MODEL, "tokens": [5] * 9000}, 400, "context"),
    (PIN, {"model": MODEL, "id": "abc"}, 400, "id"),
    (PIN, {"model": "nope", "prompt": "x"}, 404, "not found"),
    (UNPIN, {"model": MODEL, "id": "0123456789abcdef"}, 404, "no pin"),
    (UNPIN, {"model": MODEL, "prompt": "never pinned"}, 404, "no pin"),
    (RESET, {"pins": "maybe"}, 400, "pins"),
    ("/api/pull", {"model": "llama9:999b"}, 404, "not found"),
    ("/api/pull", {"model": ["smollm2:135m"]}, 400, "model"),
    ("/api/push", {"model": MODEL}, 501, "never changes"),
    ("/api/nothing", {}, 404, "Not Found"),
]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--kv-cache-memory", "64", "--max-body-bytes", str(2**21))
    yield proc
    assert proc.stop() == 0, proc.logs()


def normal_reply(server: ServerProcess) -> str:
    reply = httpx.post(
        f"{server.url}/api/generate",
        timeout=60,
        json={
            "model": MODEL,
            "prompt": "The capital of France is",
            "raw": True,
            "stream": False,
            "options": {"num_predict": 4, "temperature": 0},
        },
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["response"]


@pytest.fixture(scope="module")
def baseline(server) -> tuple[str, dict]:
    text = normal_reply(server)
    return text, server.wait_idle()


def test_the_suite_is_large_enough():
    assert len(CASES) >= 60
    assert {c[0] for c in CASES} >= {G, C, OC, OCC, PIN, UNPIN, RESET}


@pytest.mark.parametrize(
    ("path", "body", "status", "says"), CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)]
)
def test_bad_input_is_refused_clearly_and_changes_nothing(
    server, baseline, path, body, status, says
):
    text, before = baseline
    if isinstance(body, bytes):
        reply = httpx.post(f"{server.url}{path}", content=body, timeout=60)
    else:
        reply = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    if path.startswith("/v1/"):
        assert set(error) >= {"message", "type", "code"} and error["code"] == status
        message = error["message"]
    else:
        assert isinstance(error, str)
        message = error
    assert says.lower() in message.lower(), message
    assert "Traceback" not in message and "internal error" not in message
    after = server.wait_idle()
    assert after["used_blocks"] == 0 and after["waiting"] == 0
    assert after["num_sequences"] == 0
    assert after["pinned_blocks"] == before["pinned_blocks"]
    assert normal_reply(server) == text
