"""The live page of `agentrt serve` (GET /ui): self-contained, keyless itself, and — in headless
Chromium driven by Playwright — showing the server's programs and their changes as they end."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from agentrt.server import create_app
from agentrt.server.ui import PAGE
from tests.server.live import live_server, tiny_config

KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = os.environ.get("AGENTRT_UI_SCREENSHOT")  # also copy the screenshot here (docs/ui.png)


def test_page_is_self_contained():
    assert "<script>" in PAGE and "<style>" in PAGE
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", PAGE), "the page must load nothing from another host"
    assert "http://" not in PAGE and "https://" not in PAGE
    assert "/ui" in create_app().state.openapi["paths"]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    with live_server(tiny_config(tiny_model_path, api_keys=[KEY])) as s:
        yield s


def test_page_needs_no_key_but_its_data_does(server):
    r = httpx.get(f"{server.url}/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and "agentrt" in r.text
    r = httpx.get(f"{server.url}/?key=abc", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/ui?key=abc"
    assert httpx.get(f"{server.url}/v1/programs").status_code == 401
    assert httpx.get(f"{server.url}/v1/programs", headers=AUTH).status_code == 200


def test_browser_sees_programs_run_and_end(server, tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium; scripts/setup.sh does it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
    for pid, name in (("ui-alpha", "alpha"), ("ui-beta", "beta")):
        assert http.post("/v1/programs", json={"program_id": pid, "name": name}).status_code == 201
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                  headers={"X-Program-Id": "ui-alpha"})
    assert r.status_code == 200
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 480})
            page.goto(f"{server.url}/ui?key={KEY}")
            alpha = page.locator('tr[data-program-id="ui-alpha"]')
            beta = page.locator('tr[data-program-id="ui-beta"]')
            alpha.wait_for(timeout=20_000)
            assert alpha.get_attribute("data-state") == "running" and beta.get_attribute("data-state") == "running"
            assert "0/0/1" in alpha.inner_text()  # its call is done
            sync_api.expect(page.locator("#count-running")).to_have_text("2", timeout=10_000)
            assert page.locator("#keyform").is_hidden() and page.locator("#error").inner_text() == ""

            assert http.delete("/v1/programs/ui-beta").status_code == 200  # one program ends ...
            page.locator('tr[data-program-id="ui-beta"][data-state="finished"]').wait_for(timeout=10_000)
            assert alpha.get_attribute("data-state") == "running"  # ... the other runs on
            sync_api.expect(page.locator("#count-running")).to_have_text("1", timeout=10_000)
            shot = tmp_path / "ui.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 1000
            if SCREENSHOT:
                shutil.copy(shot, Path(SCREENSHOT))

            keyless = browser.new_page()  # without the key: the page asks for it
            keyless.goto(f"{server.url}/ui")
            keyless.locator("#keyform").wait_for(state="visible", timeout=10_000)
            keyless.fill("#key", KEY)
            keyless.click("#keyform button")
            keyless.locator('tr[data-program-id="ui-alpha"]').wait_for(timeout=10_000)
        finally:
            browser.close()
            http.delete("/v1/programs/ui-alpha")
            http.close()


def test_browser_sees_the_kv_tiers_and_a_program_s_loaded_tokens(tiny_model_path):
    """A server with a host tier and a pool of 6 blocks: a program's second call with its first prompt finds
    that prompt's evicted blocks in T1; the page shows the tier's blocks and hits, and the program's tokens
    loaded from tiers."""
    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium; scripts/setup.sh does it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    config = tiny_config(tiny_model_path, engine={"num_blocks": 6, "kv_host_gib": 0.01})
    prompt = list(range(3, 73))  # 4 full blocks and a partial one
    with live_server(config) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        assert http.post("/v1/programs", json={"program_id": "ui-tiers"}).status_code == 201
        for p in (prompt, [t + 200 for t in prompt], prompt):
            r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 2, "temperature": 0},
                          headers={"X-Program-Id": "ui-tiers"})
            assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert http.get("/v1/programs/ui-tiers").json()["kv_tier_loaded_tokens"] == 48
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--headless", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.goto(f"{s.url}/ui")
                sync_api.expect(page.locator("#tiers")).to_have_text(re.compile(r"host \d+ blocks, 3 hits"),
                                                                     timeout=20_000)
                assert page.locator("#tiers-stat").is_visible()
                row = page.locator('tr[data-program-id="ui-tiers"]')
                row.wait_for(timeout=10_000)
                assert "64 (48 from tiers)" in row.inner_text()
            finally:
                browser.close()
