"""Built-in rule-based verifiers: plain functions `(response, label, metadata) -> float`.

A verifier raises (ValueError) when it cannot judge at all, e.g. the sample has no
label; the scorer turns that into a FAILED sample with the reason, never a silent 0.
A response without a recognisable answer is simply wrong: 0.0.

Responses are written by the policy, or by whoever can call the service, so every function
in this package takes time linear in its input: no regex with two `\\s*` joined only by
optional parts (they backtrack over every split of a run of spaces), no scan restarted per
match.

One module per family:
  extraction      finding the answer: the last \\boxed{}, "the answer is X"; and `format`
  math_answers    `math`: normalised or symbolic (sympy) equality
  gsm8k_answers   `gsm8k`: the final number, exactly
  text_answers    `exact_match`, `f1`
  choice_answers  `multiple_choice`: the chosen letter A-E
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlmesh.reward.verifiers.choice_answers import multiple_choice
from rlmesh.reward.verifiers.extraction import format
from rlmesh.reward.verifiers.gsm8k_answers import gsm8k
from rlmesh.reward.verifiers.math_answers import math
from rlmesh.reward.verifiers.text_answers import exact_match, f1

Verifier = Callable[[str, str, dict[str, Any]], float]

# What the scorer gives a verifier by default: a response's (and a label's) last 100k characters.
# Every verifier in this package is linear in its input; the cap bounds that input.
DEFAULT_MAX_ANSWER_CHARS = 100_000


# Each a module-level function: worker processes load them by import path (rlmesh.reward.workers).
VERIFIERS: dict[str, Verifier] = {
    "exact_match": exact_match,
    "math": math,
    "gsm8k": gsm8k,
    "f1": f1,
    "multiple_choice": multiple_choice,
    "format": format,
}
