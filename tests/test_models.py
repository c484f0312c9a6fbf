"""Several models in one server: a second one loaded on demand beside the started one,
each with its own pool carved from one KV budget; keep_alive unloads it (resident memory
drops), /api/ps and /api/tags agree; the started model stays whatever keep_alive says."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")

from kvpool.server.errors import APIError  # noqa: E402
from kvpool.server.models import FOREVER, keep_alive_seconds  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.synthetic_gguf import write_model  # noqa: E402

BUDGET_MIB = 256  # two pools of 128 MiB


def test_keep_alive_values():
    assert keep_alive_seconds(None, 300) == 300
    assert keep_alive_seconds("5m", 0) == 300
    assert keep_alive_seconds("1h30m", 0) == 5400
    assert keep_alive_seconds("250ms", 0) == 0.25
    assert keep_alive_seconds(0, 300) == 0
    assert keep_alive_seconds(-1, 0) == keep_alive_seconds("-1", 0) == FOREVER
    assert keep_alive_seconds("10", 0) == 10
    for bad in ("soon", "5x", True, [1]):
        with pytest.raises(APIError, match="keep_alive"):
            keep_alive_seconds(bad, 0)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _loaded(url: str) -> list[str]:
    return [m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"]]


def _until(check, timeout: float = 60.0):
    """Poll ``check`` until it returns something true (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


@pytest.fixture(scope="module")
def two_model_server(tmp_path_factory):
    path = write_model(
        tmp_path_factory.mktemp("models") / "tiny.gguf", "llama", {"attn_q.weight": "Q8_0"}
    )
    proc = ServerProcess(
        "--max-models", "2", "--kv-cache-memory", str(BUDGET_MIB), "--keep-alive", "-1"
    )
    yield proc, path
    assert proc.stop() == 0, proc.logs()


def test_a_second_model_loads_on_demand_and_keep_alive_unloads_it(two_model_server):
    proc, path = two_model_server
    url, name = proc.url, path.stem
    if not Path(f"/proc/{proc.proc.pid}/status").exists():
        pytest.skip("no /proc to read resident memory from")
    assert _loaded(url) == ["smollm2:135m"]
    # the tiny model, by its path, through the OpenAI route (token ids: its vocabulary is
    # synthetic); the default model answers beside it
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"model": str(path), "prompt": [5, 6, 7], "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"] or []) == 0
    client = ollama.Client(host=url)
    assert client.generate(model="smollm2", prompt="Hi", options={"num_predict": 2}).done
    ps = httpx.get(f"{url}/api/ps").json()["models"]
    assert [m["name"] for m in ps] == ["smollm2:135m", name]
    pools = [m["kv_cache"]["bytes"] for m in ps]
    half = BUDGET_MIB * 2**20 // 2  # one budget, carved in two (whole blocks each)
    assert all(0.95 * half <= b <= half for b in pools), pools
    assert {m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]} == {
        "smollm2:135m",
        name,
    }
    # keep_alive 0 with nothing to generate: Ollama's unload
    reply = client.generate(model=str(path), prompt="", keep_alive=0)
    assert reply.done_reason == "unload"
    _until(lambda: _loaded(url) == ["smollm2:135m"])
    # a keep_alive duration: gone once it has passed (polled), listed until then
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": str(path), "prompt": [5], "max_tokens": 1},
        timeout=120,
    )
    assert r.status_code == 200
    client.generate(model=str(path), prompt="", keep_alive="1s")
    entry = next(m for m in httpx.get(f"{url}/api/ps").json()["models"] if m["name"] == name)
    assert entry["expires_at"] < "2100"
    _until(lambda: _loaded(url) == ["smollm2:135m"])
    # the started model stays whatever keep_alive says
    assert client.generate(model="smollm2", prompt="", keep_alive=0).done_reason == "load"
    assert _loaded(url) == ["smollm2:135m"]


def test_an_unload_gives_the_memory_back(two_model_server, default_model_file, tmp_path):
    """A second copy of the built-in model (weights of ~100 MB, resident once loaded):
    resident memory grows when it loads and drops when keep_alive 0 unloads it."""
    proc, _ = two_model_server
    if not Path(f"/proc/{proc.proc.pid}/status").exists():
        pytest.skip("no /proc to read resident memory from")
    copy = tmp_path / "second-copy.gguf"
    copy.write_bytes(default_model_file.read_bytes())
    size_mib = copy.stat().st_size / 2**20
    client = ollama.Client(host=proc.url)
    before = _rss_mib(proc.proc.pid)
    reply = client.generate(model=str(copy), prompt="Hello", options={"num_predict": 4})
    assert reply.done and _loaded(proc.url) == ["smollm2:135m", "second-copy"]
    loaded = _rss_mib(proc.proc.pid)
    assert loaded - before > 0.5 * size_mib, (before, loaded)
    assert client.generate(model=str(copy), prompt="", keep_alive=0).done_reason == "unload"
    _until(lambda: _loaded(proc.url) == ["smollm2:135m"])
    # the memory returns once the unloaded engine's thread has ended and its objects are
    # freed, a moment after the listing changed (seen late once in CI): poll for it
    with contextlib.suppress(AssertionError):  # the assertion below says what it saw
        _until(lambda: loaded - _rss_mib(proc.proc.pid) > 0.5 * size_mib, timeout=30)
    after = _rss_mib(proc.proc.pid)
    assert loaded - after > 0.5 * size_mib, (before, loaded, after)


