"""Choosing and placing a cooperative service's plan: the planner's inputs from measurements and
verified links, the RPC servers' allocations, and the head replica's spec.

RPC shards go only on nodes the head node's discovery verified lately, at the address that
verification saw — and only when that address is the one the control plane itself knows the node
by (`Node.address`, which only that node's credential sets): the discovery key is shared by every
node, so a key holder could announce another node's id at an address of its choosing (its own
loopback, say); the control plane's record is what ties the id to a machine. Loopback and
link-local addresses mean "this machine" or "this link" whoever says them, so they are used only
when the head itself is on loopback (a single-machine pool, as tests and `cpool bench coop` run).
The RPC server binds that private address (the engine refuses any other) and admits only the
holder of the plan's secret.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from computepool.scheduler.constraints import tolerates
from computepool.server.coop.measure import NODE_LABEL
from computepool.server.logic.allocations import _normalise
from computepool.serving.coop import planner, scripts
from computepool.store.coop import Measurement, NodeRow, PeerRow
from computepool.wire.allocations import AllocationCreate
from computepool.wire.coop import CoopSpec
from computepool.wire.services import ServiceSpec

RPC_CPU_MILLI = 1000
RPC_MEMORY_MIB = 256  # beyond the shard's own memory
MIB = 1 << 20
SECRET_ENV = "CPOOL_COOP_SECRET"  # what the engine programs read the plan's secret from
# A service's request.env may not name CPOOL_ variables (schemas/allocations.check_env_name), so the
# head's spec carries the secret under this name and its launching shell renames it.
SPEC_SECRET_ENV = "COOP_PLAN_SECRET"


def fits(node: NodeRow, request: AllocationCreate) -> bool:
    """Whether the service's own node selector and tolerations let its allocations go to `node`.
    Not the node label: the controller itself pins the head's spec with it (and probes and RPC
    servers get their own)."""
    if any(node.labels.get(k) != v for k, v in (request.node_selector or {}).items() if k != NODE_LABEL):
        return False
    allowed = frozenset(request.tolerations or ())
    return all(tolerates(allowed, k, v) for k, v in node.taints.items())


def peer_refusal(peer: PeerRow, nodes: dict[str, NodeRow]) -> str | None:
    """Why this verified peer row may not place an RPC shard (None: it may); see the module's doc."""
    node, head = nodes.get(peer.node_id), nodes.get(peer.observer)
    if node is None or head is None:
        return f"{peer.node_id} as seen by {peer.observer}: not a node of the pool"
    where = f"{peer.node_id} as seen by {peer.observer}"
    try:
        seen = ipaddress.ip_address(peer.address)
    except ValueError:
        return f"{where}: announced address is not an IP address"
    try:
        known = ipaddress.ip_address(node.address)
    except ValueError:
        return f"{where}: the pool knows the node by {node.address or 'no address'!r}, not an IP address"
    if seen != known:
        return f"{where}: announced at {seen}, but the pool knows the node at {known}"
    if seen.is_unspecified:
        return f"{where}: unspecified address {seen}"
    if seen.is_loopback or seen.is_link_local:
        try:
            local = ipaddress.ip_address(head.address).is_loopback
        except ValueError:
            local = False
        if not local:
            return f"{where}: {seen} is loopback or link-local, and the head {peer.observer} is not"
    return None


def shape(detail: dict[str, Any]) -> planner.ModelShape:
    """The model's shape from a probe's report (it read the file's header)."""
    n_layers = max(1, int(detail.get("n_layer") or 1))
    model_bytes = int(detail.get("model_bytes") or 0)
    embd = int(detail.get("embd_bytes") or 0)
    layer = int(detail.get("layer_bytes") or 0)
    if not layer:
        layer = model_bytes // (n_layers + 1)
    if not embd:
        embd = max(0, model_bytes - n_layers * layer)
    return planner.ModelShape(
        n_layers=n_layers, model_bytes=model_bytes, layer_bytes=layer, embd_bytes=embd,
        n_embd=int(detail.get("n_embd") or 0), n_vocab=int(detail.get("n_vocab") or 0),
    )  # fmt: skip


