"""`rlmesh run CONFIG` and `rlmesh runs ...`: submit, follow, list and operate runs through
the coordinator's REST API (client.py), found through the local stack's data directory
(`rlmesh up`) or --url."""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from string import Template

import httpx
import yaml

from rlmesh.cli.client import (
    URL_ENV,
    CliError,
    Coordinator,
    answer,
    eval_rewards,
    find_coordinator,
    follow,
    reward_text,
    run_metrics,
)

MAX_CONFIG_BYTES = 1024 * 1024  # (the coordinator's default max_request_bytes)
ACTIONS = ("stop", "pause", "resume")
# Metric record fields that say where a record lies: the CSV's first columns.
KEY_COLUMNS = ("rollout_id", "sft_step", "step", "time")


def add_connection_flags(p: argparse.ArgumentParser, inherited: bool = False) -> None:
    """--data-dir, --url, --token-file; `inherited`: on a subcommand of `runs`, whose own
    defaults would otherwise overwrite what was given before the subcommand."""

    def default(value: str) -> str:
        return argparse.SUPPRESS if inherited else value

    p.add_argument("--data-dir", default=default(".rlmesh"), help="the data directory of the `rlmesh up` to talk to")
    p.add_argument("--url", default=default(""), help=f"the coordinator's address instead (or {URL_ENV})")
    p.add_argument(
        "--token-file",
        default=default(""),
        help="a file holding the stack's token (default: RLMESH_TOKEN, RLMESH_TOKEN_FILE, or the data directory's)",
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "run",
        help="submit a run (a YAML or JSON run config, see docs/run-config.md) and follow it to its end; "
        "Ctrl-C asks whether to stop it",
    )
    r.add_argument("config", help="the run config: a .yaml/.yml or .json file")
    r.add_argument("--detach", action="store_true", help="submit and exit without following it")
    add_connection_flags(r)
    s = sub.add_parser(
        "runs", help="list runs; `rlmesh runs show|stop|pause|resume|delete|move|metrics ID` operate one"
    )
    add_connection_flags(s)
    ops = s.add_subparsers(dest="action")
    show = ops.add_parser("show", help="a run's status, progress, eval and final model")
    show.add_argument("id")
    show.add_argument("--json", action="store_true", help="the whole record as JSON")
    show.add_argument("--follow", action="store_true", help="follow it to its end, as `rlmesh run` does")
    for name, what in (
        ("stop", "stop a run (a queued one at once)"),
        ("pause", "hold a run at its next step boundary"),
        ("resume", "let a paused run carry on"),
        ("delete", "forget a finished or queued run (checkpoints stay on disk)"),
    ):
        ops.add_parser(name, help=what).add_argument("id")
    move = ops.add_parser("move", help="move a queued run to POSITION in the queue (1 = next)")
    move.add_argument("id")
    move.add_argument("position", type=int)
    metrics = ops.add_parser("metrics", help="a run's metric records (JSON lines; --csv: a CSV table)")
    metrics.add_argument("id")
    metrics.add_argument("--csv", action="store_true", help="one row per record, one column per metric")
    for p in ops.choices.values():
        add_connection_flags(p, inherited=True)


