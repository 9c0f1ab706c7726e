"""What the trainer's record of trained groups costs each checkpoint as a run grows: the
append-only log (rlmesh.trainer.trained_log: a checkpoint appends the steps since the last
one and syncs) against the baseline measured in the same run, the whole record serialized
into every checkpoint's trainer_state.json (json.dumps, indent=2, synced), as the trainer
did before the log. And what the trainer holds of it in memory: the ids' 64-bit digests
(trained_log.GroupIds) against the baseline, a set of the ids themselves (as before), both
measured with tracemalloc after the run.

A simulated run of --steps steps of --groups group ids each (ids as the buffer names them,
"g<n>"), a checkpoint every --interval steps; no model, only the record. Prints per
checkpoint (the first and the last) bytes written and seconds, then a JSON line.

    python -m bench.trained_record
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from rlmesh.trainer.trained_log import GroupIds, TrainedLog, log_path


def whole_record(path: Path, record: dict[int, list[str]]) -> int:
    """The baseline: the whole record in trainer_state.json (as before the log)."""
    text = json.dumps({"trained_groups": {str(step): ids for step, ids in record.items()}}, indent=2)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return len(text)


def held_bytes(build: Callable[[], object]) -> tuple[int, object]:
    """The memory what build() returns holds (tracemalloc: allocated during the build, still held)."""
    tracemalloc.start()
    try:
        held = build()
        return tracemalloc.get_traced_memory()[0], held
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--groups", type=int, default=512)
    parser.add_argument("--interval", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        log = TrainedLog(log_path(root, "bench"), GroupIds(), 0, 0)
        record: dict[int, list[str]] = {}
        rows = []
        for step in range(1, args.steps + 1):
            ids = [f"g{(step - 1) * args.groups + i}" for i in range(args.groups)]
            record[step] = ids
            log.add(step, ids)
            if step % args.interval:
                continue
            started = time.perf_counter()
            baseline_bytes = whole_record(root / "trainer_state.json", record)
            baseline_seconds = time.perf_counter() - started
            size = log.size
            started = time.perf_counter()
            log.flush()
            rows.append((step, baseline_bytes, baseline_seconds, log.size - size, time.perf_counter() - started))
    every_id = [f"g{n}" for n in range(args.steps * args.groups)]
    # (the ids' strings are made inside each build: the baseline held them too)
    set_bytes, _ = held_bytes(lambda: {f"g{n}" for n in range(len(every_id))})
    digest_bytes, digests = held_bytes(lambda: GroupIds(f"g{n}" for n in range(len(every_id))))
    started = time.perf_counter()
    assert all(gid in digests for gid in every_id[:: max(len(every_id) // 100_000, 1)])
    lookup_us = (time.perf_counter() - started) / min(len(every_id), 100_000) * 1e6
    print(f"{args.steps} steps x {args.groups} groups, a checkpoint every {args.interval} steps")
    print("| checkpoint at step | whole record: bytes | seconds | log: bytes appended | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for step, b_bytes, b_seconds, l_bytes, l_seconds in (rows[0], rows[-1]):
        print(f"| {step} | {b_bytes:,} | {b_seconds:.3f} | {l_bytes:,} | {l_seconds:.3f} |")
    total = {"baseline_bytes": sum(r[1] for r in rows), "log_bytes": sum(r[3] for r in rows)}
    print(f"over the run: whole record {total['baseline_bytes']:,} bytes, log {total['log_bytes']:,} bytes")
    print(
        f"in memory, {len(every_id):,} ids: digests {digest_bytes / 1e6:.1f} MB ({lookup_us:.1f} us a lookup), "
        f"a set of the ids (baseline) {set_bytes / 1e6:.1f} MB"
    )
    last = rows[-1]
    print(json.dumps({"steps": args.steps, "groups": args.groups, "interval": args.interval, **total,
                      "last_baseline_seconds": last[2], "last_log_seconds": last[4],
                      "memory_digest_bytes": digest_bytes, "memory_set_bytes": set_bytes}))  # fmt: skip


if __name__ == "__main__":
    main()