@dataclass(frozen=True)
class Choice:
    plan: planner.Plan
    head: str | None
    links: list[planner.Link]
    why: str  # what limited the choice (no verified peers, …)


def choose(
    coop: CoopSpec,
    model: planner.ModelShape,
    measured: dict[str, Measurement],
    peers: Sequence[PeerRow],
    *,
    single_only: bool,
) -> Choice:
    """Try each measured node as the head, fastest first, with the nodes it verified as RPC
    candidates; the first plan that satisfies a forced split wins, else the fastest chosen plan."""
    heads = sorted(measured, key=lambda n: (-measured[n].tokens_per_s, n))
    force = coop.force_split
    if force is not None and force > len(measured):
        force = len(measured) if len(measured) > 1 else 1
    best: Choice | None = None
    for head in heads:
        seen = {
            p.node_id: p for p in peers if p.observer == head and p.node_id in measured and p.node_id != head
        }
        nodes = [head] if single_only else [head, *sorted(seen)]
        cands = [_candidate(measured[n]) for n in nodes]
        links = [
            planner.Link(a=head, b=n, rtt_ms=p.rtt_ms, bandwidth_mbps=p.bandwidth_mbps)
            for n, p in sorted(seen.items())
        ]
        max_nodes = 1 if single_only else coop.max_nodes
        f = force if not single_only else None
        if f is not None and f > len(nodes):
            continue
        why = ""
        if not seen and not single_only:
            found = any(p.observer == head and p.node_id != head for p in peers)
            what = (
                "no usable verified peer (the others are excluded or unmeasured)"
                if found
                else "no verified peers"
            )
            why = f"node {head} reported {what}: single-node plans only"
        got = planner.plan(model, cands, links, max_nodes=max_nodes, min_gain=coop.min_gain,
                           force_split=f, head_node=head)  # fmt: skip
        choice = Choice(got, head, links, why)
        if got.chosen is not None and (f is None or len({s.node for s in got.chosen.shards}) == f):
            return choice
        if best is None or (best.plan.chosen is None and got.chosen is not None):
            best = choice
    if best is not None:
        return best
    return Choice(
        planner.Plan(chosen=None, best_single=None, options=(), reason="no node measured"), None, [], ""
    )


def _candidate(m: Measurement) -> planner.Candidate:
    return planner.Candidate(
        node=m.node, device=m.device, memory_mib=m.memory_mib, tokens_per_s=m.tokens_per_s
    )


def rpc_request(
    coop: CoopSpec, spec: AllocationCreate, node: str, host: str, port: int, memory_mib: int, tenant: str,
    service: str,
) -> dict[str, Any]:  # fmt: skip
    """An RPC server's allocation (its secret goes in its env, never in these args)."""
    args = ["--host", host, "--port", str(port), "--threads", "1"]
    body = AllocationCreate(
        name=f"coop-rpc-{service}"[:63],
        cpu_milli=RPC_CPU_MILLI,
        memory_mib=memory_mib + RPC_MEMORY_MIB,
        node_selector={**(spec.node_selector or {}), NODE_LABEL: node},
        tolerations=spec.tolerations,
        command=scripts.command(coop.engine_python, "rpc_server", args),
    )
    return _normalise(body, tenant)


def free_port(used: set[int], lo: int, hi: int) -> int | None:
    return next((p for p in range(lo, hi + 1) if p not in used), None)


