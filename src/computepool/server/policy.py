"""Who may do what: roles, actions, and the one function that decides — `authorize`.

Every route declares its action (see `deps.requires`); the dependency calls `authorize` with no
target (may this role do this at all?), and services call it again with the object they touch
(is it in the caller's tenant? is it the caller's own token?). Objects of another tenant are
reported as missing (404), so their names do not leak; a known object the caller may see but not
change is refused (403).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from computepool.server.errors import Forbidden, NotFound


class Role(StrEnum):
    ADMIN = "admin"  # the whole pool
    TENANT_ADMIN = "tenant-admin"  # users, tokens and audit of their tenant
    MEMBER = "member"  # uses the pool within their tenant
    VIEWER = "viewer"  # reads only (may still revoke their own tokens)
    NODE = "node"  # a node agent's credential, bound to that node
    WORKER = "worker"  # a function worker's token: its own function's worker routes, while it holds
    SCRAPER = "scraper"  # a monitoring system's user: reads /metrics and nothing else


HUMAN_ROLES = frozenset({Role.ADMIN, Role.TENANT_ADMIN, Role.MEMBER, Role.VIEWER})


class Action(StrEnum):
    WHOAMI = "whoami"
    TENANT_CREATE = "tenant.create"
    TENANT_LIST = "tenant.list"
    TENANT_GET = "tenant.get"
    USER_CREATE = "user.create"
    USER_LIST = "user.list"
    TOKEN_CREATE = "token.create"
    TOKEN_LIST = "token.list"
    TOKEN_REVOKE = "token.revoke"
    QUOTA_SET = "quota.set"
    QUOTA_GET = "quota.get"
    JOIN_TOKEN_CREATE = "join-token.create"
    NODE_JOIN = "node.join"  # authenticated by the join token in the body, not by a bearer token
    NODE_HEARTBEAT = "node.heartbeat"
    NODE_LIST = "node.list"
    NODE_CORDON = "node.cordon"
    NODE_UNCORDON = "node.uncordon"
    NODE_DRAIN = "node.drain"
    NODE_DELETE = "node.delete"
    NODE_UPDATE = "node.update"  # labels, taints, dedication
    AUDIT_LIST = "audit.list"
    AUDIT_VERIFY = "audit.verify"
    ALLOCATION_CREATE = "allocation.create"
    ALLOCATION_LIST = "allocation.list"
    ALLOCATION_GET = "allocation.get"  # the allocation, its explanation and its logs
    ALLOCATION_RELEASE = "allocation.release"
    ALLOCATION_CANCEL = "allocation.cancel"
    NODE_ASSIGNMENTS = "node.assignments.get"  # the agent's long-poll for its work
    NODE_REPORT = "node.report"  # the agent reports process states
    NODE_PEERS_REPORT = "node.peers.report"  # the agent reports the LAN peers its discovery found
    DISCOVERY_KEY_GET = "discovery.key.get"  # the agent fetches the pool's discovery key
    PEER_LIST = "peer.list"
    SERVICE_PLAN_GET = "service.plan.get"  # a cooperative service's plan and measurements
    NODE_LOG_APPEND = "node.log.append"  # the agent ships job output
    METRICS_READ = "metrics.read"
    FUNCTION_CREATE = "function.create"
    FUNCTION_LIST = "function.list"
    FUNCTION_GET = "function.get"
    FUNCTION_DELETE = "function.delete"
    FUNCTION_CALL = "function.call"  # submit calls
    FUNCTION_RESULTS = "function.results.get"  # a POST that only reads (long-poll with many ids)
    FUNCTION_CALL_CANCEL = "function.call.cancel"
    WORKER_NEXT = "worker.next"  # a worker hands in a result and takes the next call
    WORKER_OUTPUT = "worker.output"  # a worker streams a call's printed output
    BLOB_PUT = "blob.put"  # upload bytes the tenant's requests then name (code, stdin)
    BLOB_GET = "blob.get"  # read or HEAD a blob: the tenant's users, a node running work that names it
    FILE_REQUEST = "allocation.files.create"  # ask a job's node for files from its work dir
    FILE_GET = "allocation.files.get"
    NODE_FILE_ANSWER = "node.files.answer"  # the agent hands in the packed files (or why not)
    ALLOCATION_EXEC = "allocation.exec"  # a shell in a running job, or a connection to its port
    NODE_RELAYS = "node.relays.get"  # the agent's long-poll for the shells and tunnels it should open
    SERVICE_PUT = "service.put"  # create or change a model service
    SERVICE_LIST = "service.list"
    SERVICE_GET = "service.get"
    SERVICE_DELETE = "service.delete"
    GATEWAY_USE = "gateway.use"  # OpenAI-compatible requests to a service (/v1/...)
    GATEWAY_MODELS_LIST = "gateway.models.list"
    GATEWAY_USAGE_LIST = "gateway.usage.list"
    GATEWAY_LIMIT_SET = "gateway.limit.set"  # a tenant's gateway rate limit
    GATEWAY_LIMIT_GET = "gateway.limit.get"
    USAGE_LIST = "usage.list"  # the usage ledger, grouped (GPU-hours, energy, cost)
    USAGE_STATIC_GET = "usage.static.get"  # what static partitions would have needed
    NODE_HISTORY_GET = "node.history.get"  # a node's devices' utilization, memory and power history
    PRICE_LIST = "price.list"
    PRICE_SET = "price.set"
    ALERT_LIST = "alert.list"
    ALERT_RULE_LIST = "alert.rule.list"
    ALERT_RULE_SET = "alert.rule.set"
    WEBHOOK_CREATE = "webhook.create"
    WEBHOOK_LIST = "webhook.list"
    WEBHOOK_DELETE = "webhook.delete"
    IMAGE_PUBLISH = "image.publish"  # pin an image name to a digest for all or named tenants
    IMAGE_LIST = "image.list"
    IMAGE_UNPUBLISH = "image.unpublish"
    SECRET_SET = "secret.set"  # a tenant's secret: set (or replace) its value
    SECRET_LIST = "secret.list"  # names, who set them and when; never values
    SECRET_DELETE = "secret.delete"
    THROUGHPUT_LIST = "throughput.list"  # measured speeds per job type and device model

    @property
    def mutating(self) -> bool:
        """State-changing actions are audited, refused attempts included.

        Heartbeats, job output and metric scrapes are telemetry, frequent and voluminous: not audited.
        """
        if self in (
            Action.WHOAMI,
            Action.NODE_HEARTBEAT,
            Action.NODE_LOG_APPEND,
            Action.METRICS_READ,
            Action.NODE_PEERS_REPORT,
        ):
            return False
        if self in (Action.FUNCTION_CALL, Action.WORKER_NEXT, Action.WORKER_OUTPUT, Action.GATEWAY_USE):
            return False  # per-call traffic (remote functions, inference), hundreds a second: not audited
        return self.split(".")[-1] not in ("list", "get", "verify")


_ALL = frozenset(HUMAN_ROLES)
_ADMIN = frozenset({Role.ADMIN})
_ADMINS = frozenset({Role.ADMIN, Role.TENANT_ADMIN})
_WRITERS = frozenset({Role.ADMIN, Role.TENANT_ADMIN, Role.MEMBER})

GRANTS: dict[Action, frozenset[Role]] = {
    Action.WHOAMI: _ALL | {Role.NODE, Role.SCRAPER},
    Action.TENANT_CREATE: _ADMIN,
    Action.TENANT_LIST: _ALL,
    Action.TENANT_GET: _ALL,
    Action.USER_CREATE: _ADMINS,
    Action.USER_LIST: _ALL,
    Action.TOKEN_CREATE: _WRITERS,
    Action.TOKEN_LIST: _ALL,
    Action.TOKEN_REVOKE: _ALL,
    Action.QUOTA_SET: _ADMIN,
    Action.QUOTA_GET: _ALL,
    Action.JOIN_TOKEN_CREATE: _ADMIN,
    Action.NODE_JOIN: frozenset(),  # never by bearer token
    Action.NODE_HEARTBEAT: frozenset({Role.NODE}),
    Action.NODE_LIST: _ALL,
    Action.NODE_CORDON: _ADMIN,
    Action.NODE_UNCORDON: _ADMIN,
    Action.NODE_DRAIN: _ADMIN,
    Action.NODE_DELETE: _ADMIN,
    Action.NODE_UPDATE: _ADMIN,
    Action.AUDIT_LIST: _ADMINS,
    Action.AUDIT_VERIFY: _ADMIN,
    Action.IMAGE_PUBLISH: _ADMIN,
    Action.IMAGE_LIST: _ALL,  # a tenant's users see the images their tenant may run
    Action.IMAGE_UNPUBLISH: _ADMIN,
    Action.SECRET_SET: _ADMINS,  # jobs of the tenant's writers use them; only its admins change them
    Action.SECRET_LIST: _ALL,
    Action.SECRET_DELETE: _ADMINS,
    Action.THROUGHPUT_LIST: _ALL,  # scoped to the caller's tenant but for admins
    Action.ALLOCATION_CREATE: _WRITERS,
    Action.ALLOCATION_LIST: _ALL,
    Action.ALLOCATION_GET: _ALL,
    Action.ALLOCATION_RELEASE: _WRITERS,
    Action.ALLOCATION_CANCEL: _WRITERS,
    Action.NODE_ASSIGNMENTS: frozenset({Role.NODE}),
    Action.NODE_REPORT: frozenset({Role.NODE}),
    Action.NODE_PEERS_REPORT: frozenset({Role.NODE}),
    Action.DISCOVERY_KEY_GET: frozenset({Role.NODE}),
    Action.PEER_LIST: _ALL,
    Action.SERVICE_PLAN_GET: _ALL,
    Action.NODE_LOG_APPEND: frozenset({Role.NODE}),
    Action.METRICS_READ: frozenset({Role.ADMIN, Role.SCRAPER}),
    Action.FUNCTION_CREATE: _WRITERS,
    Action.FUNCTION_LIST: _ALL,
    Action.FUNCTION_GET: _ALL,
    Action.FUNCTION_DELETE: _WRITERS,
    Action.FUNCTION_CALL: _WRITERS,
    Action.FUNCTION_RESULTS: _ALL,
    Action.FUNCTION_CALL_CANCEL: _WRITERS,
    Action.WORKER_NEXT: frozenset({Role.WORKER}),
    Action.WORKER_OUTPUT: frozenset({Role.WORKER}),
    Action.BLOB_PUT: _WRITERS,
    Action.BLOB_GET: _ALL | {Role.NODE},
    Action.FILE_REQUEST: _WRITERS,
    Action.FILE_GET: _ALL,
    Action.NODE_FILE_ANSWER: frozenset({Role.NODE}),
    Action.ALLOCATION_EXEC: _WRITERS,
    Action.NODE_RELAYS: frozenset({Role.NODE}),
    Action.SERVICE_PUT: _WRITERS,
    Action.SERVICE_LIST: _ALL,
    Action.SERVICE_GET: _ALL,
    Action.SERVICE_DELETE: _WRITERS,
    Action.GATEWAY_USE: _WRITERS,
    Action.GATEWAY_MODELS_LIST: _ALL,
    Action.GATEWAY_USAGE_LIST: _ALL,
    Action.GATEWAY_LIMIT_SET: _ADMIN,
    Action.GATEWAY_LIMIT_GET: _ALL,
    Action.USAGE_LIST: _ALL,  # scoped to the caller's tenant but for admins
    Action.USAGE_STATIC_GET: _ALL,  # likewise: a tenant sees its own partition, admins the pool's
    Action.NODE_HISTORY_GET: _ALL,
    Action.PRICE_LIST: _ALL,
    Action.PRICE_SET: _ADMIN,
    Action.ALERT_LIST: _ALL,  # a tenant's users see their tenant's alerts only
    Action.ALERT_RULE_LIST: _ALL,
    Action.ALERT_RULE_SET: _ADMIN,
    Action.WEBHOOK_CREATE: _ADMIN,
    Action.WEBHOOK_LIST: _ADMIN,
    Action.WEBHOOK_DELETE: _ADMIN,
}

# Actions on tokens, where a member or viewer may only touch their own.
_OWN_ONLY = frozenset({Action.TOKEN_CREATE, Action.TOKEN_REVOKE})


@dataclass(frozen=True)
class Principal:
    """Who is calling: a user (with tenant) or a node (bound to `node`)."""

    name: str
    role: Role
    tenant: str | None
    token_id: str
    node: str | None = None
    worker: int | None = None  # a worker token: its allocation's id
    function: int | None = None  # … and its function's id

    @property
    def actor(self) -> str:
        if self.role is Role.WORKER:
            return f"worker:{self.worker}"
        return f"node:{self.node}" if self.role is Role.NODE else f"user:{self.name}"


@dataclass(frozen=True)
class Target:
    """The object an action touches. `owner`/`owner_role`: the user a token or new user is for."""

    kind: str
    name: str
    tenant: str | None = None
    owner: str | None = None
    owner_role: Role | None = None
    node: str | None = None
    field: str | None = None  # the request field that named the object, for error messages

    def describe(self) -> str:
        return f"{self.kind} '{self.name}'"


@dataclass(frozen=True)
class Scope:
    """What a list may show: None means no restriction on that field."""

    tenant: str | None = None
    user: str | None = None


def authorize(principal: Principal, action: Action, target: Target | None = None) -> Scope:
    """Raise Forbidden (403) or NotFound (404, for other tenants' objects); else the list scope."""
    role = principal.role
    if role not in GRANTS[action]:
        raise Forbidden(f"role '{role}' may not {action}")
    if role is Role.ADMIN:
        return Scope()
    own = ("function", str(principal.function))
    if role is Role.WORKER and target is not None and (target.kind, target.name) != own:
        raise Forbidden(f"this worker token belongs to function '{principal.function}' only")
    if target is not None:
        if target.tenant is not None and target.tenant != principal.tenant:
            raise NotFound.of(target.kind, target.name, target.field)
        if target.node is not None and target.node != principal.node:
            raise Forbidden(f"this credential belongs to node '{principal.node}', not '{target.node}'")
        if target.owner_role is Role.ADMIN:
            raise Forbidden("only an admin may act on admin users or their tokens")
        if action in _OWN_ONLY and role is not Role.TENANT_ADMIN and target.owner != principal.name:
            raise Forbidden(f"role '{role}' may only {action} for its own user")
    if action is Action.TOKEN_LIST and role is not Role.TENANT_ADMIN:
        return Scope(tenant=principal.tenant, user=principal.name)
    return Scope(tenant=principal.tenant)
