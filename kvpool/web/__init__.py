"""kvpool.web: the live view's page (``dashboard.html``, one self-contained file: no
external asset, no build step), served by ``kvpool.server`` and written with a replay in
it by ``kvpool simulate --html``. Imports nothing of kvpool."""

from __future__ import annotations

import functools
import importlib.resources
import json


@functools.cache
def page() -> str:
    """The page as the server sends it (it polls ``/api/dashboard``)."""
    return importlib.resources.files(__name__).joinpath("dashboard.html").read_text()


def replay_page(replay: dict[str, object]) -> str:
    """The page with ``replay`` (``base``, ``frames``, ``history``, ``title``) in it:
    it scrubs through the frames instead of polling."""
    data = json.dumps(replay, separators=(",", ":")).replace("</", "<\\/")
    script = f"<script>window.KVPOOL_REPLAY = {data};</script>\n"
    html = page()
    at = html.index("<script>")
    return html[:at] + script + html[at:]
