"""The coordinator's page in a real headless Chromium (Debian's `chromium`, driven by
Playwright from PyPI; no browser is downloaded): a person enters the token, starts a run
from a config, watches a curve gain points, pauses it (it comes to rest: no progress),
resumes it, browses its recent groups (filtered by reward and status) and stops it; then
overlays its curves with a second run's and downloads the chart's data as CSV. Every
service is real and on loopback.

Screenshots are kept under tests/artifacts/page/ (or $RLMESH_TEST_ARTIFACTS/page/)."""

from __future__ import annotations

import csv
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
        "checkpoint_interval": 5,
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
    # A paused run takes no checkpoint, so the checkpoints tab below needs one taken before the pause
    # (a busy machine can draw the curve's points before the run reaches its first checkpoint).
    wait_until(lambda: api.get(f"/runs/{run_id}/checkpoints").json(), what="the run's first checkpoint")

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
    # Filtered by reward: only samples rewarded at least as well as the newest group's first one.
    newest = api.get(f"/runs/{run_id}/samples", params={"limit": 1}).json()["groups"][0]
    floor = newest["samples"][0]["reward"]
    page.locator("#samples-min-reward").fill(str(floor))
    page.locator("#samples-min-reward").dispatch_event("change")
    expect(page.locator("#samples-total")).to_contain_text("groups kept match")
    page.locator("#samples article.group").first.wait_for()
    rewards = page.locator("#samples table.samples td:nth-child(3)").all_text_contents()
    assert rewards and all(float(r) >= floor - 1e-3 for r in rewards), (floor, rewards)
    # ... and by status: this run's samples did not fail.
    page.locator("#samples-status").select_option("failed")
    expect(page.locator("#samples")).to_have_text("no group matches")
    shot("04b-samples-filtered")
    page.locator("#samples-status").select_option("")
    page.locator("#samples-min-reward").fill("")
    page.locator("#samples-min-reward").dispatch_event("change")

    page.locator('#tabs button[data-tab="checkpoints"]').click()
    page.locator("#checkpoints tbody tr").first.wait_for()
    checkpoints = api.get(f"/runs/{run_id}/checkpoints").json()
    assert checkpoints and all(c["automatic"] and c["step"] % 5 == 0 for c in checkpoints)
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

    # A second run with another learning rate: the eval's reward components get their own curves.
    other = {**config, "name": "page-other", "num_rollouts": 12, "optimizer": {"lr": 2e-3}}
    other_id = api.post("/runs", json=other).json()["id"]
    assert wait_for_run(api, other_id)["status"] == "completed"
    page.locator(f'#runs tr[data-run-id="{other_id}"] td:nth-child(2)').click()
    expect(page.locator("#run-status")).to_have_text("completed")
    components = page.locator('figure.chart[data-title="Held-out reward by component"]')
    wait_until(lambda: int(components.get_attribute("data-points") or 0) > 0, what="the eval's component curves")
    assert "eval/held_out/reward/exact_match_mean" in components.locator(".legend").inner_text()

    # Overlay both runs' reward curves: one colour each, named by the run and what differs.
    for rid in (run_id, other_id):
        page.locator(f'#runs tr[data-run-id="{rid}"] input.compare').check()
    page.locator('#tabs button[data-tab="compare"]').click()
    overlay = page.locator("#compare-charts figure.chart")
    expect(overlay).to_have_attribute("data-runs", "2")
    wait_until(lambda: overlay.locator(".legend li").count() == 2, what="both runs in the overlay's legend")
    legend = overlay.locator(".legend li").all_text_contents()
    assert any(t.startswith("page-demo (") for t in legend) and any(t.startswith("page-other (") for t in legend)
    assert all("optimizer.lr=" in t and "num_rollouts=" in t for t in legend), legend
    assert "optimizer.lr" in page.locator("#compare-settings").inner_text()
    colours = {sw.get_attribute("style") for sw in overlay.locator(".legend .swatch").all()}
    assert len(colours) == 2
    shot("07-compare")

    # Its data as CSV: a column per run, a row per rollout, the values the API has.
    with page.expect_download() as info:
        overlay.locator("button.csv").click()
    info.value.save_as(ARTIFACTS / "compare.csv")
    rows = list(csv.reader((ARTIFACTS / "compare.csv").open()))
    assert rows[0][0] == "rollout_id" and len(rows[0]) == 3
    column = next(i for i, h in enumerate(rows[0]) if h.startswith("page-other ("))
    records = api.get(f"/runs/{other_id}/metrics", params={"fields": "rollout/reward_mean", "limit": 1000}).json()
    want = {r["rollout_id"]: r["rollout/reward_mean"] for r in records["records"] if "rollout/reward_mean" in r}
    assert want and {int(r[0]): float(r[column]) for r in rows[1:] if r[column]} == want
    assert errors == []
    print(f"screenshots in {ARTIFACTS}")
