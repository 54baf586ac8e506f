#!/usr/bin/env bash
# Check device discovery on a machine with accelerators of any vendor (NVIDIA, AMD, Intel, Ascend,
# Apple), in under two minutes: prints what the agent finds per vendor (and why a vendor found
# nothing), each device's usage now, then starts a one-node pool on this machine (`cpool up`) and
# runs one job per device that prints the visible-devices variables the agent gave it.
# `scripts/device-check.sh --simulate SPEC` does the same with simulated devices (no hardware).
# Read-only towards the devices. Writes device-check.json and the pool's log to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUTDIR="${OUT:-$(mktemp -d)}"
simulate=()
if [ "${1:-}" = "--simulate" ] && [ -n "${2:-}" ]; then simulate=(--simulate "$2"); fi

for tool in nvidia-smi amd-smi xpu-smi npu-smi system_profiler; do
  command -v "$tool" >/dev/null 2>&1 && echo "found $tool: $(command -v "$tool")"
done
"$PY" -m computepool.agent.devices "${simulate[@]}" --usage > "$OUTDIR/device-check.json" \
  || { echo "FAIL: device discovery failed"; exit 2; }
"$PY" - "$OUTDIR/device-check.json" <<'PYEOF'
import json, sys
found = json.load(open(sys.argv[1]))
print(f"backend: {found['backend']}")
for d in found["devices"]:
    env = " ".join(f"{k}={v}" for k, v in d["env"].items()) or "(no variable)"
    print(f"  [{d['index']}] {d['vendor']:7} {d['model']:16} {d['memory_mib']:>8} MiB  vendor index "
          f"{d['physical_index']}  uuid {d['uuid']}  link {d['link_group'] or '-'}  "
          f"cores {d['cores'] or '-'}  nodes {' '.join(d['dev_nodes']) or '-'}  -> {env}")
for u in found.get("usage", []):
    print(f"  usage [{u['index']}] util {u['utilization_pct']}  used {u['memory_used_mib']} MiB  "
          f"power {u['power_w']} W  health {u['health'] or 'ok'}")
for n in found["notes"]:
    print(f"  note: {n}")
PYEOF
count=$("$PY" -c "import json,sys; print(len(json.load(open(sys.argv[1]))['devices']))" "$OUTDIR/device-check.json")
if [ "$count" = 0 ]; then echo "no accelerator found: nothing to run a job on"; exit 1; fi

# One node pool on this machine; one job per device model, printing what it was given.
data=$(mktemp -d); port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
export CPOOL_CONFIG="$data/config.json" CPOOL_CGROUP_BASE=none
"$PY" -m computepool.cli.main up "${simulate[@]}" --data-dir "$data/pool" --port "$port" > "$OUTDIR/up.log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 120); do grep -q "ComputePool is up" "$OUTDIR/up.log" && break; sleep 0.5; done
grep -q "ComputePool is up" "$OUTDIR/up.log" || { echo "FAIL: cpool up did not start"; tail "$OUTDIR/up.log"; exit 2; }
rc=0
for model in $("$PY" -c "import json,sys; print(' '.join(sorted({d['model'] for d in json.load(open(sys.argv[1]))['devices']})))" "$OUTDIR/device-check.json"); do
  echo "job on a $model:"
  timeout 120 "$PY" -m computepool.cli.main run --gpus 1 --model "$model" -- sh -c \
    'for v in CUDA_VISIBLE_DEVICES HIP_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES ZE_AFFINITY_MASK ASCEND_RT_VISIBLE_DEVICES CPOOL_DEVICE_UUIDS; do eval "echo \"  $v=\${$v-unset}\""; done' \
    || { echo "FAIL: the job on a $model failed"; rc=1; }
done
echo "device-check finished with exit code $rc"
exit $rc
