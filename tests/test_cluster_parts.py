"""The cluster's parts that need no Ray: the event log and a router's replay of it, the
routing policy, and a request through an ASGI app in process.

- Log and replay: replicas' random operations published in batches, a router pulling as
  it likes (and one that fell behind the log's window: it gets a snapshot) holds exactly
  each replica's cached block set; a forgotten replica holds nothing, and a batch it
  still had in flight does not bring it back.
- Policy: the least cost wins (the work sent there plus 8 x the prompt tokens it would
  compute there); a request's prefix counts as soon as it is chosen (before Ray Serve
  reports it, before any event); a replica with many more requests in flight is passed
  over.
- ASGI: streamed parts arrive in order; closing early tells the app the client left; an
  app that fails before answering gives a 500.
- Responses: a stateless request is tokenized as the same chat; one that names a stored
  response goes to the replica whose id the response's id carries.
- GPUs: a replica asks Ray for one, a share where replicas outnumber GPUs (its KV pool
  then sized from that share of the GPU's memory), none on the CPU.
- The HTTP port: asked for 0, the cluster takes another free port (outside the kernel's
  ephemeral range) when its first choice was taken before Serve's proxy bound it; a port
  asked for by number is tried once, a clear error if taken; other errors stay errors.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kvpool.cache import KVCacheManager
from kvpool.cache.kv_index import prefix_keys
from kvpool.cluster.app import (
    PortInUse,
    ephemeral_ports,
    gpu_shortfall,
    replica_gpus,
    serve_argv,
    start_proxy,
)
from kvpool.cluster.asgi_call import HTTPRequest, ResponseStart, call_app
from kvpool.cluster.event_log import IndexReplay, KVEventLog, ReplicaLoad
from kvpool.cluster.routing import PrefixRouting

BS = 4


def _run(manager: KVCacheManager, seq: int, tokens: list[int], salt=None) -> None:
    manager.allocate(seq, tokens, salt, computed=False)
    manager.mark_computed(seq, len(tokens))
    manager.free(seq)


@pytest.mark.parametrize("keep", [4096, 3])
def test_replayed_index_equals_every_replicas_blocks(keep):
    rng = random.Random(keep)
    replicas = {n: KVCacheManager(24, BS) for n in ("a", "b", "c")}
    for m in replicas.values():
        m.enable_kv_events()
    log = KVEventLog(BS, keep=keep)
    eager, lazy = IndexReplay(BS), IndexReplay(BS)
    systems = [[rng.randrange(30) for _ in range(3 * BS)] for _ in range(5)]

    async def scenario() -> None:
        for step in range(400):
            name = rng.choice(list(replicas))
            op = rng.random()
            if op < 0.05:
                replicas[name].reset_prefix_cache()
            elif op < 0.1:
                replicas[name].pin(rng.choice(systems))
            else:
                extra = [rng.randrange(30) for _ in range(rng.randrange(1, 9))]
                _run(replicas[name], step, rng.choice(systems) + extra, rng.choice([None, "t"]))
            log.publish(name, replicas[name].take_kv_events(), ReplicaLoad(free_blocks=step))
            eager.apply(await log.pull(eager.cursor, 0))
            if step % 37 == 0:  # a router that pulls seldom (behind the window: a snapshot)
                lazy.apply(await log.pull(lazy.cursor, 0))
        lazy.apply(await log.pull(lazy.cursor, 0))

    asyncio.run(scenario())
    for replay in (eager, lazy):
        for name, m in replicas.items():
            assert replay.index.blocks_of(name) == m.cached_block_hashes()
            pinned = {b.block_hash for b in m.pool.blocks if b.pin_count and b.block_hash}
            assert replay.index.pinned_of(name) == pinned
    assert log.blocks() == {n: sorted(m.cached_block_hashes()) for n, m in replicas.items()}


def test_a_forgotten_replica_stays_forgotten():
    m = KVCacheManager(16, BS)
    m.enable_kv_events()
    log, replay = KVEventLog(BS), IndexReplay(BS)
    _run(m, 1, list(range(13)))
    assert log.publish("a", m.take_kv_events())
    log.forget("a")
    _run(m, 2, list(range(20, 33)))
    assert not log.publish("a", m.take_kv_events())  # its last batch, arriving late
    replay.apply(asyncio.run(log.pull(None, 0)))
    assert replay.index.blocks_of("a") == set()
    assert log.blocks() == {} or log.blocks() == {"a": []}


def test_a_pull_waits_for_news_and_returns_it():
    log = KVEventLog(BS)
    m = KVCacheManager(16, BS)
    m.enable_kv_events()

    async def scenario() -> dict:
        cursor = (await log.pull(None, 0))["cursor"]
        waiting = asyncio.create_task(log.pull(cursor, 30))
        await asyncio.sleep(0)
        assert not waiting.done()
        _run(m, 1, list(range(9)))
        log.publish("a", m.take_kv_events())
        return await asyncio.wait_for(waiting, 5)

    pulled = asyncio.run(scenario())
    assert [name for name, _ in pulled["entries"]] == ["a"]


def _keys(tokens: list[int]) -> list[int]:
    return prefix_keys(tokens, BS, None)


def _cache(routing: PrefixRouting, replica: str, tokens: list[int]) -> None:
    m = KVCacheManager(32, BS)
    m.enable_kv_events()
    _run(m, 1, tokens)
    routing.replay.index.apply(replica, m.take_kv_events())


def test_the_longest_cached_prefix_wins():
    routing = PrefixRouting(BS, imbalance=4)
    system = list(range(100, 120))
    _cache(routing, "b", [*system[:8], 1, 2, 3])  # two blocks of the system prompt
    _cache(routing, "c", [*system, 1, 2, 3])  # all five
    prompt = [*system, 7, 7]
    assert routing.rank(["a", "b", "c"], _keys(prompt), len(prompt))[0] == ["c"]
    assert routing.routed_by_prefix == 1
    assert routing.rank(["a", "b"], _keys(prompt), len(prompt))[0] == ["b"]
    unknown = list(range(500, 520))
    routing.pending.update({"a": 5, "b": 0, "c": 9})
    assert routing.rank(["a", "b", "c"], _keys(unknown), len(unknown))[0] == ["b"]  # least work
    assert routing.routed_by_load == 1


def test_a_routed_prefix_counts_until_its_events_confirm_it():
    routing = PrefixRouting(BS, imbalance=4)
    prompt = list(range(40))
    keys = _keys(prompt)
    first = routing.rank(["a", "b"], keys, len(prompt))[0][0]
    routing.routed("r1", first, keys, len(prompt), max_tokens=8)
    assert routing.pending[first] == len(prompt) + 8  # nothing cached: all of it
    assert routing.rank(["a", "b"], keys, len(prompt))[0] == [first]  # expected there
    routing.completed("r1", first)
    assert routing.in_flight[first] == 0 and routing.pending[first] == 0
    # still expected there: no event has shown its blocks yet (a stream may be reported
    # complete before its prefill ran)
    assert routing.hits(["a", "b"], keys)[first] == len(keys)
    _cache(routing, first, prompt)  # the events come: the index speaks for it now
    assert routing.hits(["a", "b"], keys)[first] == len(keys)
    assert not routing._expected
    routing.drop(first)
    assert routing.hits(["a", "b"], keys) == {"a": 0, "b": 0}


def test_a_cached_prefix_loses_only_to_a_backlog_far_longer_than_its_prefill():
    routing = PrefixRouting(BS, imbalance=3)
    system = list(range(100, 120))
    _cache(routing, "a", [*system, 1])
    prompt = [*system, 9, 9]  # 22 tokens; 20 of them cached on a
    keys = _keys(prompt)
    routing.pending.update({"a": 159, "b": 0})  # 159 + 8 x 2 < 8 x 22 on b: a
    assert routing.rank(["a", "b"], keys, len(prompt))[0] == ["a"]
    routing.pending["a"] = 161  # 161 + 16 > 176: b, though it must compute it all
    assert routing.rank(["a", "b"], keys, len(prompt))[0] == ["b"]
    routing.pending["a"] = 0
    routing.in_flight.update({"a": 3, "b": 0})  # 3 more in flight: passed over
    assert routing.rank(["a", "b"], keys, len(prompt)) == [["b"], ["a"]]
    routing.drop("a")
    assert routing.hits(["a", "b"], keys) == {"a": 0, "b": 0}
    with pytest.raises(ValueError):
        PrefixRouting(BS, imbalance=0)


async def _streaming_app(scope, receive, send):
    assert scope["path"] == "/stream" and scope["query_string"] == b"n=3"
    body = await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson")]})  # fmt: skip
    for i in range(3):
        await send({"type": "http.response.body", "body": body["body"] + str(i).encode(),
                    "more_body": True})  # fmt: skip
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_a_request_streams_through_an_app_in_process():
    async def scenario() -> list:
        request = HTTPRequest("POST", "/stream", b"n=3", [], b"x")
        return [part async for part in call_app(_streaming_app, request)]

    parts = asyncio.run(scenario())
    assert isinstance(parts[0], ResponseStart) and parts[0].status == 200
    assert parts[0].header("Content-Type") == "application/x-ndjson"
    assert parts[1:] == [b"x0", b"x1", b"x2"]


def test_closing_early_tells_the_app_the_client_left():
    seen: list[str] = []

    async def endless(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen.append((await receive())["type"])  # what a streaming response listens for

    async def scenario() -> None:
        stream = call_app(endless, HTTPRequest("GET", "/"))
        assert isinstance(await stream.__anext__(), ResponseStart)
        assert await stream.__anext__() == b"first"
        await stream.aclose()

    asyncio.run(scenario())
    assert seen == ["http.disconnect"]


def test_an_app_that_fails_before_answering_gives_a_500():
    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    async def scenario() -> list:
        return [p async for p in call_app(broken, HTTPRequest("GET", "/"))]

    start, body = asyncio.run(scenario())
    assert start.status == 500 and b"boom" in body


def test_a_burst_chosen_before_any_report_spreads_and_reports_do_not_count_twice():
    routing = PrefixRouting(BS, imbalance=32)
    prompts = [[p * 100 + t for t in range(20)] for p in range(8)]  # 8 distinct, 5 blocks
    placed = []
    for i, prompt in enumerate(prompts):
        best = routing.rank(["a", "b"], _keys(prompt), len(prompt))[0][0]
        routing.chosen(f"r{i}", best, _keys(prompt), len(prompt), 16)
        placed.append(best)
    assert placed.count("a") == placed.count("b") == 4
    again = routing.rank(["a", "b"], _keys(prompts[0]), len(prompts[0]))[0][0]
    assert again == placed[0]  # a later request of a prompt follows its first
    before = dict(routing.in_flight), dict(routing.pending)
    for i, prompt in enumerate(prompts):  # Ray Serve reports them where they were chosen
        routing.routed(f"r{i}", placed[i], _keys(prompt), len(prompt), 16)
    assert (routing.in_flight, routing.pending) == before
    routing.routed("r0", "b" if placed[0] == "a" else "a", _keys(prompts[0]), 20, 16)
    assert sum(routing.in_flight.values()) == 8  # moved, not added
    for i in range(8):
        routing.completed(f"r{i}", "ignored")
    assert sum(routing.in_flight.values()) == sum(routing.pending.values()) == 0


class _ServeWithBusyPorts:
    """Ray Serve's ``start``/``shutdown`` where the first ``taken`` binds fail as the
    proxy's do (a ``RayTaskError`` whose text carries the proxy's ``RuntimeError``)."""

    def __init__(self, taken: int, error: Exception | None = None, errors: int = 99) -> None:
        self.taken, self.error, self.errors = taken, error, errors
        self.tried: list[int] = []
        self.shutdowns = 0

    def start(self, http_options: dict) -> None:
        self.tried.append(http_options["port"])
        if self.error is not None and len(self.tried) <= self.errors:
            raise self.error
        if len(self.tried) <= self.taken:
            raise RuntimeError(
                "ray::ProxyActor.ready() RuntimeError: Failed to bind to address "
                f"'{http_options['host']}:{http_options['port']}'."
            )

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_port_zero_takes_another_free_port_when_its_first_choice_was_taken():
    serve = _ServeWithBusyPorts(taken=2)
    port = start_proxy(serve, "127.0.0.1", 0)
    assert serve.tried[-1] == port and len(serve.tried) == 3 and serve.shutdowns == 2
    low, high = ephemeral_ports()
    assert all(p >= 20000 and not low <= p <= high for p in serve.tried), serve.tried
    always_taken = _ServeWithBusyPorts(taken=99)
    with pytest.raises(PortInUse, match="any port"):
        start_proxy(always_taken, "127.0.0.1", 0, tries=4)
    assert len(always_taken.tried) == 4


def test_a_port_asked_for_by_number_is_tried_once_and_other_errors_stay_errors():
    assert start_proxy(_ServeWithBusyPorts(taken=0), "127.0.0.1", 8123) == 8123
    busy = _ServeWithBusyPorts(taken=1)
    with pytest.raises(PortInUse, match=r"127\.0\.0\.1:8123"):
        start_proxy(busy, "127.0.0.1", 8123)
    assert busy.tried == [8123]
    broken = _ServeWithBusyPorts(taken=0, error=ValueError("no such host"))
    with pytest.raises(ValueError):
        start_proxy(broken, "127.0.0.1", 0)
    assert broken.shutdowns == 0 and len(broken.tried) == 1


class ActorDiedError(Exception):
    """Named as Ray's (ray.exceptions.ActorDiedError), whose text this carries."""


