"""kvpool.server: Ollama- and OpenAI-compatible HTTP APIs over the engine's block pool.

Modules: ``app`` builds the FastAPI application from a ``ServedModel``; ``ollama_api``,
``openai_api`` and ``admin_api`` hold the routes; ``generation`` runs one request on the
engine (timings, metrics, disconnects); ``params`` turns each API's options into
``SamplingParams``; ``auth`` maps API keys to tenants and cache salts; ``errors`` and
``limits`` answer bad input; ``metrics`` is the Prometheus side; ``main`` is
``kvpool serve``.
"""
