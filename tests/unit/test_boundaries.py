"""The service boundary (docs/architecture.md, "What may import what"), checked on the
source: a service imports only itself, rlmesh.common and the generated rlmesh.v1;
rlmesh.common imports no service; only the CLI (which starts everything) imports
anything. And no module imports another module's private (_underscored) names.
`make lint` runs this file, so a break fails before any test runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"
SHARED = {"common", "v1"}
# Packages that may import any rlmesh package: the CLI and launcher start every service.
ANYTHING = {"cli"}


def _imports(path: Path, root: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every `import rlmesh...` and `from rlmesh... import ...` in the file,
    function-level imports included; relative imports resolved against the file's package."""
    package = ["rlmesh", *path.relative_to(root).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return [(line, module, names) for line, module, names in found if module.split(".")[0] == "rlmesh"]


def boundary_breaks(root: Path) -> list[str]:
    breaks = []
    for path in sorted(root.glob("*/**/*.py")):
        package = path.relative_to(root).parts[0]
        if package in ANYTHING:
            continue
        allowed = SHARED if package == "common" else SHARED | {package}
        for line, module, _ in _imports(path, root):
            target = module.split(".")[1] if "." in module else ""
            if target not in allowed:
                breaks.append(
                    f"services/{path.relative_to(root)}:{line} imports {module} "
                    f"(rlmesh.{package} may import only {', '.join(sorted(allowed))})"
                )
    return breaks


def private_imports(root: Path, shown_as: str = "services") -> list[str]:
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for line, module, names in _imports(path, root):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                offenders.append(f"{shown_as}/{path.relative_to(root)}:{line} takes {', '.join(private)} from {module}")
    return offenders


def test_services_share_only_common_and_the_contracts():
    breaks = boundary_breaks(SERVICES)
    assert breaks == [], "the service boundary is broken:\n" + "\n".join(breaks)


def test_no_module_imports_another_modules_private_names():
    # (tests and benchmarks too: what they need of a module is part of its public face)
    offenders = [
        o
        for folder in ("services", "tests", "bench")
        for o in private_imports(SERVICES.parent / folder, shown_as=folder)
    ]
    assert offenders == [], "make these public, or keep them in their module:\n" + "\n".join(offenders)


@pytest.mark.parametrize("module", ["rlmesh.coordinator.app", "rlmesh.buffer.server", "rlmesh.reward.server"])
def test_services_without_tensors_start_without_torch(module):
    # torch costs seconds of start-up and hundreds of MB; the services that never hold a
    # tensor keep it out (the torch-free declaration of the algorithms is rlmesh.common.algorithm).
    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"{module} imports torch through: {loaded.strip()}"


def test_the_checks_see_a_break(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "bad.py").write_text("def f():\n    from rlmesh.trainer.backend import _copy\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "fine.py").write_text("import rlmesh.trainer.server\n")
    assert boundary_breaks(tmp_path) == [
        "services/common/bad.py:2 imports rlmesh.trainer.backend (rlmesh.common may import only common, v1)"
    ]
    assert private_imports(tmp_path) == ["services/common/bad.py:2 takes _copy from rlmesh.trainer.backend"]