def test_a_proxy_killed_before_it_ran_is_started_again():
    """Serve's controller kills a proxy that was not ready within its check (a loaded
    machine) while ``serve.start`` waits on it: the start is tried again (the port asked
    for, or another free one), and the error stays an error once every try is spent."""
    died = ActorDiedError("The actor died unexpectedly before finishing this task.\n"
                          "\tclass_name: ProxyActor\n The actor never ran")  # fmt: skip
    flaky = _ServeWithBusyPorts(taken=0, error=died, errors=2)
    assert start_proxy(flaky, "127.0.0.1", 8123) == 8123
    assert flaky.tried == [8123] * 3 and flaky.shutdowns == 2
    any_port = _ServeWithBusyPorts(taken=0, error=died, errors=1)
    assert start_proxy(any_port, "127.0.0.1", 0) == any_port.tried[-1]
    assert len(any_port.tried) == 2
    dead = _ServeWithBusyPorts(taken=0, error=died)
    with pytest.raises(ActorDiedError):
        start_proxy(dead, "127.0.0.1", 0, tries=3)
    assert len(dead.tried) == 3 and dead.shutdowns == 3
    other_actor = _ServeWithBusyPorts(taken=0, error=ActorDiedError("class_name: Replica"))
    with pytest.raises(ActorDiedError):
        start_proxy(other_actor, "127.0.0.1", 0)
    assert len(other_actor.tried) == 1


