"""Measuring a cooperative model: speed probes on candidate nodes, and the running plan's real speed.

A probe is an allocation of the service's tenant pinned to one node that loads the model and decodes
`probe_tokens` greedily (serving/coop/engine/probe.py); its `CPOOL-PROBE {json}` line in the job's
stdout is the measurement. The running plan is measured through its replica, as the gateway reaches
it (showing the replica's key), so `explain` compares what users get, not a prediction.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from computepool.server.logic.allocations import _normalise
from computepool.serving.coop import planner, scripts
from computepool.store.coop import Measurement
from computepool.wire.allocations import AllocationCreate
from computepool.wire.coop import CoopSpec

PROBE_LINE = "CPOOL-PROBE "
RPC_READY_LINE = "CPOOL-RPC ready "
PROBE_CPU_MILLI = 1000
PROBE_OVERHEAD_MIB = 256  # the engine's own memory (Python, llama.cpp's buffers) beyond the model's
NODE_LABEL = "cpool.io/node"
LOG_GRACE_S = 10.0  # an ended probe's last output may reach the server this long after it ended
PENDING_DEADLINE_S = 120.0  # a probe or RPC server not started by then: its node cannot take it now
SPEED_PROMPT = "The pool measures"
MIB = 1 << 20


def probe_memory_mib(model_bytes: int | None, node_memory_mib: int) -> int:
    """What a probe asks for (and is held to: memory.max): the whole model with the planner's margin
    plus the engine's own, never more than the node has. Before any probe read the file's size the
    control plane cannot know it (the file is on the nodes), so the first probes ask for the node's
    memory: too little would have the model's load killed, and a probe that cannot get it in time
    marks the node unusable (see PENDING_DEADLINE_S)."""
    if not model_bytes or model_bytes <= 0:
        return max(1, node_memory_mib)
    need = math.ceil(model_bytes * planner.MEMORY_MARGIN / MIB) + PROBE_OVERHEAD_MIB
    return max(1, min(need, node_memory_mib))


def identity(detail: dict[str, Any]) -> tuple[object, ...]:
    """What tells two probes' model files apart: the size llama.cpp read, and the file's size and
    digest where the probe reports them. Not its modification time: a file copied to each node
    has one time per copy, yet it is the same model."""
    return (detail.get("model_bytes"), detail.get("file_size"), detail.get("file_digest"))


def probe_request(
    coop: CoopSpec, spec: AllocationCreate, node: str, memory_mib: int, tenant: str, service: str
) -> dict[str, Any]:
    args = [
        "--model",
        coop.model,
        "--tokens",
        str(coop.probe_tokens),
        "--ctx",
        str(coop.ctx),
        "--threads",
        "1",
    ]
    body = AllocationCreate(
        name=f"coop-probe-{service}"[:63],
        cpu_milli=PROBE_CPU_MILLI,
        memory_mib=memory_mib,
        node_selector={**(spec.node_selector or {}), NODE_LABEL: node},
        tolerations=spec.tolerations,
        command=scripts.command(coop.engine_python, "probe", args),
        time_limit="10m",
    )
    return _normalise(body, tenant)


def probe_result(stdout: str) -> dict[str, Any] | None:
    """The probe's JSON line, or None when it printed none (or an unreadable one)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(PROBE_LINE):
            try:
                out = json.loads(line[len(PROBE_LINE) :])
            except ValueError:
                return None
            return out if isinstance(out, dict) and isinstance(out.get("tokens_per_s"), int | float) else None
    return None


def measurement(node: str, memory_mib: int, result: dict[str, Any], now: datetime) -> Measurement:
    return Measurement(node, "cpu", float(result["tokens_per_s"]), memory_mib, now, result)


def failure(state: str, reason: str, stderr: str) -> str:
    """One line saying why a probe gave no measurement (the engine's last stderr line helps most)."""
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    why = f"probe {state}: {reason}" if state != "released" else "probe printed no CPOOL-PROBE line"
    return (f"{why} ({last[:200]})" if last else why)[:500]


@dataclass(frozen=True)
class Speed:
    tokens_per_s: float | None
    detail: str


async def measure_replica(endpoint: str, key: str | None, tokens: int, timeout_s: float = 120.0) -> Speed:
    """Decoding speed through the replica: one greedy completion of `tokens` tokens, timed."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": SPEED_PROMPT, "max_tokens": tokens, "temperature": 0}
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            start = time.monotonic()
            r = await client.post(f"{endpoint}/v1/completions", json=body, headers=headers)
            elapsed = time.monotonic() - start
    except httpx.HTTPError as e:
        return Speed(None, f"timed completion failed: {type(e).__name__}")
    if r.status_code != 200:
        return Speed(None, f"timed completion answered {r.status_code}")
    try:
        done = int(r.json()["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return Speed(None, "timed completion: no usage in the answer")
    if done <= 0 or elapsed <= 0:
        return Speed(None, "timed completion decoded nothing")
    return Speed(done / elapsed, f"{done} tokens in {elapsed:.2f} s")
