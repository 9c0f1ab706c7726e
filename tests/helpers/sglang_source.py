"""SGLang's HTTP API as its own source declares it, read without importing SGLang (its
import needs CUDA packages): the request bodies (`sglang/srt/managers/io_struct.py`,
the sampling parameters), the routes (`sglang/srt/entrypoints/http_server.py`) and the
fields of its answers (where `tokenizer_manager.py` builds `meta_info`, the routes' own
dict literals, the server arguments), all by `ast`. Where the wheel carries SGLang's
generated JSON contract (`sglang/api/v1/api_types.py`, pure Python over msgspec), that
module is loaded on its own so a `/generate` body meets SGLang's real decoder.

Which SGLang: the wheel `make` downloads into .venv/sglang/ (PINNED_VERSION, or the
version RLMESH_SGLANG_VERSION names), or RLMESH_SGLANG_SOURCE: a wheel, or a folder
holding the `sglang` package (a checkout's `python/`, a site-packages)."""

from __future__ import annotations

import ast
import base64
import binascii
import importlib.util
import os
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

PINNED_VERSION = "0.5.23"
REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO / ".venv" / "sglang"

IO_STRUCT = "sglang/srt/managers/io_struct.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
SERVER_ARGS = "sglang/srt/server_args.py"
SERVER_ARG_FIELDS = "sglang/srt/arg_groups/fields/"  # 0.5.2x: ServerArgs' fields, by namespace
API_TYPES = "sglang/api/v1/api_types.py"
ROUTE_DECORATORS = {"get": {"GET"}, "post": {"POST"}, "put": {"PUT"}, "delete": {"DELETE"}}


class SourceMissing(RuntimeError):
    pass


