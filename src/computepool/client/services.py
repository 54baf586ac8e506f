"""`PoolClient`'s model-service and gateway calls: services, their usage, per-tenant rate limits.

A mixin so that http.py keeps the plumbing; answers are the server's JSON (ServiceOut, UsageRow,
GatewayLimitOut in wire/services.py), never client-side copies of those models.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    JSON = dict[str, Any]


def _seg(value: object) -> str:
    """A path segment, percent-encoded so a name can never reach another route."""
    return quote(str(value), safe="")


class ServiceMethods:
    """Mixed into PoolClient, which provides `request` and `_items`."""

    if TYPE_CHECKING:

        def request(
            self,
            method: str,
            path: str,
            *,
            json: object = None,
            params: Mapping[str, Any] | None = None,
            headers: Mapping[str, str] | None = None,
            api: bool = True,
        ) -> Any: ...  # PoolClient's

        def _items(self, path: str, params: Mapping[str, Any] | None = None) -> list[JSON]: ...

    # -- services ------------------------------------------------------------------------

    def put_service(self, name: str, spec: Mapping[str, Any], tenant: str | None = None) -> JSON:
        """Create the service, or change it (a new generation when `spec` differs); a PUT, so a
        retried call cannot create it twice."""
        body: dict[str, Any] = {"spec": dict(spec)}
        if tenant is not None:
            body["tenant"] = tenant
        return dict(self.request("PUT", f"/services/{_seg(name)}", json=body))

    def services(self) -> list[JSON]:
        """The caller's tenant's services (admins: every tenant's)."""
        return self._items("/services")

    def service(self, name: str, tenant: str | None = None) -> JSON:
        return dict(self.request("GET", f"/services/{_seg(name)}", params={"tenant": tenant}))

    def service_plan(self, name: str, tenant: str | None = None) -> JSON:
        """A cooperative service's plan (CoopPlanOut): its shards, measurements and the reason."""
        return dict(self.request("GET", f"/services/{_seg(name)}/plan", params={"tenant": tenant}))

    def delete_service(self, name: str, tenant: str | None = None) -> JSON:
        """Delete the service; its replicas drain (no new requests) and are then released."""
        return dict(self.request("DELETE", f"/services/{_seg(name)}", params={"tenant": tenant}))

    # -- the gateway ---------------------------------------------------------------------

    def gateway_usage(
        self,
        since: datetime | str | None = None,
        tenant: str | None = None,
        service: str | None = None,
    ) -> list[JSON]:
        """Gateway usage per (tenant, user, token, service, hour); `since` is a time or an age (7d)."""
        when = since.isoformat() if isinstance(since, datetime) else since
        return self._items("/gateway/usage", {"since": when, "tenant": tenant, "service": service})

    def set_gateway_limit(self, tenant: str, rpm: int, burst: int | None = None) -> JSON:
        body: dict[str, Any] = {"requests_per_minute": rpm}
        if burst is not None:
            body["burst"] = burst
        return dict(self.request("PUT", f"/tenants/{_seg(tenant)}/gateway-limit", json=body))

    def gateway_limit(self, tenant: str) -> JSON:
        return dict(self.request("GET", f"/tenants/{_seg(tenant)}/gateway-limit"))

    def delete_gateway_limit(self, tenant: str) -> None:
        self.request("DELETE", f"/tenants/{_seg(tenant)}/gateway-limit")
