"""The coordinator's page in a real headless Chromium (Debian's `chromium`, driven by
Playwright from PyPI; no browser is downloaded): a person enters the token, starts a run
from a config, watches a curve gain points, pauses it (it comes to rest: no progress),
resumes it, browses its recent groups and stops it. Every service is real and on loopback.

Screenshots are kept under tests/artifacts/page/ (or $RLMESH_TEST_ARTIFACTS/page/)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from rlmesh.common.auth import stack_token
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack, wait_for_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("RLMESH_TEST_ARTIFACTS", Path(__file__).parents[1] / "artifacts")) / "page"
TIMEOUT_MS = 120_000

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
expect = playwright_api.expect


@pytest.fixture
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


def reward_points(page) -> int:
    return int(page.locator('figure.chart[data-title^="Reward"]').get_attribute("data-points") or 0)


def wait_until(predicate, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_person_starts_watches_pauses_resumes_and_stops_a_run(
    browser, redis_url, start_in_loop, engine_url, tmp_path, tiny_model_dir
):
    stack = start_local_stack(start_in_loop, redis_url, engine_url, tmp_path)
    api = stack.api
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    # Script errors, and anything the page's Content-Security-Policy blocked, are bugs; a
    # refused request (the wrong token's 401) is logged too, and is what the test asks for.
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
    shot = lambda name: page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)  # noqa: E731

    # The page itself is served without the token; it asks for it, and a wrong one is refused.
    page.goto(f"http://{stack.addresses['coordinator']}/")
    page.locator("#token").fill("not-the-token")
    page.locator("#token-form button").click()
    expect(page.locator("#login-error")).to_contain_text("token")
    shot("01-token-refused")
    page.locator("#token").fill(stack_token())
    page.locator("#token-form button").click()
    page.locator("#app").wait_for(state="visible")

    # Start a run from a config (checkpoints on, so the checkpoints tab has something to list).
    config = {
        **run_config(tmp_path, tiny_model_dir, num_rollouts=100_000),
        "name": "page-demo",
        "checkpoint_interval": 20,
        "keep_last": 2,
        "eval": {"limit": 4, "interval": 10, "sampling": {"max_new_tokens": 4, "temperature": 0}},
    }
    page.locator("#new-run summary").click()
    page.locator("#config-input").fill(json.dumps(config))
    page.locator("#start-run").click()
    expect(page.locator("#run-status")).to_have_text("running")
    run_id = page.locator("#run-id").text_content()
    assert api.get(f"/runs/{run_id}").json()["name"] == "page-demo"

    # A curve gains points while it trains.
    wait_until(lambda: reward_points(page) >= 3, what="the reward curve's first points")
    first = reward_points(page)
    wait_until(lambda: reward_points(page) > first + 2, what="the reward curve to grow")
    # Each step's time split is drawn stacked, every part of it (other included) named in the legend.
    split = page.locator('figure.chart[data-title^="Step time split"]')
    assert split.get_attribute("data-stacked") == "true" and int(split.get_attribute("data-points") or 0) > 0
    legend = split.locator(".legend").inner_text()
    for part in ("generate", "reward", "train", "update", "other"):
        assert f"split/{part}_seconds" in legend
    shot("02-running")

    # Pause: the run comes to rest at a step boundary and makes no progress.
    page.locator("#pause").click()
    expect(page.locator("#run-status")).to_have_text("paused")
    run = api.get(f"/runs/{run_id}").json()
    assert run["status"] == "paused" and run["held"]
    rollouts, points = run["rollout_id"], reward_points(page)
    time.sleep(3)
    run = api.get(f"/runs/{run_id}").json()
    assert run["status"] == "paused" and run["rollout_id"] == rollouts
    assert reward_points(page) == points
    assert page.locator("#resume").is_enabled() and not page.locator("#pause").is_enabled()
    shot("03-paused")

    # The recent groups: prompt, responses, rewards, weight versions.
    page.locator('#tabs button[data-tab="samples"]').click()
    page.locator("#samples article.group").first.wait_for()
    group = page.locator("#samples article.group").first
    assert "rev " in group.locator("pre.prompt").text_content()
    assert group.locator("table.samples tr").count() == 1 + 3  # a header and n_samples_per_prompt rows
    assert "exact_match=" in group.text_content() and "v" in group.text_content()
    shot("04-samples")

    page.locator('#tabs button[data-tab="checkpoints"]').click()
    page.locator("#checkpoints tbody tr").first.wait_for()
    checkpoints = api.get(f"/runs/{run_id}/checkpoints").json()
    assert checkpoints and all(c["automatic"] and c["step"] % 20 == 0 for c in checkpoints)
    shot("05-checkpoints")

    # Resume: it trains again and the curve grows.
    page.locator('#tabs button[data-tab="curves"]').click()
    page.locator("#resume").click()
    expect(page.locator("#run-status")).to_have_text("running")
    wait_until(lambda: reward_points(page) > points + 2, what="the reward curve to grow after resuming")
    assert api.get(f"/runs/{run_id}").json()["rollout_id"] > rollouts

    # Stop.
    page.locator("#stop").click()
    expect(page.locator("#run-status")).to_have_text("stopped")
    run = wait_for_run(api, run_id)
    assert run["status"] == "stopped" and run["rollout_id"] < 100_000
    assert page.locator("#delete").is_enabled()
    shot("06-stopped")
    assert errors == []
    print(f"screenshots in {ARTIFACTS}")