def test_bad_model_names_and_keep_alive(two_model_server):
    proc, _ = two_model_server
    r = httpx.post(f"{proc.url}/api/generate", json={"model": "nope:1b", "prompt": "x"})
    assert r.status_code == 404 and "not found" in r.json()["error"], r.text
    r = httpx.post(
        f"{proc.url}/api/generate", json={"model": "smollm2", "prompt": "x", "keep_alive": "soon"}
    )
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    assert _loaded(proc.url) == ["smollm2:135m"]


def test_a_damaged_model_file_is_a_400_and_the_server_goes_on(two_model_server, tmp_path):
    """A file cut short (a partial download) or one whose tensor directory disagrees
    with its metadata, asked for by path: a 400 in Ollama's shape saying what is wrong,
    nothing loaded, and the served model answers as before."""
    proc, path = two_model_server
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    r = httpx.post(f"{proc.url}/api/generate", json={"model": str(cut), "prompt": "x"})
    assert r.status_code == 400, r.text
    assert "cannot be loaded" in r.json()["error"] and "a partial download?" in r.json()["error"]
    name = b"blk.0.ffn_norm.weight"
    damaged = tmp_path / "renamed.gguf"
    damaged.write_bytes(data.replace(name, name[:-1] + b"X", 1))
    r = httpx.post(f"{proc.url}/api/generate", json={"model": str(damaged), "prompt": "x"})
    assert r.status_code == 400 and "no tensor 'blk.0.ffn_norm.weight'" in r.json()["error"]
    assert _loaded(proc.url) == ["smollm2:135m"]
    r = httpx.post(
        f"{proc.url}/api/generate",
        json={"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
    )
    assert r.status_code == 200 and r.json()["done"], r.text


def test_pull_answers_for_what_the_server_can_serve_and_loads_nothing(two_model_server):
    """``ollama.pull`` (which the ``ollama`` CLI's ``run`` and many scripts call before
    a model's first use): ``success`` for the started model and for a file the server
    would load on demand, without loading it; a 404 that says where kvpool looks for a
    name it cannot resolve; the routes that change the model store answer 501 in
    Ollama's shape. Nothing loads, nothing changes."""
    proc, path = two_model_server
    client = ollama.Client(host=proc.url)
    assert _loaded(proc.url) == ["smollm2:135m"]
    assert client.pull("smollm2:135m").status == "success"
    assert [p.status for p in client.pull("smollm2", stream=True)] == ["success"]
    assert client.pull(str(path)).status == "success"  # loadable: found, not loaded
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("nope:1b")
    assert missing.value.status_code == 404
    assert "Ollama store" in missing.value.error and "never downloads" in missing.value.error
    r = httpx.post(f"{proc.url}/api/pull", json={})
    assert r.status_code == 400 and r.json() == {"error": "model is required"}
    for call in (
        lambda: client.delete("smollm2:135m"),
        lambda: client.copy("smollm2:135m", "other"),
        lambda: client.push("smollm2:135m"),
        lambda: client.create(model="other", from_="smollm2:135m"),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 501 and "never changes" in refused.value.error
    assert _loaded(proc.url) == ["smollm2:135m"]


def test_a_name_of_no_model_is_a_404_while_every_slot_is_busy(tmp_path, monkeypatch):
    """A request naming no model, on a server whose slots are all busy (the started
    model and one loaded on demand still answering): 404, not 'try again' (503), and
    nothing unloaded or loaded for it."""
    import asyncio

    from kvpool.server.models import ModelRegistry

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))  # an empty Ollama store

    class Served:
        unloading, active, keep_alive, expires_at, last_used = False, 1, FOREVER, FOREVER, 0.0

        def __init__(self, name):
            self.name = name

        def matches(self, requested):
            return requested == self.name

    loads = []
    registry = ModelRegistry(Served("a"), lambda name, kv: loads.append(name), max_models=2)
    registry.extras.append(Served("b"))  # busy: a request is running on it
    with pytest.raises(APIError, match="nope") as refused:
        asyncio.run(registry.resolve("nope:1b"))
    assert refused.value.status == 404 and not loads
    assert [m.name for m in registry.loaded()] == ["a", "b"]


def test_pull_on_a_one_model_server_names_the_flag(default_model_file):
    """A server of one model cannot load another: pull says how to allow it."""
    from kvpool.server.models import ModelRegistry

    class Primary:
        name = "smollm2:135m"
        unloading = False

        def matches(self, requested):
            return requested.startswith("smollm2")

    registry = ModelRegistry(Primary(), None)  # type: ignore[arg-type]
    assert registry.check("smollm2") is registry.primary
    with pytest.raises(APIError, match="--max-models") as refused:
        registry.check(str(default_model_file))  # a file it finds, but one model only
    assert refused.value.status == 404
    with pytest.raises(APIError, match="model is required"):
        registry.check("")
