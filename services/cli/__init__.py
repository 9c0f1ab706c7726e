"""The `rlmesh` command: serve one service, bring all of them up, or run the demo."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from rlmesh.common.grpc_server import serve_service
from rlmesh.common.heap import mark_service_process
from rlmesh.common.net import loopback_bypasses_proxy
from rlmesh.common.settings import add_settings_flags, settings_from_args

# service name -> package holding its config.Settings and server.serve
SERVICE_PACKAGES = {
    "buffer": "rlmesh.buffer",
    "rollout": "rlmesh.rollout",
    "reward": "rlmesh.reward",
    "trainer": "rlmesh.trainer",
    "coordinator": "rlmesh.coordinator",
    "engine": "rlmesh.engine",
}
SERVER_MODULE = {"coordinator": "app"}  # the coordinator's transport is HTTP


def service_settings(name: str, argv: list[str]):
    """The settings `rlmesh serve NAME ARGV...` runs with (flags over environment over defaults);
    argparse exits on an unknown flag, pydantic raises on a bad value. (The Kubernetes manifests'
    consistency test reads every container's command line through this.)"""
    package = SERVICE_PACKAGES[name]
    settings_cls = importlib.import_module(f"{package}.config").Settings
    parser = argparse.ArgumentParser(prog=f"rlmesh serve {name}", description=f"Run the {name} service.")
    add_settings_flags(parser, settings_cls)
    return settings_from_args(settings_cls, parser.parse_args(argv))


def _serve(name: str, argv: list[str]) -> None:
    package = SERVICE_PACKAGES[name]
    settings = service_settings(name, argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    if logging.getLogger().level > logging.DEBUG:
        # httpx logs every request at INFO: a line per sample generated (failures are logged as ours).
        logging.getLogger("httpx").setLevel(logging.WARNING)
    server = importlib.import_module(f"{package}.{SERVER_MODULE.get(name, 'server')}")
    mark_service_process()  # (what the service builds is then kept out of the collector's sight)
    if hasattr(server, "serve"):  # HTTP services (coordinator, engine) serve themselves
        asyncio.run(server.serve(settings))
    else:
        asyncio.run(serve_service(server.build, settings))


def _up(args: argparse.Namespace) -> None:
    from rlmesh.cli.embedded_redis import settings_from_args
    from rlmesh.cli.launcher import reload_config, start_stack, supervise
    from rlmesh.cli.stack_config import StackConfigError, load_stack_config
    from rlmesh.cli.tiny_model import build_tiny_model

    try:
        service_config = load_stack_config(args.config) if args.config else {}
    except StackConfigError as e:
        print(f"rlmesh up: {e}", file=sys.stderr)
        sys.exit(2)
    data_dir = Path(args.data_dir)
    model_path = args.model_path or str(data_dir / "tiny-model")
    if not args.model_path and not (Path(model_path) / "config.json").exists():
        print(f"building the tiny model in {model_path}")
        build_tiny_model(model_path)
    from rlmesh.cli.demo import write_task
    from rlmesh.cli.launcher import datasets_dir

    # The toy task examples/reverse/run.yaml trains on (the demo's), under the buffer's data roots.
    write_task(datasets_dir(data_dir) / "reverse")
    print("starting rlmesh:")
    stack = start_stack(
        data_dir,
        model_path,
        redis_url=args.redis_url,
        redis_settings=settings_from_args(args),
        service_config=service_config,
    )
    print(f"rlmesh is up. REST API: {stack.coordinator_url} (docs: {stack.coordinator_url}/docs). Ctrl-C stops it.")
    print(f"Every call needs 'Authorization: Bearer <token>'; the token is in {stack.token_file}.")
    print(f"A service that exits is started again on its port (logs: {data_dir / 'logs'}).")
    stop, reload = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    echo = lambda message: print(message, flush=True)  # noqa: E731

    def on_reload() -> None:
        if not args.config:
            echo("SIGHUP: no --config to read again")
            return
        try:
            restarted = reload_config(stack, load_stack_config(args.config), echo=echo)
        except StackConfigError as e:  # (the running services keep their settings)
            echo(f"SIGHUP: {e}; nothing restarted")
            return
        echo(f"SIGHUP: {args.config} read again; restarted: {', '.join(restarted) or 'none (nothing changed)'}")

    if args.config:
        print(f"SIGHUP (kill -HUP {os.getpid()}) reads {args.config} again and restarts the services it changes.")
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    supervise(stack, stop, echo=echo, reload=reload, on_reload=on_reload)


def _health(address: str, timeout: float) -> int:
    from rlmesh.cli.launcher import grpc_health

    status = grpc_health(address, timeout)
    print(f"{address}: {status}")
    return 0 if status == "SERVING" else 1


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} is below {minimum}")
        return number

    return parse


def seconds(value: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} seconds: give a positive number")
    return number


def host_port(value: str) -> str:
    """An argparse type: HOST:PORT with a port in 1-65535."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: give HOST:PORT, the port in 1-65535")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `rlmesh` command line (`serve SERVICE` and `reward check` take their own flags: see main)."""
    parser = argparse.ArgumentParser(prog="rlmesh", description="RL post-training as five gRPC services.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run one service (rlmesh serve SERVICE --help lists its settings)",
        description="Run one service; `rlmesh serve SERVICE --help` lists its settings (flags and RLMESH_* variables).",
    )
    s.add_argument("service", choices=sorted(SERVICE_PACKAGES))
    u = sub.add_parser("up", help="run every service as a local process (embedded Redis, CPU engine, tiny model)")
    d = sub.add_parser(
        "demo", help="train the tiny model on a small task end to end and print eval reward before/after"
    )
    for p in (u, d):
        p.add_argument("--data-dir", default=".rlmesh", help="where Redis data, logs and the tiny model live")
        p.add_argument("--redis-url", default="", help="use this Redis instead of starting an embedded one")
        p.add_argument(
            "--redis-maxmemory",
            default=None,
            help="the embedded Redis's memory limit: a share of this machine's memory ('25%%', the default) or a "
            "size ('4gb'); '0' = none. Past it writes are refused (RESOURCE_EXHAUSTED), nothing is evicted",
        )
        p.add_argument(
            "--redis-appendfsync",
            choices=("always", "everysec"),
            default=None,
            help="when the embedded Redis fsyncs its append-only file: before each answer (always, the default) "
            "or once a second (everysec); see docs/fault-tolerance.md",
        )
    u.add_argument(
        "--config",
        default="",
        help="a YAML file with one section per service (engine, reward, buffer, rollout, trainer, coordinator), "
        "each with the settings `rlmesh serve SERVICE --help` lists, plug-in registrations included; SIGHUP "
        "reads it again and restarts the services whose section changed",
    )
    u.add_argument(
        "--model-path", default="", help="a local Hugging Face checkpoint directory (default: the tiny model)"
    )
    d.add_argument(
        "--task",
        choices=("reverse", "agent", "environment"),
        default="reverse",
        help="reverse: reverse three letters; agent: call a tool to find a secret code (multi-turn); "
        "environment: reverse three letters, the samples from an Atropos environment (needs atroposlib)",
    )
    d.add_argument(
        "--sft-steps",
        type=count(0),
        default=None,
        help="SFT warm-start steps before RL, 0 for none (default: the task's)",
    )
    d.add_argument("--rollouts", type=count(1), default=None, help="RL iterations (default: the task's)")
    d.add_argument(
        "--coordinator-url",
        default="",
        help="use running services (default: the ones `rlmesh up` started, else start them)",
    )
    d.add_argument(
        "--engine-url",
        default="",
        help="--task environment with --coordinator-url: the engine the environment generates on",
    )
    from rlmesh.cli.runs_cli import add_commands as add_run_commands

    add_run_commands(sub)
    r = sub.add_parser("reward", help="reward tools")
    r.add_subparsers(dest="reward_command", required=True).add_parser(
        "check",
        add_help=False,  # (its own flags: `rlmesh reward check --help`)
        help="run the conformance suite against a remote reward service (`rlmesh reward check --help`)",
    )
    h = sub.add_parser(
        "health", help="exit 0 if the gRPC service at HOST:PORT reports SERVING (grpc.health.v1), else 1"
    )
    h.add_argument("address", metavar="HOST:PORT", type=host_port)
    h.add_argument("--timeout", type=seconds, default=3.0, help="seconds to wait for the answer")
    t = sub.add_parser("build-tiny-model", help="write the tiny model and tokenizer to a directory")
    t.add_argument("out_dir")
    e = sub.add_parser(
        "export",
        help="write a checkpoint (automatic, saved, or a final model) as a Hugging Face model directory that "
        "transformers and SGLang load: no trainer state; LoRA adapters merged, and kept under OUT/adapter",
    )
    e.add_argument("checkpoint", help="the checkpoint's directory (on the trainer's machine)")
    e.add_argument("out", help="a new directory")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    loopback_bypasses_proxy()  # the stack's own calls on 127.0.0.1 never go through a proxy
    parser = build_parser()
    if argv[:1] == ["serve"] and len(argv) >= 2 and argv[1] in SERVICE_PACKAGES:
        _serve(argv[1], argv[2:])
        return
    if argv[:2] == ["reward", "check"]:
        from rlmesh.reward.check import main as reward_check

        sys.exit(reward_check(argv[2:]))
    args = parser.parse_args(argv)
    if args.command == "up":
        _up(args)
    elif args.command == "demo":
        from rlmesh.cli.demo import run_demo

        sys.exit(run_demo(args))
    elif args.command in ("run", "runs"):
        from rlmesh.cli.runs_cli import main as runs_main

        sys.exit(runs_main(args))
    elif args.command == "health":
        sys.exit(_health(args.address, args.timeout))
    elif args.command == "build-tiny-model":
        from rlmesh.cli.tiny_model import build_tiny_model

        sys.exit(_writing("build-tiny-model", args.out_dir, lambda: build_tiny_model(args.out_dir)))
    elif args.command == "export":
        from rlmesh.trainer.final_model import export_checkpoint

        sys.exit(_writing("export", args.out, lambda: export_checkpoint(Path(args.checkpoint), Path(args.out))))


def _writing(command: str, out: str, write: Callable[[], Path]) -> int:
    """A command that writes a new directory `out`: what it wrote, or why it could not (2)."""
    from rlmesh.common.errors import RlmeshError

    try:
        print(write())
    except RlmeshError as e:
        print(f"rlmesh {command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"rlmesh {command}: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    main()
