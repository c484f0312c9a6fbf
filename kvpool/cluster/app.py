"""``kvpool cluster``: kvpool replicas on Ray Serve behind one ingress.

The application: an ingress deployment (one replica: the HTTP door, the tokenizer, the
router; ``kvpool.cluster.ingress``), an engine deployment of N replicas (each a whole
kvpool server with its own block pool; ``kvpool.cluster.replica``) and one named actor,
the ``KVEventLog``, through which replicas' KV events reach the router. The engine
deployment's router is chosen by ``--router``: ``kvpool`` (``KVPrefixRouter``: the
longest cached prefix, balanced against load), ``pow2`` (Ray Serve's default, power of
two choices) or ``prefix-affinity`` (Ray Serve LLM's ``PrefixCacheAffinityRouter``,
which matches prompt text), so the three can be compared on one cluster.

Ray runs locally (started here, the default) or is joined (``--address``, as ``ray
start --head`` printed it); every node then needs the model file at the same path.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import sys
import threading
from typing import Any

from kvpool.cluster.event_log import KVEventLog

APP_NAME = "kvpool"
ENGINE = "kvpool-engine"
LOG_NAMESPACE = "kvpool"
ROUTERS = {
    "kvpool": "kvpool.cluster.router:KVPrefixRouter",
    "pow2": "kvpool.cluster.baseline_routers:Pow2Router",  # Ray Serve's default policy
    "prefix-affinity": "kvpool.cluster.baseline_routers:PrefixAffinityRouter",
}


def log_name(app_name: str) -> str:
    return f"kvpool-kv-events-{app_name}"


def event_log(block_size: int, app_name: str = APP_NAME) -> Any:
    """The application's ``KVEventLog`` actor (made by whoever asks first)."""
    import ray

    actor = ray.remote(KVEventLog).options(
        name=log_name(app_name), namespace=LOG_NAMESPACE, get_if_exists=True,
        lifetime="detached", num_cpus=0, max_concurrency=1000,
    )  # fmt: skip
    return actor.remote(block_size)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvpool.server import main

    main.add_arguments(p)
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads per replica (default: CPUs / replicas)")  # fmt: skip
    p.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379, or 'auto'); default: "
                        "start Ray on this machine")  # fmt: skip
    p.add_argument("--router", choices=sorted(ROUTERS), default="kvpool",
                   help="how requests are sent to replicas (default kvpool: by cached "
                        "prefix, balanced against load)")  # fmt: skip
    p.add_argument("--imbalance", type=int, default=32, metavar="REQUESTS",
                   help="kvpool router: a replica with this many more requests in flight "
                        "than the least loaded one is passed over, whatever it caches "
                        "(default 32); below that, the least cost wins")  # fmt: skip
    p.add_argument("--gpus-per-replica", type=float, default=None, metavar="N",
                   help="GPUs each replica asks Ray for (default: none with --device cpu "
                        "or where Ray has no GPU; else one each, or an equal share of one "
                        "where replicas outnumber GPUs)")  # fmt: skip


