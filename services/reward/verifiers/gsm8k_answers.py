"""The `gsm8k` verifier: the final number of a response (after GSM8K's '####', in a
\\boxed{}, or the last one) against the label's, compared exactly as fractions."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from rlmesh.reward.verifiers.extraction import answer_phrase, last_boxed, require_label
from rlmesh.reward.verifiers.math_answers import normalize_math_answer

# ---------------------------------------------------------------- GSM8K: the final number

_GSM8K_MARK = re.compile(r"####\s*([^\n]*)")
# 1,234.5 / 1234 / .5 / -3 / 3/4; thousands groups need exactly three digits.
_FINAL_NUMBER = re.compile(r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-−]?\.\d+")
_LATEX_FRACTION = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(\d+)\}$")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def _as_fraction(text: str) -> Fraction | None:
    """'1,234.50' / '-3' / '3/4' / '\\frac{3}{4}' -> an exact Fraction; None otherwise."""
    text = text.replace("−", "-").replace(",", "")
    m = _LATEX_FRACTION.match(text)
    if m:
        text = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    # Only plain decimals and a/b: Fraction("1e999999999") would build a gigantic integer.
    if len(text) > 64 or not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _number_in(text: str, prefer_last: bool = False) -> Fraction | None:
    """The number an answer span states: the whole span when it is one number (after the
    math normalisation: $, units, commas, \\text{}), else its first number (its last one
    after an '=' or when prefer_last)."""
    whole = _as_fraction(normalize_math_answer(text))
    if whole is not None:
        return whole
    if "=" in text:
        text, prefer_last = text.rsplit("=", 1)[1], False
    found = _FINAL_NUMBER.findall(text)
    if not found:
        return None
    return _as_fraction(found[-1] if prefer_last else found[0])


def gsm8k_final_number(text: str) -> Fraction | None:
    """The final numeric answer: after the last '####', else in the last \\boxed{}, else
    in the last "the answer is ...", else the last number in the text."""
    marks = _GSM8K_MARK.findall(text)
    if marks:
        return _number_in(marks[-1])
    boxed = last_boxed(text)
    if boxed is not None:
        return _number_in(boxed)
    phrase = answer_phrase(text)
    if phrase is not None and (value := _number_in(phrase)) is not None:
        return value
    found = _FINAL_NUMBER.findall(text)
    return _as_fraction(found[-1]) if found else None


def gsm8k(response: str, label: str, metadata: dict[str, Any]) -> float:
    """1.0 when the response's final number equals the label's (GSM8K's '#### 72', a
    \\boxed{} or a bare number), exactly: 72 == 72.00 == $72, 1,000 == 1000."""
    require_label(label)
    reference = gsm8k_final_number(label)
    if reference is None:
        raise ValueError(f"label {label[-40:]!r} states no final number (expected '#### 72' or a number)")
    answer = gsm8k_final_number(response)
    return 1.0 if answer is not None and answer == reference else 0.0
