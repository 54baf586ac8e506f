#!/usr/bin/env bash
# Check the node agent's isolation on a machine with an NVIDIA GPU, in one go (the checks take under
# 7 minutes), then the pool end to end on it (scripts/gpu-check-e2e.sh, under 5 minutes, which ends
# by serving a small model through the gateway where llama-cpp-python is there).
# Installs the project (from .whl/ without network when present), then runs scripts/gpu_check.py,
# which prints a pass/fail/skip table and, when $OUT is set, writes gpu-check.json / gpu-check.txt
# and job logs there. Arguments go to gpu_check.py (`--dry-run`: simulated devices, no GPU needed).
# Read-only towards the GPU: no MIG mode change, no clocks, no reset.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
start=$(date +%s)

nvidia-smi -L 2>&1 | head -n 16 || echo "nvidia-smi not available"

# A GPU machine that fetches nothing installs from the carried wheels (scripts/gpu-wheels.sh).
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --find-links .whl -e . \
    || { echo "FAIL: pip install --no-index --find-links .whl -e . failed (run scripts/gpu-wheels.sh)"; exit 2; }
else
  "$PY" -m pip install -q -e . || { echo "FAIL: pip install -e . failed"; exit 2; }
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "WARN: PyTorch is not installed; the checks that need it will be skipped"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
  2>/dev/null || true

timeout 420 "$PY" scripts/gpu_check.py "$@"
rc=$?
# On a real GPU, the pool end to end as well: `cpool up`, slices, a remote function, and a model
# served through the gateway (scripts/gpu-check-e2e.sh; its output goes to $OUT/e2e.log too).
if [[ " $* " != *" --dry-run "* ]] && nvidia-smi -L >/dev/null 2>&1; then
  timeout 300 bash scripts/gpu-check-e2e.sh 2>&1 | tee "${OUT:-/tmp}/e2e.log"
fi
echo "gpu-check finished in $(( $(date +%s) - start )) s with exit code $rc"
exit $rc