class Source:
    """The files of one SGLang release, read from a wheel or a folder."""

    def __init__(self, where: Path) -> None:
        self.where = where
        if where.is_file():
            archive = zipfile.ZipFile(where)
            self._files = {n: archive for n in archive.namelist() if n.endswith(".py")}
        elif (where / "sglang").is_dir():
            self._files = {p.relative_to(where).as_posix(): None for p in (where / "sglang").rglob("*.py")}
        else:
            raise SourceMissing(f"{where} is neither a wheel nor a folder holding the sglang package")
        self._trees: dict[str, ast.Module] = {}
        self.version = _version_of(where)

    def text(self, name: str) -> str | None:
        if name not in self._files:
            return None
        archive = self._files[name]
        return archive.read(name).decode() if archive else (self.where / name).read_text()

    def tree(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            text = self.text(name)
            if text is None:
                return None
            self._trees[name] = ast.parse(text, name)
        return self._trees[name]

    def names_under(self, folder: str) -> list[str]:
        return sorted(n for n in self._files if n.startswith(folder))


def _version_of(where: Path) -> str:
    match = re.match(r"sglang-([^-]+)-", where.name)
    return match.group(1) if match else f"source at {where}"


def locate() -> Source:
    """The SGLang release to check against (see the module's docstring)."""
    explicit = os.environ.get("RLMESH_SGLANG_SOURCE", "")
    if explicit:
        return Source(Path(explicit).expanduser().resolve())
    version = os.environ.get("RLMESH_SGLANG_VERSION", "") or PINNED_VERSION
    wheels = sorted(WHEEL_DIR.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        raise SourceMissing(
            f"no SGLang {version} wheel in {WHEEL_DIR}: run `make sglang-source SGLANG_VERSION={version}` "
            "(make test fetches the pinned one), or set RLMESH_SGLANG_SOURCE to a wheel or an sglang source folder"
        )
    return Source(wheels[-1])


# ---- request bodies ------------------------------------------------------------------------


@dataclass
class Field:
    name: str
    annotation: ast.expr | None
    required: bool


@dataclass
class Declarations:
    """The classes and type aliases of one module, by name."""

    classes: dict[str, dict[str, Field]] = field(default_factory=dict)
    aliases: dict[str, ast.expr] = field(default_factory=dict)


def _has_default(value: ast.expr | None) -> bool:
    if value is None:
        return False
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
        return any(k.arg in ("default", "default_factory") for k in value.keywords)
    return True


def declarations(tree: ast.Module) -> Declarations:
    """Every class's annotated fields (its bases' in this module first, as dataclasses and
    msgspec Structs inherit them) and every module-level type alias."""
    found = Declarations()
    nodes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields_of(name: str) -> dict[str, Field]:
        if name in found.classes:
            return found.classes[name]
        node = nodes[name]
        own: dict[str, Field] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in nodes:
                own.update(fields_of(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if _is_classvar(stmt.annotation):
                    continue
                own[stmt.target.id] = Field(stmt.target.id, stmt.annotation, not _has_default(stmt.value))
        found.classes[name] = own
        return own

    for name in nodes:
        fields_of(name)
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, (ast.Subscript, ast.Name, ast.BinOp, ast.Attribute))
        ):
            found.aliases[stmt.targets[0].id] = stmt.value
    return found


def _is_classvar(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return getattr(target, "id", getattr(target, "attr", "")) == "ClassVar"


def sampling_params(source: Source) -> dict[str, Field]:
    """SamplingParams' API fields: a msgspec Struct's annotations (0.5.2x), else the
    keyword arguments of its __init__ (older releases)."""
    tree = source.tree(SAMPLING_PARAMS)
    if tree is None:
        raise SourceMissing(f"{SAMPLING_PARAMS} is not in {source.where}")
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    fields = declarations(ast.Module(body=[node], type_ignores=[])).classes["SamplingParams"]
    if fields:
        return fields
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[1:] + init.args.kwonlyargs
    return {a.arg: Field(a.arg, a.annotation, False) for a in args}


# ---- JSON values against annotations ---------------------------------------------------------


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _args(node: ast.Subscript) -> list[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


class TypeCheck:
    """Whether a JSON value fits a Python annotation, as SGLang's body parsing sees it
    (stricter where pydantic's lax mode would coerce: a string is not a number).
    Names it cannot resolve (enums, classes of other modules) accept anything; they are
    counted in `unresolved` so a test can say what it did not check."""

    def __init__(self, decls: Declarations) -> None:
        self.decls = decls
        self.unresolved: set[str] = set()

    def problems(self, value: Any, annotation: ast.expr | None, where: str) -> list[str]:
        if annotation is None:
            return []
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a forward reference
            annotation = ast.parse(annotation.value, mode="eval").body
        if isinstance(annotation, ast.Constant) and annotation.value is None:
            return [] if value is None else [f"{where}: {value!r} is not null"]
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):  # X | Y
            return self._union(value, [annotation.left, annotation.right], where)
        if isinstance(annotation, ast.Subscript):
            return self._generic(value, _name(annotation.value), _args(annotation), where)
        return self._plain(value, _name(annotation), where)

    def _union(self, value: Any, arms: list[ast.expr], where: str) -> list[str]:
        found = [self.problems(value, arm, where) for arm in arms]
        if any(not p for p in found):
            return []
        return [f"{where}: {value!r} fits none of {' | '.join(ast.unparse(a) for a in arms)}"]

    def _generic(self, value: Any, name: str, args: list[ast.expr], where: str) -> list[str]:
        if name == "Optional":
            return [] if value is None else self.problems(value, args[0], where)
        if name == "Union":
            return self._union(value, args, where)
        if name == "Annotated":
            if any(_name(a.func if isinstance(a, ast.Call) else a) == "Base64Bytes" for a in args[1:]):
                return self._base64(value, args[0], where)
            return self.problems(value, args[0], where)
        if name == "Literal":
            allowed = [a.value for a in args if isinstance(a, ast.Constant)]
            return [] if value in allowed else [f"{where}: {value!r} is not one of {allowed}"]
        if name in ("List", "list", "Sequence", "Set", "set", "FrozenSet"):
            if not isinstance(value, list):
                return [f"{where}: {value!r} is not a list"]
            return [p for i, v in enumerate(value) for p in self.problems(v, args[0], f"{where}[{i}]")]
        if name in ("Tuple", "tuple"):
            if not isinstance(value, list):
                return [f"{where}: {value!r} is not a list"]
            if len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value is Ellipsis:
                args = [args[0]] * len(value)
            if len(args) != len(value):
                return [f"{where}: {value!r} does not have {len(args)} items"]
            return [p for i, (v, a) in enumerate(zip(value, args)) for p in self.problems(v, a, f"{where}[{i}]")]
        if name in ("Dict", "dict", "Mapping"):
            if not isinstance(value, dict):
                return [f"{where}: {value!r} is not an object"]
            return [p for k, v in value.items() for p in self.problems(v, args[1], f"{where}.{k}")]
        self.unresolved.add(name)
        return []

    def _plain(self, value: Any, name: str, where: str) -> list[str]:
        if name in ("Any", "object"):
            return []
        checks = {
            "str": lambda v: isinstance(v, str),
            "bool": lambda v: isinstance(v, bool),
            "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "bytes": lambda v: isinstance(v, str),  # JSON has no bytes: pydantic takes a string
        }
        if name in checks:
            return [] if checks[name](value) else [f"{where}: {value!r} is not {name}"]
        if name in self.decls.aliases:
            return self.problems(value, self.decls.aliases[name], where)
        if name in self.decls.classes:
            if not isinstance(value, dict):
                return [f"{where}: {value!r} is not an object ({name})"]
            return body_problems(value, self.decls.classes[name], self, where)
        self.unresolved.add(name)
        return []

    def _base64(self, value: Any, inner: ast.expr, where: str) -> list[str]:
        """SGLang's Base64Bytes: HTTP callers send bytes as base64 strings."""
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if not isinstance(item, str):
                return [f"{where}[{i}]: {item!r} is not a base64 string"]
            try:
                base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                return [f"{where}[{i}]: {item[:40]!r} is not base64"]
        return []


def body_problems(body: dict, fields: dict[str, Field], check: TypeCheck, where: str) -> list[str]:
    """A request body against a class's fields: unknown keys (SGLang ignores them), missing
    required ones, and values of the wrong type."""
    found = [f"{where}.{k}: no such field (SGLang ignores it)" for k in body if k not in fields]
    found += [f"{where}.{f.name}: required, not sent" for f in fields.values() if f.required and f.name not in body]
    for key, value in body.items():
        if key in fields:
            found += check.problems(value, fields[key].annotation, f"{where}.{key}")
    return found


# ---- routes ------------------------------------------------------------------------------------


@dataclass
class Route:
    path: str
    methods: set[str]
    function: ast.AsyncFunctionDef | ast.FunctionDef
    body_class: str | None  # the io_struct class its JSON body is parsed into

    @property
    def deprecated(self) -> bool:
        return "deprecated" in (ast.get_docstring(self.function) or "").lower()


def _constant_path(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and len(node.args) == 2:  # os.environ.get("X", "/default")
        return _constant_path(node.args[1])
    return None


def _body_class(function: ast.AsyncFunctionDef | ast.FunctionDef, classes: dict[str, Any]) -> str | None:
    for arg in function.args.args:
        annotation = arg.annotation
        if isinstance(annotation, ast.Subscript) and _name(annotation.value) == "Annotated":
            annotation = _args(annotation)[0]
        if annotation is not None and _name(annotation) in classes:
            return _name(annotation)
    return None


def routes(source: Source, classes: dict[str, Any]) -> dict[str, Route]:
    """The routes of SGLang's HTTP server: path -> methods, handler, body class."""
    tree = source.tree(HTTP_SERVER)
    if tree is None:
        raise SourceMissing(f"{HTTP_SERVER} is not in {source.where}")
    found: dict[str, Route] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.AsyncFunctionDef, ast.FunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.args):
                continue
            path = _constant_path(deco.args[0])
            kind = deco.func.attr
            if path is None or (kind not in ROUTE_DECORATORS and kind != "api_route"):
                continue
            methods = set(ROUTE_DECORATORS.get(kind, ()))
            for keyword in deco.keywords:
                if keyword.arg == "methods" and isinstance(keyword.value, (ast.List, ast.Tuple)):
                    methods |= {e.value for e in keyword.value.elts if isinstance(e, ast.Constant)}
            route = found.setdefault(path, Route(path, set(), node, _body_class(node, classes)))
            route.methods |= methods
    return found


# ---- the fields of SGLang's answers --------------------------------------------------------------


def dict_keys(node: ast.AST) -> set[str]:
    """The string keys of every dict literal under a node."""
    return {
        k.value
        for d in ast.walk(node)
        if isinstance(d, ast.Dict)
        for k in d.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }


def _subscript_keys(node: ast.AST, variable: str) -> set[str]:
    """`variable["key"] = ...` and `variable.update({"key": ...})` under a node."""
    keys = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if (
                    isinstance(t, ast.Subscript)
                    and _name(t.value) == variable
                    and isinstance(t.slice, ast.Constant)
                    and isinstance(t.slice.value, str)
                ):
                    keys.add(t.slice.value)
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "update"
            and _name(n.func.value) == variable
        ):
            keys |= {k for a in n.args for k in dict_keys(a)}
        if isinstance(n, ast.Assign) and any(_name(t) == variable for t in n.targets) and isinstance(n.value, ast.Dict):
            keys |= dict_keys(n.value)
    return keys


def route_answer_keys(route: Route, all_routes: dict[str, Route]) -> set[str]:
    """The keys of the JSON objects a route's handler builds (following a handler that
    only answers what another route's handler does, as /get_model_info does)."""
    keys = dict_keys(route.function)
    by_function = {r.function.name: r for r in all_routes.values()}
    for n in ast.walk(route.function):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in by_function:
            other = by_function[n.func.id]
            if other is not route:
                keys |= dict_keys(other.function)
    return keys


def answer_is_none(route: Route) -> bool:
    """The handler returns nothing on success (FastAPI answers `null`)."""
    returns = [n for n in ast.walk(route.function) if isinstance(n, ast.Return)]
    return all(
        n.value is None or "error" in ast.unparse(n.value).lower() or "exception" in ast.unparse(n.value).lower()
        for n in returns
    )


@dataclass
class GenerateAnswer:
    top: set[str]
    meta_info: set[str]
    finish_reason: set[str]
    finish_types: set[str]
    logprob_entry: list[str]  # the positions of an output_token_logprobs entry, when declared


def generate_answer(source: Source, contract: ModuleType | None) -> GenerateAnswer:
    """What a /generate answer may hold: the dicts tokenizer_manager.py builds (the answer
    and its meta_info), the finish reasons' to_json, and the generated contract's fields."""
    tm = source.tree(TOKENIZER_MANAGER)
    sb = source.tree(SCHEDULE_BATCH)
    if tm is None or sb is None:
        raise SourceMissing(f"{TOKENIZER_MANAGER} or {SCHEDULE_BATCH} is not in {source.where}")
    top = set()
    for n in ast.walk(tm):
        if isinstance(n, ast.Dict) and "meta_info" in dict_keys(n):
            top |= dict_keys(n)
    top |= _subscript_keys(tm, "out_dict") - {"meta_info"} | {"meta_info"}
    meta = _subscript_keys(tm, "meta_info")
    finish, types = set(), set()
    for cls in (n for n in sb.body if isinstance(n, ast.ClassDef) and "FINISH" in n.name):
        for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "to_json"):
            for d in (d for d in ast.walk(fn) if isinstance(d, ast.Dict)):
                for k, v in zip(d.keys, d.values):
                    if isinstance(k, ast.Constant):
                        finish.add(k.value)
                        if k.value == "type" and isinstance(v, ast.Constant):
                            types.add(v.value)
    entry: list[str] = []
    if contract is not None:
        top |= set(contract.GenerateResponse.__struct_fields__)
        meta |= set(contract.GenerateMetaInfo.__struct_fields__)
        for name in ("FinishStop", "FinishLength", "FinishAbort"):
            finish |= set(getattr(contract, name).__struct_fields__)
        entry = list(contract.LogprobEntry.__struct_fields__)
    return GenerateAnswer(top, meta, finish, types, entry)


def server_info_keys(source: Source, route: Route, all_routes: dict[str, Route]) -> set[str]:
    """/server_info: every server argument (ServerArgs' fields) and the keys the handler
    and build_server_info add (scheduler_info's are not declared anywhere: left out)."""
    keys = route_answer_keys(route, all_routes)
    names = [SERVER_ARGS, *source.names_under(SERVER_ARG_FIELDS)]
    for name in names:
        tree = source.tree(name)
        for cls in (n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef)):
            if name == SERVER_ARGS and cls.name != "ServerArgs":
                continue
            keys |= {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for name in source.names_under("sglang/srt/utils/"):
        if "def build_server_info" in (source.text(name) or ""):  # (parsing every utility module is slow)
            for fn in (n for n in source.tree(name).body if isinstance(n, ast.FunctionDef)):
                if fn.name == "build_server_info":
                    keys |= _subscript_keys(fn, "result")
    return keys


# ---- SGLang's own code, run alone ---------------------------------------------------------------


class _Stub:
    """Stands in for a name sampling_params.py imports from the rest of SGLang (watermarking,
    reasoning tokens: features rlmesh does not use)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def sampling_verifier(source: Source):
    """SGLang's SamplingParams (sglang/srt/sampling/sampling_params.py run alone, its imports
    of the rest of SGLang stubbed) as a function: (sampling_params dict, vocabulary size) ->
    the ValueError SGLang's tokenizer manager answers 400 with, or None. None where this
    release's SamplingParams cannot be run so."""
    tree = source.tree(SAMPLING_PARAMS)
    if tree is None:
        return None
    stubs: dict[str, Any] = {}
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            stubs.update({a.asname or a.name: type(a.name, (_Stub,), {}) for a in node.names})
        else:
            body.append(node)
    namespace: dict[str, Any] = {"__name__": "sglang_sampling_params_checked", **stubs}
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), SAMPLING_PARAMS, "exec"), namespace)
        cls = namespace["SamplingParams"]
        cls(max_new_tokens=1).verify(8)
    except Exception:
        return None

    def verify(params: dict, vocab_size: int) -> str | None:
        try:
            cls(**params).verify(vocab_size)
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    return verify


# ---- SGLang's generated JSON contract ------------------------------------------------------------


def contract_module(source: Source) -> ModuleType | None:
    """sglang/api/v1/api_types.py loaded alone (it imports only typing and msgspec), or
    None where this release has no such module."""
    text = source.text(API_TYPES)
    if text is None:
        return None
    spec = importlib.util.spec_from_loader("sglang_api_types_checked", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the Structs' annotations through it
    exec(compile(text, f"{source.where}/{API_TYPES}", "exec"), module.__dict__)
    return module
