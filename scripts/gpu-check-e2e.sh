#!/usr/bin/env bash
# The README's tour on a real NVIDIA GPU, end to end: `cpool up` (control plane + agent through
# NVML), then `cpool run` with a half slice, an exclusive GPU and an MPS slice, each job reporting
# what PyTorch sees and how much memory it could take, and a remote function through the SDK.
# Read-only towards the GPU (no MIG mode, clocks or reset). Prints one line per step; with $OUT
# set, the pool's log lands in $OUT/e2e-pool.log. Run after scripts/gpu-check.sh installed the
# project.   usage: scripts/gpu-check-e2e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
CPOOL="$(dirname "$(command -v "$PY")")/cpool"
[ -x "$CPOOL" ] || CPOOL="$(command -v cpool)"
DATA="$(mktemp -d /tmp/cpool-e2e.XXXX)"
PORT="${CPOOL_E2E_PORT:-8479}"
LOG="${OUT:-$DATA}/e2e-pool.log"
"$CPOOL" up --data-dir "$DATA" --port "$PORT" ${CPOOL_E2E_SIMULATE:+--simulate "$CPOOL_E2E_SIMULATE"} >"$LOG" 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; sleep 3; kill $UP 2>/dev/null' EXIT
export CPOOL_SERVER="https://127.0.0.1:$PORT" CPOOL_CA="$DATA/tls/cert.pem"
for _ in $(seq 60); do
  [ -s "$DATA/admin-token" ] && "$CPOOL" --token "$(cat "$DATA/admin-token")" nodes >/dev/null 2>&1 && break
  sleep 1
done
export CPOOL_TOKEN="$(cat "$DATA/admin-token" 2>/dev/null)"
for _ in $(seq 30); do
  "$CPOOL" nodes 2>/dev/null | grep -qi 'ready' && break; sleep 1
done
echo "== cpool nodes"; "$CPOOL" nodes
# A job that takes GPU memory 1 GiB at a time up to 200 GiB (more than any GPU) and says where it stopped.
probe='import json,os,sys
try:
    import torch
except ImportError as e:
    sys.exit(f"{e}: uid {os.getuid()}, {sys.executable}, sys.path {sys.path}")
d=torch.cuda.get_device_properties(0); got=0; keep=[]
try:
    while got < 200*1024:
        keep.append(torch.empty(1024*2**20, dtype=torch.uint8, device="cuda")); got += 1024
