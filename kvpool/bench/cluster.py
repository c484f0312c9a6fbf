"""``kvpool bench cluster``: the same cluster under three routers, side by side in one run.

For each router (kvpool's ``KVPrefixRouter``; Ray Serve's default, power of two
choices; Ray Serve LLM's ``PrefixCacheAffinityRouter``) it starts ``kvpool cluster``
(N replicas on a local Ray, the same flags), replays ``kvpool bench serve``'s workloads
through the OpenAI API with concurrent clients, and stops it. Reported per workload and
router: wall time, output tokens/s, TTFT and latency p50/p99, and the cluster-wide
prefix hit rate (prompt tokens the replicas reported cached).

The pool is deliberately smaller than every system prompt times every replica: a router
that spreads a prompt's requests over replicas makes each of them compute and store it,
and evict others for it, which is the cost this benchmark shows.

On two machines: ``ray start --head`` on one, ``ray start --address HEAD:6379`` on the
other, then ``kvpool cluster --address HEAD:6379 --replicas 2`` and ``kvpool bench serve
--url cluster=http://HEAD:11434 --workloads system-prompts chat`` per router.
"""

from __future__ import annotations

import asyncio
import os
import sys

from kvpool.bench import serve
from kvpool.bench.local_server import LocalServer
from kvpool.model.cpu import cpu_features

ROUTERS = ("kvpool", "pow2", "prefix-affinity")


def run(
    *,
    names: list[str],
    requests: int,
    clients: int,
    kv_cache_memory: int,
    replicas: int = 2,
    routers: tuple[str, ...] = ROUTERS,
) -> str:
    chosen = {n: w for n, w in serve.workloads(requests).items() if n in names}
    threads = max(1, (os.cpu_count() or 1) // replicas)
    rows: list[serve.Row] = []
    for router in routers:
        flags = ["--replicas", str(replicas), "--threads", str(threads), "--router", router,
                 "--dtype", "float32", "--kv-cache-memory", str(kv_cache_memory)]  # fmt: skip
        print(f"starting a cluster, router {router} ({' '.join(flags)})", file=sys.stderr)
        try:
            server = LocalServer(*flags, command="cluster", timeout=600)
        except RuntimeError as exc:
            print(f"  {router}: could not start: {str(exc)[-300:]}", file=sys.stderr)
            continue
        try:
            model = serve._model_of(server.url, None)
            for workload in chosen.values():
                row = asyncio.run(
                    serve.run_workload(server.url, model, workload, clients, router, None)
                )
                rows.append(row)
        finally:
            server.stop()
    rows.sort(key=lambda r: list(chosen).index(r.workload))
    load = os.getloadavg()
    return "\n".join([
        f"kvpool bench cluster: {replicas} replicas x {threads} threads on one machine "
        f"({os.cpu_count()} CPUs: {cpu_features().summary()}), {kv_cache_memory} MiB of KV "
        f"each (float32 blocks), {clients} concurrent clients; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "(ttft / lat: seconds, p50 and p99; cached: prompt tokens the replicas reported "
        "cached, the cluster's prefix hit rate)",
        serve.HEADER.replace("server            ", "router            "),
        *(row.line() for row in rows),
    ])  # fmt: skip