def replica_gpus(args: argparse.Namespace, cluster_gpus: float) -> float:
    """The GPUs each replica asks Ray for (``--gpus-per-replica``, or chosen from the
    cluster's). Ray hides every GPU from an actor that asks for none (its
    ``CUDA_VISIBLE_DEVICES`` is empty), so a replica meant to compute on a GPU must ask.
    Replicas that outnumber the GPUs share them: ``1 / ceil(replicas / GPUs)`` each, a
    share that packs whole on every GPU."""
    if args.gpus_per_replica is not None:
        return float(args.gpus_per_replica)
    if cluster_gpus < 1 or (args.device or "").startswith("cpu"):
        return 0.0
    return 1.0 / -(-args.replicas // int(cluster_gpus))


def gpu_shortfall(replicas: int, each: float, cluster_gpus: float) -> str | None:
    """Why Ray could never place ``replicas`` replicas asking ``each`` GPU on a cluster of
    ``cluster_gpus`` GPUs, or None. Ray Serve does not refuse such replicas: it waits for
    GPUs that never come. A share below one packs whole on a GPU (``floor(1 / each)``
    replicas each); a larger ask takes whole GPUs. Reckoned from the cluster's total,
    so it finds what can never fit; GPUs spread over nodes can still leave a replica
    waiting, with Ray's own message."""
    if each < 0:
        return f"--gpus-per-replica {each:g}: a share of a GPU is 0 or more"
    if each == 0:
        return None
    if each < 1:  # floor(1 / each) replicas on each whole GPU
        room = int(cluster_gpus) * int(1 / each + 1e-9)
    else:
        room = int(cluster_gpus // each + 1e-9)
    if replicas <= room:
        return None
    return (
        f"{replicas} replicas of {each:g} GPU each do not fit the Ray cluster's "
        f"{cluster_gpus:g} GPUs (room for {room}); Ray Serve would wait for them without "
        "end: give fewer --replicas or a smaller --gpus-per-replica"
    )


def serve_argv(args: argparse.Namespace, gpus: float = 0.0) -> list[str]:
    """The ``kvpool serve`` flags each replica builds its server from. A replica with a
    share of a GPU (``gpus`` < 1) sizes its KV pool from that share of its memory."""
    argv: list[str] = [args.model] if args.model else []
    skip = {"model", "replicas", "threads", "address", "router", "imbalance", "host", "port",
            "func", "command", "gpus_per_replica"}  # fmt: skip
    values = dict(vars(args))
    if 0 < gpus < 1 and values.get("gpu_memory_utilization") is not None:
        values["gpu_memory_utilization"] = round(values["gpu_memory_utilization"] * gpus, 4)
    for key, value in values.items():
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def application(
    args: argparse.Namespace, block_size: int, model_path: str, gpus: float = 0.0
) -> Any:
    """The Ray Serve application the arguments describe (``gpus``: each replica's)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvpool.cluster.ingress_deployment import ingress_deployment
    from kvpool.cluster.replica import EngineReplica

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    kwargs: dict[str, Any] = {}
    if args.router == "kvpool":
        kwargs = {"block_size": block_size, "imbalance": args.imbalance,
                  "log_name": log_name(APP_NAME), "log_namespace": LOG_NAMESPACE}  # fmt: skip
    router_config = RequestRouterConfig(
        request_router_class=ROUTERS[args.router], request_router_kwargs=kwargs
    )
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=args.replicas,
        max_ongoing_requests=args.max_queue + 256,
        ray_actor_options={
            "num_cpus": threads,
            "num_gpus": gpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        health_check_period_s=2,
        graceful_shutdown_timeout_s=5,
        request_router_config=router_config,
    )
    KVPoolIngress = ingress_deployment()
    return KVPoolIngress.bind(
        engine.bind(serve_argv(args, gpus), log_name(APP_NAME), LOG_NAMESPACE),
        model_path=model_path,
        block_size=block_size,
        api_keys=args.api_key,
        keys_file=str(args.keys_file) if args.keys_file else None,
        deployment=ENGINE,
    )


class PortInUse(RuntimeError):
    """Serve's HTTP proxy could not bind the address asked for."""


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def unclaimed_port(host: str) -> int:
    """A port free now on ``host``, chosen outside the kernel's ephemeral range and Ray's
    worker ports (10002-19999): Ray's own processes and every outgoing connection take
    ports from those, so a port picked there may be gone by the time the proxy binds it.
    Falls back to one the kernel hands out where no such port is free."""
    low, high = ephemeral_ports()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    quiet = [p for p in range(20000, 65536) if not low <= p <= high]
    for port in random.sample(quiet, min(len(quiet), 64)):
        with socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def proxy_gave_out(exc: BaseException) -> bool:
    """Serve's proxy actor killed before it ran: its controller gives a starting proxy a
    few seconds to answer that it is ready (``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``, 5 s),
    then kills it and starts another, while ``serve.start`` waits on the first and raises
    (seen on a fresh 2-core machine under load: the cluster never started)."""
    return type(exc).__name__ == "ActorDiedError" and "ProxyActor" in str(exc)


def start_proxy(serve: Any, host: str, port: int, tries: int = 5) -> int:
    """Start Serve's HTTP proxy on ``host:port`` and return the port. ``port`` 0: a free
    port chosen now, after Ray's processes have started, and another one if something took
    it before the proxy bound it (``tries`` in all). A proxy killed before it ran
    (``proxy_gave_out``) is started again (on the port asked for, or another free one),
    up to ``tries`` times in all, then its error raised. Raises ``PortInUse`` where the
    port asked for, or every port tried, was taken."""
    for attempt in range(tries):
        chosen = port or unclaimed_port(host)
        try:
            serve.start(http_options={"host": host, "port": chosen})
        except Exception as exc:  # Ray wraps the proxy's error in its own task error
            gave_out = proxy_gave_out(exc)
            if not gave_out and "Failed to bind" not in str(exc):
                raise
            serve.shutdown()
            if gave_out and attempt + 1 < tries:
                continue
            if gave_out:
                raise
            if port == 0:
                continue
            break
        return chosen
    raise PortInUse(f"cannot listen on {host}:{port or 'any port'}: the address is in use")


def run(args: argparse.Namespace) -> int:
    """``kvpool cluster``: start (or join) Ray, run the application, serve until stopped."""
    import ray
    from ray import serve

    from kvpool.model_store import ModelNotFound, resolve_model_path
    from kvpool.server.main import host_and_port

    if args.replicas < 1:
        print("kvpool: --replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        model_path = str(resolve_model_path(args.model))
    except ModelNotFound as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 2
    host, port = host_and_port(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    if args.address:
        ray.init(address=args.address, namespace=LOG_NAMESPACE, log_to_driver=not args.quiet)
    else:
        # The Ray instance started here (its processes take this environment): Serve's
        # controller gives its proxy 5 s to start by default, less than a loaded 2-core
        # machine may take (proxy_gave_out); 30 s unless set.
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
        cpus = max(os.cpu_count() or 1, args.replicas * threads)
        ray.init(num_cpus=cpus, include_dashboard=False, namespace=LOG_NAMESPACE,
                 log_to_driver=not args.quiet)  # fmt: skip
    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    gpus = replica_gpus(args, cluster_gpus)
    shortfall = gpu_shortfall(args.replicas, gpus, cluster_gpus)
    if shortfall:
        print(f"kvpool: {shortfall}", file=sys.stderr)
        ray.shutdown()
        return 2
    if gpus and (args.device or "cuda") not in ("cuda", "cuda:0"):
        print(f"kvpool: --device {args.device}: Ray gives each replica its GPU, which it "
              "sees as cuda (give --device cuda)", file=sys.stderr)  # fmt: skip
        ray.shutdown()
        return 2
    log_actor = event_log(args.block_size)
    try:
        port = start_proxy(serve, host, port)
    except PortInUse as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        ray.kill(log_actor)
        ray.shutdown()
        return 1
    on_gpus = f", {gpus:g} GPU each" if gpus else ""
    print(
        f"kvpool: starting {args.replicas} replicas ({threads} threads{on_gpus}, router "
        f"{args.router}) of {model_path}",
        file=sys.stderr,
        flush=True,
    )
    app = application(args, args.block_size, model_path, gpus)
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"kvpool: {args.replicas} replicas on Ray Serve, router {args.router}",
          file=sys.stderr, flush=True)  # fmt: skip
    print(f"kvpool: serving {args.model or 'the built-in model'} on http://{host}:{port}",
          flush=True)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("kvpool: stopping the cluster", file=sys.stderr, flush=True)
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.kill(log_actor)
    ray.shutdown()
    print("kvpool: stopped", file=sys.stderr)
    return 0
