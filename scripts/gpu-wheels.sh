#!/usr/bin/env bash
# Prepare .whl/: wheels (CPython 3.12, manylinux x86_64) of every project dependency a GPU machine
# that fetches nothing lacks, so scripts/gpu-check.sh can install with `pip install --no-index`.
#
# Starts from the prepared folder beside the checkout (../shared/gpu-wheels, or $CPOOL_GPU_WHEELS),
# then downloads what pyproject.toml needs beyond it and beyond what that machine has already
# (PRESENT below), plus the build backend (setuptools, wheel, packaging) an editable install
# needs: pip builds it in an isolated environment, where the installed packages do not count.
# .whl/ is kept out of git through .git/info/exclude; carry it to the GPU machine with the tree.
#   usage: scripts/gpu-wheels.sh        (needs the package index here, not there)
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${CPOOL_GPU_WHEELS:-../shared/gpu-wheels}"
DEST=.whl
PY="${PYTHON:-python3}"
# Installed on the GPU machine already: never carried (pip takes the installed ones).
PRESENT="torch numpy aiohttp httpx rich typer psutil nvidia-ml-py prometheus-client cloudpickle matplotlib pillow fonttools kiwisolver contourpy cycler pyparsing python-dateutil six pyyaml pathspec"

mkdir -p "$DEST"
if [ -d "$SRC" ]; then
  cp -n "$SRC"/*.whl "$DEST"/ 2>/dev/null || true
  chmod u+w "$DEST"/*.whl
else
  echo "note: $SRC not found; downloading every missing wheel"
fi

exclude="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$DEST/" "$exclude" 2>/dev/null || echo "/$DEST/" >>"$exclude"

# The dependencies pyproject.toml names, less those the GPU machine has.
mapfile -t wanted < <(PRESENT="$PRESENT" "$PY" - <<'EOF'
import os, re, tomllib
present = {p.lower() for p in os.environ["PRESENT"].split()}
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    name = re.split(r"[\[<>=!~; ]", dep, maxsplit=1)[0]
    if re.sub(r"[-_.]+", "-", name).lower() not in present:
        print(dep)
EOF
)
wanted+=("setuptools>=68" "wheel" "packaging>=24")

"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform any \
  --find-links "$DEST" -d "$DEST" "${wanted[@]}"

# Transitive dependencies the GPU machine has (numpy under matplotlib, …) are not carried.
for name in $PRESENT; do
  stem="$(echo "$name" | tr '-' '_')"
  rm -f "$DEST/$stem"-[0-9]*.whl
done
echo "$DEST: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) (carry it: .whl)"
