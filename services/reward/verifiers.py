"""Built-in rule-based verifiers: plain functions `(response, label, metadata) -> float`.

A verifier raises (ValueError) when it cannot judge at all, e.g. the sample has no
label; the scorer turns that into a FAILED sample with the reason, never a silent 0.
A response without a recognisable answer is simply wrong: 0.0.

Responses are written by the policy, or by whoever can call the service, so every function
here takes time linear in its input: no regex with two `\\s*` joined only by optional parts
(they backtrack over every split of a run of spaces), no scan restarted per match.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

Verifier = Callable[[str, str, dict[str, Any]], float]

# What the scorer gives a verifier by default: a response's (and a label's) last 100k characters.
# Every verifier here is linear in its input; the cap bounds that input.
DEFAULT_MAX_ANSWER_CHARS = 100_000


def _require_label(label: str) -> str:
    if not label.strip():
        raise ValueError("the sample has no label (reference answer) to compare against")
    return label


# ---------------------------------------------------------------- answer extraction

def _braced(text: str, open_index: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[open_index] and the index after it;
    escaped braces (\\{ \\}) are literal. None when the braces never balance. A scan per
    group: for short texts (many groups in a long text: _brace_pairs)."""
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


def _brace_pairs(text: str, start: int = 0) -> dict[int, int]:
    """Index of each '{' from text[start:] -> index of the '}' that closes it, in one pass
    (unclosed groups are absent). Escapes pair up the same from any starting point before a
    brace, so one pass answers what _braced would for every group: linear where a scan per
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
                pairs, covers_all = _brace_pairs(text, m.start()), m is boxes[0]
            if start not in pairs and not covers_all:  # the boxes before it: one pass over it all
                pairs, covers_all = _brace_pairs(text, boxes[0].start()), True
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


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def extract_math_answer(text: str) -> str | None:
    """Last \\boxed{...}; else "the answer is X"; else the last number in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    phrase = answer_phrase(text)
    if phrase is not None:
        return phrase
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# ---------------------------------------------------------------- math answers: normalise, then compare

_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|textit|textnormal|textrm|mathrm|mathbf|mbox|operatorname)\s*\{")
_UNITS = (
    "dollars", "dollar", "cents", "cent", "units", "unit", "degrees", "degree", "radians", "percent",
    "centimeters", "centimetres", "cm", "meters", "metres", "mm", "km", "kilometers", "kilometres",
    "inches", "inch", "feet", "foot", "ft", "yards", "miles", "mph", "hours", "hour", "hrs", "minutes",
    "minute", "mins", "seconds", "second", "sec", "days", "day", "weeks", "months", "years",
    "kg", "grams", "pounds", "lbs", "ounces", "liters", "litres", "ml", "people", "students",
)
# A unit word right after a number (or a closing brace, as in \frac{1}{2} cups).
_TRAILING_UNIT = re.compile(
    r"(?<=[\d}])\s*(?:(?:square|sq\.?|cubic)\s*)?(?:" + "|".join(_UNITS) + r")\b(?:\s*\^\s*\{?[23]\}?)?\s*$",
    re.IGNORECASE,
)


def _unwrap_text_commands(s: str) -> str:
    """\\text{ dollars} -> ' dollars' (and \\mathrm, \\textbf, ...), left to right, up to the
    first one whose braces never close; in one pass (nested commands once took a pass each)."""
    commands = list(_TEXT_COMMANDS.finditer(s))
    if not commands:
        return s
    pairs = _brace_pairs(s, commands[0].start())
    cuts: list[tuple[int, int]] = []  # (start, end) of each command's head and of its closing brace
    for m in commands:
        close = pairs.get(m.end() - 1)
        if close is None:
            break
        cuts += [(m.start(), m.end()), (close, close + 1)]
    kept, position = [], 0
    for start, end in sorted(cuts):
        kept.append(s[position:start])
        position = end
    kept.append(s[position:])
    return "".join(kept)


def normalize_math_answer(answer: str) -> str:
    s = _unwrap_text_commands(answer.strip())
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg|displaystyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:[,;:! ]|quad(?![A-Za-z])|qquad(?![A-Za-z]))", " ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\^\s*(?:\{\s*)?\\circ\s*\}?", "", s).replace("°", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    s = _TRAILING_UNIT.sub("", s)
    s = re.sub(r"^[A-Za-z]\s*=\s*(?=[^=]*$)", "", s)  # "x = 5" -> "5"
    s = re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])", "\\1\0", s)  # keep "\ln x" apart from "\lnx"
    s = re.sub(r"\s+", "", s).replace("\0", " ")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d\w])\.(?=\d)", "0.", s)  # ".5" -> "0.5"
    if re.fullmatch(r"[-+]?\d+\.\d*", s):  # "5.0" -> "5", "2.50" -> "2.5"
        s = s.rstrip("0").rstrip(".")
    return s.lstrip("+")


