"""Verifiers that compare text: `exact_match` (up to case and whitespace) and `f1`
(SQuAD-style token overlap); a label may list several accepted answers."""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from typing import Any

from rlmesh.reward.verifiers.extraction import answer_phrase, last_boxed, require_label


def _normalize_text(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".").strip()


def _label_alternatives(label: str) -> list[str]:
    """A label may list several accepted answers as a JSON array of strings."""
    stripped = label.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: "[[[[..." nested too deep
            return [label]
        if isinstance(values, list) and values and all(isinstance(v, (str, int, float)) for v in values):
            return [str(v) for v in values]
    return [label]


def _extracted_answer(response: str) -> str | None:
    boxed = last_boxed(response)
    return boxed if boxed is not None else answer_phrase(response)


def exact_match(response: str, label: str, metadata: dict[str, Any]) -> float:
    """1.0 when the \\boxed{} / "answer is" answer, or the whole response, equals the label
    up to case and whitespace."""
    require_label(label)
    golds = {_normalize_text(g) for g in _label_alternatives(label)}
    candidates = [c for c in (_extracted_answer(response), response) if c is not None]
    return 1.0 if any(_normalize_text(c) in golds for c in candidates) else 0.0


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _f1_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.casefold().translate(_PUNCTUATION)).split()


def _token_f1(prediction: str, gold: str) -> float:
    pred, ref = _f1_tokens(prediction), _f1_tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1(response: str, label: str, metadata: dict[str, Any]) -> float:
    """SQuAD-style token F1 (case, punctuation and articles ignored) of the extracted
    answer (or the whole response) against the best-matching label."""
    require_label(label)
    prediction = _extracted_answer(response)
    if prediction is None:
        prediction = response
    return max(_token_f1(prediction, gold) for gold in _label_alternatives(label))
