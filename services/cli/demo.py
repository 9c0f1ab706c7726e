"""`rlmesh demo`: a real RL run on a task the tiny model can learn on two CPU cores.

The task: reverse a three-letter string ("rev abc=" -> "cba"). A fifth of all strings
over "abcdefgh" is held out for evaluation. A short SFT warm start teaches the answer
format (and a little of the task); GRPO with an exact-match reward then has to do the
rest. The last line printed is `eval reward: before=X after=Y` (held-out, greedy)."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx

from rlmesh.cli.client import FINAL, follow, run_metrics, train_reward
from rlmesh.cli.embedded_redis import settings_from_args
from rlmesh.common.auth import client_headers
from rlmesh.common.run_config import RunConfig

LETTERS = "abcdefgh"


def write_task(out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = [], []
    for chars in itertools.product(LETTERS, repeat=3):
        s = "".join(chars)
        row = {"prompt": f"rev {s}=", "label": s[::-1]}
        # Held out by a stable hash of the string: the same split on every machine.
        (held_out if zlib.crc32(s.encode()) % 5 == 0 else train).append(row)
    paths = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    for path, rows in zip(paths, (train, held_out)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def demo_config(model_path: str, train: Path, held_out: Path, sft_steps: int = 35, rollouts: int = 80) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": "demo: reverse three letters",
            "model_path": model_path,
            "datasets": [
                {"name": "train", "path": str(train), "shuffle": True, "seed": 0},
                {"name": "held_out", "path": str(held_out), "eval": True},
            ],
            "num_rollouts": rollouts,
            "rollout": {
                "rollout_batch_size": 16,
                "n_samples_per_prompt": 8,
                "sampling": {"max_new_tokens": 8, "temperature": 1.0},
            },
            "reward": {"components": {"exact_match": 1.0}},
            "algorithm": {"advantage_estimator": "grpo"},
            # A 137k-parameter model wants a far larger step than a real LLM.
            "optimizer": {"lr": 3e-3, "grad_clip": 1.0},
            "sft_optimizer": {"lr": 3e-3, "grad_clip": 1.0},
            "micro_batch_size": 128,
            "sft_warmup": {"steps": sft_steps, "batch_groups": 32},
            "eval": {"interval": 10, "sampling": {"max_new_tokens": 8, "temperature": 0.0}},
            "seed": 0,
        }
    )


def _eval_reward(metrics: dict) -> float | None:
    return metrics.get("eval/held_out/reward_mean")


def write_plot(history: list[dict], path: Path) -> None:
    """Reward curves as a small self-contained SVG (train reward and held-out eval by rollout)."""
    w, h, pad = 640, 320, 40
    series = {
        "train reward": [(m["rollout_id"], train_reward(m)) for m in history if train_reward(m) is not None],
        "held-out eval": [(m["rollout_id"], _eval_reward(m)) for m in history if _eval_reward(m) is not None],
    }
    xmax = max([x for pts in series.values() for x, _ in pts] + [1])

    def sx(x):
        return pad + (w - 2 * pad) * x / xmax

    def sy(y):
        return h - pad - (h - 2 * pad) * y

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<line x1="{pad}" y1="{sy(0)}" x2="{w - pad}" y2="{sy(0)}" stroke="black"/>',
        f'<line x1="{pad}" y1="{sy(0)}" x2="{pad}" y2="{sy(1)}" stroke="black"/>',
        f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">rollout</text>',
        f'<text x="8" y="{sy(1) + 4}">1.0</text><text x="8" y="{sy(0) + 4}">0.0</text>',
        f'<text x="{sx(0)}" y="{sy(0) + 16}" text-anchor="middle">0</text>',
        f'<text x="{sx(xmax)}" y="{sy(0) + 16}" text-anchor="middle">{xmax}</text>',
    ]
    for (name, pts), color, y in zip(series.items(), ("#1f77b4", "#d62728"), (20, 36)):
        if pts:
            d = " ".join(f"{sx(x):.1f},{sy(v):.1f}" for x, v in pts)
            parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{pad + 10}" y="{y}" fill="{color}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def _task(args, data_dir: Path, model_path: Path) -> tuple[RunConfig, Path]:
    """The task's datasets written where the stack's buffer may read; its run config and its
    training dataset."""
    from rlmesh.cli import agent_demo, environment_demo
    from rlmesh.cli.launcher import datasets_dir

    sft_steps, rollouts = args.sft_steps, args.rollouts or 80  # (sft_steps None: the task's; 0: none)
    if args.task == "agent":
        warm_start, train, held_out = agent_demo.write_task(datasets_dir(data_dir) / "demo")
        return agent_demo.agent_demo_config(
            str(model_path), warm_start, train, held_out, 200 if sft_steps is None else sft_steps, rollouts
        ), train
    train, held_out = write_task(datasets_dir(data_dir) / "demo")
    make = environment_demo.environment_demo_config if args.task == "environment" else demo_config
    return make(str(model_path), train, held_out, 35 if sft_steps is None else sft_steps, rollouts), train


def _cannot_run(args) -> str:
    from rlmesh.cli import environment_demo

    if args.task != "environment":
        return ""
    if args.coordinator_url and not args.engine_url:
        return "the environment demo on running services needs the engine's address too: --engine-url"
    return environment_demo.atroposlib_missing()


def _feeder_check(http: httpx.Client, run_id: str, feeder: subprocess.Popen | None):
    """For `follow`: a run fed by an environment process is stopped if that process ends
    first (exit 0: it has posted the groups the run needs; else it failed): no sample would
    come any more."""
    if feeder is None:
        return None

    def check(run: dict) -> dict | None:
        if feeder.poll() is None:
            return None
        run = http.get(f"/runs/{run_id}").json()
        if run["status"] not in FINAL:
            print(f"the environment exited with code {feeder.returncode}; stopping the run")
            http.post(f"/runs/{run_id}/stop")
            run = {**run, "status": "stopped", "error": f"the environment exited with code {feeder.returncode}"}
        return run

    return check


def run_demo(args) -> int:
    from rlmesh.cli import environment_demo
    from rlmesh.cli.launcher import running_stack, start_stack
    from rlmesh.cli.tiny_model import build_tiny_model

    start = time.monotonic()
    if why := _cannot_run(args):
        print(why)
        return 2
    data_dir = Path(args.data_dir).resolve()
    demo_dir = data_dir / "demo"
    model_path = demo_dir / "tiny-model"
    if not (model_path / "config.json").exists():
        build_tiny_model(model_path)
    config, train = _task(args, data_dir, model_path)

    stack = environment = None
    url, engine_url = args.coordinator_url, args.engine_url
    if not url:
        state = running_stack(data_dir)
        if state:
            url = state["coordinator_url"]
            engine_url = engine_url or f"http://127.0.0.1:{state['ports']['engine']}"
            print(f"using the services `rlmesh up` started ({url})")
        else:
            print("starting rlmesh (embedded Redis, CPU reference engine, tiny model):")
            # SIGTERM (a CI job's timeout, `kill`) must stop the stack like Ctrl-C does,
            # not leave its services running: exit through the `finally` below.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
            stack = start_stack(
                data_dir, str(model_path), redis_url=args.redis_url, redis_settings=settings_from_args(args)
            )
            url = stack.coordinator_url
            engine_url = f"http://{stack.address('engine')}"
    try:
        with httpx.Client(base_url=url, timeout=60, headers=client_headers()) as http:
            r = http.post("/runs", json=config.model_dump(mode="json"))
            if r.status_code != 201:
                print(f"could not start the run: {r.status_code} {r.text}")
                return 1
            run_id = r.json()["id"]
            print(f"run {run_id} started: {config.name}; watch it at {url}/ui/ (the token is in {data_dir / 'token'})")
            if args.task == "environment":
                trajectory_url = url.rstrip("/") + http.get(f"/runs/{run_id}").json()["trajectory_api"]
                log_file = data_dir / "logs" / "environment.log"
                environment = environment_demo.start_environment(
                    trajectory_url, engine_url, str(model_path), train, config, log_file
                )
                print(f"environment started: python -m rlmesh.cli.reverse_env serve (its log: {log_file})")
            run = follow(
                http,
                run_id,
                start,
                echo=lambda line: print(line, flush=True),
                check=_feeder_check(http, run_id, environment),
            )
            history = run_metrics(http, run_id)
        if run["status"] != "completed":
            print(f"run {run['status']}: {run['error']}")
            return 1
        plot = demo_dir / f"reward-{args.task}.svg"
        write_plot(history, plot)
        print(f"reward curves: {plot}; total {time.monotonic() - start:.0f} s")
        if args.task == "environment":
            print(
                f"environment groups: {run['environment_groups_received']} taken, "
                f"{run['environment_groups_refused']} refused, "
                f"{sum(m.get('train/stale_groups_dropped', 0) for m in history):.0f} dropped as stale"
            )
        print(f"eval reward: before={_eval_reward(run['eval_before']):.2f} after={_eval_reward(run['eval_after']):.2f}")
        return 0
    except httpx.TransportError as e:
        print(f"rlmesh demo: the coordinator at {url} cannot be reached: {e}", file=sys.stderr)
        return 1
    finally:
        if environment is not None:
            environment_demo.stop_environment(environment)
        if stack is not None:
            stack.stop()