class _Unsupported(Exception):
    """LaTeX the small converter below does not handle; only textual comparison applies."""


_LATEX_WORDS = {
    "pi": "pi", "infty": "oo", "sin": "sin", "cos": "cos", "tan": "tan", "log": "log", "ln": "log",
    "exp": "exp", "cdot": "*", "times": "*", "div": "/",
}
_SYMPY_WORDS = {"sqrt", "pi", "oo", "sin", "cos", "tan", "log", "exp"}
_MAX_SYMPY_CHARS = 120


def _latex_arg(s: str, i: int) -> tuple[str, int]:
    """One argument of a LaTeX command: {group}, \\command, or a single character."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s):
        raise _Unsupported
    if s[i] == "{":
        found = _braced(s, i)
        if found is None:
            raise _Unsupported
        return _latex_to_sympy_text(found[0]), found[1]
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+", s[i:])
        if m is None:
            raise _Unsupported
        return _latex_to_sympy_text(m.group(0)), i + m.end()
    return _latex_to_sympy_text(s[i]), i + 1


def _latex_to_sympy_text(s: str) -> str:
    """Simple LaTeX (fractions, roots, powers, pi, trig) -> sympy's input syntax."""
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+)", s[i:])
            if m is None:
                raise _Unsupported
            name, i = m.group(1), i + m.end()
            if name == "frac":
                numerator, i = _latex_arg(s, i)
                denominator, i = _latex_arg(s, i)
                out.append(f"(({numerator})/({denominator}))")
            elif name == "sqrt":
                index = None
                if i < len(s) and s[i] == "[":
                    close = s.find("]", i)
                    if close < 0:
                        raise _Unsupported
                    index, i = _latex_to_sympy_text(s[i + 1 : close]), close + 1
                radicand, i = _latex_arg(s, i)
                out.append(f"sqrt({radicand})" if index is None else f"(({radicand})**(1/({index})))")
            elif name in _LATEX_WORDS:
                out.append(f" {_LATEX_WORDS[name]} ")
            else:
                raise _Unsupported
        elif c == "{":
            found = _braced(s, i)
            if found is None:
                raise _Unsupported
            out.append(f"({_latex_to_sympy_text(found[0])})")
            i = found[1]
        elif c == "^":
            exponent, i = _latex_arg(s, i + 1)
            out.append(f"**({exponent})")
        elif c in "0123456789.+-*/() " or (c.isascii() and c.isalpha()):
            out.append(c)
            i += 1
        else:
            raise _Unsupported
    return "".join(out)


def _sympy_globals() -> dict[str, Any]:
    import sympy

    return {
        "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol,
        "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow,
        "sqrt": sympy.sqrt, "pi": sympy.pi, "oo": sympy.oo, "sin": sympy.sin, "cos": sympy.cos,
        "tan": sympy.tan, "log": sympy.log, "exp": sympy.exp,
    }


def _bounded_powers(expr) -> bool:
    """No power towers or huge exponents: 9^{9^{9}} must not hang the service."""
    import sympy

    harmless = (-1, sympy.Rational(1, 2), sympy.Rational(-1, 2))  # 1/x and square roots
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            # A power inside a power's exponent or base makes a tower: (9^{999})^{999} is
            # as deadly as 9^{9^{9}}. (A reciprocal or square root of a power is harmless;
            # any tower inside it is met as a node of its own.)
            for part in (node.exp,) if exponent in harmless else (node.exp, node.base):
                for inner in sympy.preorder_traversal(part):
                    if isinstance(inner, sympy.Pow) and inner.exp not in harmless:
                        return False
            if not exponent.free_symbols and abs(float(exponent)) > 1000:
                return False
    return True


def _to_sympy(answer: str):
    """The answer as a sympy expression, or None when it is not simple math. Only a
    whitelisted character set and names reach sympy's parser (which evaluates code)."""
    if len(answer) > _MAX_SYMPY_CHARS:
        return None
    try:
        text = _latex_to_sympy_text(answer)
    except _Unsupported:
        return None
    if any(len(w) > 1 and w not in _SYMPY_WORDS for w in re.findall(r"[A-Za-z]+", text)):
        return None
    if re.search(r"\.(?!\d)|(?<!\d)\.", text):  # dots only inside decimals
        return None
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = standard_transformations + (implicit_multiplication_application,)
    try:
        unevaluated = parse_expr(text, global_dict=_sympy_globals(), transformations=transformations, evaluate=False)
        if not _bounded_powers(unevaluated):
            return None
        return parse_expr(text, global_dict=_sympy_globals(), transformations=transformations)
    except Exception:
        return None


