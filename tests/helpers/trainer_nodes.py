"""The Kubernetes trainer's launcher (deploy/k8s/base/trainer.yaml's `sh -c` command, which
runs torchrun across the StatefulSet's pods): read from the manifest, and run by a real `sh`,
either with a stand-in `torchrun` that records the command line it was given (the manifest
checks) or with the real one (the two-node test on one machine)."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from tests.helpers.kustomize import K8S, by_kind, render

STUB = '#!/bin/sh\nprintf \'%s\\0\' "$@" > "$TORCHRUN_ARGV_FILE"\n'


def is_launcher(container: dict) -> bool:
    command = container.get("command") or []
    return command[:2] == ["sh", "-c"] and "exec torchrun " in command[2]


def base_trainer() -> dict:
    """The trainer container of the base manifests."""
    (container,) = by_kind(render(K8S / "base"), "StatefulSet")["trainer"]["spec"]["template"]["spec"]["containers"]
    assert is_launcher(container)
    return container


def torchrun_argv(command: list[str], args: list[str], env: dict[str, str], tmp: Path) -> list[str]:
    """The torchrun command line the launcher runs with this environment (a real `sh` runs the
    script; a stand-in torchrun first on PATH writes down its arguments)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "torchrun"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp / "torchrun-argv"
    run_env = {**env, "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "TORCHRUN_ARGV_FILE": str(out)}
    # `sh -c SCRIPT NAME ARGS...`, as the container runs it: its args are the script's "$@".
    subprocess.run([*command, *args], env=run_env, check=True, timeout=30)
    return out.read_bytes().decode().split("\0")[:-1]


def parse_torchrun(argv: list[str]) -> argparse.Namespace:
    """torchrun's own parser (torch.distributed.run), as the real command reads the line."""
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(argv)
