"""The `multiple_choice` verifier: the letter (A-E) a response chooses against the label's."""

from __future__ import annotations

import re
from typing import Any

from rlmesh.reward.verifiers.extraction import last_boxed, require_label

_CHOICE_LABEL = re.compile(r"\(?([A-Ea-e])\)?(?:[.:)]\s*.*|\s+.*)?", re.S)
_CHOICE_ANSWER = re.compile(
    r"(?i:answer)\s*(?:(?i:is)\s*|:\s*)?(?::\s*)?(?:(?i:option|choice)\s*)?(?:\(\s*([A-Ea-e])\s*\)|([A-E]))(?![A-Za-z])"
)
_CHOICE_ALONE = re.compile(r"\(?([A-E])\)?[.)]?")
_CHOICE_PAREN = re.compile(r"\(([A-E])\)")


def extract_choice(response: str) -> str | None:
    text = response.replace("*", "")  # markdown bold around the letter
    boxed = last_boxed(text)
    if boxed is not None:
        inner = re.sub(r"\\text(?:bf)?\{([^{}]*)\}", r"\1", boxed).strip()
        m = re.fullmatch(r"\(?([A-Ea-e])\)?", inner)
        if m:
            return m.group(1).upper()
    answers = _CHOICE_ANSWER.findall(text)
    if answers:
        paren, bare = answers[-1]
        return (paren or bare).upper()
    alone = _CHOICE_ALONE.fullmatch(text.strip())
    if alone:
        return alone.group(1)
    parens = _CHOICE_PAREN.findall(text)
    return parens[-1] if parens else None


def multiple_choice(response: str, label: str, metadata: dict[str, Any]) -> float:
    """1.0 when the chosen letter (A-E) equals the label's letter."""
    require_label(label)
    m = _CHOICE_LABEL.fullmatch(label.strip())
    if not m:
        raise ValueError(f"label {label[:40]!r} is not a choice letter A-E")
    return 1.0 if extract_choice(response) == m.group(1).upper() else 0.0
