"""Finding the answer in a response, for every verifier family: the last \\boxed{...} (brace
groups matched in one pass), or the phrase after "the answer is"; the label check each
verifier starts with; and the `format` verifier, which asks only that a boxed answer be there."""

from __future__ import annotations

import re
from typing import Any


def require_label(label: str) -> str:
    if not label.strip():
        raise ValueError("the sample has no label (reference answer) to compare against")
    return label


# ---------------------------------------------------------------- answer extraction


def braced(text: str, open_index: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[open_index] and the index after it;
    escaped braces (\\{ \\}) are literal. None when the braces never balance. A scan per
    group: for short texts (many groups in a long text: brace_pairs)."""
    depth = 0
    i = open_index
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i], i + 1
        i += 1
    return None


# A backslash takes the next character with it (an escape), so "\\{" opens nothing.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.S)


def brace_pairs(text: str, start: int = 0) -> dict[int, int]:
    """Index of each '{' from text[start:] -> index of the '}' that closes it, in one pass
    (unclosed groups are absent). Escapes pair up the same from any starting point before a
    brace, so one pass answers what braced would for every group: linear where a scan per
    group is quadratic (50,000 unclosed \\boxed{ took minutes)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_TOKEN.finditer(text, start):
        c = m.group()
        if c == "{":
            stack.append(m.start())
        elif c == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_BARE_ANSWER = re.compile(r"[^\s$]+")


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed \\boxed{...} (or \\fbox{...}, or `\\boxed 5`); an
    unclosed one is skipped for the one before it. Linear in len(text)."""
    boxes = list(_BOXED.finditer(text))
    pairs: dict[int, int] | None = None
    covers_all = False
    for m in reversed(boxes):
        start = m.end()
        if text.startswith("{", start):
            if pairs is None:  # usually the last box closes: only the text from it is read
                pairs, covers_all = brace_pairs(text, m.start()), m is boxes[0]
            if start not in pairs and not covers_all:  # the boxes before it: one pass over it all
                pairs, covers_all = brace_pairs(text, boxes[0].start()), True
            if start in pairs:
                return text[start + 1 : pairs[start]].strip()
        elif (bare := _BARE_ANSWER.match(text, start)) is not None:
            return bare.group(0)
    return None


# Never two \s* with only optional parts between them: on a run of spaces that fails to match,
# each way of splitting the run is tried (quadratic, or worse with three).
_ANSWER_IS = re.compile(r"(?i:(?:final\s+)?answer)\s*(?:is|:|=)\s*(?::\s*)?(.+)")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")


def answer_phrase(text: str) -> str | None:
    """X from the last "the answer is X" / "Answer: X", up to the end of its sentence."""
    matches = _ANSWER_IS.findall(text)
    if not matches:
        return None
    phrase = matches[-1].strip()
    end = _SENTENCE_END.search(phrase)
    if end:
        phrase = phrase[: end.start()]
    phrase = phrase.strip().strip("*").strip()
    return phrase or None


# ---------------------------------------------------------------- verifiers


def format(response: str, label: str, metadata: dict[str, Any]) -> float:
    """1.0 when the response ends its reasoning with a non-empty \\boxed{} answer."""
    return 1.0 if last_boxed(response) else 0.0