except torch.cuda.OutOfMemoryError: pass
mps={k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}
print(json.dumps({"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "name": d.name, "total_mib": d.total_memory//2**20, "sm": d.multi_processor_count, "took_mib": got, "mps_env": mps}), flush=True)
import time; time.sleep(float(os.environ.get("PROBE_HOLD", "0")))'
# Jobs start with a clean environment: where the host's PyTorch comes from PYTHONPATH (as in some
# images), the job is given that folder explicitly.
SITE="$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)"
echo "PyTorch from $SITE; host PYTHONPATH=${PYTHONPATH:-}"
ENVS=(); [ -n "$SITE" ] && ENVS=(--env "PYTHONPATH=$SITE")
step() { echo "== cpool run $*"; timeout 120 "$CPOOL" run --no-code -n "${ENVS[@]}" "$@" -- "$PY" -c "$probe"; echo "exit $?"; }
step --gpus 0.5
step --gpus 1 --exclusive
# held 6 s, so that NVML shows whether the client went through the MPS server (as MPS clients
# do) or straight to the GPU (no MPS: none of its limits)
( sleep 12; echo "-- while the MPS job holds:"; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  ps -eo user,pid,args | grep -E '[n]vidia-cuda-mps' ) &
ENVS+=(--env PROBE_HOLD=6); step --gpus 0.25 --isolation mps; unset 'ENVS[-1]'; unset 'ENVS[-1]'; wait
echo "== two half slices at once"
"$CPOOL" run --no-code -n "${ENVS[@]}" --detach --name half-a --gpus 0.5 -- "$PY" -c "$probe; import time; time.sleep(20)"
timeout 120 "$CPOOL" run --no-code -n "${ENVS[@]}" --gpus 0.5 -- "$PY" -c "$probe"; echo "exit $?"
echo "== cpool ps"; "$CPOOL" ps
echo "== MPS slices of two tenants on one GPU at once (MPS serves one uid at a time)"
"$CPOOL" tenants create teamb >/dev/null && "$CPOOL" users create bob --tenant teamb >/dev/null
BOB="$("$CPOOL" tokens create --user bob --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["token"])')"
"$CPOOL" run --no-code -n "${ENVS[@]}" --detach --name mps-a --gpus 0.25 --isolation mps -- "$PY" -c "$probe; import time; time.sleep(25)"
sleep 8; t0=$(date +%s)
CPOOL_TOKEN="$BOB" timeout 90 "$CPOOL" run --no-code -n "${ENVS[@]}" --gpus 0.25 --isolation mps -- "$PY" -c "$probe"
echo "exit $? after $(( $(date +%s) - t0 )) s (tenant a's MPS job holds the GPU for 25 s)"
echo "== a remote function (SDK)"
SITE="$SITE" timeout 180 "$PY" - <<'PYEOF'
import os
from computepool import Pool
pool = Pool()
env = {"PYTHONPATH": os.environ["SITE"]} if os.environ.get("SITE") else {}
@pool.function(gpus=0.5, time_limit="5m", env=env)
def where() -> str:
    import torch
    x = torch.randn(4096, 4096, device="cuda")
    return f"{torch.cuda.get_device_name(0)}: {float((x @ x).sum()):.3e}"
print(where.remote())
PYEOF
echo "exit $?"
echo "== a model service behind the gateway (llama.cpp serving the tiny test model)"
# The GPU machine reaches no model hub: the tiny GGUF the tests use is written here. Where llama.cpp's
# server is not importable (CPOOL_LLAMA_PYTHON: a python that has it), the step says so and skips.
LPY="${CPOOL_LLAMA_PYTHON:-$PY}"
if ! "$PY" -c 'import gguf' 2>/dev/null; then
  echo "skip: gguf is not importable by $PY (pip install 'computepool[serve]')"
elif ! "$LPY" -c 'import llama_cpp.server.app' 2>/dev/null; then
  echo "skip: llama_cpp.server is not importable by $LPY (scripts/llama-venv.sh builds a venv; set CPOOL_LLAMA_PYTHON)"
else
  MDIR="$(mktemp -d /var/tmp/cpool-tiny.XXXX)"; chmod 755 "$MDIR"
  "$PY" -m computepool.serving.tinymodel "$MDIR/tiny.gguf" >/dev/null && chmod 644 "$MDIR/tiny.gguf"
  LSITE="$("$LPY" -c 'import os, llama_cpp; print(os.path.dirname(os.path.dirname(llama_cpp.__file__)))')"
  timeout 60 "$CPOOL" serve tiny --no-code --gpus 0.25 --min 1 --max 1 --health-path /v1/models \
    --env "PYTHONPATH=$LSITE" --command "exec $LPY -m llama_cpp.server --model $MDIR/tiny.gguf \
    --host 127.0.0.1 --n_ctx 256 --n_gpu_layers -1 --port \$PORT --api_key \$CPOOL_SERVICE_KEY" >/dev/null
  echo "cpool serve: exit $?"
  timeout 150 "$PY" - <<'PYEOF'
import os, time
import httpx
from computepool.core.tls import client_context
url, headers = os.environ["CPOOL_SERVER"], {"Authorization": f"Bearer {os.environ['CPOOL_TOKEN']}"}
http = httpx.Client(base_url=url, headers=headers, timeout=60, verify=client_context(os.environ["CPOOL_CA"]))
t0 = time.time()
while http.get("/api/v1/services/tiny").json().get("ready", 0) < 1 and time.time() - t0 < 120:
    time.sleep(1)
print(f"ready after {time.time() - t0:.0f} s:", http.get("/v1/models").json())
body = {"model": "tiny", "prompt": "The pool serves", "max_tokens": 16, "temperature": 0}
r = http.post("/v1/completions", json=body)
print("completion:", r.status_code, r.json().get("choices", [{}])[0].get("text"), r.json().get("usage"))
endpoint = http.get("/api/v1/services/tiny").json()["replicas"][0]["endpoint"]
print("the replica's port without its key:", httpx.get(endpoint + "/v1/models", timeout=10).status_code)
http.delete("/api/v1/services/tiny")  # then wait for its replica to end before the pool stops
live = ("pending", "bound", "active")
while time.time() - t0 < 140 and any(
    a["name"] == "svc-tiny" and a["state"] in live for a in http.get("/api/v1/allocations").json()["items"]
):
    time.sleep(1)
PYEOF
  echo "exit $?"
  rm -rf "$MDIR"
fi
