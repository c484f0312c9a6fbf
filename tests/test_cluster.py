"""``kvpool cluster``: two engine replicas on a local Ray Serve, through the real ``openai``
client, against the router's promises (issue: beyond one machine).

- kvpool's router sends each system prompt's requests where it is cached: at least 90%
  of prompt tokens after each prompt's first request come from cache; Ray Serve's
  default router (power of two choices), on the same workload, caches less.
- The router's index equals the replicas' own block sets after a run that evicts.
- Pins reach every replica; the cluster's /api/kvcache adds the replicas up.
- A Responses conversation continues on the replica that stored it; Anthropic's Messages
  requests are routed to their cached prefix as chat's are.
- A replica killed mid-run: its requests end cleanly (an error, never a hang), later
  requests succeed, and Ray Serve brings a replica back.

Small pools (1 thread and a few hundred blocks a replica) keep it to a couple of minutes
on two cores.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'kvpool[cluster]'")
openai = pytest.importorskip("openai")

from kvpool.bench.local_server import LocalServer  # noqa: E402

MODEL = "smollm2:135m"
VOCABULARY = (
    "policy billing refund account invoice shipping warranty return exchange order status "
    "delivery address payment method card bank transfer discount coupon loyalty points "
    "subscription renewal cancel upgrade downgrade support ticket escalation manager hours"
)
WORDS = VOCABULARY.split()


def system_prompt(k: int, words: int = 400) -> str:
    """A long, distinct system prompt (a few hundred tokens: many full blocks)."""
    body = " ".join(WORDS[(k * 7 + i * (k + 3)) % len(WORDS)] for i in range(words))
    return f"You are support assistant number {k} of the company. Rules: {body}."


def start(router: str) -> LocalServer:
    return LocalServer(
        "--dtype", "float32", "--replicas", "2", "--threads", "1", "--router", router,
        "--kv-cache-memory", "80", "--max-running", "8",
        command="cluster", timeout=300,
    )  # fmt: skip


def cluster_view(server: LocalServer, **params: str) -> dict:
    return httpx.get(f"{server.url}/api/cluster", params=params, timeout=60).json()


def wait_replicas(server: LocalServer, n: int, timeout: float = 180) -> dict:
    """Poll until the router sees ``n`` replicas."""
    deadline = time.monotonic() + timeout
    while True:
        view = cluster_view(server)
        if len(view["replicas"]) == n or time.monotonic() > deadline:
            return view
        time.sleep(0.2)


def ask(client, prompt: int, question: str, max_tokens: int = 2):
    return client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": system_prompt(prompt)},
            {"role": "user", "content": question},
        ],
        max_tokens=max_tokens,
        temperature=0,
    )


def shared_prompt_run(server: LocalServer, prompts: int = 4, per_prompt: int = 16) -> float:
    """Each prompt's first request alone, then the rest of all prompts at once (8 in
    flight); the share of the later requests' prompt tokens that came from cache."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)
    for p in range(prompts):
        ask(client, p, "Hello?")
    later = [(p, f"Question {q}?") for q in range(1, per_prompt) for p in range(prompts)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda pq: ask(client, *pq), later))
    cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    total = sum(r.usage.prompt_tokens for r in replies)
    return cached / total


@pytest.fixture(scope="module")
def cluster():
    server = start("kvpool")
    try:
        wait_replicas(server, 2)
        yield server
    finally:
        server.stop()


HIT_RATES: dict[str, float] = {}  # router -> share of later prompt tokens from cache


def test_kvpool_router_serves_each_prompt_from_cache(cluster):
    hit = HIT_RATES["kvpool"] = shared_prompt_run(cluster)
    assert hit >= 0.9, f"only {hit:.1%} of later prompt tokens came from cache"
    view = cluster_view(cluster)
    assert view["routed_by_prefix"] >= 4 * 15
    # both replicas served: the prompts were spread, not all sent to one
    usage = httpx.get(f"{cluster.url}/api/kvcache", timeout=60).json()
    assert all(r["prefix_query_tokens"] > 0 for r in usage["replicas"].values())
    replicas = usage["replicas"].values()
    assert usage["prefix_hit_tokens"] == sum(r["prefix_hit_tokens"] for r in replicas)
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=60).text
    for name in view["replicas"]:  # every replica's series, labelled, and the router's
        assert f'replica="{name}"' in metrics
    assert 'kvpool_cluster_routed_total{by="prefix"}' in metrics


def test_index_equals_replicas_blocks_after_evictions(cluster):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 16 more long prompts: evictions
        list(pool.map(lambda p: ask(client, 100 + p, "Hi"), range(16)))
    usage = httpx.get(f"{cluster.url}/api/kvcache", timeout=60).json()
    assert usage["evictions"] > 0
    deadline = time.monotonic() + 30
    while True:  # the router's copy follows the events within milliseconds: poll
        truth = httpx.get(f"{cluster.url}/api/kvcache?blocks=true", timeout=60).json()
        index = cluster_view(cluster, blocks="true")
        want = {n: set(r["block_hashes"]) for n, r in truth["replicas"].items()}
        got = {n: set(r["block_hashes"]) for n, r in index["replicas"].items()}
        if want == got or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert want == got
    assert all(want.values())


