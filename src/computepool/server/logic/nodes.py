"""Join tokens, joining, heartbeats, node state and the admin's cordon / drain."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy.orm import Session

from computepool.core.address import check_address
from computepool.core.errors import InvalidInput
from computepool.core.tls import file_fingerprint, split_pin, with_pin
from computepool.server.context import Ctx
from computepool.server.credentials import new_secret, secret_matches, split_token
from computepool.server.errors import Conflict, Invalid, NotFound, Unauthorized
from computepool.server.logic import throughputs
from computepool.server.logic.audit import record
from computepool.server.policy import Principal, Role, Target, authorize
from computepool.server.scheduling.snapshot import node_states
from computepool.server.settings import ServerSettings
from computepool.store import functions as fn_store
from computepool.store import gangs as gang_store
from computepool.store import lease, nodes, peers, tenants, tokens
from computepool.store.db import db_now
from computepool.store.models import ApiToken, JoinToken, Node
from computepool.store.nodes import DeviceSpec, DeviceUsage
from computepool.wire.common import Items
from computepool.wire.nodes import (
    MAX_LABELS,
    MAX_TAINTS,
    DeviceOut,
    Heartbeat,
    HeartbeatOut,
    JoinTokenCreate,
    JoinTokenCreated,
    NodeJoin,
    NodeJoined,
    NodeOut,
    NodePatch,
    NodeSettings,
    NodeState,
    PortRangeOut,
)

log = logging.getLogger("computepool.server")


def node_state(age_s: float, settings: ServerSettings) -> NodeState:
    """ready below `suspect_after_s`, suspect below `lost_after_s`, then lost."""
    if age_s < settings.suspect_after_s:
        return "ready"
    if age_s < settings.lost_after_s:
        return "suspect"
    return "lost"


def judged_states(
    s: Session, now: datetime, settings: ServerSettings, beats: dict[str, datetime] | None = None
) -> dict[str, NodeState]:
    """Every node's state as the scheduling leader judges it, whichever replica answers: silence
    counted from no earlier than the leader began to watch with a working database (the lease
    says when), and none lost while so many are silent that the brake holds. A stored heartbeat's
    age alone would call nodes lost after a database outage or a failover that the scheduler, rightly,
    has not declared lost. `beats`: name → last heartbeat of every node, when already read."""
    beats = nodes.heartbeats(s) if beats is None else beats
    names = list(beats)
    states, _, _, _ = node_states([beats[n] for n in names], now, lease.observed_since(s, now), settings)
    return {n: cast(NodeState, st) for n, st in zip(names, states, strict=True)}


def _judged_out(s: Session, node: Node, settings: ServerSettings, viewer: Principal | None = None) -> NodeOut:
    now = db_now(s)
    return _out(node, now, settings, viewer, judged_states(s, now, settings).get(node.name))


def _dedicated_to(n: Node, viewer: Principal | None) -> str | None:
    """The owner's name for admins and the owner's users; others only learn that it is dedicated."""
    t = n.dedicated_tenant
    if t is None:
        return None
    if viewer is None or viewer.role is Role.ADMIN or viewer.tenant == t.name:
        return t.name
    return None


def _out(
    n: Node,
    now: datetime,
    settings: ServerSettings,
    viewer: Principal | None = None,
    state: NodeState | None = None,
) -> NodeOut:
    """`state`: as `judged_states` says (else by the heartbeat's age alone, as for a node that has
    just joined)."""
    age = max(0.0, (now - n.last_heartbeat_at).total_seconds())
    return NodeOut(
        name=n.name,
        cpu_milli=n.cpu_milli,
        memory_mib=n.memory_mib,
        labels=dict(n.labels),
        devices=[
            DeviceOut(
                index=d.index,
                vendor=d.vendor,
                model=d.model,
                memory_mib=d.memory_mib,
                uuid=d.uuid,
                compute_milli=d.compute_milli,
                link_group=d.link_group,
                mig_parent_uuid=d.mig_parent_uuid,
                used_memory_mib=d.used_memory_mib,
                utilization_pct=d.utilization_pct,
                power_w=d.power_w,
                health=d.health or "",
            )
            for d in n.devices
        ],
        state=state or node_state(age, settings),
        heartbeat_age_s=round(age, 3),
        cordoned=n.cordoned,
        draining=n.draining,
        taints=dict(n.taints or {}),
        dedicated=n.dedicated_tenant_id is not None,
        dedicated_to=_dedicated_to(n, viewer),
        lending=n.lending,
        address=n.address or "",
        pythons=list(n.pythons or []),
        joined_at=n.joined_at,
        last_heartbeat_at=n.last_heartbeat_at,
    )


def create_join_token(ctx: Ctx, body: JoinTokenCreate) -> JoinTokenCreated:
    with ctx.db.write() as s:
        now = db_now(s)
        secret = new_secret()
        tok = tokens.add_join(
            s,
            JoinToken(
                id=secret.id,
                secret_hash=secret.secret_hash,
                single_use=body.single_use,
                created_by=ctx.caller().name,
                created_at=now,
                expires_at=now + timedelta(seconds=body.expires_in_s),
                uses=0,
            ),
        )
        record(s, ctx, f"join-token:{tok.id}", detail={"single_use": body.single_use})
        token = secret.token
        if ctx.settings.tls_cert is not None:  # the agent pins this certificate on its first contact
            token = with_pin(token, file_fingerprint(ctx.settings.tls_cert))
        return JoinTokenCreated(id=tok.id, token=token, expires_at=tok.expires_at, single_use=tok.single_use)


def _address(given: str | None, peer: str | None) -> str:
    """The node's address: the one it gave, else the one its call came from (as a stored address)."""
    if given:
        return given
    try:
        return check_address(peer or "", "address")
    except InvalidInput:
        return ""  # e.g. a test client without a socket: peers fall back to the node's name


