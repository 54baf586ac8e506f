"""`PoolClient`: one typed method per API endpoint over a shared httpx connection pool.

Answers are the server's JSON (dicts), not client-side copies of the server's models: the
server's schemas are the one definition, and the CLI prints what the server says. Errors come
back as `PoolError` (the server's message and field) or `ServerUnreachable` (no answer).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from computepool.client.alerts import AlertMethods
from computepool.client.blobs import BlobMethods
from computepool.client.config import ClientConfig
from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.images import ImageMethods
from computepool.client.peers import PeerMethods
from computepool.client.services import ServiceMethods
from computepool.client.usage import UsageMethods
from computepool.core.allocation import ENDED, PENDING
from computepool.core.servers import (
    ServerArg,
    ServerList,
    may_resend,
    retry_after,
    split_servers,
)
from computepool.core.tls import client_context, describe_tls_failure

if TYPE_CHECKING:  # the wire's models load pydantic: not at the CLI's start-up
    import ssl

    from computepool.wire.allocations import AllocationCreate

API = "/api/v1"
JSON = dict[str, Any]
AllocId = int | str
ENDED_STATES = frozenset(ENDED)  # for membership tests; the states are core's


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("computepool")
    except Exception:  # not installed (running from a source tree)
        return "0+unknown"


def error_from_response(r: httpx.Response) -> PoolError:
    """The server's `{"error", "field"}` when it sent one, else the status line and a bit of body."""
    return error_from_parts(r.status_code, r.reason_phrase, r.text)


def error_from_parts(status: int, reason: str | None, text: str) -> PoolError:
    """`error_from_response` for any HTTP library: status, reason phrase and body text."""
    message, field = "", None
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        message = body["error"]
        field = body.get("field") if isinstance(body.get("field"), str) else None
    else:
        snippet = " ".join(text.split())[:200]
        reason = reason or "error"
        message = reason if snippet in ("", reason) else f"{reason}: {snippet}"
    if status >= 500 and status != 503:
        message += " (a server fault, not your input: the server's log has the details)"
    return PoolError(status, message, field)


def retry_after_s(r: httpx.Response, attempt: int) -> float:
    """Seconds to wait before retrying a 503 or 429: the server's Retry-After (seconds or a date),
    bounded."""
    return retry_after(r.headers.get("Retry-After"), attempt)


def _sent_plain_http(e: httpx.TransportError) -> bool:
    try:
        return e.request.url.scheme == "http"
    except RuntimeError:  # an error raised with no request
        return False


def transport_cause(e: httpx.TransportError, timeout: float) -> str:
    tls = describe_tls_failure(e)
    if tls is not None:
        return tls
    if isinstance(e, httpx.TimeoutException):
        return f"no answer within {timeout:g} s"
    if isinstance(e, httpx.ConnectError):
        return f"connection failed: {e}" if str(e) else "connection refused"
    said = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if isinstance(e, httpx.RemoteProtocolError) and _sent_plain_http(e):
        said += "; a server that speaks https (as `cpool up` does) closes plain http: use https:// and --ca"
    return said


