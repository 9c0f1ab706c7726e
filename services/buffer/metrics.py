"""Prometheus metrics of every run in the buffer's Redis, in the text exposition format
(version 0.0.4), served over a minimal HTTP endpoint (`GET /metrics`) when the
`metrics_port` setting is not 0. Written by hand: it is a few lines, and saves a
dependency."""

from __future__ import annotations

import asyncio
import logging

from rlmesh.buffer.store import BufferStore
from rlmesh.common.errors import NotFound

log = logging.getLogger(__name__)

# BufferStats field -> (metric name, type, help)
_METRICS = [
    ("queued_groups", "queued_groups", "gauge", "Completed groups waiting for training."),
    ("queued_samples", "queued_samples", "gauge", "Samples in the queued groups."),
    ("leased_groups", "leased_groups", "gauge", "Groups leased to a trainer, not yet acknowledged."),
    ("partial_groups", "partial_groups", "gauge", "Aborted groups waiting to resume."),
    ("epoch", "epoch", "gauge", "Epoch of the first training dataset."),
    ("groups_written", "groups_written_total", "counter", "Completed groups stored (duplicates not counted)."),
    ("acknowledged_groups", "acknowledged_groups_total", "counter", "Groups acknowledged by a trainer."),
    ("dropped_groups", "dropped_groups_total", "counter", "Groups dropped (filtered out by rollout, or stale)."),
    ("stale_groups_dropped", "stale_groups_dropped_total", "counter", "Groups dropped as older than a lease's bound."),
    ("stale_groups_kept", "stale_groups_kept_total", "counter", "Groups delivered although older than a lease's bound."),
    ("redelivered_groups", "redelivered_groups_total", "counter", "Groups redelivered after a batch lease expired."),
    ("dead_letter_groups", "dead_letter_groups", "gauge",
     "Groups in the dead-letter list (rejected by a trainer, or delivered max_deliveries times); never delivered."),
    ("prompts_handed_out", "prompts_handed_out_total", "counter", "Prompt groups handed to rollout workers."),
    ("prompts_reissued", "prompts_reissued_total", "counter", "Prompts handed out again after their lease expired."),
    ("partial_groups_returned", "partial_groups_returned_total", "counter", "Aborted groups handed back to resume."),
    ("prompts_skipped", "prompts_skipped_total", "counter", "Dataset records skipped as longer than max_prompt_length."),
    ("groups_written_per_second", "groups_written_per_second", "gauge", "Groups written per second (rate window)."),
    ("groups_acknowledged_per_second", "groups_acknowledged_per_second", "gauge",
     "Groups acknowledged per second (rate window)."),
    ("prompts_handed_out_per_second", "prompts_handed_out_per_second", "gauge",
     "Prompt groups handed out per second (rate window)."),
]
PREFIX = "rlmesh_buffer_"


def _label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


async def render(store: BufferStore) -> str:
    stats = {}
    for run in await store.list_runs():
        try:
            stats[run] = await store.stats(run)
        except NotFound:  # deleted meanwhile
            continue
    lines: list[str] = []
    for field, name, kind, help_text in _METRICS:
        lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
        lines += [f'{PREFIX}{name}{{run="{_label(run)}"}} {s[field]}' for run, s in stats.items()]
    name = f"{PREFIX}dropped_groups_by_reason_total"
    lines += [f"# HELP {name} Groups dropped, by reason.", f"# TYPE {name} counter"]
    for run, s in stats.items():
        lines += [f'{name}{{run="{_label(run)}",reason="{_label(reason)}"}} {n}'
                  for reason, n in sorted(s["dropped_by_reason"].items())]
    return "\n".join(lines) + "\n"


async def start_metrics_server(store: BufferStore, host: str, port: int) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await reader.readline()
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # headers: not needed
            parts = request_line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                status, body = "200 OK", (await render(store)).encode()
            else:
                status, body = "404 Not Found", b"only GET /metrics is served here\n"
        except Exception as e:
            log.exception("metrics scrape failed")
            status, body = "500 Internal Server Error", f"metrics failed: {type(e).__name__}: {e}\n".encode()
        head = (f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            writer.write(head + body)
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