def join(ctx: Ctx, body: NodeJoin, peer: str | None = None) -> NodeJoined:
    parts = split_token(split_pin(body.join_token)[0])  # the certificate pin is the agent's business
    if parts is None:
        raise Unauthorized("join_token: malformed (expected '<id>.<secret>' from POST /api/v1/join-tokens)")
    token_id, secret = parts
    with ctx.db.write() as s:
        jt = tokens.get_join(s, token_id)
        if jt is None or not secret_matches(secret, jt.secret_hash):
            log.warning("node %r tried to join with an unknown join token", body.name)
            raise Unauthorized("join_token: not a valid join token")
        now = db_now(s)
        if jt.expires_at <= now:
            raise Unauthorized(f"join_token: join token {token_id} has expired")
        if nodes.get(s, body.name) is not None:
            raise Conflict(f"node '{body.name}' has joined already (an admin can remove it)", "name")
        if not tokens.consume_join(s, jt, now):
            raise Unauthorized(f"join_token: join token {token_id} was single-use and has been used already")
        node = nodes.create(
            s,
            name=body.name,
            cpu_milli=body.cpu_milli,
            memory_mib=body.memory_mib,
            labels=body.labels,
            devices=[DeviceSpec(**d.model_dump()) for d in body.devices],
            now=now,
        )
        node.address = _address(body.address, peer)
        s.flush()  # written before anything expires the session's objects
        fn_store.set_pythons(s, node.name, body.pythons or [])
        cred = new_secret()
        tokens.add(
            s,
            ApiToken(
                id=cred.id,
                secret_hash=cred.secret_hash,
                name=f"node {node.name}",
                node_id=node.id,
                created_by=f"join-token:{token_id}",
                created_at=now,
            ),
        )
        record(
            s,
            ctx,
            f"node:{node.name}",
            actor=f"join-token:{token_id}",
            detail={"devices": len(body.devices), "credential": cred.id},
        )
        joined = NodeJoined(
            node=_out(node, now, ctx.settings),
            credential=cred.token,
            heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
            lost_after_s=ctx.settings.lost_after_s,
        )
    if ctx.caches is not None:
        ctx.caches.shape.invalidate()  # admission sees the new capacity at once
    return joined


def heartbeat(ctx: Ctx, name: str, body: Heartbeat, peer: str | None = None) -> HeartbeatOut:
    authorize(ctx.caller(), ctx.action, Target("node", name, node=name))
    usage = [
        DeviceUsage(u.index, u.used_memory_mib, u.utilization_pct, u.power_w, u.energy_j, u.health)
        for u in body.devices_usage
    ]
    with ctx.db.write() as s:
        try:
            got = nodes.beat(s, name, db_now(s), usage)
        except KeyError as e:
            i = int(e.args[0])
            raise Invalid(
                f"node '{name}' has no device {usage[i].index}", f"devices_usage[{i}].index"
            ) from None
        if got is None:
            raise NotFound.of("node", name)
        address = None
        if body.address is not None:  # an agent that (re)started says where peers reach it
            address = _address(body.address, peer)
            gang_store.set_address(s, name, address)
        if body.pythons is not None:  # an agent that (re)started says which Pythons jobs can run
            fn_store.set_pythons(s, name, body.pythons)
        if body.progress:  # running jobs' steps/s: the pool's measured speeds
            throughputs.record_progress(s, name, body.progress, db_now(s))
    return HeartbeatOut(
        node=name,
        state="ready",
        cordoned=got.cordoned,
        draining=got.draining,
        heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        lost_after_s=ctx.settings.lost_after_s,
        address=address,
        reserved_ports=reserved_ports(ctx.settings),
        log_max_mib=ctx.settings.log_max_mib,
    )


