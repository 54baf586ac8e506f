#!/usr/bin/env bash
# Build the Python environment the serving tests run llama.cpp from: a venv made from the system's
# /usr/bin/python3 (a python every tenant's user may run) holding llama-cpp-python with its OpenAI-
# compatible server, and gguf (to write the tests' tiny model). World-readable; built once, reused.
#   usage: scripts/llama-venv.sh [DIR]   (default /opt/computepool-test/llama-venv)
#   env:   CPOOL_LLAMA_VERSION (default 0.3.36), CPOOL_LLAMA_VENV_PYTHON (default /usr/bin/python3),
#          CMAKE_ARGS (default -DGGML_RPC=ON), PIP_FIND_LINKS (more folders to look for the wheel in)
# llama-cpp-python has no prebuilt wheels on PyPI: its wheel is compiled once (about 5 minutes on two
# cores) into ~/.cache/computepool/wheels, which CI keeps between runs; later runs take seconds.
set -euo pipefail
DIR="${1:-/opt/computepool-test/llama-venv}"
VERSION="${CPOOL_LLAMA_VERSION:-0.3.36}"
PY="${CPOOL_LLAMA_VENV_PYTHON:-/usr/bin/python3}"
CACHE="${HOME}/.cache/computepool/wheels"
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_RPC=ON}"

check='import sys, gguf, llama_cpp, llama_cpp.server.app
sys.exit(llama_cpp.__version__ != sys.argv[1])'
if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "$check" "$VERSION" 2>/dev/null; then
  echo "$DIR: llama-cpp-python $VERSION already there"
  exit 0
fi

"$PY" -c 'import ensurepip, venv' 2>/dev/null || {
  echo "$PY has no venv/ensurepip module: install python3-venv (apt-get install python3-venv)" >&2
  exit 1
}
if [ -e "$DIR" ] && [ ! -f "$DIR/pyvenv.cfg" ] && [ -n "$(ls -A "$DIR")" ]; then
  echo "$DIR exists and is not a virtual environment: not touching it (give another DIR)" >&2
  exit 1
fi
start=$(date +%s)
umask 022
# An unfinished build from before does not import, so it lands here and is made again.
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")" "$CACHE"
"$PY" -m venv "$DIR"

# The wheel: from the cache, a local wheel folder or PIP_FIND_LINKS; else compiled into the cache.
wheel=""
IFS=' ' read -r -a links <<<"$CACHE /opt/computepool-test/wheels ${PIP_FIND_LINKS:-}"
for d in "${links[@]}"; do
  found="$(compgen -G "$d/llama_cpp_python-$VERSION-*.whl" | head -n 1 || true)"
  if [ -n "$found" ]; then wheel="$found"; break; fi
done
if [ -z "$wheel" ]; then
  echo "compiling llama-cpp-python $VERSION (CMAKE_ARGS=$CMAKE_ARGS); takes minutes, once"
  "$DIR/bin/python" -m pip wheel -q --no-deps --no-cache-dir -w "$CACHE" "llama-cpp-python==$VERSION"
  wheel="$(compgen -G "$CACHE/llama_cpp_python-$VERSION-*.whl" | head -n 1)"
elif [ "$(dirname "$wheel")" != "$CACHE" ]; then
  cp -f "$wheel" "$CACHE/"  # so that CI's cache of that folder holds it
fi
"$DIR/bin/python" -m pip install -q --no-cache-dir "${wheel}[server]" gguf
chmod -R a+rX "$DIR"
chmod a+rx "$(dirname "$DIR")"
"$DIR/bin/python" -c "$check" "$VERSION" || { echo "$DIR: llama-cpp-python $VERSION does not import" >&2; exit 1; }
echo "$DIR: llama-cpp-python $VERSION ready in $(( $(date +%s) - start )) s (wheel $(basename "$wheel"))"