# A chat completion with one call and its result: the Responses and Messages requests
# of the same conversation must read as it does.
CHAT_WITH_A_CALL = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "c", "content": "done"},
    ],
    "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}],
}  # fmt: skip


def test_a_responses_request_reads_as_the_same_chat_does(default_model_file):
    """The ingress tokenizes a stateless Responses request as the chat completion of the
    same conversation (instructions as the system turn, items as messages, function
    tools): the two APIs route to, and reuse, the same cached prefix. A continuation
    (``previous_response_id``) has its history on a replica: no prompt here."""
    import json

    from kvpool.cluster.prompt import PromptReader

    reader = PromptReader(default_model_file)
    tool = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    responses = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "done"},
        ],
        "instructions": "Be brief.",
        "tools": [{"type": "function", **tool}],
    }
    ids = reader.prompt_ids("/v1/responses", json.dumps(responses).encode())
    chat = json.dumps(CHAT_WITH_A_CALL).encode()
    assert ids and ids == reader.prompt_ids("/v1/chat/completions", chat)
    continued = {"input": "more", "previous_response_id": "resp_abc_123"}
    assert reader.prompt_ids("/v1/responses", json.dumps(continued).encode()) is None
    assert reader.max_tokens(json.dumps({"max_output_tokens": 7}).encode()) == 7