def _numerically_equal(x, y) -> bool:
    """Equal values at a few fixed pseudo-random points (for every free symbol). Cheap
    and bounded, unlike sympy.simplify, which can take seconds on (x+1)^{1000}."""
    import sympy

    symbols = sorted(x.free_symbols | y.free_symbols, key=str)
    rng = random.Random(1234)  # the same points every time: reproducible rewards
    agreed = 0
    for _ in range(6):
        point = {s: sympy.Float(rng.uniform(0.3, 2.7), 30) for s in symbols}
        try:
            vx, vy = sympy.N(x, 30, subs=point), sympy.N(y, 30, subs=point)
            if not (vx.is_finite and vy.is_finite):
                continue  # a pole or undefined value here: try another point
            if not bool(sympy.Abs(vx - vy) <= 1e-6 * sympy.Max(1, sympy.Abs(vy))):
                return False
        except (TypeError, ValueError, ArithmeticError):
            continue
        agreed += 1
        if agreed == (3 if symbols else 1):
            return True
    return False


def _sympy_equal(a: str, b: str) -> bool:
    x, y = _to_sympy(a), _to_sympy(b)
    if x is None or y is None:
        return False
    try:
        return x == y or _numerically_equal(x, y)
    except Exception:
        return False


def _outer_brackets(s: str) -> tuple[str, str]:
    if s.startswith("\\{") and s.endswith("\\}"):
        return "\\{", "\\}"
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        return s[0], s[-1]
    return "", ""


def _split_top_level(s: str) -> tuple[str, list[str], str] | None:
    """'(1,2]' -> ('(', ['1', '2'], ']'); None when s is not a comma-separated list."""
    opening, closing = _outer_brackets(s)
    inner = s[len(opening) : len(s) - len(closing)]
    items, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:  # the outer brackets did not enclose the whole answer
                return None
        elif c == "," and depth == 0:
            items.append(inner[start:i])
            start = i + 1
    items.append(inner[start:])
    return (opening, items, closing) if len(items) > 1 and depth == 0 else None


def answers_equal(answer: str, reference: str) -> bool:
    """Same answer after normalisation, textually or symbolically; lists, tuples and
    intervals compare item by item with the same brackets."""
    a, b = normalize_math_answer(answer), normalize_math_answer(reference)
    if not a:
        return False
    if a == b:
        return True
    parts_a, parts_b = _split_top_level(a), _split_top_level(b)
    if parts_a is not None or parts_b is not None:
        if parts_a is None or parts_b is None:
            return False
        (open_a, items_a, close_a), (open_b, items_b, close_b) = parts_a, parts_b
        if (open_a, close_a) != (open_b, close_b) or len(items_a) != len(items_b):
            return False
        return all(x == y or _sympy_equal(x, y) for x, y in zip(items_a, items_b))
    return _sympy_equal(a, b)


# ---------------------------------------------------------------- verifiers

def math(response: str, label: str, metadata: dict[str, Any]) -> float:
    """1.0 when the extracted answer equals the label, textually after normalisation or
    symbolically (sympy); a label holding a worked solution is reduced to its \\boxed{}."""
    _require_label(label)
    reference = last_boxed(label) or label
    answer = extract_math_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_equal(answer, reference) else 0.0


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
    _require_label(label)
    reference = gsm8k_final_number(label)
    if reference is None:
        raise ValueError(f"label {label[-40:]!r} states no final number (expected '#### 72' or a number)")
    answer = gsm8k_final_number(response)
    return 1.0 if answer is not None and answer == reference else 0.0


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
    _require_label(label)
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
    _require_label(label)
    prediction = _extracted_answer(response)
    if prediction is None:
        prediction = response
    return max(_token_f1(prediction, gold) for gold in _label_alternatives(label))


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
    _require_label(label)
    m = _CHOICE_LABEL.fullmatch(label.strip())
    if not m:
        raise ValueError(f"label {label[:40]!r} is not a choice letter A-E")
    return 1.0 if extract_choice(response) == m.group(1).upper() else 0.0


def format(response: str, label: str, metadata: dict[str, Any]) -> float:
    """1.0 when the response ends its reasoning with a non-empty \\boxed{} answer."""
    return 1.0 if last_boxed(response) else 0.0


# Each a module-level function: worker processes load them by import path (rlmesh.reward.workers).
VERIFIERS: dict[str, Verifier] = {
    "exact_match": exact_match,
    "math": math,
    "gsm8k": gsm8k,
    "f1": f1,
    "multiple_choice": multiple_choice,
    "format": format,
}