def test_pins_reach_every_replica(cluster):
    body = {"model": MODEL, "system": system_prompt(7)}
    reply = httpx.post(f"{cluster.url}/api/kvcache/pin", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    per_replica = reply.json()["replicas"]
    assert len(per_replica) == 2
    assert all(r["pinned_tokens"] > 0 for r in per_replica.values()), per_replica
    view = cluster_view(cluster)
    deadline = time.monotonic() + 30
    while not all(r["pinned_blocks"] > 0 for r in view["replicas"].values()):
        assert time.monotonic() < deadline, view
        time.sleep(0.1)
        view = cluster_view(cluster)
    # The live view through the ingress: one named replica's pool, its pin on the map.
    page = httpx.get(f"{cluster.url}/dashboard", timeout=60)
    assert page.status_code == 200 and 'id="blockmap"' in page.text
    for name in per_replica:
        data = httpx.get(f"{cluster.url}/api/dashboard", params={"replica": name}, timeout=60)
        assert data.status_code == 200, data.text
        assert any(p["tokens"] > 0 for p in data.json()["pins"])


def test_a_responses_conversation_continues_on_the_replica_that_stored_it(cluster):
    """Stored responses live on the replica that made them; a continuation
    (``previous_response_id``) and a retrieval reach that replica (without it, about half
    of them would reach the other one and get a 404)."""
    live = set(wait_replicas(cluster, 2)["replicas"])
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120)
    holders = set()

    def first(k: int):
        return client.responses.create(
            model=MODEL, input=f"{system_prompt(k, 200)} Hello.", max_output_tokens=8
        )

    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # at once: spread by load
        firsts = list(pool.map(first, range(6)))
    for reply in firsts:
        for turn in range(3):
            holder = reply.id.split("_")[1]
            assert holder in live, reply.id
            holders.add(holder)
            reply = client.responses.create(
                model=MODEL, input=f"Turn {turn}?", previous_response_id=reply.id,
                max_output_tokens=2,
            )  # fmt: skip
            assert reply.id.split("_")[1] == holder  # the same replica, the chain's
            assert reply.usage.input_tokens_details.cached_tokens > 0
        assert client.responses.retrieve(reply.id).id == reply.id
    assert holders == live  # the first turns were spread over both replicas


def test_anthropic_messages_are_routed_to_their_cached_prefix(cluster):
    """The ingress reads Anthropic's Messages requests as it reads chat: each system
    prompt's later requests (another question each, some streamed) go where its blocks
    are cached (routed by load alone, about half would compute it again)."""
    anthropic = pytest.importorskip("anthropic")
    wait_replicas(cluster, 2)
    client = anthropic.Anthropic(base_url=cluster.url, api_key="unused", timeout=120)

    def ask_messages(k: int, question: str, stream: bool = False):
        kw = {"model": MODEL, "max_tokens": 2, "system": system_prompt(k + 20, 200),
              "messages": [{"role": "user", "content": question}]}  # fmt: skip
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as events:
            return events.get_final_message()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # at once: spread by load
        list(pool.map(lambda k: ask_messages(k, "Hello?"), range(4)))
    for k in range(4):
        for q in range(3):
            reply = ask_messages(k, f"Question {q}?", stream=q == 1)
            u = reply.usage
            assert u.cache_read_input_tokens >= 0.8 * (u.input_tokens + u.cache_read_input_tokens)


def test_default_router_caches_less():
    """Ray Serve's power-of-two-choices router on the same workload: lower hit rate."""
    server = start("pow2")
    try:
        wait_replicas(server, 2)
        hit = shared_prompt_run(server)
    finally:
        server.stop()
    kvpool = HIT_RATES.get("kvpool", 0.9)
    print(f"prompt tokens from cache: kvpool's router {kvpool:.1%}, Ray Serve's pow2 {hit:.1%}")
    assert hit < kvpool, f"the default router cached {hit:.1%}, kvpool's {kvpool:.1%}"


def test_a_replica_killed_mid_run(cluster):
    view = wait_replicas(cluster, 2)
    victim = next(iter(view["replicas"].values()))
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=60,
                           max_retries=0)  # fmt: skip

    def streamed(k: int) -> str:
        try:
            stream = client.chat.completions.create(
                model=MODEL, stream=True, max_tokens=64, temperature=0,
                messages=[{"role": "system", "content": system_prompt(k % 4)},
                          {"role": "user", "content": f"Tell me a long story {k}"}],
            )  # fmt: skip
            for _ in stream:
                pass
            return "ok"
        except openai.APIError:
            return "failed cleanly"

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(streamed, k) for k in range(8)]
        while True:  # the kill must land mid-run: once the victim runs some of them
            usage = httpx.get(f"{cluster.url}/api/kvcache", timeout=60).json()
            mine = usage["replicas"][victim["replica"]]
            if mine.get("running", 0) > 0 or all(f.done() for f in futures):
                break
        os.kill(victim["pid"], signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in futures]
    assert time.monotonic() - started < 120
    assert set(outcomes) <= {"ok", "failed cleanly"}
    # later requests succeed (retried away from the dead replica if need be)
    for k in range(4):
        reply = ask(client, k, "Still there?")
        assert reply.choices[0].message is not None
    # the router dropped the dead replica; Ray Serve starts another in its place
    deadline = time.monotonic() + 180
    while True:
        view = cluster_view(cluster)
        if victim["replica"] not in view["replicas"] and len(view["replicas"]) == 2:
            break
        assert time.monotonic() < deadline, view
        time.sleep(0.5)


def test_replicas_that_could_never_get_their_gpus_are_refused_up_front():
    """More GPUs asked for than the Ray cluster has: a one-line error and exit status 2,
    not a Ray Serve that waits for them without end."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "cluster", "--replicas", "64",
         "--gpus-per-replica", "1", "--port", "0", "--quiet"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "64 replicas of 1 GPU each do not fit the Ray cluster's" in run.stderr
