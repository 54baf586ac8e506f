"""Tenants' secrets: set (from stdin, by the tenant's admins), listed by name, deleted, and given to
the tenant's jobs that name them.

A request holds only names (`secrets: [{name, env}]`); the server opens the values only when it builds
a node's assignment, so they never appear in allocations, events, logs, the dashboard or the audit
log. Another tenant's secret is answered exactly as a missing one (404 here, 422 "unknown secret" in
a request): a tenant learns nothing of another's names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE
from computepool.server.context import Ctx
from computepool.server.errors import Conflict, Invalid, NotFound
from computepool.server.logic.audit import record
from computepool.server.policy import Target, authorize
from computepool.server.secret_box import SecretBox, SecretUnreadable
from computepool.server.settings import ServerSettings
from computepool.store import secrets as store
from computepool.store import tenants as tenant_store
from computepool.store.agent_rows import HeldJob
from computepool.store.db import db_now
from computepool.store.models import Allocation, Secret, Service, Tenant
from computepool.wire.allocations import SecretUse, check_env_name
from computepool.wire.common import Items
from computepool.wire.secrets import SecretOut, SecretSet

log = logging.getLogger("computepool.server")
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")  # as the env keys of a request


def _tenant(s: Session, ctx: Ctx, named: str | None) -> Tenant:
    """The tenant the call is about: the caller's own, or the one an admin names."""
    caller = ctx.caller()
    name = named or caller.tenant
    if name is None:
        raise Invalid("tenant: an admin names the tenant whose secrets these are (--tenant)", "tenant")
    authorize(caller, ctx.action, Target("tenant", name, tenant=name, field="tenant"))
    t = tenant_store.get(s, name)
    if t is None:
        raise NotFound.of("tenant", name, "tenant")
    return t


def _out(secret: Secret, tenant: str) -> SecretOut:
    return SecretOut(
        name=secret.name,
        tenant=tenant,
        set_by=secret.set_by,
        created_at=secret.created_at,
        updated_at=secret.updated_at,
    )


def set_secret(ctx: Ctx, name: str, body: SecretSet) -> SecretOut:
    box = SecretBox.load(ctx.settings.secrets_key_path)
    with ctx.db.write() as s:
        t = _tenant(s, ctx, body.tenant)
        now = db_now(s)
        sealed = box.seal(t.id, name, body.value)
        secret, created = store.put(s, t.id, name, sealed, ctx.caller().actor, now)
        record(s, ctx, f"secret:{t.name}/{name}", tenant=t.name, detail={"created": created}, now=now)
        return _out(secret, t.name)


def list_secrets(ctx: Ctx, tenant: str | None) -> Items[SecretOut]:
    with ctx.db.read() as s:
        t = _tenant(s, ctx, tenant)
        return Items(items=[_out(x, t.name) for x in store.of_tenant(s, t.id)])


def delete_secret(ctx: Ctx, name: str, tenant: str | None) -> SecretOut:
    with ctx.db.write() as s:
        t = _tenant(s, ctx, tenant)
        secret = store.get(s, t.id, name, for_update=True)
        if secret is None:
            raise NotFound.of("secret", name)
        users = _users(s, t.id, name)
        if users:
            raise Conflict(
                f"secret '{name}' is named by {', '.join(users[:5])}"
                + (f" and {len(users) - 5} more" if len(users) > 5 else "")
                + ": cancel or change them first, or set a new value (cpool secrets set)"
            )
        out = _out(secret, t.name)
        store.delete(s, secret)
        record(s, ctx, f"secret:{t.name}/{name}", tenant=t.name, detail={"deleted": True})
        return out


def _names(request: dict[str, Any]) -> set[str]:
    return {u["name"] for u in request.get("secrets") or ()}


def _users(s: Session, tenant_id: int, name: str) -> list[str]:
    """The tenant's live allocations and services whose requests name the secret."""
    allocs = s.execute(
        select(Allocation.id, Allocation.request).where(
            Allocation.tenant_id == tenant_id, Allocation.state.in_(LIVE)
        )
    ).all()
    services = s.execute(
        select(Service.name, Service.spec).where(Service.tenant_id == tenant_id, Service.deleted_at.is_(None))
    ).all()
    found = [f"allocation {i}" for i, req in allocs if name in _names(req)]
    return found + [f"service {n}" for n, spec in services if name in _names(spec.get("request") or {})]


# --- requests that name secrets -------------------------------------------------------------------
def stored_uses(uses: Sequence[SecretUse] | None, env: dict[str, str] | None) -> list[dict[str, str]] | None:
    """The request's `secrets` as stored (each with the variable it sets); Invalid naming
    `secrets[i]` for a variable that is no variable's name, is the pool's, or is set twice."""
    if not uses:
        return None
    taken = set(env or ())
    out: list[dict[str, str]] = []
    for i, use in enumerate(uses):
        where = f"secrets[{i}]"
        var = use.variable()
        if not _VARIABLE.match(var):
            raise Invalid(f"{where}: '{use.name}' is not a variable name: say which (NAME=VARIABLE)", where)
        try:
            check_env_name(var)
        except ValueError as e:
            raise Invalid(f"{where}: {e}", where) from None
        if var in taken:
            raise Invalid(f"{where}: variable {var} is set twice (env or another secret)", where)
        taken.add(var)
        out.append({"name": use.name, "env": var})
    return out


def check_known(s: Session, tenant_id: int, request: dict[str, Any], *, lock: bool = True) -> None:
    """Invalid (422, `secrets[i]`) unless the tenant has every secret the request names; with `lock`
    (a write transaction) they stay locked against a delete until the caller's transaction ends."""
    uses = request.get("secrets") or []
    have = store.named(s, tenant_id, (u["name"] for u in uses), share=lock)
    for i, use in enumerate(uses):
        if use["name"] not in have:
            where = f"secrets[{i}]"
            raise Invalid(f"{where}: unknown secret '{use['name']}' (cpool secrets list)", where)


def job_envs(
    s: Session, settings: ServerSettings, allocations: Sequence[Allocation | HeldJob]
) -> dict[int, dict[str, str]]:
    """Per allocation id, the job's environment with its secrets' values. One whose secret is gone or
    does not open is left out (its job does not start) and the server's log says why."""
    envs: dict[int, dict[str, str]] = {}
    box: SecretBox | None = None
    for a in allocations:
        env = dict(a.env or {})
        uses = a.request.get("secrets") or []
        if uses:
            box = box or SecretBox.load(settings.secrets_key_path)
            have = store.named(s, a.tenant_id, (u["name"] for u in uses))
            try:
                for u in uses:
                    if u["name"] not in have:
                        raise SecretUnreadable(f"secret '{u['name']}' no longer exists")
                    env[u["env"]] = box.open(a.tenant_id, u["name"], have[u["name"]].ciphertext)
            except SecretUnreadable as e:
                log.error("allocation %s is not given to its node: %s", a.id, e)
                continue
        envs[a.id] = env
    return envs