def head_spec(
    spec: ServiceSpec,
    name: str,
    head: str,
    address: str,
    shards: Sequence[planner.Shard],
    endpoints: Sequence[str],
    secret: str,
) -> dict[str, Any]:
    """The service's spec with the head replica's command (the engine gets the port the service
    controller picks from `port_env`, and the plan's secret, through a shell: never in argv) and
    pinned to the head node."""
    coop = spec.cooperative
    assert coop is not None
    threads = max(1, spec.request.cpu_milli // 1000)
    args = ["--model", coop.model, "--host", address, "--ctx", str(coop.ctx), "--threads", str(threads),
            "--alias", name]  # fmt: skip
    if endpoints:
        n_gpu_layers, split = planner.layer_params(list(shards))
        args += ["--rpc", ",".join(endpoints), "--n-gpu-layers", str(n_gpu_layers)]
        if split:
            args += ["--tensor-split", ",".join(f"{x:g}" for x in split)]
    launch = (f'{SECRET_ENV}="${SPEC_SECRET_ENV}"; export {SECRET_ENV}; unset {SPEC_SECRET_ENV}; '
              f'exec "$0" "$@" --port "${spec.port_env}"')  # fmt: skip
    command = ["/bin/sh", "-c", launch, *scripts.command(coop.engine_python, "head", args)]
    dumped = spec.model_dump(mode="json", exclude_unset=False)
    request = dict(dumped["request"])
    request["command"] = command
    request["env"] = {**(request.get("env") or {}), SPEC_SECRET_ENV: secret}
    request["node_selector"] = {**(request.get("node_selector") or {}), NODE_LABEL: head}
    dumped["request"] = {k: v for k, v in request.items() if v is not None}
    return dumped


def without_command(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with no head command (and no plan secret): the service controller then runs no
    replica (while re-planning)."""
    request = {k: v for k, v in dict(spec.get("request") or {}).items() if k != "command"}
    env = {k: v for k, v in dict(request.get("env") or {}).items() if k != SPEC_SECRET_ENV}
    request.pop("env", None)
    if env:
        request["env"] = env
    return dict(spec, request=request)


def shard_json(s: planner.Shard, endpoint: str | None) -> dict[str, Any]:
    return {
        "node": s.node, "device": s.device, "role": s.role, "first_layer": s.first_layer, "layers": s.layers,
        "memory_mib": s.memory_mib, "tokens_per_s": s.tokens_per_s, "endpoint": endpoint,
    }  # fmt: skip


def public_plan(
    choice: Choice,
    measured: dict[str, Measurement],
    nodes: dict[str, NodeRow],
    notes: dict[str, str],
    model: planner.ModelShape,
) -> dict[str, Any]:
    """The plan as CoopPlanOut shows it (no endpoints yet: placement adds them)."""
    p = choice.plan
    chosen = p.chosen
    used = {s.node for s in chosen.shards} if chosen else set()
    candidates = []
    for name in sorted(set(nodes) | set(measured)):
        m = measured.get(name)
        note = notes.get(name, "")
        if not note and name not in used:
            note = "not chosen" if m else "unmeasured"
        candidates.append({
            "node": name, "device": m.device if m else "cpu", "tokens_per_s": m.tokens_per_s if m else None,
            "memory_mib": m.memory_mib if m else (nodes[name].memory_mib if name in nodes else 0),
            "holds_model": bool(m and model.model_bytes * planner.MEMORY_MARGIN <= m.memory_mib * MIB),
            "measured_at": m.measured_at.isoformat() if m else None, "note": note[:500],
        })  # fmt: skip
    return {
        "shards": [shard_json(s, None) for s in chosen.shards] if chosen else [],
        "predicted_tokens_per_s": chosen.predicted_tokens_per_s if chosen else None,
        "measured_tokens_per_s": None,
        "best_single": shard_json(p.best_single.shards[0], None)
        if p.best_single and p.best_single.shards
        else None,
        "candidates": candidates,
        "links": [
            {"a": k.a, "b": k.b, "rtt_ms": k.rtt_ms, "bandwidth_mbps": k.bandwidth_mbps} for k in choice.links
        ],
        "options": [
            {
                "shards": [shard_json(s, None) for s in o.shards],
                "predicted_tokens_per_s": o.predicted_tokens_per_s,
                "note": o.note,
            }
            for o in p.options
        ],  # fmt: skip
    }
