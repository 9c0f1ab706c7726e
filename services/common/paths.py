"""Paths that arrive in requests and run configs, confined to directories the operator
configured (a service's "roots"), and the one validator of run ids.

A caller may name files only under the roots: a relative path is taken under the first
root that holds it (else the first), an absolute one must lie under one of them. The path
is resolved first (symlinks followed, `..` collapsed), so neither `..` nor a link pointing
out of a root escapes. A refused path is answered with the same message whether or not it exists, so the answer
reveals nothing about the files outside the roots."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from rlmesh.common.errors import InvalidArgument

# A run id: also the coordinator's path parameter pattern (its REST API answers 422).
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_RUN_ID = re.compile(RUN_ID_PATTERN)
# What any file system here takes: a path of at most PATH_MAX bytes, each name at most NAME_MAX.
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
_SHOWN_CHARS = 120


def shown(text: str) -> str:
    """A caller's value as an error message repeats it: quoted, and cut short when long."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


def validate_run_id(run_id: str) -> str:
    """The run id, if it is safe as a Redis key part and as a directory name (no ':', '*',
    '/', no leading '.' or '-', so never '.' or '..'); InvalidArgument otherwise."""
    if not _RUN_ID.fullmatch(run_id):
        raise InvalidArgument(
            f"run_id must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit; got {shown(run_id)}"
        )
    return run_id


def resolve_roots(roots: Sequence[str | Path]) -> tuple[Path, ...]:
    """The roots as absolute paths with symlinks resolved (relative ones from the working directory)."""
    return tuple(Path(r).expanduser().resolve() for r in roots)


def resolve_under(path: str | Path, roots: Sequence[Path], what: str, setting: str) -> Path:
    """`path` resolved, if it lies under one of `roots` (already resolved, see resolve_roots);
    InvalidArgument naming `setting` (where an operator configures them, never the server's
    directories themselves) otherwise. `what` names the path in messages, e.g. "dataset 'train': path"."""
    text = str(path)
    if not text:
        raise InvalidArgument(f"{what} is required (a path under {setting})")
    if not roots:
        raise InvalidArgument(f"{what} {shown(text)} cannot be used: {setting} names no directory")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise InvalidArgument(f"{what} {shown(text)} holds a control character (a newline, a NUL, ...)")
    encoded = text.encode(errors="surrogatepass")
    if len(encoded) > MAX_PATH_BYTES or any(len(name) > MAX_NAME_BYTES for name in encoded.split(b"/")):
        raise InvalidArgument(
            f"{what} {shown(text)} is too long: at most {MAX_PATH_BYTES} bytes, each name in it at most "
            f"{MAX_NAME_BYTES}"
        )
    candidate = Path(text)
    if not candidate.is_absolute():
        under = [root / candidate for root in roots]
        candidate = next((c for c in under if c.exists()), under[0])
    try:
        # strict=False: a path that does not exist yet resolves too, the same way.
        resolved = candidate.resolve(strict=False)
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        resolved = None
    if resolved is not None and any(resolved.is_relative_to(root) for root in roots):
        return resolved
    # (the roots themselves are the server's business: the message names the setting only)
    raise InvalidArgument(
        f"{what} {shown(text)} is not under {setting}; relative paths are taken under the first of them where "
        "they exist (else the first), and "
        "neither '..' nor a symlink may lead out of them"
    )
