#!/usr/bin/env bash
# Build the Python environment the multi-host gang tests run their jobs with: a venv made from the
# system's /usr/bin/python3 (a python every tenant's user may run) holding the CPU build of PyTorch.
# World-readable, so jobs running as the tenants' users can import from it; built once, then reused.
#   usage: scripts/torch-venv.sh [DIR]   (default /opt/computepool-test/torch-venv)
#   env:   CPOOL_TORCH_VERSION (default 2.13.0), CPOOL_TORCH_VENV_PYTHON (default /usr/bin/python3)
# Only the CPU build is ever asked for: a plain `torch` requirement would pull the CUDA build (GBs).
set -euo pipefail
DIR="${1:-/opt/computepool-test/torch-venv}"
VERSION="${CPOOL_TORCH_VERSION:-2.13.0}"
PY="${CPOOL_TORCH_VENV_PYTHON:-/usr/bin/python3}"

if [ -x "$DIR/bin/python" ] \
  && "$DIR/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
  echo "$DIR: torch $VERSION already there"
  exit 0
fi

"$PY" -c 'import ensurepip, venv' 2>/dev/null || {
  echo "$PY has no venv/ensurepip module: install python3-venv (apt-get install python3-venv)" >&2
  exit 1
}

# The CPU wheel: from a local wheel directory when one holds it (pip's find-links), else from
# PyTorch's CPU index.
IFS=' ' read -r -a links <<<"${PIP_FIND_LINKS:-} /opt/wheels"
source_args=()
for d in "${links[@]}"; do
  if [ -n "$d" ] && compgen -G "$d/torch-$VERSION+cpu-*.whl" >/dev/null; then
    source_args=(--find-links "$d")
    break
  fi
done
[ "${#source_args[@]}" -gt 0 ] || source_args=(--extra-index-url https://download.pytorch.org/whl/cpu)

if [ -e "$DIR" ] && [ ! -f "$DIR/pyvenv.cfg" ] && [ -n "$(ls -A "$DIR")" ]; then
  echo "$DIR exists and is not a virtual environment: not touching it (give another DIR)" >&2
  exit 1
fi
start=$(date +%s)
umask 022
# An unfinished build from before does not import torch, so it lands here and is made again.
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --no-cache-dir "${source_args[@]}" "torch==$VERSION+cpu"
chmod -R a+rX "$DIR"
chmod a+rx "$(dirname "$DIR")"
"$DIR/bin/python" -W ignore::UserWarning - "$DIR" "$start" <<'PY'
import sys, time
import torch
import torch.distributed as dist
assert torch.version.cuda is None, f"{torch.__version__} is not the CPU build"
assert dist.is_gloo_available(), "torch.distributed has no gloo backend"
print(f"{sys.argv[1]}: torch {torch.__version__} built in {time.time() - float(sys.argv[2]):.0f} s")
PY
