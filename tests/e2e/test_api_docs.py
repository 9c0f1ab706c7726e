"""The coordinator's API docs (Swagger UI at /docs) in a real headless Chromium, offline:
its files come from the coordinator (nothing from a CDN), its Content-Security-Policy
blocks nothing it needs, and "Authorize" with the stack's token lets "Try it out" call a
route that needs it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlmesh.common.auth import stack_token
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TIMEOUT_MS = 30_000

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
expect = playwright_api.expect


def test_swagger_ui_loads_from_the_coordinator_and_authorizes(start_in_loop, redis_url, silent_address):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    services = {f"{name}_address": silent_address for name in ("buffer", "rollout", "reward", "trainer")}
    _, port = start_in_loop(lambda: start_coordinator(Settings(port=0, redis_url=redis_url, **services)))
    base = f"http://127.0.0.1:{port}"
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        errors, elsewhere = [], []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        # offline: any request off the coordinator's origin is refused (and recorded)
        page.route(
            "**/*",
            lambda route: (
                route.continue_()
                if route.request.url.startswith(base)
                else (elsewhere.append(route.request.url), route.abort())
            ),
        )
        page.goto(f"{base}/docs")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("rlmesh coordinator")
        page.locator("button.authorize").first.click()
        page.locator(".auth-container input").fill(stack_token())
        page.locator(".auth-btn-wrapper button.authorize").click()
        page.locator("button.btn-done").click()
        operation = page.locator("#operations-default-list_runs_runs_get")
        operation.locator(".opblock-summary").click()
        operation.locator("button.try-out__btn").click()
        operation.locator("button.execute").click()
        expect(operation.locator(".live-responses-table tbody td.response-col_status").first).to_have_text("200")
        browser.close()
    assert errors == [] and elsewhere == [], (errors, elsewhere)
