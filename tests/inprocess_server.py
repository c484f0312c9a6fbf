"""A real kvpool server on 127.0.0.1 inside the test process (uvicorn on a thread), for
tests that must reach into the engine while real clients talk to it over HTTP: inject a
fault tied to one request, hold the engine inside a step."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from kvpool import LLM
from kvpool.engine.async_llm import AsyncLLM
from kvpool.server.app import create_app
from kvpool.server.auth import KeyRing
from kvpool.server.served_model import ServedModel


class InProcessServer:
    def __init__(
        self, llm: LLM, *, keys: KeyRing | None = None, aliases: list[str] | None = None, **app_kw
    ) -> None:
        self.llm = llm
        self.engine = AsyncLLM(llm.engine)
        self.model = ServedModel.open(None, llm.loaded, self.engine, aliases=aliases)
        app = create_app(self.model, keys=keys, **app_kw)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.engine.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:  # poll: no fixed sleep
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.engine.stop_soon()
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()


def wait_for(predicate: Callable[[], bool], timeout: float = 60) -> None:
    """Poll ``predicate`` until it holds (raise after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)