class PoolClient(BlobMethods, ServiceMethods, UsageMethods, AlertMethods, PeerMethods, ImageMethods):
    """A connection to one pool's control plane (one URL, or several replicas) with one bearer token.

    A 503 (database away, replica going) or 429 (over the tenant's API rate) is retried up to
    `retries` times per URL, waiting as the server's Retry-After says (at most 10 s each); with
    several URLs a refused connection or a 503 moves the call to the next, and the client stays with
    the one that answered. Everything else is raised at once.
    """

    def __init__(
        self,
        server: ServerArg,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        sleep: Callable[[float], None] = time.sleep,
        ca: str | None = None,
    ) -> None:
        """`server`: a URL, a comma-separated list or a list of URLs; `ca`: a PEM file the server's
        certificate must chain to (else the system's CAs)."""
        self.servers = ServerList(split_servers(server))
        self.token = token
        self.timeout = timeout
        self.retries = max(0, retries)
        self._sleep = sleep
        headers = {"User-Agent": f"cpool/{_version()}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(headers=headers, timeout=timeout, verify=self._verify(ca))

    def _verify(self, ca: str | None) -> ssl.SSLContext | bool:
        """The pool's CA alone where one is given; nothing where every URL is plain http (the
        system's CAs cost ~100 ms to load, a tenth of a tiny job's whole run, and no TLS is spoken:
        this client learns no other URLs); else the system's CAs."""
        if ca:
            return client_context(Path(ca))
        return not all(url.startswith("http://") for url in self.servers.urls)

    @property
    def server(self) -> str:
        """The URL in use now (the last that answered)."""
        return self.servers.current

    @classmethod
    def from_config(cls, cfg: ClientConfig, timeout: float = 30.0) -> PoolClient:
        return cls(cfg.server, cfg.token, timeout=timeout, ca=cfg.ca)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        api: bool = True,
    ) -> Any:
        """One call (under /api/v1 unless `api` is false) with 503 and 429 retries; returns the decoded
        JSON."""
        url = API + path if api else path
        hdrs = dict(headers or {})
        query = {k: v for k, v in (params or {}).items() if v is not None}
        r = self.send(method, url, json=json, params=query, headers=hdrs)
        if r.is_success:
            return r.json() if r.content else None
        err = error_from_response(r)
        if r.status_code in (404, 405) and err.message in ("Not Found", "Method Not Allowed"):
            # the route itself is missing: name it, rather than suggest the object does not exist
            err = PoolError(
                r.status_code, f"{self.server} has no {method} {url} (a server older than this client?)"
            )
        elif r.status_code == 401 and not self.token:
            err = PoolError(401, f"{err.message}; no token: run `cpool login` or set CPOOL_TOKEN", err.field)
        raise err

    def send(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        **kw: Any,
    ) -> httpx.Response:
        """One request to `url` (a path on the server) on whichever URL answers; the response as is.

        A refused connection moves on to the next URL at once. A request that went out but got no
        answer is sent again (first to the same URL: a kept-alive connection the server had closed,
        then to the next) only if that cannot do it twice (`may_resend`). A 503 moves on too and
        that URL is left alone for its Retry-After; a 429 waits its Retry-After.
        """
        hdrs = dict(headers or {})
        wait = timeout if timeout is not None else self.timeout
        busy = 0  # 503/429 answers so far
        unreachable: dict[str, str] = {}  # URL -> why, in this call
        resent: set[str] = set()
        said: tuple[str, float] | None = None  # the last 503's URL and its Retry-After
        while True:
            base = next((u for u in self.servers.order() if u not in unreachable), None)
            if base is None:
                urls = list(unreachable)
                cause = (
                    "; ".join(f"{u}: {c}" for u, c in unreachable.items())
                    if len(urls) > 1
                    else unreachable[urls[0]]
                )
                raise ServerUnreachable(self.servers.describe(), cause)
            # back to the URL that just said 503 (no other to try): wait as it said
            pause = said[1] if said is not None and said[0] == base else self.servers.wait_s(base)
            said = None
            if pause > 0:
                self._sleep(pause)
            try:
                r = self._http.request(method, base + url, headers=hdrs, timeout=wait, **kw)
            except httpx.TransportError as e:
                tls = describe_tls_failure(e)
                if tls is not None:
                    raise ServerUnreachable(base, tls, tls=True) from None
                sent = not isinstance(e, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)
                if not may_resend(method, hdrs, sent):
                    self.servers.failed(base)
                    raise ServerUnreachable(base, transport_cause(e, wait)) from None
                stale = isinstance(e, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError)
                if sent and stale and base not in resent:
                    resent.add(base)  # most likely a kept-alive connection the server had closed
                    continue
                self.servers.failed(base)
                unreachable[base] = transport_cause(e, wait)
                continue
            if r.status_code in (429, 503) and busy < self.retries * len(self.servers):
                busy += 1  # neither was acted on
                if r.status_code == 503:
                    said = (base, retry_after_s(r, busy - 1))
                    self.servers.failed(base, said[1])
                else:
                    self._sleep(retry_after_s(r, busy - 1))
                continue
            self.servers.worked(base)
            return r

    def _items(self, path: str, params: Mapping[str, Any] | None = None) -> list[JSON]:
        return list(self.request("GET", path, params=params)["items"])

    # -- health and identity --------------------------------------------------------------

    def healthz(self) -> JSON:
        return dict(self.request("GET", "/healthz", api=False))

    def readyz(self) -> JSON:
        return dict(self.request("GET", "/readyz", api=False))

    def whoami(self) -> JSON:
        return dict(self.request("GET", "/whoami"))

    # -- tenants, users, tokens, quotas ---------------------------------------------------

    def list_tenants(self) -> list[JSON]:
        return self._items("/tenants")

    def get_tenant(self, name: str) -> JSON:
        return dict(self.request("GET", f"/tenants/{_seg(name)}"))

    def create_tenant(self, name: str, weight: float = 1.0) -> JSON:
        return dict(self.request("POST", "/tenants", json={"name": name, "weight": weight}))

    def list_users(self) -> list[JSON]:
        return self._items("/users")

    def create_user(self, name: str, tenant: str, role: str) -> JSON:
        return dict(self.request("POST", "/users", json={"name": name, "tenant": tenant, "role": role}))

    def list_tokens(self) -> list[JSON]:
        return self._items("/tokens")

    def create_token(self, user: str | None = None, name: str = "", expires_in_s: int | None = None) -> JSON:
        body: JSON = {"name": name}
        if user is not None:
            body["user"] = user
        if expires_in_s is not None:
            body["expires_in_s"] = expires_in_s
        return dict(self.request("POST", "/tokens", json=body))

    def revoke_token(self, token_id: str) -> JSON:
        return dict(self.request("DELETE", f"/tokens/{_seg(token_id)}"))

    def get_quota(self, tenant: str) -> JSON:
        return dict(self.request("GET", f"/tenants/{_seg(tenant)}/quota"))

    def set_quota(self, tenant: str, quota: Mapping[str, Any]) -> JSON:
        """Replaces the tenant's whole quota (resources left out have none)."""
        return dict(self.request("PUT", f"/tenants/{_seg(tenant)}/quota", json=dict(quota)))

    def get_reclaim(self, tenant: str) -> JSON:
        return dict(self.request("GET", f"/tenants/{_seg(tenant)}/reclaim"))

    def set_reclaim(self, tenant: str, idle: int | str, warn: int | str = 0) -> JSON:
        """Release the tenant's allocations whose devices show no use for `idle`, warning `warn` before."""
        body = {"idle": idle, "warn": warn}
        return dict(self.request("PUT", f"/tenants/{_seg(tenant)}/reclaim", json=body))

    def delete_reclaim(self, tenant: str) -> JSON:
        return dict(self.request("DELETE", f"/tenants/{_seg(tenant)}/reclaim"))

    def tenant_defaults(self, tenant: str) -> JSON:
        """What the tenant's requests get when they name no CPU or memory, and its process limit."""
        return dict(self.request("GET", f"/tenants/{_seg(tenant)}/defaults"))

    def set_tenant_defaults(self, tenant: str, changes: Mapping[str, int | None]) -> JSON:
        """Change some of them: cpu_milli, memory_mib, pids_max (None: back to the pool's default)."""
        return dict(self.request("PATCH", f"/tenants/{_seg(tenant)}/defaults", json=dict(changes)))

    # -- nodes ----------------------------------------------------------------------------

    def create_join_token(self, expires_in_s: int = 3600, single_use: bool = True) -> JSON:
        body = {"expires_in_s": expires_in_s, "single_use": single_use}
        return dict(self.request("POST", "/join-tokens", json=body))

    def join_node(
        self,
        join_token: str,
        name: str,
        cpu_milli: int,
        memory_mib: int,
        devices: Sequence[Mapping[str, Any]] = (),
        labels: Mapping[str, str] | None = None,
    ) -> JSON:
        """Join with a join token (no bearer token); the answer holds the node's credential."""
        body = {
            "join_token": join_token,
            "name": name,
            "cpu_milli": cpu_milli,
            "memory_mib": memory_mib,
            "labels": dict(labels or {}),
            "devices": [dict(d) for d in devices],
        }
        return dict(self.request("POST", "/nodes/join", json=body))

    def heartbeat(self, name: str, devices_usage: Sequence[Mapping[str, Any]] = ()) -> JSON:
        """Needs the node's own credential as this client's token."""
        body = {"devices_usage": [dict(u) for u in devices_usage]}
        return dict(self.request("POST", f"/nodes/{_seg(name)}/heartbeat", json=body))

    def list_nodes(self) -> list[JSON]:
        return self._items("/nodes")

    def get_node(self, name: str) -> JSON:
        return dict(self.request("GET", f"/nodes/{_seg(name)}"))

    def cordon(self, name: str) -> JSON:
        return dict(self.request("POST", f"/nodes/{_seg(name)}/cordon"))

    def uncordon(self, name: str) -> JSON:
        return dict(self.request("POST", f"/nodes/{_seg(name)}/uncordon"))

    def drain(self, name: str) -> JSON:
        return dict(self.request("POST", f"/nodes/{_seg(name)}/drain"))

    def delete_node(self, name: str) -> JSON:
        return dict(self.request("DELETE", f"/nodes/{_seg(name)}"))

    def update_node(self, name: str, **changes: Any) -> JSON:
        """PATCH the node's placement rules: `labels`/`taints` (a None value removes the key),
        `dedicated_to` (a tenant, or None to share the node again) and `lending`."""
        return dict(self.request("PATCH", f"/nodes/{_seg(name)}", json=changes))

    # -- audit ----------------------------------------------------------------------------

    def list_audit(
        self,
        tenant: str | None = None,
        actor: str | None = None,
        action: str | None = None,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        after: int | None = None,
        limit: int | None = None,
    ) -> list[JSON]:
        params = {
            "tenant": tenant,
            "actor": actor,
            "action": action,
            "since": since.isoformat() if isinstance(since, datetime) else since,
            "until": until.isoformat() if isinstance(until, datetime) else until,
            "after": after,
            "limit": limit,
        }
        return self._items("/audit", params)

    def verify_audit(self) -> JSON:
        return dict(self.request("GET", "/audit/verify"))

    # -- allocations ----------------------------------------------------------------------

    def create_allocation(self, req: AllocationCreate, idempotency_key: str | None = None) -> JSON:
        """Submit a request. The idempotency key (made up if not given) is reused by the 503
        retries, so a retried submit never queues the request twice."""
        key = idempotency_key or uuid.uuid4().hex
        return dict(self.request("POST", "/allocations", json=req.body(), headers={"Idempotency-Key": key}))

    def list_allocations(
        self,
        state: str | None = None,
        tenant: str | None = None,
        limit: int | None = None,
        array: int | None = None,
    ) -> list[JSON]:
        params = {"state": state, "tenant": tenant, "limit": limit, "array": array}
        return self._items("/allocations", params)

    def get_allocation(self, alloc_id: AllocId, wait: float = 0.0, state: str | None = None) -> JSON:
        """The allocation; with `wait`, the server answers once its state differs from `state`
        (default: the state it has now) or after `wait` seconds."""
        params: dict[str, Any] = {"wait": wait, "state": state} if wait > 0 else {}
        return dict(self.request("GET", f"/allocations/{_seg(alloc_id)}", params=params or None))

    def explain_allocation(self, alloc_id: AllocId) -> JSON:
        return dict(self.request("GET", f"/allocations/{_seg(alloc_id)}/explain"))

    def release_allocation(self, alloc_id: AllocId) -> JSON:
        return dict(self.request("POST", f"/allocations/{_seg(alloc_id)}/release"))

    def cancel_allocation(self, alloc_id: AllocId) -> JSON:
        return dict(self.request("POST", f"/allocations/{_seg(alloc_id)}/cancel"))

    def allocation_logs(
        self,
        alloc_id: AllocId,
        stdout: int = 0,
        stderr: int = 0,
        *,
        rank: int = 0,
        wait: float | None = None,
    ) -> JSON:
        """Both streams of one member from their byte offsets: {stdout: {data, next}, stderr: …, ended}."""
        params: dict[str, Any] = {"stdout": stdout, "stderr": stderr, "rank": rank}
        if wait:
            params["wait"] = wait
        return dict(self.request("GET", f"/allocations/{_seg(alloc_id)}/logs", params=params))

    def wait_allocation(
        self,
        alloc_id: AllocId,
        timeout: float | None = None,
        poll_s: float = 0.5,
        on_pending: Callable[[JSON], None] | None = None,
    ) -> JSON:
        """Wait until the allocation leaves `pending` or `timeout` passes; returns its last state.

        Each call long-polls the server for up to `poll_s` (it answers as soon as the state
        changes), so a binding is seen at once; `on_pending` sees each pending answer (the CLI
        updates its spinner there).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        alloc = self.get_allocation(alloc_id)
        while True:
            if alloc.get("state") != PENDING:
                return alloc
            if on_pending is not None:
                on_pending(alloc)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return alloc
            pause = poll_s if left is None else min(poll_s, left)
            alloc = self.get_allocation(alloc_id, wait=pause, state=PENDING)


def _seg(value: object) -> str:
    """A path segment, percent-encoded so a name can never reach another route."""
    return quote(str(value), safe="")
