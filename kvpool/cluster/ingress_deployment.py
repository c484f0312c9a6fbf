"""The ingress (``kvpool.cluster.ingress``) as a Ray Serve deployment.

No postponed annotations in this module: FastAPI reads the route's parameter types from
its annotations, and a replica gets this class pickled by value, where a type named only
by a string could not be resolved.
"""

from typing import Any

from fastapi import FastAPI, Request, Response

from kvpool.cluster.ingress import Ingress, dispatch


def ingress_deployment() -> Any:
    """One replica: routing and the tokenizer are light, and one router that sees every
    request keeps its in-flight counts exact."""
    from ray import serve

    http_app = FastAPI(title="kvpool cluster", docs_url=None, redoc_url=None, openapi_url=None)
    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]

    @serve.deployment(name="kvpool-ingress", num_replicas=1, max_ongoing_requests=4096,
                      ray_actor_options={"num_cpus": 0})  # fmt: skip
    @serve.ingress(http_app)
    class KVPoolIngress:
        def __init__(self, engine: Any, **settings: Any) -> None:
            self.ingress = Ingress(engine, **settings)

        @http_app.api_route("/{path:path}", methods=methods)
        async def route(self, request: Request, path: str) -> Response:
            return await dispatch(self.ingress, request)

    return KVPoolIngress
