"""Every benchmark ends by printing its summary as a markdown table, in the form
docs/benchmarks.md keeps, so a new measurement is pasted there and nowhere else.

    print_table([{"mode": "`sync`", "samples/s": 444.5}], title="python -m bench.async")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cell(value: Any, floatfmt: str) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        value = format(value, floatfmt)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict[str, Any]], floatfmt: str = ".2f") -> str:
    """`rows` as a markdown table: the columns are the first row's keys, in order (a key a
    row lacks is an empty cell); floats are formatted with `floatfmt`, bools as yes/no."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(_cell(row.get(c, ""), floatfmt) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def print_table(rows: Sequence[dict[str, Any]], title: str = "", floatfmt: str = ".2f") -> None:
    """Prints `rows` as a markdown table, after a blank line and the title, if any."""
    print()
    if title:
        print(title)
        print()
    print(markdown_table(rows, floatfmt), flush=True)
