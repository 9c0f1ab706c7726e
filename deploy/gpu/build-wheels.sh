#!/usr/bin/env bash
# The wheel bundle for a bare GPU machine: one with its own CUDA torch and no package index.
# It holds what such a machine lacks to run rlmesh and its GPU suite (docs/gpu.md): the
# rlmesh wheel, its Python dependencies, megatron-core and pytest, as wheels for the target's
# Python and platform; never torch, nor what torch itself brings (nvidia-*, triton, sympy,
# networkx, jinja2, fsspec, filelock, typing-extensions, ...), which the CUDA torch already
# installed. Left out to stay under the size bound (LEAVE_OUT): pyarrow (parquet datasets
# only; 40 MB), hf-xet (Hugging Face Hub downloads; the suite loads local models only) and
# pygments (pytest's and rich's colouring, which both do without it; 1.2 MB).
#
#   deploy/gpu/build-wheels.sh [OUT_DIR]        (default dist/gpu-wheels; needs a package index)
#
# Settings (environment): PYTHON (the interpreter whose pip resolves; default .venv/bin/python
# or python3), TARGET_PYTHON (the GPU machine's Python as 3.11; default this one's),
# TARGET_PLATFORM (default manylinux_2_28_x86_64: glibc 2.28 or newer), MAX_MIB (default 60:
# the script fails above it). On the GPU machine:
#
#   pip install --no-index --no-deps OUT_DIR/*.whl
set -euo pipefail

cd "$(dirname "$0")/../.."
OUT=${1:-dist/gpu-wheels}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TARGET_PYTHON=${TARGET_PYTHON:-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
TARGET_PLATFORM=${TARGET_PLATFORM:-manylinux_2_28_x86_64}
MAX_MIB=${MAX_MIB:-60}
LEAVE_OUT=${LEAVE_OUT:-pyarrow,hf-xet,pygments}

rm -rf "$OUT" && mkdir -p "$OUT"
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT

# 1. rlmesh itself.
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT" .

# 2. What the project needs on the target, resolved by pip for the target's Python and platform.
"$PYTHON" -m pip install -q --dry-run --ignore-installed --report "$work/report.json" \
  --only-binary=:all: --python-version "$TARGET_PYTHON" --platform "$TARGET_PLATFORM" \
  --platform manylinux2014_x86_64 --target "$work/none" \
  "$OUT"/rlmesh-*.whl "megatron-core>=0.16.1,<0.17" "pytest>=8"

# 3. Less torch and everything it brings (reachable from it in the resolution), less LEAVE_OUT.
"$PYTHON" - "$work/report.json" "$LEAVE_OUT" > "$work/wanted.txt" <<'PY'
import json, re, sys
report, leave_out = json.load(open(sys.argv[1])), set(sys.argv[2].split(","))
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
meta = {norm(i["metadata"]["name"]): i["metadata"] for i in report["install"]}
def requires(name):
    for r in meta[name].get("requires_dist") or []:
        if ";" in r and "extra ==" in r.split(";", 1)[1]:
            continue
        dep = norm(re.match(r"[A-Za-z0-9._-]+", r).group())
        if dep in meta:
            yield dep
torch_side, todo = set(), ["torch"]
while todo:
    n = todo.pop()
    if n in meta and n not in torch_side:
        torch_side.add(n)
        todo.extend(requires(n))
for name, m in sorted(meta.items()):
    if name not in torch_side and name not in {norm(x) for x in leave_out} and name != "rlmesh":
        print(f"{m['name']}=={m['version']}")
PY

# 4. Their wheels for the target (a package published as an sdist only is built here: pure Python).
while read -r requirement; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" \
      --platform "$TARGET_PLATFORM" --platform manylinux2014_x86_64 -d "$OUT" "$requirement" 2>/dev/null \
    || "$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "$requirement"
done < "$work/wanted.txt"

bytes=$(cat "$OUT"/*.whl | wc -c)
size=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "$(ls "$OUT" | wc -l) wheels, ${size} MiB in $OUT (torch and its own dependencies excluded; left out: $LEAVE_OUT)"
if [ "$bytes" -ge $((MAX_MIB * 1048576)) ]; then
  echo "the bundle is over ${MAX_MIB} MiB" >&2
  exit 1
fi
