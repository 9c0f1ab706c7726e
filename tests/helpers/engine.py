"""What the reference engine's tests share."""

from __future__ import annotations

import time

import httpx

# Long enough that a request with ignore_eos is still running when a test aborts it.
LONG = {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 0}


def wait_until_in_flight(client: httpx.Client) -> None:
    """/flush_cache answers 400 while requests are in flight."""
    while client.post("/flush_cache", json={}).status_code != 400:
        time.sleep(0.01)
