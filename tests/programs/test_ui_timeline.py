"""The live page's timelines and charts in headless Chromium (issue 52, acceptance 1): a running MCTS
program's timeline grows on the live page, the charts move under its load, and after a restart of the
server on the same SQLite file the finished program's timeline comes back from the records at
/ui/programs/{id}. AGENTRT_TIMELINE_SCREENSHOTS=docs writes the screenshots docs/serving.md shows."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest

import agentrt
from agentrt.programs.countdown import Puzzle
from agentrt.programs.mcts import mcts
from tests.programs.test_ui import CHROMIUM
from tests.server.live import live_server, tiny_config

SHOTS = os.environ.get("AGENTRT_TIMELINE_SCREENSHOTS")  # a folder (docs) to copy the screenshots into


def _shot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 5000
    if SHOTS:
        shutil.copy(path, Path(SHOTS) / name)


def test_timeline_grows_charts_move_and_a_finished_program_comes_back_after_a_restart(tiny_model_path, tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium; scripts/setup.sh does it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    config = tiny_config(tiny_model_path, db=f"sqlite:///{tmp_path / 'records.db'}", engine={"max_num_seqs": 4})
    launch = dict(executable_path=CHROMIUM, args=["--no-sandbox", "--headless", "--disable-gpu",
                                                  "--disable-background-networking", "--no-first-run"])
    done: dict = {}
    with live_server(config) as s, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(**launch)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.goto(f"{s.url}/ui")
            page.locator("#chart-tokens svg").wait_for(timeout=20_000)

            async def run() -> None:
                async with agentrt.connect(s.url):
                    done["result"] = await mcts(Puzzle((3, 5, 7, 11), 999), budget=160, width=4, max_tokens=32,
                                                max_expansions=40)

            worker = threading.Thread(target=lambda: anyio.run(run), daemon=True)
            worker.start()
            calls = page.locator("#timeline g.call")
            seen: list[int] = []
            deadline = time.monotonic() + 120
            while worker.is_alive() and time.monotonic() < deadline:  # the page follows the running program
                if page.locator("#timeline").get_attribute("data-program-id"):
                    seen.append(calls.count())
                    if len(set(seen)) == 3:
                        _shot(page, tmp_path, "timeline-live.png")
                time.sleep(0.25)
            worker.join(60)
            result = done["result"]
            pid = page.locator("#timeline").get_attribute("data-program-id")
            grown = [n for n in seen if n]
            assert len(set(grown)) >= 2, seen  # it grew while it ran ...
            assert grown == sorted(grown)  # ... and never shrank
            sync_api.expect(calls).to_have_count(result.calls, timeout=10_000)  # ... to every call it made
            assert page.locator("#timeline g.thread").count() >= 4  # the branches of its gathers
            sync_api.expect(page.locator("#tl-title")).to_contain_text("finished", timeout=10_000)
            assert page.locator('#totals [data-total="calls"]').inner_text() == str(result.calls)
            # the charts moved under the load: tokens flowed, calls ran, blocks were used, the program counted
            for chart in ("chart-tokens", "chart-calls", "chart-kv", "chart-programs"):
                assert float(page.locator(f"#{chart}").get_attribute("data-max") or 0) > 0, chart
            points = page.locator('#chart-tokens polyline[data-series="tokens/s"]').get_attribute("points").split()
            assert len(points) >= 3 and len({p.split(",")[1] for p in points}) >= 2  # a line that moved
            if len(set(seen)) < 3:
                _shot(page, tmp_path, "timeline-live.png")
            http = httpx.get(f"{s.url}/v1/programs/{pid}/timeline", timeout=30).json()
            assert http["totals"]["calls"] == result.calls and http["state"] == "finished"
        finally:
            browser.close()
    # a new server on the same records: the finished program's timeline is drawn from SQLite
    with live_server(config) as s2, sync_api.sync_playwright() as pw:
        assert s2.state.runtime.programs.get(pid) is None
        browser = pw.chromium.launch(**launch)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 700})
            page.goto(f"{s2.url}/ui/programs/{pid}")
            sync_api.expect(page.locator("#timeline g.call")).to_have_count(result.calls, timeout=20_000)
            assert page.locator("body").get_attribute("data-state") == "finished"
            assert page.locator('#totals [data-total="calls"]').inner_text() == str(result.calls)
            assert page.locator('#totals [data-total="output tokens"]').inner_text() == str(http["totals"]["num_output_tokens"])
            assert page.locator("#error").inner_text() == ""
            states = {page.locator("#timeline g.call").nth(i).get_attribute("data-state") for i in range(result.calls)}
            assert states <= {"stop", "length"}
            _shot(page, tmp_path, "timeline-program.png")
        finally:
            browser.close()