def test_an_anthropic_messages_request_reads_as_the_same_chat_does(default_model_file):
    """The ingress tokenizes a Messages request (system blocks, tool_use and
    tool_result blocks, custom tools) as the chat completion of the same conversation,
    so both route to the same cached prefix; a stream its replica cannot finish ends in
    Anthropic's ``error`` event, not in OpenAI's ``[DONE]``."""
    import json

    from kvpool.cluster.asgi_call import ResponseStart
    from kvpool.cluster.ingress import _failure_tail
    from kvpool.cluster.prompt import PromptReader

    reader = PromptReader(default_model_file)
    schema = {"type": "object", "properties": {}}
    messages = {
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"}]},
        ],
        "tools": [{"name": "f", "input_schema": schema}],
        "max_tokens": 9,
    }  # fmt: skip
    ids = reader.prompt_ids("/v1/messages", json.dumps(messages).encode())
    chat = json.dumps(CHAT_WITH_A_CALL).encode()
    assert ids and ids == reader.prompt_ids("/v1/chat/completions", chat)
    assert reader.max_tokens(json.dumps(messages).encode()) == 9
    sse = ResponseStart(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
    tail = _failure_tail("/v1/messages", sse, "gone").decode()
    assert tail.startswith("event: error\ndata: ") and tail.endswith("\n\n")
    event = json.loads(tail.split("data: ", 1)[1])
    assert event == {"type": "error", "error": {"type": "overloaded_error", "message": "gone"}}
    assert "[DONE]" in _failure_tail("/v1/chat/completions", sse, "gone").decode()


def test_a_request_naming_a_stored_response_goes_to_the_replica_that_stored_it():
    from kvpool.cluster.ingress import Ingress
    from kvpool.server.responses_api import new_response_id, replica_of

    rid = new_response_id("abc123")
    assert replica_of(rid) == "abc123" and replica_of(new_response_id("")) is None
    ingress = Ingress.__new__(Ingress)  # its routing of names alone: no Ray, no model

    async def replicas() -> list[str]:
        return ["abc123", "def456"]

    ingress.replicas = replicas  # type: ignore[method-assign]

    def holder(method: str, path: str, body: dict | None = None) -> str | None:
        import json

        request = HTTPRequest(method, path, body=json.dumps(body or {}).encode())
        return asyncio.run(ingress._holder(request))

    assert holder("POST", "/v1/responses", {"previous_response_id": rid}) == "abc123"
    assert holder("GET", f"/v1/responses/{rid}") == "abc123"
    assert holder("DELETE", f"/v1/responses/{rid}") == "abc123"
    gone = new_response_id("zzz999")  # its replica is gone: any replica answers (404)
    assert holder("POST", "/v1/responses", {"previous_response_id": gone}) is None
    assert holder("POST", "/v1/responses", {"input": "x"}) is None
    assert holder("POST", "/v1/chat/completions", {"previous_response_id": rid}) is None
    assert asyncio.run(ingress._holder(HTTPRequest("POST", "/v1/responses", body=b"{"))) is None


def _cluster_args(*flags: str):
    from kvpool.cli import build_parser

    return build_parser().parse_args(["cluster", *flags])


def test_replicas_ask_ray_for_gpus_where_they_compute_on_one():
    """Ray hides every GPU from an actor that asks for none: a replica meant for a GPU
    must ask. Replicas that outnumber GPUs share them evenly, each sizing its pool from
    its share of the memory; --device cpu or no GPU in the cluster: none."""
    two = _cluster_args("--replicas", "2")
    assert replica_gpus(two, 0) == 0.0
    assert replica_gpus(two, 2) == 1.0 and replica_gpus(two, 8) == 1.0
    assert replica_gpus(_cluster_args("--replicas", "3"), 2) == 0.5  # packs: 2 + 1
    assert replica_gpus(_cluster_args("--replicas", "4"), 1) == 0.25
    assert replica_gpus(_cluster_args("--device", "cpu"), 4) == 0.0
    assert replica_gpus(_cluster_args("--gpus-per-replica", "0.5"), 0) == 0.5

    # what Ray could never place is refused up front (Ray Serve would wait without end)
    for replicas, each, cluster in ((2, 1.0, 2), (3, 0.5, 2), (4, 0.25, 1), (8, 0, 0), (1, 2, 2)):
        assert gpu_shortfall(replicas, each, cluster) is None, (replicas, each, cluster)
    for replicas, each, cluster in ((3, 1.0, 2), (2, 0.5, 0), (3, 0.4, 1), (2, 2, 3)):
        why = gpu_shortfall(replicas, each, cluster)
        assert why and f"{cluster:g} GPUs" in why and "--gpus-per-replica" in why
    assert "0 or more" in gpu_shortfall(1, -1, 4)
    chosen = [(r, g) for r in range(1, 9) for g in range(1, 5)]  # the default's shares fit
    assert all(gpu_shortfall(r, replica_gpus(_cluster_args("--replicas", str(r)), g), g) is None
               for r, g in chosen)  # fmt: skip

    argv = serve_argv(two, 1.0)
    assert "--gpus-per-replica" not in argv and "--replicas" not in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    shared = serve_argv(two, 0.25)
    assert shared[shared.index("--gpu-memory-utilization") + 1] == "0.225"
    assert "--kv-cache-memory" not in shared  # each replica sizes its own pool
    sized = serve_argv(_cluster_args("--kv-cache-memory", "256"), 0.5)
    assert sized[sized.index("--kv-cache-memory") + 1] == "256"
