"""Writes docs/run-config.md, the reference of a run's configuration (the body of
`POST /runs`), from `RunConfig.model_json_schema()`: one table per model, every field with
its type, default, bounds and description. The output depends only on the schema.

    python -m rlmesh.cli.config_reference docs/run-config.md           # make docs
    python -m rlmesh.cli.config_reference --check docs/run-config.md   # make docs-check
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from pydantic.json_schema import GenerateJsonSchema

from rlmesh.common.run_config import RunConfig

HEADER = """\
# Run configuration reference

<!-- Generated from rlmesh.common.run_config.RunConfig by `make docs`
(services/cli/config_reference.py); edit the models' descriptions, not this file. -->

The body of the coordinator's `POST /runs`, declared once in `services/common/run_config.py`
(`rlmesh.common.run_config.RunConfig`); the coordinator's OpenAPI docs (`/docs`) show the same
schema. A field that breaks a bound below is refused with a 422 naming it. A number may also
come as a string that reads as one (`"1e-6"`, as YAML writes some), as pydantic takes it; a
string that does not is a 422. Each service's own settings are not here: they are in
`services/<service>/config.py` (`rlmesh serve SERVICE --help`).
"""

BOUNDS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
    ("maxProperties", "entries <= {}"),
    ("pattern", "pattern `{}`"),
)


class _FactoryDefaults(GenerateJsonSchema):
    """Shows the defaults of `default_factory` fields too (pydantic leaves them out)."""

    def get_default_value(self, schema):
        if "default_factory" in schema and not schema.get("default_factory_takes_data"):
            return schema["default_factory"]()
        return super().get_default_value(schema)


def _ref_name(schema: dict) -> str | None:
    return schema["$ref"].rsplit("/", 1)[-1] if "$ref" in schema else None


def _type(schema: dict) -> str:
    if name := _ref_name(schema):
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_type(s) for s in schema["anyOf"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "any")
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(_type(s) for s in schema["prefixItems"]) + "]"
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object":
        values = schema.get("additionalProperties")
        return f"map of string to {_type(values)}" if isinstance(values, dict) else "object"
    return kind


def _bounds(schema: dict) -> list[str]:
    """The schema's constraints, with those of its alternatives, items and keys."""
    out = []
    if "enum" in schema:
        out.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"]))
    if "prefixItems" in schema:  # a tuple: its length is its type's
        schema = {k: v for k, v in schema.items() if k not in ("minItems", "maxItems")}
    out += [text.format(schema[key]) for key, text in BOUNDS if key in schema]
    for option in schema.get("anyOf", []):
        out += _bounds(option)
    for where, key in (("each", "items"), ("each key", "propertyNames")):
        if isinstance(schema.get(key), dict) and (inner := _bounds(schema[key])):
            out.append(f"{where}: " + ", ".join(inner))
    if "prefixItems" in schema:
        inner = {", ".join(_bounds(s)) for s in schema["prefixItems"]} - {""}
        out += [f"each: {b}" for b in sorted(inner)]
    return out


def _default(schema: dict, required: bool, defs: dict) -> str:
    if required:
        return "required"
    if "default" not in schema:
        return ""
    default = schema["default"]
    name = _ref_name(schema) or next((_ref_name(s) for s in schema.get("anyOf", []) if _ref_name(s)), None)
    if name and isinstance(default, dict):  # a nested model: name only what differs from its own defaults
        own = {k: v.get("default") for k, v in defs[name]["properties"].items()}
        changed = {k: v for k, v in default.items() if own.get(k) != v}
        return "its defaults" + (
            ", but " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in changed.items()) if changed else ""
        )
    return f"`{json.dumps(default)}`"


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, and a `<name>` outside code spans shown as
    text rather than read as an HTML tag."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p) for i, p in enumerate(parts))


def _table(model: dict, defs: dict) -> list[str]:
    required = set(model.get("required", []))
    lines = ["| field | type | default | bounds | description |", "| --- | --- | --- | --- | --- |"]
    for field, schema in model["properties"].items():
        cells = (
            f"`{field}`",
            _type(schema),
            _default(schema, field in required, defs),
            ", ".join(_bounds(schema)),
            schema.get("description", ""),
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _nested(schema: dict) -> list[tuple[str, str]]:
    """(model name, path suffix) of the models a field's schema holds."""
    if name := _ref_name(schema):
        return [(name, "")]
    found = [n for s in schema.get("anyOf", []) for n in _nested(s)]
    if isinstance(schema.get("items"), dict):
        found += [(n, "[]" + suffix) for n, suffix in _nested(schema["items"])]
    return found


def render(schema: dict[str, Any] | None = None) -> str:
    schema = schema or RunConfig.model_json_schema(schema_generator=_FactoryDefaults)
    defs = schema.get("$defs", {})
    paths: dict[str, list[str]] = {}  # model -> where it is used, in the order first met (depth first)

    def walk(model: dict, prefix: str, seen: tuple[str, ...]) -> None:
        for field, field_schema in model["properties"].items():
            for name, suffix in _nested(field_schema):
                paths.setdefault(name, []).append(prefix + field + suffix)
                if name not in seen:
                    walk(defs[name], prefix + field + suffix + ".", (*seen, name))

    walk(schema, "", (schema["title"],))
    out = [
        HEADER,
        "Sections: " + ", ".join(f"[{n}](#{n.lower()}) (`{'`, `'.join(p)}`)" for n, p in paths.items()) + ".",
        "",
        f"## {schema['title']}",
        "",
    ]
    if description := schema.get("description"):
        out += [" ".join(description.split()), ""]
    out += _table(schema, defs)
    for name, where in paths.items():
        model = defs[name]
        out += ["", f"## {name}", "", "At " + ", ".join(f"`{p}`" for p in where) + "."]
        if description := model.get("description"):
            out += ["", " ".join(description.split())]
        out += ["", *_table(model, defs)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", default="docs/run-config.md", help="the file to write or check")
    parser.add_argument("--check", action="store_true", help="fail when the file differs from what it would write")
    args = parser.parse_args(argv)
    path, text = Path(args.path), render()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"stale {args.path}; run 'make docs'", file=sys.stderr)
            return 1
        print(f"{args.path} is up to date")
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
