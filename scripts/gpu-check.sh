#!/usr/bin/env bash
# Check the node agent's isolation on a machine with an NVIDIA GPU, in one go (< 8 minutes).
# Installs the project (and PyTorch if missing), then runs scripts/gpu_check.py, which prints a
# pass/fail table and, when $OUT is set, writes gpu-check.json / gpu-check.txt and job logs there.
# Read-only towards the GPU: no MIG mode change, no clocks, no reset.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
start=$(date +%s)

nvidia-smi -L 2>&1 | head -n 16 || echo "nvidia-smi not available"

"$PY" -m pip install -q -e . || { echo "FAIL: pip install -e . failed"; exit 2; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "PyTorch missing: installing it (this is the slow part)"
  timeout 240 "$PY" -m pip install -q torch || echo "WARN: torch install failed; torch checks will be skipped"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
  2>/dev/null || true

timeout 210 "$PY" scripts/gpu_check.py
rc=$?
echo "gpu-check finished in $(( $(date +%s) - start )) s with exit code $rc"
exit $rc
