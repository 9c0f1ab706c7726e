"""The coordinator's page: static files (plain HTML, JS and CSS; no build step, nothing
fetched from the network) served at /ui/ on the API's own origin. The files carry no run
data, so they are served without the token; every API call the page makes sends it
(the page asks for it once and keeps it in the tab's sessionStorage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from rlmesh.common.sample import group_from_proto, sample_to_json
from rlmesh.v1 import sample_pb2

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PREFIX = "/ui"
# Per-token arrays are of no use to a person reading a sample (and large): left out.
_ARRAYS = ("tokens", "loss_mask", "rollout_log_probs", "multimodal_inputs")


# The page shows text the model wrote: it runs only its own script and talks only to its
# own origin, whatever that text holds.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class _PageFiles(StaticFiles):
    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


def is_page_path(path: str) -> bool:
    """The page's own files (and the redirect to them): no token needed."""
    return path in ("/", PAGE_PREFIX) or path.startswith(PAGE_PREFIX + "/")


def mount_page(app: FastAPI) -> None:
    app.mount(PAGE_PREFIX, _PageFiles(directory=STATIC_DIR, html=True), name="page")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse(PAGE_PREFIX + "/")


def group_for_people(msg: sample_pb2.SampleGroup) -> dict[str, Any]:
    """A stored group as the samples browser shows it: prompt, responses, rewards and their
    components, status, weight versions, metadata (an agent sample's tool turns are in its
    metadata's agent_turns); the per-token arrays are dropped."""
    group = group_from_proto(msg)
    samples = []
    for s in group.samples:
        d = sample_to_json(s)
        for k in _ARRAYS:
            d.pop(k, None)
        d["multimodal_inputs"] = len(s.multimodal_inputs)
        samples.append(d)
    return {"group_id": group.group_id, "group_index": group.group_index, "dataset": group.dataset, "samples": samples}


def filter_group(
    group: dict[str, Any], status: str | None, min_reward: float | None, max_reward: float | None
) -> dict[str, Any] | None:
    """The group with only its samples of that status and reward range (bounds included), and
    how many it had (`samples_total`); None when none is left. A sample without a reward yet
    matches no reward bound."""

    def keep(s: dict[str, Any]) -> bool:
        reward = s.get("reward")
        if status is not None and s.get("status") != status:
            return False
        if min_reward is not None and (reward is None or reward < min_reward):
            return False
        return max_reward is None or (reward is not None and reward <= max_reward)

    samples = [s for s in group["samples"] if keep(s)]
    return {**group, "samples": samples, "samples_total": len(group["samples"])} if samples else None
