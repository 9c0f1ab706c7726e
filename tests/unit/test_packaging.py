"""rlmesh installs under one import name: a user's own `services` package (a common
FastAPI/Django layout) can neither shadow rlmesh nor be shadowed by it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OLD_IMPORT = re.compile(r"^\s*(from|import) services[. ]", re.MULTILINE)


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_users_services_package_does_not_collide_with_rlmesh(tmp_path):
    users = tmp_path / "services"
    users.mkdir()
    (users / "__init__.py").write_text("OWNER = 'user'\n")
    (users / "cli.py").write_text("raise SystemExit('the user package ran instead of rlmesh')\n")

    # `rlmesh up` starts every service with `python -m rlmesh.cli serve ...` from the user's directory.
    result = _run(tmp_path, "-m", "rlmesh.cli", "serve", "buffer", "--help")
    assert result.returncode == 0, result.stderr
    assert "rlmesh serve buffer" in result.stdout

    probe = _run(tmp_path, "-c", "import services, rlmesh.buffer.server, rlmesh.v1.sample_pb2; print(services.OWNER)")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "user"


def test_nothing_imports_the_old_top_level_name():
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("services", "tests", "bench", "examples")
        for path in (REPO / folder).rglob("*.py")
        if OLD_IMPORT.search(path.read_text())
    ]
    assert offenders == [], f"these still import `services.*` instead of `rlmesh.*`: {offenders}"


def test_every_package_under_services_is_installed():
    # pyproject.toml lists the packages by hand (the folder is `services/`, the import name
    # `rlmesh`): a subpackage missing from the list would be left out of a wheel.
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(("rlmesh", *init.parent.relative_to(REPO / "services").parts))
        for init in (REPO / "services").rglob("__init__.py")
    }
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
