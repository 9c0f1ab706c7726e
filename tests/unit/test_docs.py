"""Every repo path the docs name exists.

A repo path is a backticked token that starts with one of the repo's top-level entries
(`services/...`, `docs/...`, `Makefile`, ...), read from the repo root, or a relative
markdown link target, read from the doc's own folder. A `:line`, `:line-line` or `::test`
suffix and a `#anchor` are dropped; `*` and `<placeholder>` are globs that must match
something. Fenced code blocks are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/**/*.md", "deploy/README.md", "examples/**/README.md"]
TOP_LEVEL = (
    "services/",
    "proto/",
    "tests/",
    "bench/",
    "docs/",
    "deploy/",
    "examples/",
    ".ci/",
    "Makefile",
    "pyproject.toml",
    "README.md",
    "rlmesh/",
)  # no such folder (the source is in services/): named so that the slip is caught

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)\s]+)[^)]*\)")
SUFFIX = re.compile(r"(::.*|:\d+(-\d+)?|#.*)$")


def _exists(path: str, base: Path) -> bool:
    path = SUFFIX.sub("", re.sub(r"<[^>]+>", "*", path)).rstrip("/")
    if "*" in path:
        return next(base.glob(path), None) is not None
    return (base / path).exists()


def _named_paths(doc: Path):
    """(line, path, base folder) of every repo path `doc` names."""
    text = FENCE.sub(lambda m: "\n" * m.group().count("\n"), doc.read_text())
    for match in CODE.finditer(text):
        token = match.group(1)
        if not re.search(r"\s", token) and token.startswith(TOP_LEVEL):
            yield text.count("\n", 0, match.start()) + 1, token, REPO
    for match in LINK.finditer(text):
        target = match.group(1)
        if not re.match(r"[a-z]+:|#", target):  # not a URL, not an anchor on the same page
            yield text.count("\n", 0, match.start()) + 1, target, doc.parent


def test_every_repo_path_named_in_the_docs_exists():
    docs = sorted({doc for pattern in DOCS for doc in REPO.glob(pattern)})
    assert any(doc.name == "README.md" and doc.parent == REPO for doc in docs)
    dead = [
        f"{doc.relative_to(REPO)}:{line}: {path}"
        for doc in docs
        for line, path, base in _named_paths(doc)
        if not _exists(path, base)
    ]
    if dead:
        pytest.fail("these docs name paths that do not exist:\n" + "\n".join(dead), pytrace=False)
