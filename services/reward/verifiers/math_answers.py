"""The `math` verifier: the response's final answer (\\boxed{}, "the answer is", or its last
number) against the label, equal after normalisation (LaTeX wrappers, units, formatting) or
symbolically, through a small LaTeX-to-sympy converter that only lets simple math through."""

from __future__ import annotations

import random
import re
from typing import Any

from rlmesh.reward.verifiers.extraction import answer_phrase, brace_pairs, braced, last_boxed, require_label

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
    "dollars",
    "dollar",
    "cents",
    "cent",
    "units",
    "unit",
    "degrees",
    "degree",
    "radians",
    "percent",
    "centimeters",
    "centimetres",
    "cm",
    "meters",
    "metres",
    "mm",
    "km",
    "kilometers",
    "kilometres",
    "inches",
    "inch",
    "feet",
    "foot",
    "ft",
    "yards",
    "miles",
    "mph",
    "hours",
    "hour",
    "hrs",
    "minutes",
    "minute",
    "mins",
    "seconds",
    "second",
    "sec",
    "days",
    "day",
    "weeks",
    "months",
    "years",
    "kg",
    "grams",
    "pounds",
    "lbs",
    "ounces",
    "liters",
    "litres",
    "ml",
    "people",
    "students",
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
    pairs = brace_pairs(s, commands[0].start())
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
    "pi": "pi",
    "infty": "oo",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "log": "log",
    "ln": "log",
    "exp": "exp",
    "cdot": "*",
    "times": "*",
    "div": "/",
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
        found = braced(s, i)
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
            found = braced(s, i)
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
        "Integer": sympy.Integer,
        "Float": sympy.Float,
        "Rational": sympy.Rational,
        "Symbol": sympy.Symbol,
        "Add": sympy.Add,
        "Mul": sympy.Mul,
        "Pow": sympy.Pow,
        "sqrt": sympy.sqrt,
        "pi": sympy.pi,
        "oo": sympy.oo,
        "sin": sympy.sin,
        "cos": sympy.cos,
        "tan": sympy.tan,
        "log": sympy.log,
        "exp": sympy.exp,
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
    require_label(label)
    reference = last_boxed(label) or label
    answer = extract_math_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_equal(answer, reference) else 0.0