def load_config(path: str) -> dict:
    """The run config file as a dict: JSON for .json, else YAML (a JSON file is YAML too)."""
    file = Path(path)
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise CliError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
        text = file.read_text()
    except OSError as e:
        raise CliError(f"{path} cannot be read: {e.strerror}") from None
    try:
        config = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise CliError(f"{path} is not valid {'JSON' if file.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(config, dict):
        raise CliError(f"{path} must hold a mapping of run config fields (docs/run-config.md)")
    return config


DATA_DIR_ENV = "RLMESH_DATA_DIR"


def expand(value, env: dict[str, str]):
    """$NAME and ${NAME} in the config's strings replaced by environment variables (unknown
    ones are left as they are), so one file serves any data directory."""
    if isinstance(value, str):
        return Template(value).safe_substitute(env)
    if isinstance(value, list):
        return [expand(v, env) for v in value]
    if isinstance(value, dict):
        return {k: expand(v, env) for k, v in value.items()}
    return value


def run(args: argparse.Namespace) -> int:
    coordinator = find_coordinator(args.data_dir, args.url, args.token_file)
    env = dict(os.environ)
    if coordinator.data_dir is not None:  # the local stack's, whatever the environment says
        env[DATA_DIR_ENV] = str(coordinator.data_dir)
    config = expand(load_config(args.config), env)
    start = time.monotonic()
    with coordinator.client() as http:
        created = answer(http.post("/runs", json=config))
        run_id = created["id"]
        where = f"queued, #{created['queue_position']} in line" if created["status"] == "queued" else "started"
        name = f": {config['name']}" if config.get("name") else ""
        print(f"run {run_id} {where}{name}; watch it at {coordinator.url}/ui/", flush=True)
        if args.detach:
            return 0
        return follow_to_end(coordinator, http, run_id, start)


def follow_to_end(coordinator: Coordinator, http, run_id: str, start: float) -> int:
    """Follow the run, then say how it ended (eval, final model). Ctrl-C asks whether to stop
    it: yes stops it and follows it to its end; no (or a second Ctrl-C) leaves it running."""
    while True:
        try:
            final = follow(http, run_id, start, echo=lambda line: print(line, flush=True))
            break
        except KeyboardInterrupt:
            if not ask(f"\nstop run {run_id}? [y/N] "):
                print(f"run {run_id} goes on; `rlmesh runs show {run_id} --follow` follows it again")
                return 130
            status = answer(http.post(f"/runs/{run_id}/stop"))["status"]
            print(f"run {run_id}: {status}", flush=True)
    print_outcome(coordinator, final)
    return 0 if final["status"] == "completed" else 1


def ask(question: str) -> bool:
    """A yes/no answer from the terminal; no on a closed stdin or another Ctrl-C."""
    try:
        return input(question).strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        return False


def print_outcome(coordinator: Coordinator, run: dict) -> None:
    print(f"run {run['id']} {run['status']}" + (f": {run['error']}" if run.get("error") else ""))
    before, after = eval_rewards(run.get("eval_before") or {}), eval_rewards(run.get("eval_after") or {})
    for name in sorted(set(before) | set(after)):
        said = [reward_text(rewards[name]) if name in rewards else "-" for rewards in (before, after)]
        print(f"eval {name} reward: before={said[0]} after={said[1]}")
    for warning in run.get("warnings") or []:
        print(f"warning: {warning}")
    if run.get("final_model"):
        print(f"final model: {coordinator.final_model_path(run['final_model'])}")


def runs(args: argparse.Namespace) -> int:
    coordinator = find_coordinator(args.data_dir, args.url, args.token_file)
    with coordinator.client() as http:
        action = args.action
        if action is None:
            print_table(answer(http.get("/runs")))
        elif action == "show":
            record = answer(http.get(f"/runs/{args.id}"))
            if args.follow:
                return follow_to_end(coordinator, http, args.id, time.monotonic())
            if args.json:
                print(json.dumps(record, indent=2))
            else:
                print_table([record])
                print_outcome(coordinator, record)
        elif action in ACTIONS:
            print(f"run {args.id}: {answer(http.post(f'/runs/{args.id}/{action}'))['status']}")
        elif action == "delete":
            answer(http.delete(f"/runs/{args.id}"))
            print(f"run {args.id} deleted")
        elif action == "move":
            moved = answer(http.post(f"/runs/{args.id}/queue-position", json={"position": args.position}))
            print(f"run {args.id}: queued, #{moved['queue_position']} in line")
        elif action == "metrics":
            answer(http.get(f"/runs/{args.id}", params={"metrics_last": 0}))  # (an unknown run: a clear 404)
            write_metrics(run_metrics(http, args.id), as_csv=args.csv)
    return 0


def print_table(records: list[dict]) -> None:
    rows = [("ID", "NAME", "STATUS", "PHASE", "ROLLOUT", "CREATED")]
    for r in records:
        status = f"queued #{r['queue_position']}" if r.get("queue_position") else r["status"]
        if r["status"] == "paused" and not r.get("held"):
            status = "pausing"
        created = datetime.fromtimestamp(r["created_at"]).strftime("%Y-%m-%d %H:%M:%S")
        rows.append((r["id"], r["name"], status, r["phase"], f"{r['rollout_id']}/{r['num_rollouts']}", created))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def write_metrics(records: list[dict], as_csv: bool, out=None) -> None:
    """JSON lines, or a CSV with a column per field (where a record lies first, then the
    metrics by name; a record without a field leaves its cell empty)."""
    out = out or sys.stdout
    if not as_csv:
        for record in records:
            out.write(json.dumps(record) + "\n")
        return
    names = sorted({k for r in records for k in r} - set(KEY_COLUMNS))
    columns = [k for k in KEY_COLUMNS if any(k in r for r in records)] + names
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in record.items()})


def main(args: argparse.Namespace) -> int:
    """`rlmesh run` / `rlmesh runs`: 0 on success (a run that completed), 1 on a run that did
    not complete or a refusal (said on stderr), 130 when left running at Ctrl-C."""
    try:
        return run(args) if args.command == "run" else runs(args)
    except CliError as e:
        print(f"rlmesh {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # (the output's reader left, say `| head`: quietly, as SIGPIPE would)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (OSError, httpx.TransportError) as e:
        print(f"rlmesh {args.command}: the coordinator cannot be reached: {e}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.flush()