def reserved_ports(settings: ServerSettings) -> list[PortRangeOut]:
    """The ranges whose ports the pool gives out one at a time: a job listens there on its own only.

    Not the gang range: rank 0 replaces a held master port with a free one (so holding it stops
    nobody), and it holds torch's default rendezvous port (29500), which a single-node job's
    `torchrun` listens on by itself."""
    st = settings
    return [
        PortRangeOut(name=name, min=lo, max=hi)
        for name, lo, hi in (
            ("service", st.service_port_min, st.service_port_max),
            ("rpc", st.rpc_port_min, st.rpc_port_max),
            ("publish", st.publish_port_min, st.publish_port_max),
        )
    ]


def list_all(ctx: Ctx) -> Items[NodeOut]:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        now = db_now(s)
        viewer = ctx.caller()
        every = nodes.list_all(s)
        states = judged_states(s, now, ctx.settings, {n.name: n.last_heartbeat_at for n in every})
        return Items[NodeOut](items=[_out(n, now, ctx.settings, viewer, states[n.name]) for n in every])


def get(ctx: Ctx, name: str) -> NodeOut:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        node = nodes.get(s, name)
        if node is None:
            raise NotFound.of("node", name)
        return _judged_out(s, node, ctx.settings, ctx.caller())


def _merged(
    current: dict[str, str], change: dict[str, str | None] | None, where: str, most: int
) -> dict[str, str]:
    if change is None:
        return dict(current)
    out = dict(current)
    for k, v in change.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    if len(out) > most:
        raise Invalid(f"a node carries at most {most} {where} ({len(out)} after this change)", where)
    return out


def update(ctx: Ctx, name: str, body: NodeSettings | NodePatch) -> NodeOut:
    """Set a node's placement rules: labels (selectors), taints, dedication to a tenant.

    PUT replaces all four; PATCH changes what it names (a label or taint set to null goes).
    Work already placed stays where it is; the next scheduling cycle applies the new rules.
    """
    authorize(ctx.caller(), ctx.action, Target("node", name))
    with ctx.db.write() as s:
        node = nodes.get(s, name)
        if node is None:
            raise NotFound.of("node", name)
        current = node.dedicated_tenant.name if node.dedicated_tenant is not None else None
        if isinstance(body, NodePatch):
            labels = _merged(node.labels, body.labels, "labels", MAX_LABELS)
            taints = _merged(node.taints or {}, body.taints, "taints", MAX_TAINTS)
            owner = body.dedicated_to if "dedicated_to" in body.model_fields_set else current
            lending = node.lending if body.lending is None else body.lending
        else:
            labels, taints = dict(body.labels), dict(body.taints)
            owner, lending = body.dedicated_to, body.lending
        tenant = None
        if owner is not None:
            tenant = tenants.get(s, owner)
            if tenant is None:
                raise Invalid(f"dedicated_to: tenant '{owner}' not found", "dedicated_to")
        labels |= fn_store.python_labels(node.pythons or [])  # kept from what the agent reported
        nodes.set_rules(s, node, labels=labels, taints=taints, dedicated_to=tenant, lending=lending)
        detail = {"labels": node.labels, "taints": node.taints, "dedicated_to": owner, "lending": lending}
        record(s, ctx, f"node:{name}", detail=detail)
        return _judged_out(s, node, ctx.settings, ctx.caller())


def set_flags(ctx: Ctx, name: str, *, cordoned: bool, draining: bool) -> NodeOut:
    """cordon: no new work; drain: cordon and move running work away; uncordon clears both."""
    authorize(ctx.caller(), ctx.action, Target("node", name))
    with ctx.db.write() as s:
        node = nodes.get(s, name)
        if node is None:
            raise NotFound.of("node", name)
        node.cordoned, node.draining = cordoned, draining
        s.flush()
        record(s, ctx, f"node:{name}", detail={"cordoned": cordoned, "draining": draining})
        return _judged_out(s, node, ctx.settings, ctx.caller())


def delete(ctx: Ctx, name: str) -> NodeOut:
    """Forget a node, its devices and its credentials (it must join again)."""
    authorize(ctx.caller(), ctx.action, Target("node", name))
    with ctx.db.write() as s:
        node = nodes.get(s, name)
        if node is None:
            raise NotFound.of("node", name)
        out = _judged_out(s, node, ctx.settings)
        nodes.delete(s, node)  # devices and the node's credentials go with it (ON DELETE CASCADE)
        peers.forget_observer(s, name)
        record(s, ctx, f"node:{name}")
    if ctx.caches is not None:
        ctx.caches.tokens.forget()
        ctx.caches.shape.invalidate()
    return out
