"""The live view in a real headless Chromium (Selenium, Debian's ``chromium`` and
``chromium-driver``; ``.ci/run`` installs them) against a real ``kvpool serve``.

The page loads from the server alone; streams sharing a system prompt, sent with the
``openai`` client, show as shared cells with their requests listed, and a cell under the
pointer names the sequences holding it; a system prompt pinned with the page's own form
shows as pinned cells; when the clients leave, the cells turn cached and the counters
have moved; the page's unpin button unpins. With keys, the page asks for one and shows
a tenant its own. A screenshot is kept (under pytest's
temporary directory, or at ``$KVPOOL_DASHBOARD_SCREENSHOT``: how docs/img/dashboard.png
is made).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")

from tests.server_process import ServerProcess  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="Chromium or chromedriver is not installed (apt-get install chromium chromium-driver)",
)

MODEL = "smollm2:135m"
SYSTEM = "You are the help desk of a bicycle shop; answer in one sentence. " * 6
PINNED = "You write release notes for kvpool, briefly and exactly. " * 6


def _wait(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("the page did not get there")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1250", "--proxy-server=direct://"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_the_page_shows_pins_shared_and_cached_blocks_live(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    server = ServerProcess("--kv-cache-memory", "1024")
    streams = []
    try:
        browser.get(f"{server.url}/")  # a browser asks for HTML: the page

        def text(element_id: str) -> str:  # read in the page: it redraws every second
            return browser.execute_script(
                "const e = document.getElementById(arguments[0]); return e ? e.textContent : ''",
                element_id,
            )

        def count(state: str) -> str:  # "" until the first data arrived
            return text(f"count-{state}")

        _wait(lambda: count("free").isdigit())
        total = int(browser.find_element(By.ID, "blockmap").get_attribute("data-blocks"))
        assert int(count("free")) == total

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        for i in range(4):
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"Do you repair wheel number {i}?"}],
                max_tokens=3000,
                stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            next(iter(stream))
            streams.append(stream)
        rows = (  # the "cached" column of the requests table
            "return [...document.querySelectorAll('#requests tr')].map(r => r.cells[4].innerText)"
        )
        _wait(lambda: len(browser.execute_script(rows)) == 4)
        _wait(lambda: int(count("shared") or 0) > 0 and int(count("in_use") or 0) > 0)
        _wait(lambda: text("stat-running") == "4")
        cached = [int(c) for c in browser.execute_script(rows)]
        assert sum(c > 0 for c in cached) >= 3  # all but the first found the prompt cached

        # Point at the first block of the prompt: the tip names the four sequences.
        layout = browser.execute_script("return cellMap.L")
        assert layout["per"] == 1
        first = int(browser.execute_script(
            "return current.requests[0].blocks[0]"))  # fmt: skip
        canvas = browser.find_element(By.ID, "blockmap")
        x = (first % layout["cols"]) * layout["cell"] + layout["cell"] // 2
        y = (first // layout["cols"]) * layout["cell"] + layout["cell"] // 2
        size = canvas.size
        ActionChains(browser).move_to_element_with_offset(
            canvas, x - size["width"] // 2, y - size["height"] // 2
        ).perform()
        tip = _wait(lambda: "holders" in (t := browser.find_element(By.ID, "tip").text) and t)
        assert f"block {first}: shared" in tip and "position 0" in tip and "holders: 4" in tip

        browser.find_element(By.ID, "pintext").send_keys(PINNED)  # the page's pin control
        browser.find_element(By.ID, "pinbutton").click()
        _wait(lambda: count("pinned").isdigit() and int(count("pinned")) > 0)
        assert "tokens" in text("pins")

        _wait(lambda: browser.execute_script("return points.length") >= 5)
        ActionChains(browser).move_by_offset(0, 400).perform()  # the tip away
        shot = Path(os.environ.get("KVPOOL_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

        for stream in streams:
            stream.close()
        streams = []
        _wait(lambda: count("shared") == "0" and count("in_use") == "0")
        _wait(lambda: int(count("cached")) > 0)
        assert text("stat-hit-rate") not in ("-", "0.0%")
        assert text("stat-preemptions") == "0"

        browser.execute_script("document.querySelector('#pins button').click()")  # unpin
        _wait(lambda: text("pins") == "none")
        _wait(lambda: count("pinned") == "0")
    finally:
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.close()
        assert server.stop() == 0, server.logs()


def test_with_keys_the_page_asks_for_one_and_shows_a_tenant_its_own(browser, tmp_path):
    from selenium.webdriver.common.by import By

    keys = tmp_path / "keys"
    keys.write_text("alice key-alice\n")
    server = ServerProcess("--api-key", "key-admin", "--keys-file", str(keys))
    try:
        browser.get(f"{server.url}/dashboard")
        form = browser.find_element(By.ID, "keyform")
        _wait(lambda: form.is_displayed())
        browser.find_element(By.ID, "key").send_keys("key-alice")
        browser.find_element(By.ID, "keybutton").click()
        _wait(lambda: browser.find_element(By.ID, "who").text == "tenant alice")
        assert not browser.find_element(By.ID, "history").is_displayed()  # pool-wide: admins
        assert "your" in browser.find_element(By.ID, "stats").text
    finally:
        browser.execute_script("sessionStorage.clear()")
        assert server.stop() == 0, server.logs()


def test_a_simulated_replay_scrubs_through_its_frames(browser, tmp_path):
    from kvpool.cli import main

    out = tmp_path / "replay.html"
    assert main(["simulate", "--requests", "60", "--html", str(out), "--quiet"]) == 0
    browser.get(out.as_uri())  # a file, no server: everything is in it

    def shown(i: int) -> tuple[str, str]:
        return browser.execute_script(
            "const s = document.getElementById('scrub'); s.value = arguments[0]; s.oninput();"
            "return [document.getElementById('frameinfo').textContent,"
            " document.getElementById('count-in_use').textContent]",
            i,
        )

    frames = browser.execute_script("return window.KVPOOL_REPLAY.frames")
    seen = {shown(i)[1] for i in range(0, len(frames), max(1, len(frames) // 12))}
    assert len(seen) > 3  # the map changes as the replay goes
    last = shown(len(frames) - 1)
    assert last[0].startswith(f"frame {len(frames)} of {len(frames)}")
    assert last[1] == str(frames[-1]["counts"]["in_use"])
